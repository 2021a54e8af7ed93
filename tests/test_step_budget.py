"""The prompt-token cap that follows a step time target (`cluster/engine/step_budget.py`): the
fit it learns from steps of a known cost, the cap it picks, the scheduler that follows it, and
an engine on the CPU whose steps it caps without changing a token."""

from __future__ import annotations

import random

import pytest

from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from cluster.engine.step_budget import MIN_DECODE_STEPS, StepBudget
from tests.fixtures import tiny_model_dir
from tests.test_engine import greedy, hf_greedy, run_staggered
from tests.test_scheduler import make_scheduler, req, run_step
from workers.forward_batch import ForwardMode
from workers.messages import ScheduledReq, StepPlan

SIZES = (256, 512, 768, 896, 1024)


def decode_cost(d: int, k: int) -> float:  # seconds: launch, per decode, per KV token read
    return 2e-3 + 5e-5 * d + 3e-8 * k


def prompt_cost(size: int) -> float:  # a fixed part (launches, the LM head's row) and one per token
    return 2e-3 + 2.2e-5 * size


def plan(decodes: list[int], prompt: int = 0) -> StepPlan:
    reqs = [ScheduledReq(f"d{i}", i, [7], ctx, [0]) for i, ctx in enumerate(decodes)]
    if prompt:
        reqs.append(ScheduledReq("p", len(decodes), [7] * prompt, 0, [0] * prompt))
    mode = ForwardMode.DECODE if not prompt else ForwardMode.MIXED if decodes else ForwardMode.EXTEND
    return StepPlan(1, mode, reqs, [], [], [])


def trained(target_s: float, seed: int = 0, ttft_target_s: float | None = None) -> StepBudget:
    """A budget that has seen DECODE steps over a range of batches and contexts, MIXED steps at
    three sizes and prompts alone (EXTEND), all of the costs above."""
    rng = random.Random(seed)
    b = StepBudget(target_s, ceiling=1024, floor=256, sizes=SIZES, ttft_target_s=ttft_target_s)
    for _ in range(60):
        ctx = [rng.randint(100, 3000) for _ in range(rng.randint(1, 250))]
        b.observe(plan(ctx), decode_cost(len(ctx), sum(ctx)))
    for prompt, size in ((1000, 1024), (700, 768), (400, 512)) * 4:  # a piece runs at its bucket's cost
        ctx = [rng.randint(100, 3000) for _ in range(rng.randint(1, 250))]
        b.observe(plan(ctx, prompt), decode_cost(len(ctx), sum(ctx)) + prompt_cost(size))
    b.observe(plan([], 2048), prompt_cost(2048))
    return b


def test_the_fit_recovers_the_step_costs():
    b = trained(0.04)
    for d, k in ((1, 500), (64, 64 * 1024), (200, 200 * 2000)):
        assert b.decode_s(d, k) == pytest.approx(decode_cost(d, k), rel=1e-3)
    for size in SIZES:  # (within the weak prior's pull: a prompt of no tokens costs nothing)
        assert b.prompt_s(size) == pytest.approx(prompt_cost(size), rel=0.05)
    assert b.prompt_s(800) == b.prompt_s(896)  # padded to its bucket


def test_steps_at_one_size_do_not_price_the_others_by_its_rate():
    """A stretch of MIXED steps at the floor: a cost per token (no fixed part) read off them
    would price 768 tokens 21% too high, and the cap would stay down."""
    b = trained(0.04)
    for _ in range(20):
        b.observe(plan([1500] * 150, 256), decode_cost(150, 150 * 1500) + prompt_cost(256))
    assert b.prompt_s(768) == pytest.approx(prompt_cost(768), rel=0.08)
    assert b.prompt_s(256) == pytest.approx(prompt_cost(256), rel=0.05)


def test_the_decode_fit_keeps_its_coefficients_nonnegative():
    """Batch and KV grow together in a serve run: with noise, an unconstrained fit may give KV a
    negative cost and the batch an inflated one, and predict a bigger batch far too slow."""
    rng = random.Random(1)
    b = StepBudget(0.04, ceiling=1024, floor=256, sizes=SIZES)
    for d in range(100, 140):  # KV a fixed multiple of the batch, times with +-10% noise
        b.observe(plan([1500] * d), decode_cost(d, 1500 * d) * rng.uniform(0.9, 1.1))
    assert all(c >= 0 for c in b.stats()["decode_fit_ms"])
    assert b.decode_s(200, 1500 * 200) == pytest.approx(decode_cost(200, 1500 * 200), rel=0.15)


