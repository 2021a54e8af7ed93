"""The shared KV store in serving, the scheduler's side (`cluster.engine.kv_offload`): which pages
each write policy saves, what a prefix found in the store turns into (prefetch, load, the rest
computed), and that a slow, failing or silent store lookup never holds a step — with hand-built
rank results and a fake store lookup, so every page count is exact. The real store in serving
is `tests/test_kvstore_serving.py`."""

from __future__ import annotations

import time

import pytest

from cluster.engine.kv_offload import SchedulerKVOffload
from cluster.engine.kv_store_judge import LOAD_PHASES
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

    def abandon(self, too_slow=False):
        if too_slow:
            self.probe.counters.errors += 1


def make(policy="write_through", prefetch="timeout", probe=None, num_pages=65, **kw):
    s = Scheduler(num_pages=num_pages, page_size=P, max_running_requests=8, max_num_batched_tokens=64,
                  chunked_prefill_size=64, max_context_len=256, eos_token_ids=(2,))
    off = SchedulerKVOffload(s, fingerprint=FP, layout="mha", tp_size=1, write_policy=policy,
                             prefetch_policy=prefetch, probe=probe or FakeProbe(), min_pages=1, **kw)
    return s, off


def req(rid, n, first=100, max_tokens=4) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def result(plan, loaded=None, prefetched=None) -> StepResult:
    """The ranks' answer to `plan`: every load complete unless `loaded` says otherwise;
    `prefetched`: rid -> (pages every rank holds, every rank's read ended)."""
    done = {ld.rid: len(ld.page_ids) for ld in plan.kv_loads}
    res = StepResult(plan.step_id, kv_loaded={**done, **(loaded or {})}, kv_prefetched=dict(prefetched or {}))
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


def test_the_drain_saves_prompt_prefixes_first_and_marks_them():
    """At shutdown the cached pages go out prompt pages first, by depth in their chain (every
    prompt's first page before any second page: a drain cut short leaves whole prefixes),
    then the output pages; each save says how many of its leading pages hold prompt tokens,
    and so do write-back saves at eviction (in eviction order: marked when all are)."""
    s, off = make("write_back_selective", num_pages=65)
    a, b = req("a", 33, max_tokens=20), req("b", 33, first=500, max_tokens=20)
    for r in (a, b):
        s.add_request(r)
    run_until_idle(s)
    saves = off.saves.drain()
    keys = [k for sv in saves for k in sv.keys]
    ka, kb = keys_of(a.all_ids[:52]), keys_of(b.all_ids[:52])  # 8 prompt pages each (33 tokens), 5 output ones
    prompt = [k for pair in zip(kb[:8], ka[:8]) for k in pair]  # b finished last: the more recent at each depth
    assert keys[:16] == prompt and set(keys[16:]) == set(ka[8:] + kb[8:])
    assert sum(sv.prompt for sv in saves) == 16 and all(sv.sync for sv in saves)
    s2, off2 = make("write_back", num_pages=17)
    s2.add_request(req("c", 33, max_tokens=20))
    run_until_idle(s2)
    s2.add_request(req("d", 40, first=900))  # evicts c's pages: the prompt ones lead its save
    saves = [sv for p in run_until_idle(s2) for sv in p.kv_saves]
    assert saves and all(set(sv.keys[: sv.prompt]) <= set(keys_of(list(range(100, 132)))) for sv in saves)
    assert sum(sv.prompt for sv in saves) >= 1


def test_pages_the_store_already_holds_are_not_saved_again(monkeypatch):
    """A request computed although the store holds its prefix (here: the store's loads are all
    busy) never writes those pages back: only the pages past what its lookup found."""
    import cluster.engine.kv_offload as ko

    monkeypatch.setattr(ko, "MAX_LOADING", 0)
    prompt = list(range(100, 141))
    s, off = make("write_through", probe=FakeProbe(keys_of(prompt[:24])))
    s.add_request(Request("r", prompt, SamplingParams(max_tokens=8, ignore_eos=True)))
    plans = run_until_idle(s)
    assert off.stats.busy == 1 and [r.prefix_len for r in plans[0].reqs] == [0]
    saved = [k for p in plans for sv in p.kv_saves for k in sv.keys]
    assert saved == keys_of(prompt + [7] * 7)[6:12]  # pages 6..11 (the last has an output token)


