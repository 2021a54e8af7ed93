"""Scheduler logic on CPU with hand-built worker results and exact token counts."""

from __future__ import annotations

import pytest

from cluster.engine.request import FinishReason, Request
from cluster.engine.scheduler import RequestRejected, Scheduler
from workers.forward_batch import ForwardMode
from workers.messages import StepResult
from workers.request_errors import QueueFull
from workers.sampling_params import SamplingParams, SamplingParamsError


def make_scheduler(**kw) -> Scheduler:
    args = dict(
        num_pages=65,
        page_size=4,
        max_running_requests=8,
        max_num_batched_tokens=64,
        chunked_prefill_size=16,
        max_context_len=256,
        eos_token_ids=(2,),
    )
    args.update(kw)
    return Scheduler(**args)


def fake_result(plan, token=7) -> StepResult:
    res = StepResult(plan.step_id)
    for r in plan.reqs:
        if r.sample:
            res.sampled_rids.append(r.rid)
            res.next_token_ids.append(token)
            res.logprobs.append(None)
    return res


def run_step(s: Scheduler, token=7):
    plan = s.schedule()
    assert plan is not None
    events = s.process_result(plan, fake_result(plan, token))
    s.check_integrity()
    return plan, events


def req(rid, n, max_tokens=4, first=100, **kw) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens, **kw))


def test_chunked_prefill_then_decode_exact_counts():
    s = make_scheduler()
    s.add_request(req("a", 40))
    plans = [run_step(s)[0] for _ in range(3)]
    assert [len(p.reqs[0].input_ids) for p in plans] == [16, 16, 8]
    assert [p.reqs[0].prefix_len for p in plans] == [0, 16, 32]
    assert [p.reqs[0].sample for p in plans] == [False, False, True]
    assert plans[0].mode == ForwardMode.EXTEND and plans[0].new_requests[0].rid == "a"
    plan, events = run_step(s)
    assert plan.mode == ForwardMode.DECODE
    assert plan.reqs[0].input_ids == [7] and plan.reqs[0].prefix_len == 40
    # slots of consecutive tokens follow the request's pages
    assert plan.reqs[0].out_cache_loc[0] // 4 != 0


def test_mixed_batch_and_budget():
    s = make_scheduler(max_num_batched_tokens=20)
    s.add_request(req("a", 8))
    run_step(s)  # a prefilled, sampled
    s.add_request(req("b", 30, first=300))
    plan, _ = run_step(s)
    assert plan.mode == ForwardMode.MIXED
    assert [(r.rid, len(r.input_ids)) for r in plan.reqs] == [("a", 1), ("b", 16)]
    plan, _ = run_step(s)
    assert [(r.rid, len(r.input_ids)) for r in plan.reqs] == [("a", 1), ("b", 14)]


def test_prompt_tokens_beside_decodes_are_capped_continued_chunks_first():
    s = make_scheduler(max_num_batched_tokens=64, mixed_prefill_tokens=10)
    s.add_request(req("a", 8, max_tokens=20))
    s.add_request(req("b", 30, max_tokens=20, first=200))
    plan, _ = run_step(s)  # nothing decodes yet: the whole budget (one chunk each)
    assert [(r.rid, len(r.input_ids)) for r in plan.reqs] == [("a", 8), ("b", 16)]
    s.add_request(req("c", 12, max_tokens=20, first=300))
    plan, _ = run_step(s)  # a decodes: b's next chunk takes the 10 prompt tokens, c waits
    assert plan.mode == ForwardMode.MIXED
    assert [(r.rid, len(r.input_ids)) for r in plan.reqs] == [("a", 1), ("b", 10)]
    plan, _ = run_step(s)  # b's last 4, then c gets the rest of the room
    assert [(r.rid, len(r.input_ids)) for r in plan.reqs] == [("a", 1), ("b", 4), ("c", 6)]
    plan, _ = run_step(s)
    assert [(r.rid, len(r.input_ids)) for r in plan.reqs] == [("a", 1), ("b", 1), ("c", 6)]
    assert plan.reqs[2].sample
    plan, _ = run_step(s)
    assert plan.mode == ForwardMode.DECODE and len(plan.reqs) == 3


