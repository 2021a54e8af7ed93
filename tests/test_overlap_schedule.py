"""Overlapped scheduling: the engine plans and launches step k+1 before it reads step k's tokens.

What a client sees must equal the one-step-at-a-time engine's, for every way a request can end
(length, stop token, stop string, abort), every sampling feature that reads earlier tokens
(penalties, per-position seeds, min_tokens) and under chunked prefill and preemption; and every
KV page comes back.
"""

from __future__ import annotations

import pytest

from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from cluster.engine.request import RequestOutput
from tests.fixtures import tiny_model_dir
from tests.test_engine import PROMPTS
from workers.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return str(tiny_model_dir(tmp_path_factory, "llama"))


class Collected:
    """Every output of one request, as a client would assemble it."""

    def __init__(self):
        self.outputs: list[RequestOutput] = []

    def __call__(self, out: RequestOutput) -> None:
        self.outputs.append(out)

    def summary(self) -> tuple:
        last = self.outputs[-1]
        assert last.finished and sum(o.finished for o in self.outputs) == 1
        return (
            [t for o in self.outputs for t in o.delta_token_ids],
            "".join(o.delta_text for o in self.outputs),
            [lp for o in self.outputs for lp in o.delta_logprobs],
            last.finish_reason,
            last.completion_tokens,
        )


def run(engine: Engine, prompts, params, arrive_every: int = 2) -> list[tuple]:
    """Submit two requests every `arrive_every` steps, run to completion, return summaries."""
    sinks, todo = [], list(zip(prompts, params))
    while todo or engine.has_work():
        for _ in range(2):
            if todo:
                prompt, p = todo.pop(0)
                sinks.append(Collected())
                engine.add_request(prompt, p, sinks[-1])
        for _ in range(arrive_every):
            engine.step()
    check_pages_back(engine)
    return [s.summary() for s in sinks]


def check_pages_back(engine: Engine) -> None:
    sch = engine.scheduler
    sch.check_integrity()
    assert not sch.running and not sch.waiting and not sch.requests
    assert sch.allocator.num_free + sch.radix.total_cached_pages == sch.allocator.num_total
    assert not engine._inflight


def pair(model: str, **kw) -> tuple[Engine, Engine]:
    overlapped = Engine(EngineConfig(model=model, **kw))
    serial = Engine(EngineConfig(model=model, disable_overlap_schedule=True, **kw))
    assert overlapped.overlap and not serial.overlap
    return overlapped, serial


def mixed_params(stop_token: int, stop_text: str) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.0, stop_token_ids=(stop_token,)),
        SamplingParams(max_tokens=9, temperature=0.0, stop_token_ids=(stop_token,), min_tokens=6),
        SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, frequency_penalty=1.5,
                       presence_penalty=0.5, repetition_penalty=1.3, logprobs=3),
        SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, stop=(stop_text,)),
        SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=0),
    ]


@pytest.mark.parametrize("options", [
    dict(page_size=1),
    dict(page_size=4, chunked_prefill_size=3, max_num_batched_tokens=7),  # MIXED steps
    dict(page_size=4, kv_cache_tokens=64),  # preemption, with tokens in flight
], ids=["plain", "chunked", "preempting"])
def test_outputs_equal_the_serial_engine(llama, options):
    overlapped, serial = pair(llama, **options)
    probe = serial.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    params = mixed_params(stop_token=probe.token_ids[2], stop_text=probe.text[len(probe.text) // 2:][:3])
    prompts = (PROMPTS * 2)[: len(params)]
    want = run(serial, prompts, params)
    got = run(overlapped, prompts, params)
    # Batches differ (a request that ended on a stop token rides one more step), so logprobs
    # may differ in the last float bits; everything else is exact.
    assert [g[:2] + g[3:] for g in got] == [w[:2] + w[3:] for w in want]
    for g, w in zip(got, want):
        assert [lp is None for lp in g[2]] == [lp is None for lp in w[2]]
        for a, b in zip(g[2], w[2]):
            if a is not None:
                assert a.token_logprob == pytest.approx(b.token_logprob, abs=1e-4)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
                assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)
    reasons = {s[3] for s in got}
    assert reasons == {"length", "stop"}
    if "kv_cache_tokens" in options:
        assert overlapped.scheduler.stats.preemptions > 0


def test_steps_are_launched_ahead(llama):
    """The overlapped loop goes through launch/collect, never execute, and keeps one step in
    flight while requests decode."""
    engine, _ = pair(llama)
    launched, in_flight = [], []
    launch = engine.workers.launch

    def spy(plan):
        launched.append(plan.mode)
        launch(plan)
        in_flight.append(len(engine._inflight))

    engine.workers.launch = spy
    engine.workers.execute = lambda plan: pytest.fail("execute() in overlapped mode")
    engine.generate(PROMPTS[:3], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert len(launched) >= 6
    assert max(in_flight) == 1  # appended after launch: the one before it is still to collect
    check_pages_back(engine)


def test_stop_token_ends_request_and_drops_the_step_in_flight(llama):
    engine, serial = pair(llama)
    ref = serial.generate([PROMPTS[2]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    stop = ref.token_ids[3]
    res = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(stop,)))[0]
    assert res.finish_reason == "stop"
    assert res.token_ids == ref.token_ids[: ref.token_ids.index(stop) + 1]
    check_pages_back(engine)


def test_abort_with_a_step_in_flight_frees_everything(llama):
    engine, _ = pair(llama, page_size=4)
    sink = Collected()
    rid = engine.add_request(PROMPTS[2], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True), sink)
    other = Collected()
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), other)
    for _ in range(4):
        engine.step()
    assert engine._inflight  # a step is in flight while the client goes away
    engine.abort(rid)
    while engine.has_work():
        engine.step()
    assert sink.outputs[-1].finish_reason == "abort"
    assert sink.outputs[-1].completion_tokens == sum(len(o.delta_token_ids) for o in sink.outputs)
    assert other.summary()[3] == "length" and len(other.summary()[0]) == 5
    check_pages_back(engine)


def test_a_failed_step_fails_its_requests_and_the_next_ones_are_served(llama):
    """A step that raises with another step in flight: the engine loop fails every request
    (none hangs), forgets the launched steps on both sides, and later requests come out exactly
    as on a fresh engine (no stale result is taken for a new plan)."""
    import asyncio

    engine, serial = pair(llama, page_size=4)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [r.token_ids for r in serial.generate(PROMPTS[:3], params)]
    runner = engine.workers.runner
    launch, calls, failed_at = runner.launch, [], []

    def flaky(plan):
        calls.append(plan.step_id)
        # The first decode step of all three (each has a token by then, the previous step is
        # in flight): chosen by what it runs, not by its number, which a slow machine changes
        # (a request added a step late would then finish normally).
        if not failed_at and len(plan.reqs) == 3 and all(len(r.input_ids) == 1 for r in plan.reqs) \
                and engine._inflight:  # (launched, not collected yet)
            failed_at.append(plan.step_id)
            raise RuntimeError("injected failure")
        return launch(plan)

    runner.launch = flaky
    engine.start()

    async def run(prompts):
        async def one(p):
            return [o async for o in engine.generate_stream(p, params)]
        return await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), timeout=60)

    try:
        failed = asyncio.run(run(PROMPTS[:3]))
        assert failed_at, calls
        assert all(outs[-1].finished and outs[-1].finish_reason == "error" for outs in failed)
        assert all("injected failure" in outs[-1].error for outs in failed)
        later = asyncio.run(run(PROMPTS[:3]))
        assert [[t for o in outs for t in o.delta_token_ids] for outs in later] == want
    finally:
        engine.shutdown()
