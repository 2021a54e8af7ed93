"""The engine against `transformers` on the same tiny checkpoints: identical greedy tokens for
batches of prompts of different lengths arriving at different steps, with the prefix cache,
chunked prefill, page sizes 1 and 16, and preemption; plus sampling and error behaviour."""

from __future__ import annotations

import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from cluster.engine.request import GenerationResult
from cluster.engine.scheduler import RequestRejected
from tests.fixtures import tiny_model_dir
from workers.sampling_params import SamplingParams, SamplingParamsError

PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "Hello",
    "In a distant land, far beyond the mountains and the rivers, there lived an old king who",
    "Serving systems batch requests",
    "one two three four five six seven",
]
MAX_NEW = 12
ARCHS = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {arch: tiny_model_dir(tmp_path_factory, arch) for arch in ARCHS}


_REF_CACHE: dict = {}


def hf_greedy(model_dir, prompt_ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation (full recompute each step: no cache subtleties)."""
    from transformers import AutoModelForCausalLM

    key = (str(model_dir), tuple(prompt_ids), n)
    if key in _REF_CACHE:
        return _REF_CACHE[key]
    if str(model_dir) not in _REF_CACHE:
        _REF_CACHE[str(model_dir)] = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    model = _REF_CACHE[str(model_dir)]
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    result = ids[len(prompt_ids):]
    _REF_CACHE[key] = result
    return result


def run_staggered(engine: Engine, prompts, params, arrive_every: int = 2) -> list[GenerationResult]:
    """Submit prompts two at a time, a couple of steps apart, then run to completion."""
    results = []
    pending = list(prompts)
    while pending or engine.has_work():
        for _ in range(2):
            if pending:
                res = GenerationResult(rid="")
                res.rid = engine.add_request(pending.pop(0), params, res.add)
                results.append(res)
        for _ in range(arrive_every):
            engine.step()
        engine.scheduler.check_integrity()
    return results


def greedy(n=MAX_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def check_against_hf(engine: Engine, model_dir, prompts=PROMPTS, **kw):
    results = run_staggered(engine, prompts, greedy(), **kw)
    for prompt, res in zip(prompts, results):
        ref = hf_greedy(model_dir, engine.tokenize(prompt), MAX_NEW)
        assert res.token_ids == ref, f"prompt {prompt!r}"
        assert res.finish_reason == "length"
    return results


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_transformers(model_dirs, arch):
    engine = Engine(EngineConfig(model=str(model_dirs[arch])))
    check_against_hf(engine, model_dirs[arch])


@pytest.mark.parametrize("arch,page_size", [("llama", 1), ("llama", 16), ("qwen2", 4), ("qwen3", 16), ("mistral", 1)])
def test_prefix_cache_hits_give_same_tokens(model_dirs, arch, page_size):
    d = model_dirs[arch]
    engine = Engine(EngineConfig(model=str(d), page_size=page_size))
    shared = PROMPTS[2] + " and then"
    engine.generate([shared], greedy())
    prompts = [shared + " the king", shared + " a dragon came", shared]
    check_against_hf(engine, d, prompts)
    assert engine.scheduler.stats.prefix_hit_tokens >= page_size * ((len(engine.tokenize(shared)) - 1) // page_size)
    assert engine.scheduler.stats.prefix_hit_tokens > 0


@pytest.mark.parametrize("arch,page_size", [("llama", 1), ("llama", 16), ("qwen2", 16), ("qwen3", 1), ("mistral", 4)])
def test_chunked_prefill_small_chunks(model_dirs, arch, page_size):
    d = model_dirs[arch]
    engine = Engine(EngineConfig(model=str(d), chunked_prefill_size=3, max_num_batched_tokens=7,
                                 page_size=page_size))
    check_against_hf(engine, d)


@pytest.mark.parametrize("arch,page_size,kv_tokens", [("llama", 1, 64), ("llama", 4, 64), ("llama", 16, 80),
                                                      ("qwen3", 4, 64)])
def test_preemption_when_kv_pool_is_too_small(model_dirs, arch, page_size, kv_tokens):
    d = model_dirs[arch]
    # 5 prompts of up to ~25 tokens + 12 new each need ~150 tokens; the pool holds far fewer
    # (with 16-token pages: 5 pages).
    engine = Engine(EngineConfig(model=str(d), kv_cache_tokens=kv_tokens, page_size=page_size))
    check_against_hf(engine, d)
    assert engine.scheduler.stats.preemptions > 0


def test_reference_backend_matches(model_dirs):
    d = model_dirs["qwen2"]
    engine = Engine(EngineConfig(model=str(d), attention_backend="reference", page_size=16))
    check_against_hf(engine, d)


def test_seeded_sampling_is_reproducible(model_dirs):
    engine = Engine(EngineConfig(model=str(model_dirs["llama"])))
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)
    alone = engine.generate([PROMPTS[0]], p)[0].token_ids
    # Same request inside a different batch, at a different position.
    batch = engine.generate([PROMPTS[1], PROMPTS[0], PROMPTS[3]],
                            [SamplingParams(max_tokens=5, temperature=0.7), p,
                             SamplingParams(max_tokens=8, temperature=1.0)])
    assert batch[1].token_ids == alone
    other = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=10, temperature=1.0, seed=99, ignore_eos=True))
    assert other[0].token_ids != alone


def test_stop_strings_cut_text_exactly(model_dirs):
    engine = Engine(EngineConfig(model=str(model_dirs["llama"])))
    full = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert len(full.text) > 4
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    cut = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                       stop=(stop,)))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert stop not in cut.text


def test_a_stop_string_in_the_last_allowed_token_finishes_with_stop(model_dirs):
    """The length limit and a stop string end a request in the same token: the stop string is
    why it ended (a client reads "length" as cut short, and a disaggregated request would go on
    to decode)."""
    engine = Engine(EngineConfig(model=str(model_dirs["llama"])))
    ids = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0].token_ids
    decode = engine.tokenizer.decode
    for k in range(len(ids), 1, -1):  # a token whose text first appears at its own place
        before, upto = decode(ids[: k - 1]), decode(ids[:k])
        new = upto[len(before) :].strip()
        if upto.startswith(before) and new and new not in before and upto.index(new) >= len(before):
            break
    else:
        raise AssertionError(f"no token of {ids} adds text of its own")
    cut = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True,
                                                       stop=(new,)))[0]
    assert (cut.finish_reason, cut.token_ids) == ("stop", ids[:k]), (k, new)
    assert new not in cut.text and cut.text == upto[: upto.index(new)]
    # One token short of it: the limit ends it.
    short = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=k - 1, temperature=0.0, ignore_eos=True,
                                                         stop=(new,)))[0]
    assert short.finish_reason == "length" and short.token_ids == ids[: k - 1]


@pytest.mark.parametrize(
    "params,param",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_k=-5), "top_k"),
    ],
)
def test_bad_parameters_raise_and_engine_keeps_serving(model_dirs, params, param):
    engine = Engine(EngineConfig(model=str(model_dirs["llama"])))
    with pytest.raises(SamplingParamsError) as ei:
        engine.generate([PROMPTS[0]], SamplingParams(**params))
    assert ei.value.param == param and param in str(ei.value)
    out = engine.generate([PROMPTS[1]], greedy(3))
    assert len(out[0].token_ids) == 3


def test_prompt_longer_than_context_is_rejected(model_dirs):
    engine = Engine(EngineConfig(model=str(model_dirs["llama"]), max_context_len=16))
    with pytest.raises(RequestRejected) as ei:
        engine.generate([list(range(5, 25))], greedy(3))
    assert ei.value.param == "prompt" and "16" in str(ei.value)
    assert not engine.has_work()
    assert len(engine.generate([list(range(5, 10))], greedy(3))[0].token_ids) == 3


def test_context_limit_finishes_with_length(model_dirs):
    engine = Engine(EngineConfig(model=str(model_dirs["llama"]), max_context_len=16))
    res = engine.generate([list(range(5, 15))], greedy(50))[0]
    assert res.finish_reason == "length" and len(res.token_ids) == 6


def test_a_step_that_raises_fails_its_requests_as_step_failed_not_as_the_replicas_fault(model_dirs):
    """An exception in a step may be a request's own doing: the requests with tokens end as
    `step_failed`, which a router does not run again elsewhere (a lost worker's are `internal`);
    those without tokens are `unavailable`, retried as before any output."""
    import time

    engine = Engine(EngineConfig(model=str(model_dirs["llama"]), disable_overlap_schedule=True))
    outs: dict[str, list] = {"started": [], "queued": []}
    engine.add_request(PROMPTS[0], greedy(40), outs["started"].append)
    engine.step()
    engine.step()  # it has tokens
    engine.add_request(PROMPTS[1], greedy(40), outs["queued"].append)

    def broken(plan):
        raise RuntimeError("a kernel failed on this batch")

    engine.workers.execute = broken
    engine.start()
    try:
        deadline = time.monotonic() + 30
        while not all(o and o[-1].finished for o in outs.values()) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.shutdown()
    assert outs["started"][-1].finish_reason == "error" and outs["started"][-1].error_type == "step_failed"
    assert outs["queued"][-1].error_type == "unavailable"


def test_an_engine_failed_for_good_refuses_admissions_as_unavailable(model_dirs):
    """A replica replacing its engine (a worker died, a restart, shutdown) fails every request
    and closes it in one step: a request that reached the old engine after its requests were
    failed would never be stepped or ended. It is refused as unavailable instead, which the
    router retries on another replica."""
    from workers.request_errors import Unavailable

    engine = Engine(EngineConfig(model=str(model_dirs["llama"])))
    before = GenerationResult(rid="")
    before.rid = engine.add_request(PROMPTS[0], greedy(), before.add)
    engine.fail_all("a step failed")  # not for good: the engine keeps serving
    assert before.finish_reason == "error"
    assert len(engine.generate([PROMPTS[1]], greedy(3))[0].token_ids) == 3
    engine.fail_all("replica r0 restarting", close=True)
    with pytest.raises(Unavailable, match="replica r0 restarting"):
        engine.add_request(PROMPTS[1], greedy(3), GenerationResult(rid="").add)
    assert not engine.scheduler.waiting and not engine.scheduler.running
