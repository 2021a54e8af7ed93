"""The router's choice of replica (`cluster/router.py::Router.choose`) and the per-replica prefix
tree it remembers prompts in (`cluster/prefix_tree.py`), without Ray: the policies are pure
functions of each replica's load, health and remembered prompts."""

from __future__ import annotations

import asyncio
import dataclasses

from cluster.prefix_tree import PrefixTree
from cluster.router import Router, RouterOptions
from tests.scripted_replica import ScriptedReplica


def router(policy: str, names=("a", "b", "c"), **options) -> Router:
    r = Router(RouterOptions(policy=policy, **options), None, None, "m", max_context_len=1000, vocab_size=1000)
    for name in names:
        r.add_replica(name, actor=None)
    return r


def set_load(r: Router, **loads: tuple[int, int, float]) -> None:
    """name=(requests in flight from this router, waiting on the replica, KV usage)."""
    for name, (inflight, waiting, kv) in loads.items():
        h = r.replicas[name]
        h.inflight, h.stats = inflight, {"num_waiting": waiting, "kv_usage": kv}


def test_round_robin_cycles_over_serving_replicas_only():
    r = router("round_robin")
    assert [r.choose([1]).name for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]
    r.replicas["b"].healthy = False
    r.replicas["c"].draining = True
    assert {r.choose([1]).name for _ in range(4)} == {"a"}
    assert r.choose([1], exclude={"a"}) is None


def test_least_load_counts_queue_then_kv_usage():
    r = router("least_load")
    set_load(r, a=(2, 3, 0.1), b=(1, 1, 0.9), c=(0, 4, 0.0))
    assert r.choose([1]).name == "b"  # queue: a 5, b 2, c 4
    set_load(r, a=(1, 1, 0.5), b=(2, 0, 0.2), c=(0, 3, 0.1))
    assert r.choose([1]).name == "b"  # queues tie at 2, b has the emptiest KV cache
    assert r.choose([1], exclude={"b"}).name == "a"


def test_cache_aware_follows_the_longest_remembered_prefix_above_the_threshold():
    r = router("cache_aware", cache_threshold=0.5)
    shared = list(range(100, 140))
    r.replicas["b"].tree.insert(shared + [1, 2, 3])
    r.replicas["c"].tree.insert(shared[:10])
    set_load(r, a=(0, 0, 0.0), b=(3, 0, 0.5), c=(1, 0, 0.0))
    assert r.choose(shared + [7, 8]).name == "b"  # 40 of 42 tokens cached there, despite its load
    # Below the threshold the least-loaded replica wins, whatever matched best.
    assert r.choose(shared[:10] + list(range(500, 520))).name == "a"  # c matches 10 of 30 < 0.5
    assert r.choose([]).name == "a"


def test_cache_aware_falls_back_to_least_load_only_past_both_balance_thresholds():
    r = router("cache_aware", cache_threshold=0.5, balance_abs_threshold=16, balance_rel_threshold=1.5)
    prompt = list(range(200, 232))
    r.replicas["b"].tree.insert(prompt)
    set_load(r, a=(20, 0, 0.0), b=(35, 0, 0.0), c=(20, 0, 0.0))
    assert r.choose(prompt).name == "b"  # gap 15 <= 16: the cache wins
    set_load(r, a=(40, 0, 0.0), b=(57, 0, 0.0), c=(40, 0, 0.0))
    assert r.choose(prompt).name == "b"  # gap 17 > 16 but 57 <= 1.5 x 40: still the cache
    set_load(r, a=(2, 0, 0.0), b=(19, 0, 0.0), c=(5, 0, 0.0))
    assert r.choose(prompt).name == "a"  # gap 17 > 16 and 19 > 1.5 x 2: balance first


def test_prefix_tree_evicts_least_recently_used_tokens_within_its_budget():
    t = PrefixTree(max_tokens=8, block=1)  # token by token: exact counts
    old, new, third = list(range(10, 16)), list(range(50, 56)), list(range(90, 94))
    t.insert(old)
    t.insert(new)  # 12 tokens: the 4 least recently used go, the tail of `old`
    assert (t.size, t.match(old), t.match(new)) == (8, 2, 6)
    t.insert(old[:2])  # a hit refreshes the prefix it matched
    t.insert(third)  # 12 again: now the tail of `new` is the oldest
    assert (t.size, t.match(old), t.match(new), t.match(third)) == (8, 2, 2, 4)
    t.insert(list(range(200, 220)))  # one prompt larger than the whole budget
    assert t.size <= 8


def _replica(*outs):
    """A replica (its real serving channel, a scripted engine) that answers every admission with
    `outs` (with its rid): a refusal at once, else queued and the outputs emitted."""
    refused = outs[0].error_type is not None

    def mine(rid: str) -> list:
        return [dataclasses.replace(o, rid=rid) for o in outs]

    return ScriptedReplica(lambda rids: [mine(rid)[0] if refused else None for rid in rids],
                           lambda rids: [o for rid in rids for o in mine(rid)])


def test_a_request_refused_before_its_first_token_is_retried_and_counted():
    from cluster.api.metrics import ServerMetrics
    from cluster.engine.request import RequestOutput
    from workers.sampling_params import SamplingParams

    metrics = ServerMetrics()
    r = Router(RouterOptions(policy="round_robin"), metrics, None, "m", max_context_len=1000, vocab_size=1000)
    sick = _replica(RequestOutput("x", finished=True, finish_reason="error", error_type="unavailable",
                                  error="replica is restarting"))
    well = _replica(RequestOutput("x", delta_token_ids=[5], finished=True, finish_reason="length"))
    r.add_replica("a", sick)
    r.add_replica("b", well)
    r._poller = object()  # no stats polling in this test

    async def run():
        return [o async for o in r.generate_stream([1, 2, 3], SamplingParams(max_tokens=1))]

    try:
        outs = asyncio.run(run())
    finally:
        sick.close()
        well.close()
    assert [o.replica for o in outs] == ["b"] and outs[-1].finish_reason == "length"
    assert sick.frames.qsize() == well.frames.qsize() == 1 and not r.replicas["a"].healthy
    assert 'manta:router_retries_total{reason="unavailable",replica="a"} 1.0' in metrics.render().decode()


def test_retry_series_are_exported_at_zero_for_a_polled_replica_and_dropped_with_it():
    """A replica the router polled exports every retry reason at 0 (so rate() sees the first
    retry, and the dashboard's panel has data); removing the replica drops its series."""
    from cluster.api.metrics import RETRY_REASONS, ServerMetrics

    metrics = ServerMetrics()
    metrics.update_replica_stats("a", {"healthy": True, "num_running": 0})
    text = metrics.render().decode()
    for reason in RETRY_REASONS:
        assert f'manta:router_retries_total{{reason="{reason}",replica="a"}} 0.0' in text
    metrics.record_retry("a", "queue_full")
    assert 'manta:router_retries_total{reason="queue_full",replica="a"} 1.0' in metrics.render().decode()
    metrics.remove_replica("a")
    assert 'replica="a"' not in "".join(line for line in metrics.render().decode().splitlines()
                                         if line.startswith("manta:router_retries"))
