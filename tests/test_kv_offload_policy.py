"""The shared KV store in serving, the scheduler's side (`cluster.engine.kv_offload`): which pages
each write policy saves, what a prefix found in the store turns into (prefetch, load, the rest
computed), and that a slow, failing or silent store lookup never holds a step — with hand-built
rank results and a fake store lookup, so every page count is exact. The real store in serving
is `tests/test_kvstore_serving.py`."""

from __future__ import annotations

import time

import pytest

from cluster.engine.kv_offload import SchedulerKVOffload
from cluster.engine.request import Request
from cluster.engine.scheduler import Scheduler
from kvstore.keys import chain_keys
from kvstore.store_link import ClientCounters
from workers.forward_batch import ForwardMode
from workers.messages import StepResult
from workers.sampling_params import SamplingParams

P = 4
FP = "ab" * 32


class FakeProbe:
    """The store as the scheduler sees it: the chain keys it holds for every rank. `hold`:
    lookups stay unanswered until `answer()`."""

    def __init__(self, keys=(), fail=False, hold=False):
        self.keys = set(keys)
        self.fail = fail
        self.hold = hold
        self.counters = ClientCounters()
        self.calls = 0

    def count(self, chain):
        self.calls += 1
        if self.fail:
            self.counters.errors += 1
            return 0
        n = 0
        while n < len(chain) and chain[n] in self.keys:
            n += 1
        return n

    def start(self, chain):
        return _Pending(self, chain)

    def answer(self):
        self.hold = False


class _Pending:
    def __init__(self, probe, chain):
        self.probe, self.chain, self.started = probe, list(chain), time.monotonic()

    def done(self):
        return not self.probe.hold

    def pages(self):
        return self.probe.count(self.chain)

    def abandon(self):
        pass


def make(policy="write_through", prefetch="timeout", probe=None, num_pages=65, **kw):
    s = Scheduler(num_pages=num_pages, page_size=P, max_running_requests=8, max_num_batched_tokens=64,
                  chunked_prefill_size=64, max_context_len=256, eos_token_ids=(2,))
    off = SchedulerKVOffload(s, fingerprint=FP, layout="mha", tp_size=1, write_policy=policy,
                             prefetch_policy=prefetch, probe=probe or FakeProbe(), min_pages=1, **kw)
    return s, off


def req(rid, n, first=100, max_tokens=4) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def result(plan, loaded=None, prefetched=()) -> StepResult:
    res = StepResult(plan.step_id, kv_loaded=dict(loaded or {}), kv_prefetched=list(prefetched))
    for r in plan.reqs:
        if r.sample:
            res.sampled_rids.append(r.rid)
            res.next_token_ids.append(7)
            res.logprobs.append(None)
    return res


def step(s, **kw):
    plan = s.schedule()
    assert plan is not None
    s.process_result(plan, result(plan, **kw))
    s.check_integrity()
    return plan


def run_until_idle(s, limit=50):
    plans = []
    while s.has_work() and len(plans) < limit:
        plans.append(step(s))
    return plans


def keys_of(tokens):
    return chain_keys(tokens, P, FP, "mha")


# ---------------------------------------------------------------------------------------------
# scheduler orders


def test_write_through_saves_every_page_the_radix_cache_takes():
    s, _ = make()
    a = req("a", 40)
    s.add_request(a)
    plans = run_until_idle(s)
    saves = [sv for p in plans for sv in p.kv_saves]
    # 40 prompt tokens + 3 computed outputs (the 4th is sampled, never fed back): 10 full pages.
    assert len(saves) == 1 and saves[0].keys == keys_of(a.all_ids[:40])
    assert len(set(saves[0].page_ids)) == 10
    # A second request with the same prefix adds only its new pages.
    b = req("b", 48)
    s.add_request(b)
    saves = [sv for p in run_until_idle(s) for sv in p.kv_saves]
    assert [k for sv in saves for k in sv.keys] == keys_of(b.all_ids[:48])[10:]