def test_prompt_cap_leaves_unchunked_prompts_whole():
    s = make_scheduler(chunked_prefill_size=-1, mixed_prefill_tokens=4)
    s.add_request(req("a", 8, max_tokens=20))
    run_step(s)
    s.add_request(req("b", 30, max_tokens=20, first=200))
    plan, _ = run_step(s)  # chunking off: a prompt cannot wait for a step that never comes
    assert [(r.rid, len(r.input_ids)) for r in plan.reqs] == [("a", 1), ("b", 30)]


def test_finish_on_length_eos_and_stop_token():
    s = make_scheduler()
    s.add_request(req("len", 5, max_tokens=2))
    s.add_request(req("eos", 5, max_tokens=10, first=200))
    s.add_request(req("stopid", 5, max_tokens=10, first=300, stop_token_ids=(9,)))
    _, ev = run_step(s, token=7)
    assert not any(e.req.finished for e in ev)
    plan = s.schedule()
    res = StepResult(plan.step_id, ["len", "eos", "stopid"], [7, 2, 9], [None] * 3)
    ev = s.process_result(plan, res)
    reasons = {e.req.rid: e.req.finish_reason for e in ev}
    assert reasons == {"len": FinishReason.LENGTH, "eos": FinishReason.STOP, "stopid": FinishReason.STOP}
    assert not s.running
    plan = s.schedule()
    assert plan is not None and plan.mode == ForwardMode.IDLE
    assert sorted(plan.finished_rids) == ["eos", "len", "stopid"]
    s.check_integrity()


def test_min_tokens_blocks_eos_and_ignore_eos():
    s = make_scheduler()
    s.add_request(req("a", 5, max_tokens=5, min_tokens=2))
    s.add_request(req("b", 5, max_tokens=3, first=200, ignore_eos=True))
    run_step(s, token=2)
    assert len(s.running) == 2  # eos ignored: below min_tokens / ignore_eos
    run_step(s, token=2)
    assert [r.rid for r in s.running] == ["b"]


def test_prefix_cache_hit_after_finish():
    s = make_scheduler(chunked_prefill_size=64)
    s.add_request(req("a", 21, max_tokens=1))
    run_step(s)
    s.add_request(req("b", 23, max_tokens=1))
    plan, _ = run_step(s)
    # 21 prompt tokens computed by "a" -> 5 whole pages (20 tokens) cached
    assert plan.reqs[0].prefix_len == 20
    assert plan.table_writes and plan.table_writes[0][0] == plan.reqs[0].req_pool_idx
    assert len(plan.table_writes[0][2]) == 20
    assert s.stats.prefix_hit_tokens == 20


def test_full_prompt_hit_still_computes_one_token():
    s = make_scheduler(page_size=1)
    s.add_request(req("a", 8, max_tokens=1))
    run_step(s)
    s.add_request(req("b", 8, max_tokens=1))
    plan, _ = run_step(s)
    assert plan.reqs[0].prefix_len == 7 and len(plan.reqs[0].input_ids) == 1


def test_disabled_radix_cache_never_hits():
    s = make_scheduler(disable_radix_cache=True, chunked_prefill_size=64)
    s.add_request(req("a", 21, max_tokens=1))
    run_step(s)
    s.add_request(req("b", 21, max_tokens=1))
    plan, _ = run_step(s)
    assert plan.reqs[0].prefix_len == 0
    assert s.allocator.num_free == s.allocator.num_total


def test_preemption_when_pool_is_full_then_recompute():
    # 8 usable pages of 4 tokens = 32 tokens; two requests of 12 prompt + 12 output need 48.
    s = make_scheduler(num_pages=9, disable_radix_cache=True, chunked_prefill_size=-1)
    s.add_request(req("a", 12, max_tokens=12))
    s.add_request(req("b", 12, max_tokens=12, first=200))
    preempted_seen = False
    finished = set()
    for _ in range(200):
        plan = s.schedule()
        if plan is None:
            break
        if any(r.rid in plan.finished_rids for r in s.waiting):
            preempted_seen = True
        for e in s.process_result(plan, fake_result(plan)):
            if e.req.finished:
                finished.add(e.req.rid)
        s.check_integrity()
    assert finished == {"a", "b"}
    assert preempted_seen and s.stats.preemptions >= 1