@pytest.mark.parametrize("prefetch", ["timeout", "wait_complete", "best_effort"])
def test_store_prefix_is_prefetched_then_loaded_by_the_plan_that_admits_it(prefetch):
    """Set aside while the ranks prefetch; once the stop policy says stop, the plan that admits
    the request also carries its load (what every rank reported holding), and only the rest of
    the prompt is computed, in that same step."""
    prompt = list(range(100, 141))  # prompt[:-1]: 10 whole pages
    probe = FakeProbe(keys_of(prompt[:40]))
    s, off = make(prefetch=prefetch, probe=probe, prefetch_timeout_s=60.0)
    s.add_request(Request("r", prompt, SamplingParams(max_tokens=2, ignore_eos=True)))
    plan = s.schedule()
    assert plan.mode == ForwardMode.IDLE and not plan.reqs  # set aside while the ranks prefetch
    assert [p.keys for p in plan.kv_prefetch] == [keys_of(prompt[:40])]
    s.process_result(plan, result(plan, prefetched={"r": (7, False)}))  # 7 pages on every rank so far
    s.check_integrity()
    held = 7
    if prefetch != "best_effort":  # these wait for every rank's read to end
        plan = s.schedule()
        assert not plan.kv_loads and not plan.reqs and s.radix.protected_pages == 0
        s.process_result(plan, result(plan, prefetched={"r": (10, True)}))
        held = 10
    free_before = s.allocator.num_free
    plan = s.schedule()
    (load,) = plan.kv_loads
    (sr,) = plan.reqs
    assert load.keys == keys_of(prompt[:40])[:held] and len(load.page_ids) == held
    assert sr.prefix_len == held * P and len(sr.input_ids) == 41 - held * P and sr.sample  # only the rest
    assert plan.table_writes[0][1:] == (0, [p * P + i for p in load.page_ids for i in range(P)])
    assert s.allocator.num_free < free_before - held  # the load's pages and the rest's
    assert off.stats.hit_pages == held and off.stats.query_pages == 10 and off.stats.probe_hit_pages == 10
    assert off.stats.early_stops == (prefetch == "best_effort")
    s.check_integrity()
    s.process_result(plan, result(plan))
    s.check_integrity()
    off.note_first_token(s.requests["r"], 0.2)  # as the engine loop reports it
    phases = off.counters()["load_phase_ms"]  # arrival -> set aside -> stop -> admission -> first token
    assert list(phases) == list(LOAD_PHASES) and sum(phases.values()) == pytest.approx(200, abs=0.5)
    plans = run_until_idle(s)
    assert s.requests == {} and s.radix.protected_pages == 0
    assert s.stats.prefix_hit_tokens == held * P and s.radix.total_cached_pages == 10
    # write_through saves every page the radix cache takes, but not those the store holds:
    # neither the loaded ones nor (best_effort) the ones computed past them
    assert not [k for p in plans for sv in p.kv_saves for k in sv.keys]


def test_timeout_grows_with_the_prompt_and_stops_early():
    prompt = list(range(100, 141))
    s, off = make(prefetch="timeout", probe=FakeProbe(keys_of(prompt[:40])), prefetch_timeout_s=0.05,
                  prefetch_timeout_per_page_s=0.01)
    s.add_request(Request("r", prompt, SamplingParams(max_tokens=1)))
    plan = s.schedule()
    e = off.loading["r"]
    assert e.deadline - e.started == pytest.approx(0.05 + 10 * 0.01)
    s.process_result(plan, result(plan, prefetched={"r": (3, False)}))
    assert not s.schedule().reqs  # still within its deadline
    time.sleep(0.16)
    plan = s.schedule()  # not every rank's read ended, but the deadline passed: what they hold
    assert [len(ld.page_ids) for ld in plan.kv_loads] == [3] and off.stats.early_stops == 1
    assert [r.prefix_len for r in plan.reqs] == [12]
    s.process_result(plan, result(plan))
    run_until_idle(s)
    assert s.stats.prefix_hit_tokens == 12 and s.requests == {}


