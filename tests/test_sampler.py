"""Behaviour of `workers.sampler.Sampler` and of `SamplingParams.validate`.

Every sampler test runs on CPU, and on CUDA where a GPU is present (marked `gpu`). Random tests
seed torch's default generator, so they are deterministic; their bounds are loose enough that
they would also pass for almost any other seed.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from workers.sampler import LOGPROB_FLOOR, RequestSamplingState, Sampler
from workers.sampling_params import SamplingParams, SamplingParamsError

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    torch.manual_seed(1234)
    if request.param == "cuda":
        torch.cuda.manual_seed(1234)
    return torch.device(request.param)


def st(prompt=(), output=(), **params) -> RequestSamplingState:
    return RequestSamplingState(SamplingParams(**params).validate(), list(prompt), list(output))


def rows(device, *vectors) -> torch.Tensor:
    return torch.tensor(vectors, dtype=torch.float32, device=device)


def peaked(V: int, best: int, device) -> torch.Tensor:
    """One row whose softmax puts ~0.97 on `best`."""
    x = torch.zeros(1, V, device=device)
    x[0, best] = 8.0
    return x


# -- greedy --------------------------------------------------------------------------------


def test_greedy_is_argmax_with_ties_to_the_lowest_id(device):
    logits = torch.randn(6, 50, device=device)
    logits[5] = 0.0
    logits[5, 7] = logits[5, 31] = 3.0  # a tie: 7 wins
    out = Sampler(50, device).sample(logits, [st(temperature=0.0) for _ in range(6)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.token_ids[5] == 7
    assert out.logprobs == [None] * 6


def test_top_k_1_is_greedy_whatever_the_temperature(device):
    logits = torch.randn(8, 40, device=device)
    sampler = Sampler(40, device)
    for _ in range(5):
        out = sampler.sample(logits, [st(temperature=1.5, top_k=1) for _ in range(8)])
        assert out.token_ids == logits.argmax(-1).tolist()


def test_tiny_top_p_is_greedy_on_a_peaked_distribution(device):
    logits = peaked(30, 17, device).repeat(500, 1) + 0.1 * torch.randn(500, 30, device=device)
    out = Sampler(30, device).sample(logits, [st(temperature=1.0, top_p=0.05) for _ in range(500)])
    assert out.token_ids == [17] * 500


def test_greedy_and_sampled_rows_mix_in_one_batch(device):
    logits = torch.randn(10, 20, device=device)
    states = [st(temperature=0.0) if i % 2 else st(temperature=1.0, top_k=3) for i in range(10)]
    out = Sampler(20, device).sample(logits, states)
    top3 = logits.topk(3, dim=-1).indices.tolist()
    for i, tok in enumerate(out.token_ids):
        if i % 2:
            assert tok == logits[i].argmax().item()
        else:
            assert tok in top3[i]


# -- distribution --------------------------------------------------------------------------


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().item()
    expected = probs * n
    return ((counts - expected) ** 2 / expected).sum().item()


# Upper 0.1% points of the chi-square distribution, by degrees of freedom.
CHI2_999 = {3: 16.27, 7: 24.32}


def test_temperature_one_matches_softmax(device):
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 1.5, -1.0, 0.2])
    n = 20_000
    out = Sampler(8, device).sample(base.to(device).repeat(n, 1), [st(temperature=1.0)] * n)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=8).float()
    assert chi_square(counts, base.softmax(-1)) < CHI2_999[7]


def test_temperature_scales_the_logits(device):
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 1.5, -1.0, 0.2])
    n = 20_000
    out = Sampler(8, device).sample(base.to(device).repeat(n, 1), [st(temperature=0.5)] * n)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=8).float()
    assert chi_square(counts, (base / 0.5).softmax(-1)) < CHI2_999[7]


def test_seeded_draws_also_match_softmax(device):
    # One seeded request per row, each with its own seed and position: the noise that the
    # (seed, position) hash yields must still be i.i.d. Exp(1).
    base = torch.tensor([0.3, -0.2, 1.1, 0.0])
    n = 4_000
    states = [st(output=[0] * (i % 7), temperature=1.0, seed=i // 7) for i in range(n)]
    out = Sampler(4, device).sample(base.to(device).repeat(n, 1), states)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4).float()
    assert chi_square(counts, base.softmax(-1)) < CHI2_999[3]


def test_top_k_never_leaves_the_top_k(device):
    logits = torch.randn(1, 64, device=device).repeat(4_000, 1)
    out = Sampler(64, device).sample(logits, [st(temperature=2.0, top_k=5)] * 4_000)
    top5 = set(logits[0].topk(5).indices.tolist())
    assert set(out.token_ids) == top5  # inside the top 5, and with T=2 each of them shows up


def test_top_p_keeps_the_smallest_set_reaching_p(device):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().to(device).repeat(4_000, 1)
    out = Sampler(4, device).sample(logits, [st(temperature=1.0, top_p=0.7)] * 4_000)
    # 0.5 < 0.7 <= 0.5 + 0.3: tokens 0 and 1 stay, in proportion 5:3.
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4)
    assert counts[2:].sum() == 0
    assert abs(counts[0].item() / 4_000 - 0.625) < 0.03


def test_top_p_applies_to_the_top_k_renormalised_distribution(device):
    # After top_k=2 the survivors are 4/7 and 3/7: 4/7 alone reaches top_p=0.5, so token 1 goes
    # (on the untruncated distribution 0.4 < 0.5 would have kept it).
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log().to(device).repeat(2_000, 1)
    out = Sampler(4, device).sample(logits, [st(temperature=1.0, top_k=2, top_p=0.5)] * 2_000)
    assert set(out.token_ids) == {0}


def test_min_p_masks_tokens_below_a_fraction_of_the_best(device):
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    logits = probs.log().to(device).repeat(4_000, 1)
    out = Sampler(5, device).sample(logits, [st(temperature=1.0, min_p=0.3)] * 4_000)
    # threshold 0.3 * 0.4 = 0.12: tokens 3 and 4 are dropped, 0..2 stay.
    assert set(out.token_ids) == {0, 1, 2}
    # The same after a top-k that keeps all of them (min_p is relative, so renormalising over
    # the top 4 does not move the threshold).
    out = Sampler(5, device).sample(logits, [st(temperature=1.0, top_k=4, min_p=0.3)] * 4_000)
    assert set(out.token_ids) == {0, 1, 2}


def test_padded_vocab_is_never_sampled(device):
    V, padded = 10, 16
    logits = torch.zeros(300, padded, device=device)
    logits[:, V:] = 100.0  # the padding columns would win every draw
    states = [st(temperature=0.0), st(temperature=1.0), st(temperature=1.0, seed=3, logprobs=5)] * 100
    out = Sampler(V, device).sample(logits, states)
    assert max(out.token_ids) < V
    lp = out.logprobs[2]
    assert all(t < V for t, _ in lp.top)
    assert lp.token_logprob == pytest.approx(-math.log(V), abs=1e-5)


# -- seeds ---------------------------------------------------------------------------------


def test_seeded_token_does_not_depend_on_the_batch(device):
    V = 100
    sampler = Sampler(V, device)
    row = torch.randn(V, device=device)
    me = st(prompt=[1, 2], output=[5, 6, 7], temperature=1.0, top_k=30, top_p=0.95, seed=42)
    alone = sampler.sample(row[None], [me]).token_ids[0]

    # The first neighbour has no top_k, which makes the batch sort the whole vocabulary.
    others = [st(temperature=1.0), st(temperature=0.0), st(temperature=0.7, seed=9, output=[1])]
    for place in range(4):
        batch = others[:place] + [me] + others[place:]
        logits = torch.randn(len(batch), V, device=device)
        logits[place] = row
        assert sampler.sample(logits, batch).token_ids[place] == alone

    # Preemption: a fresh state with the same prompt and output (and a new Sampler) resamples
    # the same position to the same token.
    again = st(prompt=[1, 2], output=[5, 6, 7], temperature=1.0, top_k=30, top_p=0.95, seed=42)
    assert Sampler(V, device).sample(row[None], [again]).token_ids[0] == alone


def test_seeded_sequence_is_reproducible_and_positions_differ(device):
    V = 50
    sampler = Sampler(V, device)
    row = torch.zeros(1, V, device=device)  # uniform: every draw is pure noise

    def run(seed: int) -> list[int]:
        s = st(temperature=1.0, seed=seed)
        for _ in range(200):
            s.output_ids.append(sampler.sample(row, [s]).token_ids[0])
        return s.output_ids

    a = run(7)
    assert run(7) == a
    assert len(set(a)) > 30  # successive positions draw fresh noise
    b = run(8)
    assert sum(x != y for x, y in zip(a, b, strict=True)) > 150  # ~196 expected


def test_unseeded_rows_vary(device):
    row = torch.zeros(1, 50, device=device)
    sampler = Sampler(50, device)
    draws = {sampler.sample(row, [st(temperature=1.0)]).token_ids[0] for _ in range(40)}
    assert len(draws) > 10


# -- penalties and min_tokens ---------------------------------------------------------------

LOGITS6 = [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]


def processed_logprobs(device, state: RequestSamplingState, logits=LOGITS6) -> list[float]:
    """The full logprob vector that the sampler reports (V <= 20, so top-V is all of it)."""
    V = len(logits)
    out = Sampler(V, device).sample(rows(device, logits), [state])
    by_id = dict(out.logprobs[0].top)
    return [by_id[t] for t in range(V)]


def log_softmax(values: list[float]) -> list[float]:
    return torch.tensor(values, dtype=torch.float64).log_softmax(-1).tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits(device):
    # prompt {0, 1}, output {3}: 2/2, -1*2, 3/2; the others untouched.
    s = st(prompt=[0, 1], output=[3], repetition_penalty=2.0, temperature=0.0, logprobs=6)
    expected = [1.0, -2.0, 0.5, 1.5, -2.0, 0.0]
    assert processed_logprobs(device, s) == pytest.approx(log_softmax(expected), abs=1e-5)


def test_frequency_and_presence_penalties_count_output_tokens_only(device):
    # output: token 1 once, token 3 twice; prompt token 0 is not penalised by these two.
    s = st(prompt=[0], output=[1, 3, 3], frequency_penalty=0.5, presence_penalty=0.25, logprobs=6)
    expected = [2.0, -1.0 - 0.5 - 0.25, 0.5, 3.0 - 1.0 - 0.25, -2.0, 0.0]
    assert processed_logprobs(device, s) == pytest.approx(log_softmax(expected), abs=1e-5)


def test_all_penalties_together_repetition_first(device):
    s = st(
        prompt=[0, 1],
        output=[1, 3, 3],
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        logprobs=6,
    )
    # rep: [1, -2, .5, 1.5, -2, 0]; then token 1: -2 - .5 - .25; token 3: 1.5 - 1 - .25
    expected = [1.0, -2.75, 0.5, 0.25, -2.0, 0.0]
    assert processed_logprobs(device, s) == pytest.approx(log_softmax(expected), abs=1e-5)


def test_penalties_apply_per_row(device):
    # A penalised row beside an unpenalised one: only the first changes; greedy follows.
    logits = rows(device, LOGITS6, LOGITS6)
    states = [
        st(output=[3], presence_penalty=2.0, temperature=0.0),  # 3.0 - 2.0 < 2.0: token 0 wins
        st(output=[3], temperature=0.0),
    ]
    assert Sampler(6, device).sample(logits, states).token_ids == [0, 3]


def test_penalties_follow_a_growing_output(device):
    # The worker keeps one state across steps and appends to output_ids; the penalties must
    # see every token appended since the last step, as a fresh state would.
    V = 12
    sampler = Sampler(V, device)
    logits = torch.randn(1, V, device=device)
    kw = dict(
        temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2, logprobs=V
    )
    kept = st(prompt=[0, 1, 1], **kw)
    for step in range(40):
        got = sampler.sample(logits, [kept]).logprobs[0].top
        fresh = st(prompt=[0, 1, 1], output=kept.output_ids, **kw)
        assert got == sampler.sample(logits, [fresh]).logprobs[0].top
        kept.output_ids.extend([step % V, (3 * step) % V][: 1 + step % 2])
    kept.output_ids = [5]  # replaced by a shorter list: the cache starts over
    fresh = st(prompt=[0, 1, 1], output=[5], **kw)
    assert sampler.sample(logits, [kept]).logprobs[0].top == sampler.sample(logits, [fresh]).logprobs[0].top


def test_min_tokens_blocks_eos_and_stop_tokens(device):
    V, eos, stop = 8, 5, 6
    sampler = Sampler(V, device, eos_token_ids={eos})
    logits = torch.zeros(1, V, device=device)
    logits[0, eos], logits[0, stop], logits[0, 2] = 10.0, 9.0, 1.0
    for n, expected in [(0, 2), (2, 2), (3, eos)]:
        s = st(output=[0] * n, temperature=0.0, min_tokens=3, stop_token_ids=(stop,), logprobs=2)
        out = sampler.sample(logits, [s])
        assert out.token_ids == [expected]
        if n < 3:  # the blocked tokens carry no probability while blocked
            assert [t for t, _ in out.logprobs[0].top][0] == 2
    # Sampling (not greedy) never picks them either.
    states = [st(temperature=1.0, min_tokens=1, stop_token_ids=(stop,)) for _ in range(300)]
    assert not {eos, stop} & set(sampler.sample(logits.repeat(300, 1), states).token_ids)


def test_min_tokens_leaves_eos_alone_with_ignore_eos(device):
    # vLLM's convention: with ignore_eos, eos is not a stop token, so min_tokens does not mask it.
    sampler = Sampler(4, device, eos_token_ids={1})
    logits = rows(device, [0.0, 5.0, 0.0, 0.0])
    s = st(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert sampler.sample(logits, [s]).token_ids == [1]


# -- logprobs ------------------------------------------------------------------------------


def test_logprobs_are_of_the_penalised_logits_before_temperature(device):
    V = 40
    logits = torch.randn(3, V, device=device)
    states = [
        st(
            prompt=[0, 1, 2],
            output=[3, 3],
            temperature=0.5,
            top_k=10,
            repetition_penalty=1.3,
            frequency_penalty=0.4,
            logprobs=5,
            seed=1,
        ),
        st(temperature=1.0),  # no logprobs asked: None
        st(temperature=0.0, logprobs=0),
    ]
    out = Sampler(V, device).sample(logits, states)

    pen = logits[0].double().cpu().clone()
    for t in (0, 1, 2, 3):
        pen[t] = pen[t] * 1.3 if pen[t] < 0 else pen[t] / 1.3
    pen[3] -= 0.4 * 2
    ref = pen.log_softmax(-1)
    lp = out.logprobs[0]
    assert lp.token_logprob == pytest.approx(ref[out.token_ids[0]].item(), abs=1e-5)
    assert [t for t, _ in lp.top] == ref.topk(5).indices.tolist()
    assert [v for _, v in lp.top] == pytest.approx(ref.topk(5).values.tolist(), abs=1e-5)
    assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)

    assert out.logprobs[1] is None
    plain = logits[2].double().cpu().log_softmax(-1)
    assert out.logprobs[2].top == []
    assert out.logprobs[2].token_logprob == pytest.approx(plain.max().item(), abs=1e-5)


def test_logprobs_of_masked_tokens_are_floored(device):
    # Vocabulary of 3 with eos masked by min_tokens: the top-3 list reports eos at the floor.
    sampler = Sampler(3, device, eos_token_ids={0})
    out = sampler.sample(rows(device, [1.0, 0.0, 0.0]), [st(temperature=0.0, min_tokens=1, logprobs=3)])
    assert out.logprobs[0].top[-1] == (0, LOGPROB_FLOOR)


@pytest.mark.parametrize("masking", [True, False])
def test_sampler_leaves_the_callers_logits_alone(device, masking):
    """With penalties or min_tokens (masked in place, on a copy) and without (float32 logits
    read as they are: greedy, a truncated draw and logprobs must not write to them)."""
    logits = torch.randn(3, 12, device=device)
    before = logits.clone()
    if masking:
        states = [st(output=[1, 1], temperature=0.8, top_p=0.5, frequency_penalty=1.0), st(min_tokens=2), st()]
    else:
        states = [st(output=[1, 1], temperature=0.8, top_p=0.5, min_p=0.1), st(temperature=0.0, logprobs=3),
                  st(temperature=1.0, top_k=4, seed=5)]
    out = Sampler(12, device, eos_token_ids={3}).sample(logits, states)
    assert torch.equal(logits, before)
    if not masking:
        assert out.token_ids[1] == int(before[1].argmax())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_host_sync_per_step_on_cuda():
    device = torch.device("cuda")
    V = 1000
    sampler = Sampler(V, device, eos_token_ids={2})
    states = [
        st(
            prompt=[1, 2, 3],
            output=[4, 4],
            temperature=0.7,
            top_k=50,
            top_p=0.9,
            min_p=0.05,
            repetition_penalty=1.2,
            presence_penalty=0.5,
            logprobs=4,
            seed=11,
        ),
        st(temperature=1.0, min_tokens=5),
        st(temperature=0.0, logprobs=2),
    ]
    logits = torch.randn(3, V + 24, device=device)
    sampler.sample(logits, states)  # warm up (first-use allocations may sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sampler.sample(logits, states)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) <= 1, syncs


# -- SamplingParams.validate --------------------------------------------------------------


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("max_tokens", -1),
        ("max_tokens", 0),
        ("max_tokens", True),
        ("max_tokens", 2.0),
        ("temperature", -0.1),
        ("temperature", 101.0),
        ("temperature", float("nan")),
        ("temperature", "hot"),
        ("top_p", 1.5),
        ("top_p", 0.0),
        ("top_p", float("nan")),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("nan")),
        ("repetition_penalty", float("inf")),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -3.0),
        ("seed", -1),
        ("seed", 2**63),
        ("seed", "7"),
        ("stop", "a bare string"),
        ("stop", ("",)),
        ("stop", tuple(f"s{i}" for i in range(17))),
        ("stop_token_ids", (-1,)),
        ("stop_token_ids", (1000,)),
        ("min_tokens", -1),
        ("min_tokens", 17),  # > max_tokens (16)
        ("logprobs", 21),
        ("logprobs", -1),
        ("logprobs", 2.5),
    ],
)
def test_validate_names_the_bad_param(param, value):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**{param: value}).validate(vocab_size=1000)
    assert err.value.param == param
    assert str(err.value).startswith(f"{param}: ")


def test_validate_accepts_the_edges():
    SamplingParams(
        max_tokens=1,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        min_p=1.0,
        repetition_penalty=0.5,
        frequency_penalty=-2.0,
        presence_penalty=2.0,
        seed=0,
        stop=("x",) * 16,
        stop_token_ids=(999,),
        min_tokens=1,
        logprobs=20,
    ).validate(vocab_size=1000)
    SamplingParams(top_k=-1, logprobs=0, seed=2**63 - 1).validate()
