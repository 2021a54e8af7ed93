"""KV events (issue 24): a replica's prefix cache published as chained block hashes, the
router's index of them, and cache_aware routing on what the caches really hold — with a real
scheduler and radix cache (every page count exact), then through real Ray replicas."""

from __future__ import annotations

import time

import pytest

from cluster.engine.block_hash import chain_hashes
from cluster.engine.kv_events import KVEventLog
from cluster.engine.request import Request
from cluster.engine.scheduler import Scheduler
from cluster.kv_index import KVIndex
from cluster.prefix_tree import RecentRoutes
from cluster.router import Router, RouterOptions
from workers.messages import StepResult
from workers.sampling_params import SamplingParams

P = 4


def cached_hashes(radix) -> set[int]:
    """What the radix cache holds, hashed from its own tree (the oracle)."""
    out: set[int] = set()
    stack = list(radix.root.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        out.update(chain_hashes(radix.path_tokens(node), P)[-len(node.pages):])
    return out


def make(num_pages=17):
    return Scheduler(num_pages=num_pages, page_size=P, max_running_requests=4, max_num_batched_tokens=64,
                     chunked_prefill_size=64, max_context_len=256, eos_token_ids=(2,))


def run(s, rid, tokens, max_tokens=3, rank=None):
    """A request through the scheduler to its end, a fixed token sampled each step; `rank(plan,
    res)`: what the ranks do with a plan besides the forward (and report in its result)."""
    s.add_request(Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    while s.has_work():
        plan = s.schedule()
        res = StepResult(plan.step_id)
        if rank is not None:
            rank(plan, res)
        for r in plan.reqs:
            if r.sample:
                res.sampled_rids.append(r.rid)
                res.next_token_ids.append(7)
                res.logprobs.append(None)
        s.process_result(plan, res)


def test_the_index_follows_the_radix_cache_through_inserts_evictions_and_resets():
    s = make()
    run(s, "warm", range(100, 121))  # cached before the log starts: in its first snapshot
    log = KVEventLog(s.radix)
    idx = KVIndex()
    idx.apply(log.since(None, 0))
    assert "snapshot" in log.since(None, 0) and idx.hashes == cached_hashes(s.radix) and idx.hashes
    shared = list(range(500, 520))
    for i, tail in enumerate([[1, 2, 3, 4, 5], [9, 9, 9, 9, 9, 9, 9, 9], list(range(300, 330)), [4] * 13]):
        run(s, f"r{i}", shared + tail)  # 16 usable pages: later ones evict earlier ones
        reply = log.since(idx.epoch, idx.seq)
        assert "events" in reply  # caught up with deltas, not a snapshot
        idx.apply(reply)
        assert idx.hashes == cached_hashes(s.radix)
    assert "removed" in {e[1] for e in log._events}  # evictions happened
    # A prompt's match in the index is what the radix cache would match.
    prompt = shared + [4] * 13
    assert idx.match(prompt) == s.radix.match_prefix(prompt).num_tokens > 0
    # Dropping the whole tree starts a new epoch: the reader gets an empty snapshot.
    s.radix.reset()
    idx.apply(log.since(idx.epoch, idx.seq))
    assert idx.hashes == set() and idx.match(prompt) == 0


def test_a_reader_behind_the_retained_events_gets_a_snapshot():
    s = make(num_pages=65)
    log = KVEventLog(s.radix, max_events=2)
    idx = KVIndex()
    idx.apply(log.since(None, 0))
    for i in range(4):
        run(s, f"r{i}", range(1000 * i, 1000 * i + 9))
    reply = log.since(idx.epoch, idx.seq)
    assert "snapshot" in reply  # 4 batches happened, 2 retained
    idx.apply(reply)
    assert idx.hashes == cached_hashes(s.radix) and len(idx.hashes) == 8


class _Actor:
    pass


def router_with(policy="cache_aware", **kw) -> Router:
    r = Router(RouterOptions(policy=policy, **kw), None, tokenizer=None, model_name="m",
               max_context_len=4096, vocab_size=32000)
    for name in ("a", "b"):
        r.add_replica(name, _Actor())
    return r


def test_cache_aware_routes_on_fresh_events_and_falls_back_to_its_memory_when_they_lag():
    prompt = list(range(64))
    r = router_with()
    a, b = r.replicas["a"], r.replicas["b"]
    a.tree.insert(prompt)  # the router sent it to a a while ago ...
    for h, cached in ((a, []), (b, prompt)):  # ... but a evicted it, and b has it cached
        h.kv_index.apply({"epoch": "e", "seq": 1, "block": 16, "snapshot": chain_hashes(cached, 16)})
    assert r.cached_prefix(a, prompt) == (0, "events") and r.cached_prefix(b, prompt) == (64, "events")
    assert r.choose(prompt).name == "b"
    for h in (a, b):
        h.kv_index.updated = time.monotonic() - 10  # the events stopped coming
    assert r.cached_prefix(a, prompt) == (64, "tree") and r.choose(prompt).name == "a"
    off = router_with(kv_events=False)
    off.replicas["a"].tree.insert(prompt)
    off.replicas["b"].kv_index.apply({"epoch": "e", "seq": 1, "block": 16, "snapshot": chain_hashes(prompt, 16)})
    assert off.choose(prompt).name == "a"  # --no-router-kv-events: the memory alone


def test_what_was_just_routed_counts_until_the_events_can_show_it():
    """A conversation's next turn may come before the pages of its last one are in an event the
    router has pulled: within the freshness window the router's own record of what it sent
    counts beside the index; after it, the index alone."""
    history, turn = list(range(64)), list(range(64)) + [7] * 32
    r = router_with()
    a, b = r.replicas["a"], r.replicas["b"]
    for h in (a, b):
        h.kv_index.apply({"epoch": "e", "seq": 1, "block": 16, "snapshot": []})
    a.recent.insert(history)
    assert r.cached_prefix(a, turn) == (64, "events") and r.cached_prefix(b, turn) == (0, "events")
    assert r.choose(turn).name == "a"
    a.recent = RecentRoutes(r.options.kv_events_max_age_s)  # the same routing, a window ago
    a.recent.insert(history, at=time.monotonic() - r.options.kv_events_max_age_s - 1)
    assert r.cached_prefix(a, turn) == (0, "events")  # long enough: the events would show it
    # The window is bounded by time, not by the memory's token budget.
    small = router_with(tree_max_tokens=16)
    h = small.replicas["a"]
    h.kv_index.apply({"epoch": "e", "seq": 1, "block": 16, "snapshot": []})
    for p in (history, list(range(100, 300))):  # what routing a request records
        h.tree.insert(p)
        h.recent.insert(p)
    assert h.tree.match(turn) == 0 and small.cached_prefix(h, turn) == (64, "events")


@pytest.mark.parametrize("block", [16, 4])
def test_index_match_uses_the_replicas_page_size(block):
    prompt = list(range(40))
    idx = KVIndex()
    idx.apply({"epoch": "e", "seq": 3, "block": block, "snapshot": chain_hashes(prompt[:32], block)})
    assert idx.match(prompt) == 32 and idx.match(prompt[:20] + [0] * 20) == 20 - 20 % block


@pytest.mark.slow
def test_router_learns_each_replicas_cache_from_its_events_through_ray(tmp_path_factory):
    """Two real replicas on Ray: the replica that served a prompt reports its pages, the other
    reports none, the router's index says so within a stats poll, a repeat of the prompt goes
    to the replica that holds it, and the routed hit is counted by source."""
    import asyncio

    import ray

    from cluster.api.metrics import ServerMetrics
    from cluster.engine.config import EngineConfig
    from cluster.launch import ClusterOptions, ServingCluster
    from tests.fixtures import tiny_model_dir
    from tests.test_engine import greedy

    ray.init(address="local", num_cpus=4, num_gpus=0, include_dashboard=False, namespace="manta-kv-events")
    d = tiny_model_dir(tmp_path_factory, "llama")
    metrics = ServerMetrics()
    cluster = ServingCluster(ClusterOptions(engine=EngineConfig(model=str(d), page_size=4), replicas=2,
                                            router=RouterOptions(stats_interval_s=0.2)), metrics)
    router = cluster.start()
    prompt = list(range(10, 70))  # 60 tokens: 14 whole pages before the last token

    async def generate(tokens):
        return [out async for out in router.generate_stream(tokens, greedy(2))]

    async def scenario():
        await router.start()
        first = (await generate(prompt))[-1]
        served = router.replicas[first.replica]
        other = next(h for h in router.replicas.values() if h is not served)
        deadline = time.monotonic() + 10
        while router.cached_prefix(served, prompt)[0] < 56 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        seen = router.cached_prefix(served, prompt), router.cached_prefix(other, prompt)
        again = (await generate(prompt))[-1]
        await router.poll_once()
        return first, seen, again, metrics.render().decode()

    try:
        first, (on_served, on_other), again, exported = asyncio.run(scenario())
    finally:
        asyncio.run(router.aclose())
        cluster.shutdown()
        ray.shutdown()
    assert first.finish_reason == "length" and again.finish_reason == "length"
    assert on_served[0] >= 56 and on_served[1] == "events"
    assert on_other == (0, "events")  # the other replica's events say it holds none of it
    assert again.replica == first.replica and again.cached_tokens >= 56
    hit = f'manta:router_prefix_hit_tokens_total{{replica="{first.replica}",source="events"}}'
    assert hit in exported and float(exported.split(hit)[1].split()[0]) >= 56
    assert "manta:router_kv_event_lag_seconds" in exported


def with_store(num_pages=17, host_pages=6, host_slack=None):
    """A scheduler with the KV store's side on (write_back_selective: a page is saved when the GPU
    evicts it), its event log, and a real `workers.host_tier.HostTier` as the first rank's tier."""
    from cluster.engine.kv_offload import SchedulerKVOffload
    from tests.test_kv_offload_policy import FakeProbe
    from workers.host_tier import HostTier

    s = make(num_pages=num_pages)
    off = SchedulerKVOffload(s, fingerprint="f" * 64, layout="mha", tp_size=1, write_policy="write_back_selective",
                             probe=FakeProbe(), min_pages=1)
    log = KVEventLog(s.radix, host_capacity=host_pages, copied=off.saves.evict_copies, host_slack=host_slack)
    off.host.listeners.append(log.host_changed)
    return s, log, HostTier(capacity_pages=host_pages, page_bytes=8, pin=False, log_changes=True)


def run_with_tier(s, tier, rid, tokens, report: bool = True) -> None:
    """`run`, with the rank's side of each plan: its saves into the host tier, and (`report`)
    the tier's changes back in the step result, as the first rank sends them."""
    def rank(plan, res) -> None:
        for save in plan.kv_saves:
            tier.publish(save.keys, tier.take(len(save.keys)))
        changes = tier.take_changes()
        if report:
            res.kv_host_ready, res.kv_host_evicted = changes

    run(s, rid, tokens, rank=rank)


PROMPTS_13 = [list(range(1000 * i, 1000 * i + 13)) for i in range(1, 11)]  # 3 whole pages each


def host_hashes(tier) -> set[int]:
    """The hashes of the pages a host tier holds (the oracle: its own keys)."""
    from kvstore.keys import chain_keys

    hash_of = {k: h for p in PROMPTS_13 for k, h in zip(chain_keys(p, P, "f" * 64, "mha"), chain_hashes(p, P))}
    return {hash_of[k] for k in tier.ready}


def test_pages_the_gpu_evicts_after_a_save_move_to_the_host_tier_and_the_store():
    """An eviction of a saved page is `removed` from the GPU and `stored` in the host tier and
    the store; the rank's tier drops its least recently used pages (the store keeps them)."""
    from cluster.kv_index import StoreIndex

    s, log, tier = with_store()
    store = StoreIndex()
    idx = KVIndex(store)
    idx.apply(log.since(None, 0))
    for i, p in enumerate(PROMPTS_13):
        run_with_tier(s, tier, f"r{i}", p)
        idx.apply(log.since(idx.epoch, idx.seq))
        assert idx.hashes == cached_hashes(s.radix)
    evicted = [h for p in PROMPTS_13 for h in chain_hashes(p, P)[:3] if h not in idx.hashes]
    assert len(evicted) > 6  # more than the host tier holds
    assert set(evicted) <= set(store.hashes)  # every evicted page was saved: the store has it
    from kvstore.keys import chain_keys

    key_of = {h: k for p in PROMPTS_13 for k, h in zip(chain_keys(p, P, "f" * 64, "mha"), chain_hashes(p, P))}
    assert {h: store.hashes[h] for h in evicted} == {h: key_of[h] for h in evicted}  # named as the store names them
    assert store.sync({"epoch": "s", "seq": 1, "removed": [key_of[evicted[0]]]}) == 1  # the store evicted one
    assert evicted[0] not in store and idx.tiers(next(p for p in PROMPTS_13 if evicted[0] in chain_hashes(p, P)))["store"] < 12
    store.add([evicted[0]], [key_of[evicted[0]]])
    assert idx.host == host_hashes(tier) and len(idx.host) == 6  # the host tier: what the rank's holds
    # Scored by tier: an evicted prompt the host tier still holds, one only the store holds.
    on_host = next(p for p in PROMPTS_13 if chain_hashes(p, P)[0] in idx.host)
    in_store = next(p for p in PROMPTS_13 if chain_hashes(p, P)[0] not in idx.host | idx.hashes)
    assert idx.tiers(on_host)["host"] >= P and idx.tiers(in_store) == {"gpu": 0, "host": 0, "store": 12}
    # A new reader gets the same view from a snapshot.
    fresh = KVIndex(StoreIndex())
    fresh.apply(log.since(None, 0))
    assert fresh.hashes == idx.hashes and fresh.host == idx.host and set(fresh.store.hashes) == set(store.hashes)
    assert fresh.store.chains == store.chains


def test_the_host_tier_events_follow_the_ranks_own_reads():
    """The rank's tier is refreshed by its reads (a prefetch of its oldest pages), which the
    scheduler does not see: the log follows the tier's reported evictions, not its own order."""
    from cluster.kv_index import StoreIndex

    s, log, tier = with_store()
    idx = KVIndex(StoreIndex())
    for i, p in enumerate(PROMPTS_13):
        run_with_tier(s, tier, f"r{i}", p)
        idx.apply(log.since(idx.epoch, idx.seq))
        if i == 6:  # the rank reads its two oldest pages: they become its newest
            tier.unpin(tier.leading(list(tier.ready)[:2]))
        assert idx.host == host_hashes(tier), i
    assert tier.evictions > 6


def test_without_the_ranks_reports_the_host_tier_is_bounded():
    """Reports lost (a rank that restarted): the log keeps at most the tier's capacity plus its
    slack in "host", dropping its own oldest."""
    from cluster.kv_index import StoreIndex

    s, log, tier = with_store(host_slack=2)
    idx = KVIndex(StoreIndex())
    for i, p in enumerate(PROMPTS_13):
        run_with_tier(s, tier, f"r{i}", p, report=False)
        idx.apply(log.since(idx.epoch, idx.seq))
    assert len(idx.host) == 6 + 2 and idx.host <= set(idx.store.hashes)


def test_the_store_index_keeps_its_two_maps_in_step():
    """A block hash renamed (another model's or TP size's chain key), evicted past capacity, or
    dropped by a reset leaves no chain key behind; a removal of an old name drops nothing."""
    from cluster.kv_index import StoreIndex

    idx = StoreIndex(capacity=2)
    idx.add([5, 6], ["a", "b"])
    idx.add([6], ["c"])  # 6 renamed
    assert idx.chains == {"a": 5, "c": 6}
    assert idx.sync({"epoch": "e", "seq": 1, "removed": ["b"]}) == 0 and 6 in idx
    idx.add([7], ["d"])  # past capacity: 5 goes, with its name
    assert dict(idx.hashes) == {6: "c", 7: "d"} and idx.chains == {"c": 6, "d": 7}
    idx.add([8])  # an event without chain keys (an older replica): known by hash alone
    assert idx.chains == {"d": 7} and idx.sync({"epoch": "e", "seq": 2, "reset": []}) == 1
    assert dict(idx.hashes) == {8: None} and idx.chains == {}
    assert idx.resync_due(every_s=60) is False and idx.resync_due(every_s=0) is True


def test_cache_aware_prefers_the_gpu_copy_then_the_host_tier_then_the_store():
    prompt = list(range(64))
    hashes = chain_hashes(prompt, 16)
    r = router_with()
    a, b = r.replicas["a"], r.replicas["b"]

    def state(gpu_a=(), host_a=(), gpu_b=(), host_b=()):
        for h, gpu, host in ((a, gpu_a, host_a), (b, gpu_b, host_b)):
            h.kv_index.apply({"epoch": "e", "seq": 1, "block": 16, "snapshot": list(gpu), "snapshot_host": list(host)})

    state(host_a=hashes)  # a's host tier has it, b nothing
    assert r.choose(prompt).name == "a" and r.cached_prefix(a, prompt) == (int(0.8 * 64), "events")
    state(host_a=hashes, gpu_b=hashes)  # b's GPU beats a's host tier
    assert r.choose(prompt).name == "b"
    state(gpu_a=hashes[:2], host_a=hashes[2:], gpu_b=hashes[:3])  # 32 GPU + 32 host against 48 GPU
    assert r.cached_prefix(a, prompt)[0] == 32 + int(0.8 * 32) > r.cached_prefix(b, prompt)[0] == 48
    assert r.choose(prompt).name == "a"
    state()
    r.store_index.add(hashes)  # only the shared store has it: worth the same everywhere, load decides
    assert r.cached_prefix(a, prompt) == r.cached_prefix(b, prompt) == (int(0.6 * 64), "events")