def test_nothing_held_is_admitted_without_a_load_and_ends_the_prefetch():
    prompt = list(range(100, 141))
    s, off = make(prefetch="wait_complete", probe=FakeProbe(keys_of(prompt[:40])))
    s.add_request(Request("r", prompt, SamplingParams(max_tokens=1)))
    step(s, prefetched={"r": (0, True)})  # a rank found none of it (its store client is down)
    plan = s.schedule()
    assert [(ld.rid, ld.page_ids) for ld in plan.kv_loads] == [("r", [])]  # the ranks end the prefetch
    assert [r.prefix_len for r in plan.reqs] == [0]
    s.process_result(plan, result(plan))
    run_until_idle(s)
    assert s.requests == {} and off.stats.hit_pages == 0 and not off.loading and not off.inflight


@pytest.mark.parametrize("overlap", [False, True])
def test_a_load_that_comes_back_short_is_computed_again_past_the_good_pages(overlap):
    """The ranks agreed on fewer pages than they had reported holding (a row lost between the
    report and the load): the forward that read the load sampled garbage. That token is never
    sent (overlapped: nor the one of the plan launched behind it, which decoded it); once
    those results are in, the request computes its prompt past the 6 good pages, which the
    radix cache kept, and ends normally."""
    prompt = list(range(100, 141))
    s, off = make(prefetch="wait_complete", probe=FakeProbe(keys_of(prompt[:40])))
    s.overlap = overlap
    s.add_request(Request("r", prompt, SamplingParams(max_tokens=4, ignore_eos=True)))
    step(s, prefetched={"r": (10, True)})
    plan = s.schedule()
    assert len(plan.kv_loads[0].page_ids) == 10
    behind = s.schedule() if overlap else None  # launched before the load's result came
    assert behind is None or [r.rid for r in behind.reqs] == ["r"]
    events = s.process_result(plan, result(plan, loaded={"r": 6}))
    r = s.requests["r"]
    assert not [ev for ev in events if ev.token_ids] and r.output_ids == [] and list(s.waiting) == [r]
    assert off.stats.short_loads == 1 and off.stats.hit_pages == 6 and s.radix.total_cached_pages == 6
    if overlap:
        held = s.schedule()  # the drop goes out; r waits for the result of the plan behind
        assert "r" in held.finished_rids and not held.reqs
        assert not [ev for ev in s.process_result(behind, result(behind)) if ev.token_ids]
        s.process_result(held, result(held))
    s.check_integrity()
    again = s.schedule()
    (sr,) = again.reqs
    assert sr.rid == "r" and sr.prefix_len == 6 * P and sr.input_ids == prompt[6 * P :] and not again.kv_loads
    tokens = []
    while again is not None:
        tokens += [t for ev in s.process_result(again, result(again)) for t in ev.token_ids]
        again = s.schedule()
    s.check_integrity()
    assert tokens == [7] * 4 and r.finish_reason.value == "length" and r.output_ids == [7] * 4
    assert s.requests == {} and s.radix.protected_pages == 0 and not off.from_store and not s._discard


