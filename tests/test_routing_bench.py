"""`manta bench routing` on a real Ray cluster: two replicas with small KV caches serve the same
multi-turn conversations (shared system prompts) under each routing policy; the engines' own
prefix-hit counts say which policy kept conversations where their pages are."""

from __future__ import annotations

import math

import pytest

from cluster.bench.routing import Workload, bench_routing
from cluster.engine.config import EngineConfig
from tests.fixtures import tiny_model_dir


@pytest.mark.slow
def test_cache_aware_policies_keep_conversations_on_their_pages(tmp_path_factory):
    import ray

    d = tiny_model_dir(tmp_path_factory, "llama")
    work = Workload(conversations=24, turns=5, system_prompts=4, system_len=64, user_len=16, output_len=8,
                    concurrency=8)
    # 500 tokens of KV per replica against ~24 x 200 tokens of conversation: replicas evict.
    config = EngineConfig(model=str(d), page_size=4, kv_cache_tokens=500)
    ray.init(address="local", num_cpus=4, num_gpus=0, include_dashboard=False, namespace="manta-routing-bench")
    try:
        res = bench_routing(config, replicas=2, policies=["round_robin", "tree", "events"], workload=work,
                            stats_interval_s=0.2)
    finally:
        ray.shutdown()
    for policy, row in res.items():
        assert row["requests"] == 24 * 5 and row["errors"] == 0, (policy, row)
        assert math.isfinite(row["ttft_ms_p50"]) and row["ttft_ms_p90"] >= row["ttft_ms_p50"] > 0
        assert 0 < row["hit_rate"] < 1 and len(row["requests_by_replica"]) == 2, (policy, row)
    rr, tree, events = (res[p]["hit_rate"] for p in ("round_robin", "tree", "events"))
    # Round robin sends every other turn where the conversation's pages are not.
    assert tree > rr + 0.1 and events > rr + 0.1, res
    # The events know no less than the router's memory of what it sent (evictions lose a
    # conversation's pages under both; the events also count what the memory never saw).
    assert events >= tree - 0.05, res