def test_write_through_selective_saves_pages_matched_twice():
    s, off = make("write_through_selective")
    for rid in ("a", "b"):
        s.add_request(req(rid, 41))
        assert not [sv for p in run_until_idle(s) for sv in p.kv_saves]
    s.add_request(req("c", 41))  # the second match of the 10 prompt pages
    saves = [sv for p in run_until_idle(s) for sv in p.kv_saves]
    assert [k for sv in saves for k in sv.keys] == keys_of(list(range(100, 140)))
    assert off.stats.saved_pages == 10


def test_write_back_saves_pages_when_the_radix_cache_evicts_them():
    s, off = make("write_back", num_pages=17)  # 16 usable pages
    a = req("a", 40)
    s.add_request(a)
    assert not [sv for p in run_until_idle(s) for sv in p.kv_saves]
    assert s.radix.total_cached_pages == 10
    s.add_request(req("b", 40, first=500))  # needs 11 pages: 5 of a's are evicted
    plans = run_until_idle(s)
    saves = [sv for p in plans for sv in p.kv_saves]
    evicted_keys = [k for sv in saves for k in sv.keys]
    assert len(evicted_keys) >= 5 and set(evicted_keys) <= set(keys_of(a.all_ids[:40]))
    # The save rides in the plan that evicted the page, ahead of the forward that reuses it.
    first = next(p for p in plans if p.kv_saves)
    reused = {slot // P for r in first.reqs for slot in r.out_cache_loc}
    assert set(first.kv_saves[0].page_ids) & reused


@pytest.mark.parametrize("prefetch", ["timeout", "wait_complete", "best_effort"])
def test_store_prefix_is_prefetched_loaded_and_only_the_rest_computed(prefetch):
    prompt = list(range(100, 141))  # prompt[:-1]: 10 whole pages
    probe = FakeProbe(keys_of(prompt[:40]))
    s, off = make(prefetch=prefetch, probe=probe, prefetch_timeout_s=60.0)
    s.add_request(Request("r", prompt, SamplingParams(max_tokens=2, ignore_eos=True)))
    plan = s.schedule()
    assert plan.mode == ForwardMode.IDLE and not plan.reqs  # set aside while the ranks prefetch
    assert [p.keys for p in plan.kv_prefetch] == [keys_of(prompt[:40])]
    s.process_result(plan, result(plan))
    s.check_integrity()
    if prefetch != "best_effort":  # the ranks have not reported the prefetch finished yet
        plan = s.schedule()
        assert not plan.kv_loads and not plan.reqs
        s.process_result(plan, result(plan, prefetched=["r"]))
    plan = s.schedule()
    (load,) = plan.kv_loads
    assert load.keys == keys_of(prompt[:40]) and len(load.page_ids) == 10
    assert load.wait_s == 0.0 if prefetch == "best_effort" else load.wait_s > 50
    s.check_integrity()  # the load's pages are accounted as held
    free_before = s.allocator.num_free
    s.process_result(plan, result(plan, loaded={"r": 7}))  # a rank had only 7 pages
    s.check_integrity()
    assert s.allocator.num_free == free_before + 3 and s.radix.total_cached_pages == 7
    plan = s.schedule()
    (sr,) = plan.reqs
    assert sr.prefix_len == 28 and len(sr.input_ids) == 41 - 28  # only the rest is computed
    assert plan.table_writes[0][1:] == (0, [p * P + i for p in load.page_ids[:7] for i in range(P)])
    assert off.stats.hit_pages == 7 and off.stats.query_pages == 10 and off.stats.probe_hit_pages == 10
    s.process_result(plan, result(plan))
    run_until_idle(s)
    assert s.requests == {} and s.radix.protected_pages == 0
    assert s.stats.prefix_hit_tokens == 28


def test_timeout_grows_with_the_prompt_and_stops_early():
    prompt = list(range(100, 141))
    s, off = make(prefetch="timeout", probe=FakeProbe(keys_of(prompt[:40])), prefetch_timeout_s=0.05,
                  prefetch_timeout_per_page_s=0.01)
    s.add_request(Request("r", prompt, SamplingParams(max_tokens=1)))
    plan = s.schedule()
    e = off.loading["r"]
    assert e.deadline - e.started == pytest.approx(0.05 + 10 * 0.01)
    s.process_result(plan, result(plan))
    time.sleep(0.16)
    plan = s.schedule()  # not reported finished, but the deadline passed
    assert plan.kv_loads and plan.kv_loads[0].wait_s == 0.0 and off.stats.early_stops == 1
    assert not plan.kv_loads[0].until_done  # past the deadline: what every rank has, no second try
    s.process_result(plan, result(plan, loaded={"r": 0}))
    run_until_idle(s)
    assert s.stats.prefix_hit_tokens == 0 and s.requests == {}


@pytest.mark.parametrize("abort", [False, True])
def test_a_rank_still_prefetching_makes_the_load_come_again(abort):
    """Rank 0 reported its prefetch finished, another rank's still runs (an MLA rank != 0 reads
    pages it never wrote): the load is `until_done`, the ranks answer LOAD_PENDING, and the
    same load (same pages) is ordered again until every rank has all of it; no page is cached
    or freed in between. An abort between two tries frees everything."""
    from workers.kv_messages import LOAD_PENDING

    prompt = list(range(100, 141))
    s, off = make(prefetch="wait_complete", probe=FakeProbe(keys_of(prompt[:40])))
    s.add_request(Request("r", prompt, SamplingParams(max_tokens=2, ignore_eos=True)))
    step(s)  # the prefetch
    step(s, prefetched=["r"])  # rank 0's prefetch is done
    first = s.schedule()
    (load,) = first.kv_loads
    assert load.until_done and len(load.page_ids) == 10
    for _ in range(3):  # another rank still reads: pending, on every rank
        s.process_result(first, result(first, loaded={"r": LOAD_PENDING}))
        s.check_integrity()
        assert s.radix.total_cached_pages == 0 and off.held_pages() == load.page_ids and not s.waiting
        first = s.schedule()
        (again,) = first.kv_loads
        assert again.page_ids == load.page_ids and again.keys == load.keys and again.until_done
    if abort:
        s.process_result(first, result(first, loaded={"r": LOAD_PENDING}))
        s.abort("r")
        plan = s.schedule()
        assert "r" in plan.finished_rids and not plan.kv_loads  # the ranks cancel the prefetch
        s.process_result(plan, result(plan))
        assert not s.has_work() and not off.loading and not off.held_pages() and s.radix.protected_pages == 0
        s.check_integrity()
        return
    s.process_result(first, result(first, loaded={"r": 10}))
    s.check_integrity()
    plan = s.schedule()
    (sr,) = plan.reqs
    assert sr.prefix_len == 40 and off.stats.hit_pages == 10 and off.stats.loads == 1
    s.process_result(plan, result(plan))
    run_until_idle(s)
    assert s.requests == {} and s.radix.protected_pages == 0


def test_abort_while_prefetching_releases_everything():
    prompt = list(range(100, 141))
    probe = FakeProbe()
    s, off = make(probe=probe)
    s.add_request(req("warm", 9, first=100))  # 2 cached pages under the lock of the set-aside
    run_until_idle(s)
    probe.keys = set(keys_of(prompt[:40]))
    s.add_request(Request("r", prompt, SamplingParams(max_tokens=1)))
    plan = s.schedule()
    assert plan.kv_prefetch[0].keys == keys_of(prompt[:40])[2:] and s.radix.protected_pages == 2
    s.process_result(plan, result(plan))
    s.abort("r")
    plan = s.schedule()
    assert "r" in plan.finished_rids and not plan.kv_loads  # the ranks cancel the prefetch
    s.process_result(plan, result(plan))
    assert not s.has_work() and s.radix.protected_pages == 0 and not off.loading
    s.check_integrity()


def test_a_load_lost_with_its_step_frees_its_pages():
    prompt = list(range(100, 141))
    s, off = make(prefetch="best_effort", probe=FakeProbe(keys_of(prompt[:40])))
    s.add_request(Request("r", prompt, SamplingParams(max_tokens=1)))
    step(s)  # the prefetch
    assert s.schedule().kv_loads  # ... and its step fails: no result comes back
    assert s.schedule() is None and not off.held_pages()  # the load counts as 0 pages: requeued
    s.check_integrity()
    plan = s.schedule()  # and admitted without it
    assert [r.prefix_len for r in plan.reqs] == [0]
    s.process_result(plan, result(plan))
    s.check_integrity()
    run_until_idle(s)
    assert s.requests == {} and s.radix.protected_pages == 0


def test_failed_probe_pauses_probing():
    probe = FakeProbe(fail=True)
    s, off = make(probe=probe)
    s.add_request(req("r0", 41, first=1000))
    step(s)  # its lookup failed: lookups pause
    for i in (1, 2):
        s.add_request(req(f"r{i}", 41, first=1000 * (i + 1)))
    run_until_idle(s)
    assert probe.calls == 1 and off.stats.probe_skips == 2 and s.requests == {}


def test_a_lookup_in_flight_never_holds_the_step():
    """A request whose store lookup has not answered is passed over (the ones behind it are
    admitted in the same step); once the answer comes it is set aside for its load."""
    stored = list(range(100, 141))
    probe = FakeProbe(keys_of(stored[:40]), hold=True)
    s, off = make(probe=probe, prefetch_timeout_s=60.0)
    s.add_request(Request("slow", stored, SamplingParams(max_tokens=2, ignore_eos=True)))
    s.add_request(req("short", 4, first=900))  # too short to look up (no whole page before its last token)
    plan = step(s)
    assert [r.rid for r in plan.reqs] == ["short"] and [r.rid for r in s.waiting] == ["slow"]
    probe.answer()
    plan = step(s)
    assert "slow" in off.loading and [p.rid for p in plan.kv_prefetch] == ["slow"]
    assert probe.calls == 1


def test_a_lookup_that_never_answers_is_a_miss():
    import cluster.engine.kv_offload as ko

    probe = FakeProbe(keys_of(list(range(100, 140))), hold=True)
    s, off = make(probe=probe)
    s.add_request(req("r", 41))
    assert s.schedule() is None  # deferred: nothing to run yet
    old, ko.PROBE_WAIT_S = ko.PROBE_WAIT_S, 0.0
    try:
        plans = run_until_idle(s)
    finally:
        ko.PROBE_WAIT_S = old
    assert off.stats.probe_timeouts == 1 and not off.loading and s.requests == {}
    assert plans[0].reqs and plans[0].reqs[0].prefix_len == 0  # computed, not loaded


@pytest.mark.parametrize("load_ttft_s, bypass", [(0.2, True), (0.02, False)])
def test_store_is_bypassed_when_loaded_requests_get_later_first_tokens(load_ttft_s, bypass):
    """The judge is time to first token per prompt token, by path: requests that loaded most of
    their prompt against requests that computed it (queueing included on both)."""
    prompt = list(range(100, 141))
    s, off = make(probe=FakeProbe(keys_of(prompt[:40])))
    for i in range(3):
        computed = req(f"c{i}", 41)
        off.note_first_token(computed, 0.05)  # 41 tokens in 50 ms: 820 tokens/s
        loaded = req(f"l{i}", 41)
        off._loaded_by[loaded.rid] = 40  # as `_finish_load` records it
        off.note_first_token(loaded, load_ttft_s)
    assert off.counters()["ttft_tokens_per_s_computed"] == pytest.approx(820)
    assert off.counters()["bypassing"] is bypass
    s.add_request(Request("r", prompt, SamplingParams(max_tokens=1)))
    plan = s.schedule()
    assert bool(plan.kv_prefetch) is not bypass and off.stats.bypassed == int(bypass)
    assert not off._loaded_by  # every sample taken once