def test_pages_the_host_tier_holds_are_loaded_by_the_first_plan():
    """What the first rank reports its host tier holding (`kv_host_ready` / `kv_host_evicted`)
    admits a request at once with a load of those pages past its radix match: no store
    lookup, no prefetch, no set-aside. An evicted key ends the run it can load."""
    from workers.messages import StepPlan

    prompt = list(range(100, 141))  # prompt[:-1]: 10 whole pages
    keys = keys_of(prompt[:40])
    s, off = make(probe=FakeProbe(keys))  # the store holds them too: the host tier goes first
    off.on_result(StepPlan(0, ForwardMode.IDLE, []), StepResult(0, kv_host_ready=keys + ["other"]))
    off.on_result(StepPlan(1, ForwardMode.IDLE, []), StepResult(1, kv_host_evicted=[keys[8]]))
    assert list(off.host.keys) == keys[:8] + keys[9:] + ["other"]
    s.add_request(Request("r", prompt, SamplingParams(max_tokens=3, ignore_eos=True)))
    plan = s.schedule()
    (load,) = plan.kv_loads
    (sr,) = plan.reqs
    assert load.keys == keys[:8] and len(load.page_ids) == 8 and not plan.kv_prefetch
    assert sr.prefix_len == 8 * P and sr.input_ids == prompt[8 * P :] and sr.sample
    assert off.stats.host_admissions == 1 and off.stats.hit_pages == 8 and off.stats.loads == 1
    tokens = []
    while plan is not None:
        tokens += [t for ev in s.process_result(plan, result(plan)) for t in ev.token_ids]
        plan = s.schedule()
    s.check_integrity()
    assert tokens == [7] * 3 and s.requests == {} and s.stats.prefix_hit_tokens == 8 * P
    assert not off.loading and not off.inflight and s.radix.protected_pages == 0
    # What the radix cache holds is not loaded again; with fewer than min_pages past it in
    # the host tier, the request goes the usual way (here: the store's prefetch).
    s.add_request(Request("r2", prompt, SamplingParams(max_tokens=1)))
    plan = s.schedule()
    assert off.stats.host_admissions == 1 and not plan.kv_loads


def _host_admitted(keys_held, prompt, overlap=False, **kw):
    """A scheduler whose host-tier picture holds `keys_held`, and the plan that admits a
    request of `prompt` with their load."""
    from workers.messages import StepPlan

    s, off = make(**kw)
    s.overlap = overlap
    off.on_result(StepPlan(0, ForwardMode.IDLE, []), StepResult(0, kv_host_ready=list(keys_held)))
    s.add_request(Request("r", prompt, SamplingParams(max_tokens=3, ignore_eos=True)))
    plan = s.schedule()
    assert plan.kv_loads and off.stats.host_admissions == 1
    return s, off, plan


def test_a_short_host_load_forgets_what_the_picture_had_wrong():
    """Pages the ranks did not have leave the picture (no next request orders them again); a
    load of none of them (a rank without the tier) pauses admissions from it."""
    prompt = list(range(100, 141))
    keys = keys_of(prompt[:40])
    s, off, plan = _host_admitted(keys, prompt)
    s.process_result(plan, result(plan, loaded={"r": 6}))
    assert list(off.host.keys) == keys[:6] and off.host.trusted()
    assert s.requests["r"].cached_tokens == 6 * P and s.stats.prefix_hit_tokens == 6 * P
    s, off, plan = _host_admitted(keys, prompt)
    s.process_result(plan, result(plan, loaded={"r": 0}))
    assert not off.host.keys and off.host.skip_until > time.monotonic()


@pytest.mark.parametrize("how", ["aborted", "preempted"])
def test_pages_of_a_load_whose_result_has_not_come_are_never_cached(how):
    """Overlapped: the request leaves the running set (aborted, or preempted by the plan built
    behind) before its load's result says it came back short. None of the load's pages reach
    the radix cache, and a preempted request's token from that plan is dropped."""
    prompt = list(range(100, 141))
    s, off, plan = _host_admitted(keys_of(prompt[:40]), prompt, overlap=True)
    r = s.requests["r"]
    if how == "aborted":
        s.abort("r")
    else:
        s._preempt(r)  # as _reserve or the fair share does while planning the next step
    assert s.radix.total_cached_pages == 0  # not the 10 loaded pages, not yet confirmed
    events = s.process_result(plan, result(plan, loaded={"r": 6}))
    assert not [ev for ev in events if ev.token_ids] and s.radix.total_cached_pages == 0
    tokens = []
    plan = s.schedule()
    while plan is not None:
        tokens += [t for ev in s.process_result(plan, result(plan)) for t in ev.token_ids]
        plan = s.schedule()
    s.check_integrity()
    assert s.requests == {} and not s._discard and s.radix.protected_pages == 0
    assert tokens == ([] if how == "aborted" else [7] * 3)
    assert how == "aborted" or r.output_ids == [7] * 3


