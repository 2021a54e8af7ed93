"""`manta bench routing` on a real Ray cluster with the KV store on: two replicas with small GPU
KV caches serve the same multi-turn conversations (shared system prompts) under each routing
policy; evicted pages live on in the replicas' host tiers and the shared store (real NIXL), and
the engines' own prefix-hit counts, split by tier, say which policy kept conversations where
their pages are."""

from __future__ import annotations

import math

import pytest

from cluster.bench.routing import Workload, bench_routing
from cluster.engine.config import EngineConfig
from cluster.engine.kv_store_link import kv_host_pages
from tests.fixtures import tiny_model_dir


@pytest.mark.slow
def test_event_routing_finds_more_of_the_prefix_than_the_tree_and_round_robin(tmp_path_factory):
    import ray

    d = tiny_model_dir(tmp_path_factory, "llama")
    work = Workload(conversations=32, turns=6, system_prompts=4, system_len=64, user_len=16, output_len=8,
                    concurrency=16)
    # Per replica: 512 tokens of GPU KV and a host tier of ~4,000 against ~32 x 200 tokens of
    # conversation (the GPU evicts, the host tier keeps most); the router's memory holds 128
    # tokens per replica — the proportions of a deployment, where a 200,000-token memory faces
    # ~500,000 GPU tokens and millions in the host tier per replica.
    config = EngineConfig(model=str(d), page_size=16, kv_cache_tokens=512,
                          kv_store=str(tmp_path_factory.mktemp("routing-store")), kv_store_host_gb=0.01,
                          kv_store_disk_gb=0.1, kv_host_cache_gb=0.004)
    assert kv_host_pages(config) * 16 >= 4 * 512
    ray.init(address="local", num_cpus=4, num_gpus=0, include_dashboard=False, namespace="manta-routing-bench")
    try:
        res = bench_routing(config, replicas=2, policies=["round_robin", "tree", "events"], workload=work,
                            stats_interval_s=0.2, tree_max_tokens=128)
    finally:
        ray.shutdown()
    for policy, row in res.items():
        assert row["requests"] == 32 * 6 and row["errors"] == 0, (policy, row)
        assert math.isfinite(row["ttft_ms_p50"]) and row["ttft_ms_p90"] >= row["ttft_ms_p50"] > 0
        assert 0 < row["hit_rate"] < 1 and len(row["requests_by_replica"]) == 2, (policy, row)
        tiers = row["gpu_hit_rate"] + row["host_hit_rate"] + row["store_hit_rate"]
        assert tiers == pytest.approx(row["hit_rate"]), (policy, row)
        assert row["local_hit_rate"] == pytest.approx(row["gpu_hit_rate"] + row["host_hit_rate"])
    # Pages went through the host tier and the store: a conversation sent away from its pages
    # found some of them there.
    assert res["round_robin"]["host_hit_rate"] + res["round_robin"]["store_hit_rate"] > 0, res
    # Round robin sends every other turn where the conversation's pages are not; the tree's
    # 128-token memory forgets what it sent where, so it routes by load; the events know what
    # every cache holds. Since admissions load what a replica's host tier holds at once
    # (cluster/engine/kv_host_admission.py), a turn sent away from its GPU pages finds much of
    # them in that replica's host tier (written there when an earlier turn's pages were
    # evicted), so routing shows most in the GPU hits. 2-core VM, 2026-11-27, five runs of this
    # workload (bc55c32; the last beside other tests): GPU rr 0.23-0.28, tree 0.30-0.44, events
    # 0.42-0.50 (ahead of the better other by 0.07-0.17); GPU + host rr 0.64-0.67, tree
    # 0.69-0.72, events 0.75-0.77 (ahead by 0.05-0.07). One CI run had GPU + host at 0.739 for
    # the tree and 0.764 for the events, so what is asserted is the order, not a margin. (At 8
    # conversations at once, a conversation's own replica was often the lightest when its next
    # turn came, so the tree's rate swung with timing: 16 at once, and tree against round robin
    # is not asserted.)
    gpu = {p: res[p]["gpu_hit_rate"] for p in res}
    local = {p: res[p]["local_hit_rate"] for p in res}
    assert gpu["events"] > max(gpu["round_robin"], gpu["tree"]), res
    assert local["events"] > max(local["round_robin"], local["tree"]), res