def test_one_slow_step_does_not_hold_the_cap_down():
    """A MIXED step slowed threefold (a collector pause) counts as at most CLIP times its
    prediction, and the steps after it bring the cap back."""
    b = trained(0.04)
    d, k = 190, 190 * 1500
    before = b.prompt_tokens(d, k)
    b.observe(plan([1500] * d, 1024), 3 * (decode_cost(d, k) + prompt_cost(1024)))
    assert b.prompt_tokens(d, k) >= 512
    for _ in range(8):
        size = b.prompt_tokens(d, k)
        b.observe(plan([1500] * d, size), decode_cost(d, k) + prompt_cost(size))
    assert b.prompt_tokens(d, k) == before


def test_the_target_holds_the_tail_of_mixed_steps_not_their_mean():
    """MIXED steps that scatter around their prediction (here up to 20% over it): the budget
    learns the 95th percentile of time over prediction and caps so that a step that far over
    still fits the target. One slow step among many changes nothing; steps as predicted leave
    the margin at 1."""
    from cluster.engine.step_budget import MIN_RATIOS, RATIOS

    d, k = 190, 190 * 1500
    rng = random.Random(5)
    noisy, exact = trained(0.04), trained(0.04)
    assert noisy.margin() == 1.0  # (too few MIXED steps seen yet)
    for i in range(RATIOS):
        size = SIZES[1 + i % 4]
        cost = decode_cost(d, k) + prompt_cost(size)
        noisy.observe(plan([1500] * d, size), cost * rng.uniform(0.9, 1.2))
        exact.observe(plan([1500] * d, size), cost * (1.5 if i == RATIOS // 2 else 1.0))
    assert exact.margin() == pytest.approx(1.0, abs=0.01)  # one slow step is not the tail
    assert 1.12 < noisy.margin() <= 1.2
    cap, m = noisy.prompt_tokens(d, k), noisy.margin()
    assert (noisy.decode_s(d, k) + noisy.prompt_s(cap)) * m <= 0.04
    bigger = [s for s in SIZES if s > cap]
    assert not bigger or (noisy.decode_s(d, k) + noisy.prompt_s(bigger[0])) * m > 0.04
    assert cap < exact.prompt_tokens(d, k)  # the mean alone would have allowed more
    assert noisy.stats()["margin"] == m and MIN_RATIOS <= RATIOS


@pytest.mark.parametrize("d,ctx", [(1, 100), (100, 1000), (190, 1500), (250, 2500), (400, 4000)])
def test_the_cap_is_the_largest_size_predicted_to_fit(d, ctx):
    target = 0.04
    b = trained(target)
    left = target - decode_cost(d, d * ctx)
    fits = [s for s in SIZES if s > 256 and b.prompt_s(s) <= left]
    expect = max(fits) if fits else 256  # nothing fits: the floor (prompts still progress)
    assert b.prompt_tokens(d, d * ctx) == expect
    if d == 1:
        assert expect == 1024  # a light step takes the whole cap
    if d == 400:
        assert expect == 256


def test_prompts_waiting_longer_than_the_ttft_target_allows_raise_the_cap():
    """The cap that fits the ITL target computes prompts more slowly than a burst arrives: once
    the capped steps would take longer than the TTFT target to compute what waits, the cap
    grows to the smallest size that would not, and to the ceiling when none would."""
    d, k = 190, 190 * 1500
    step = decode_cost(d, k)

    def drain(size: int, backlog: int) -> float:
        return -(-backlog // size) * (step + prompt_cost(size))

    b = trained(0.04)
    assert b.ttft_target_s == pytest.approx(8 * 0.04)  # the default: 8 ITL targets
    b.ttft_target_s = 0.15  # what waits may take 150 ms
    fit = b.prompt_tokens(d, k)
    assert fit < 1024 and b.stats()["relaxed_steps"] == 0
    assert b.prompt_tokens(d, k, backlog=[(0.0, fit)]) == fit  # one step's worth: nothing to relax
    assert drain(fit, 2 * fit) < 0.15 and b.prompt_tokens(d, k, backlog=[(0.0, fit), (0.0, fit)]) == fit
    backlog = 2600  # four capped steps, more than 150 ms; fewer at a larger size
    assert drain(fit, backlog) > 0.15
    raised = b.prompt_tokens(d, k, backlog=[(0.0, 1300), (0.0, 1300)])
    assert fit < raised < 1024 and drain(raised, backlog) <= 0.15
    assert all(drain(s, backlog) > 0.15 for s in SIZES if fit < s < raised)
    assert b.prompt_tokens(d, k, backlog=[(0.0, 100_000)]) == 1024  # no size drains it in time: the ceiling
    assert b.stats()["relaxed_steps"] == 2 and b.last_cap == 1024
    # A prompt that has already waited: one capped step's worth behind it would still make it
    # late, so the cap grows until its first token is predicted in time.
    tokens = fit + 64  # two capped steps, one at a larger size
    waited = 0.15 - 1.5 * drain(fit, fit)  # in time after one capped step, late after two
    late = b.prompt_tokens(d, k, backlog=[(waited, tokens)])
    assert fit < late < 1024 and waited + drain(late, tokens) <= 0.15
    assert b.prompt_tokens(d, k, backlog=[(0.0, tokens)]) == fit  # the same prompt, fresh: no change
    # Only a late one counts: a fresh prompt behind one that will be in time changes nothing.
    assert b.prompt_tokens(d, k, backlog=[(0.01, fit), (0.0, fit)]) == fit
    # Overlapped, the next plan runs after the step in flight: one capped step's worth that
    # would be in time on its own is late behind it.
    in_time = [(0.15 - 1.5 * drain(fit, fit), fit)]
    assert b.prompt_tokens(d, k, backlog=in_time) == fit
    b.steps_ahead = 1
    assert b.prompt_tokens(d, k, backlog=in_time) > fit
    lax = trained(0.04, ttft_target_s=10.0)  # a lax TTFT target: the ITL target alone decides
    assert lax.prompt_tokens(d, k, backlog=[(0.0, 10_000)]) == fit


def test_the_scheduler_tells_the_budget_what_waits():
    """The backlog: prompt tokens of running pieces still to compute and of queued prompts, not
    the decodes' one token each."""
    from cluster.engine.step_budget import prompt_backlog

    s = make_scheduler(max_num_batched_tokens=64, chunked_prefill_size=16, max_running_requests=8)
    s.add_request(req("a", 8, max_tokens=40))
    run_step(s)  # a decodes from now on
    s.add_request(req("b", 40, max_tokens=4))
    s.add_request(req("c", 30, max_tokens=4))
    now = s.requests["c"].arrival_time + 0.5
    waits = {rid: now - s.requests[rid].arrival_time for rid in ("b", "c")}
    assert prompt_backlog(s, 10_000, now) == [(waits["b"], 40), (waits["c"], 30)]
    assert waits["b"] >= waits["c"] == 0.5
    s.mixed_prefill_tokens = 16
    run_step(s)  # b's first 16 tokens beside a's decode
    assert prompt_backlog(s, 10_000, now) == [(waits["b"], 24), (waits["c"], 30)]
    assert prompt_backlog(s, 20, now) == [(waits["b"], 24)]  # counting stops past the limit
    s.max_running = len(s.running)  # no free slot: c waits for one, not for prompt room
    assert prompt_backlog(s, 10_000, now) == [(waits["b"], 24)]
    s.max_running = 8
    s.requests["c"].output_ids.append(9)  # its first token is out (resumed after a prefill replica's)
    assert prompt_backlog(s, 10_000, now) == [(waits["b"], 24)]  # so no first token of it waits


def test_before_it_has_seen_steps_the_cap_is_the_ceiling():
    b = StepBudget(1e-6, ceiling=1024, floor=256, sizes=SIZES)
    for _ in range(MIN_DECODE_STEPS - 1):
        b.observe(plan([500] * 8), 0.01)
    assert b.prompt_tokens(8, 4000) == 1024
    b.observe(plan([500] * 8), 0.01)  # the decode fit exists, but no prompt cost yet
    assert b.prompt_tokens(8, 4000) == 1024
    b.observe(plan([500] * 8, 300), 0.02)
    assert b.prompt_tokens(8, 4000) == 256
    assert b.stats()["capped_steps"] == 1


def test_without_prompt_graphs_sizes_are_granules_of_the_ceiling():
    b = StepBudget(0.0205, ceiling=1000, floor=100, granule=64)
    for d in range(1, 40):
        b.observe(plan([100] * d), 0.005)
    b.observe(plan([100] * 10, 640), 0.005 + 0.01)  # 640 prompt tokens: 10 ms (one size: through 0)
    assert b.prompt_tokens(10, 1000) == 960  # 15.5 ms left: 960 tokens fit (15 ms), the ceiling does not (16)
    assert b.prompt_tokens(10, 1000) in b._sizes_down


def test_the_scheduler_takes_its_prompt_room_from_the_budget():
    s = make_scheduler(max_num_batched_tokens=64, chunked_prefill_size=64, max_running_requests=8)
    b = StepBudget(0.04, ceiling=32, floor=4, granule=4)
    s.step_budget = b
    s.add_request(req("a", 8, max_tokens=40))
    run_step(s)
    # every step costs more the more KV its decodes read: the room shrinks as a's context grows
    for _ in range(MIN_DECODE_STEPS + 2):
        p, _ = run_step(s)
        b.observe(p, 0.001 + 1e-3 * sum(r.prefix_len for r in p.reqs if len(r.input_ids) == 1))
    b.observe(plan([20], 16), 0.001 + 0.02 + 0.016)  # 16 prompt tokens: 16 ms
    a = s.requests["a"]
    expect = b.prompt_tokens(1, a.num_computed)
    s.add_request(req("b", 60, max_tokens=4, first=300))
    p, _ = run_step(s)
    assert p.mode == ForwardMode.MIXED
    assert [(r.rid, len(r.input_ids)) for r in p.reqs] == [("a", 1), ("b", expect)]
    assert 4 <= expect < 32


def run_with_target(tmp_path_factory, ttft_target_ms: float):
    """A CPU engine with an ITL target no step can meet, prompts arriving in pairs between
    decode steps; its greedy tokens must be transformers'. Returns the budget and, for every
    MIXED plan, (prompt tokens beside decodes, the budget's cap then)."""
    d = tiny_model_dir(tmp_path_factory, "llama")
    config = EngineConfig(model=str(d), chunked_prefill_size=64, max_num_batched_tokens=64, page_size=4,
                          itl_target_ms=1e-3, ttft_target_ms=ttft_target_ms)
    engine = Engine(config)
    budget = engine.scheduler.step_budget
    assert budget is not None and (budget.ceiling, budget.floor) == (64, 16)
    assert budget.steps_ahead == int(engine.overlap)  # a plan waits for the one in flight
    plans = []
    schedule = engine.scheduler.schedule

    def recording():
        p = schedule()
        if p is not None and p.mode == ForwardMode.MIXED:
            plans.append((sum(len(r.input_ids) for r in p.reqs if r.prefix_len == 0 or len(r.input_ids) > 1),
                          budget.last_cap))
        return p

    engine.scheduler.schedule = recording
    prompts = [[5 + (i * 13 + j * 7) % 200 for j in range(40 + 3 * i)] for i in range(10)]
    results = run_staggered(engine, prompts, greedy(24), arrive_every=8)  # decode steps between arrivals
    for p, res in zip(prompts, results):
        assert res.token_ids == hf_greedy(d, p, 24)
    return engine, budget, plans


def test_an_engine_with_a_target_caps_its_mixed_steps_and_keeps_its_tokens(tmp_path_factory):
    """Once the budget has seen steps, every prompt piece beside decodes is the floor (a lax
    TTFT target: what waits never lifts the cap)."""
    engine, budget, plans = run_with_target(tmp_path_factory, ttft_target_ms=1e9)
    assert budget.capped_steps > 0 and budget.last_cap == 16 and budget.relaxed_steps == 0
    stats = engine.stats()  # what a replica reports: /admin/replicas, manta:prompt_token_cap
    assert stats["prompt_token_cap"] == 16 and stats["step_budget"]["capped_steps"] == budget.capped_steps
    first = next(i for i, (_, cap) in enumerate(plans) if cap == 16)
    assert len(plans) - first >= 5 and all(tokens <= 16 for tokens, _ in plans[first:]), plans


def test_an_engine_lifts_the_cap_while_prompts_wait_past_the_ttft_target(tmp_path_factory):
    """The same engine with a TTFT target no queue can meet: whenever more prompt tokens wait
    than the floor computes, a MIXED step takes the whole ceiling; the tokens are unchanged."""
    engine, budget, plans = run_with_target(tmp_path_factory, ttft_target_ms=1e-3)
    assert budget.relaxed_steps > 0 and engine.stats()["step_budget"]["relaxed_steps"] == budget.relaxed_steps
    assert any(tokens > 16 for tokens, cap in plans if cap == 64), plans
    assert all(cap in (16, 64) for _, cap in plans), plans


def test_the_target_is_validated():
    with pytest.raises(ValueError, match="itl_target_ms"):
        EngineConfig(model="m", itl_target_ms=0)
    with pytest.raises(ValueError, match="chunked prefill"):
        EngineConfig(model="m", itl_target_ms=30, chunked_prefill_size=-1)
    with pytest.raises(ValueError, match="itl_target_ms"):
        EngineConfig(model="m", itl_target_ms=30, speculative_draft_model="d")
    with pytest.raises(ValueError, match="ttft_target_ms"):
        EngineConfig(model="m", ttft_target_ms=300)  # without an ITL target it has nothing to bound
    with pytest.raises(ValueError, match="ttft_target_ms"):
        EngineConfig(model="m", itl_target_ms=30, ttft_target_ms=0)