@pytest.mark.parametrize("when", ["prefetching", "requeued", "loading"])
def test_abort_at_any_point_of_a_load_releases_everything(when):
    prompt = list(range(100, 141))
    probe = FakeProbe()
    s, off = make(probe=probe, prefetch="wait_complete")
    s.add_request(req("warm", 9, first=100))  # 2 cached pages under the lock of the set-aside
    run_until_idle(s)
    probe.keys = set(keys_of(prompt[:40]))
    s.add_request(Request("r", prompt, SamplingParams(max_tokens=1)))
    plan = s.schedule()
    assert plan.kv_prefetch[0].keys == keys_of(prompt[:40])[2:] and s.radix.protected_pages == 2
    s.process_result(plan, result(plan, prefetched={"r": (8, when != "prefetching")}))
    if when == "requeued":
        off.requeue_ready()
        assert list(s.waiting) == [off.loading["r"].req]
    if when == "loading":
        plan = s.schedule()
        assert plan.kv_loads and plan.reqs
    s.abort("r")
    plan = s.schedule()
    assert "r" in plan.finished_rids and not plan.kv_loads  # the ranks cancel the prefetch
    s.process_result(plan, result(plan))
    plan = s.schedule()
    if plan is not None:
        s.process_result(plan, result(plan))
    assert not s.has_work() and s.radix.protected_pages == 0 and not off.loading and not off.inflight
    assert not off.from_store
    s.check_integrity()


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
        off.judge.loaded(loaded.rid, 40)  # as `admitted` records it
        off.note_first_token(loaded, load_ttft_s)
    assert off.counters()["ttft_tokens_per_s_computed"] == pytest.approx(820)
    assert off.counters()["bypassing"] is bypass
    s.add_request(Request("r", prompt, SamplingParams(max_tokens=1)))
    plan = s.schedule()
    assert bool(plan.kv_prefetch) is not bypass and off.stats.bypassed == int(bypass)
    assert off.in_store["r"] == 10  # looked up either way: what the store holds is never saved again
    assert not off.judge._loaded  # every sample taken once


def test_loads_that_hold_the_memory_of_an_idle_replica_let_go():
    """Two requests wait on store loads, each holding its cached prefix locked (6 pages each of
    16), and each needs 6 more pages to run: with nothing running nothing would ever free them
    (a PD decode replica hung so under an audit). The replica lets their holds go and computes
    them the usual way: both finish, and every page is back."""
    a, b = list(range(100, 145)), list(range(300, 345))  # prompt[:-1]: 11 pages each
    probe = FakeProbe()
    s, off = make(probe=probe, num_pages=17, prefetch="best_effort")
    for rid, p in (("a", a[:25]), ("b", b[:25])):  # 6 pages of each cached on the GPU
        s.add_request(Request(rid, p, SamplingParams(max_tokens=1, ignore_eos=True)))
    run_until_idle(s)
    assert s.requests == {} and s.radix.total_cached_pages == 12
    probe.keys = set(keys_of(a[:36]) + keys_of(b[:36]))  # the store holds 9 pages of each
    for rid, p in (("a2", a), ("b2", b)):
        s.add_request(Request(rid, p, SamplingParams(max_tokens=2, ignore_eos=True)))
    plan = step(s)  # both set aside: 3 store pages past their 6 cached ones
    assert [p.keys for p in plan.kv_prefetch] == [keys_of(a[:36])[6:], keys_of(b[:36])[6:]]
    assert s.radix.protected_pages == 12 and not s.running
    progress = {"a2": (3, True), "b2": (3, True)}
    plans = [step(s, prefetched=progress)]
    plans += run_until_idle(s)
    assert s.requests == {} and off.stats.released_holds == 2, off.stats
    assert s.radix.protected_pages == 0 and s.allocator.num_free + s.radix.evictable_pages == 16
    assert {"a2", "b2"} <= {rid for p in plans for rid in p.finished_rids}  # their prefetches ended