def test_abort_frees_pages_and_is_reported():
    s = make_scheduler()
    s.add_request(req("a", 10, max_tokens=50))
    run_step(s)
    assert s.allocator.num_free < s.allocator.num_total
    s.abort("a")
    assert not s.running
    plan = s.schedule()
    assert plan.finished_rids == ["a"]
    # aborted request's pages are cached (whole pages) or free: nothing owned remains
    s.check_integrity()
    s.radix.evict(10**6)
    assert s.allocator.num_free == s.allocator.num_total


def test_rejections_name_the_problem():
    s = make_scheduler(max_waiting=1)
    with pytest.raises(RequestRejected, match="context"):
        s.add_request(req("long", 256))
    with pytest.raises(RequestRejected, match="empty"):
        s.add_request(Request("e", [], SamplingParams()))
    with pytest.raises(SamplingParamsError) as ei:
        s.add_request(req("neg", 4, max_tokens=-1))
    assert ei.value.param == "max_tokens"
    # The queue holds max_waiting beyond the free running slots (a burst between two steps).
    for i in range(1 + 8):
        s.add_request(req(f"ok{i}", 4))
    with pytest.raises(QueueFull):
        s.add_request(req("over", 4))
    s.schedule()  # 8 run now (slots taken): one more may wait
    assert len(s.running) == 8 and len(s.waiting) == 1
    with pytest.raises(QueueFull):
        s.add_request(req("over", 4))


def test_request_outgrowing_the_whole_cache_ends_with_length_not_livelock():
    # 4 usable pages of 4 tokens = 16 tokens; a 10-token prompt asking for 20 more cannot fit.
    s = make_scheduler(num_pages=5, disable_radix_cache=True, chunked_prefill_size=-1)
    s.add_request(req("big", 10, max_tokens=20))
    finished = []
    for _ in range(50):
        plan = s.schedule()
        if plan is None:
            break
        finished += [e.req for e in s.process_result(plan, fake_result(plan)) if e.req.finished]
        s.check_integrity()
    assert [r.rid for r in finished] == ["big"]
    assert finished[0].finish_reason == FinishReason.LENGTH
    assert len(finished[0].output_ids) == 16 - 10 + 1  # filled every slot, then one token more
    assert s.allocator.num_free == s.allocator.num_total


def test_a_request_with_many_choices_cannot_starve_the_others():
    """8 choices of one request (one group) fill every running slot; two single requests that
    arrive then get slots at the next step (the group's newest are preempted down to its fair
    share), and the group gets its slots back once they finish."""
    s = make_scheduler(max_running_requests=8, max_num_batched_tokens=256)
    for i in range(8):
        s.add_request(Request(f"big-{i}", list(range(100, 110)), SamplingParams(max_tokens=50, ignore_eos=True),
                              group="big"))
    run_step(s)
    assert len(s.running) == 8
    s.add_request(req("x", 10, max_tokens=3, first=300))
    s.add_request(req("y", 10, max_tokens=3, first=400))
    plan, _ = run_step(s)
    assert {n.rid for n in plan.new_requests} == {"x", "y"}
    assert s.stats.fair_preemptions == 2 and sum(r.group == "big" for r in s.running) == 6
    assert [r.rid for r in s.waiting] == ["big-6", "big-7"]  # the newest two wait
    while any(r.rid in ("x", "y") for r in s.running):
        run_step(s)
    run_step(s)
    assert sum(r.group == "big" for r in s.running) == 8 and not s.waiting


def test_fair_share_needs_a_waiting_group():
    """One group alone may use every slot; preemption only happens for another group."""
    s = make_scheduler(max_running_requests=4)
    for i in range(6):
        s.add_request(Request(f"g-{i}", list(range(100, 110)), SamplingParams(max_tokens=20, ignore_eos=True),
                              group="g"))
    for _ in range(3):
        run_step(s)
    assert len(s.running) == 4 and s.stats.fair_preemptions == 0
