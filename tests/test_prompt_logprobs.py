"""Prompt logprobs (vLLM's `prompt_logprobs`, and completions' `echo` with `logprobs`) equal
transformers' own log-softmax over the same checkpoint: whole prompts, prompts prefilled in
chunks beside other requests, with and without an earlier request having cached the same
prefix (such a request computes its whole prompt: a cached prefix has no logits), and with
tensor parallelism over gloo."""

from __future__ import annotations

import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from tests.fixtures import tiny_model_dir
from workers.sampling_params import SamplingParams

PROMPTS = ["The quick brown fox jumps over the lazy dog and then some more words follow here",
           "hello", "a river runs through the old town, past the mill and the bridge"]


def hf_prompt_logprobs(model_dir, ids: list[int], k: int) -> tuple[list[float], list[list[int]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        lp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    chosen = [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]
    top = [lp[i - 1].topk(k).indices.tolist() for i in range(1, len(ids))]
    return chosen, top


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("options", [
    {},
    {"chunked_prefill_size": 5, "max_num_batched_tokens": 9},
    {"tp_size": 2},
    pytest.param({"device": "cuda", "dtype": "float32", "chunked_prefill_size": 5, "max_num_batched_tokens": 9},
                 marks=[pytest.mark.gpu, CUDA]),
])
def test_prompt_logprobs_equal_transformers(tmp_path_factory, options):
    d = tiny_model_dir(tmp_path_factory, "llama")
    engine = Engine(EngineConfig(model=str(d), page_size=4, **options))
    try:
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
        plain = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        # The first prompt is cached by a plain request first: the second one must not use it.
        engine.generate([PROMPTS[0]], plain)
        results = engine.generate(PROMPTS, params)
        for prompt, res in zip(PROMPTS, results):
            ids = engine.tokenize(prompt)
            want, want_top = hf_prompt_logprobs(str(d), ids, 3)
            got = res.prompt_logprobs
            assert got is not None and len(got) == len(ids) and got[0] is None
            assert [g.token_logprob for g in got[1:]] == pytest.approx(want, abs=1e-4), prompt
            for g, top, tok in zip(got[1:], want_top, ids[1:]):
                assert [t for t, _ in g.top] == top  # the top 3, best first
                assert g.rank >= 1 and (g.rank == 1) == (tok == top[0])
            assert res.cached_tokens == 0  # no cached prefix was used
        assert engine.generate([PROMPTS[0]], plain)[0].prompt_logprobs is None
    finally:
        engine.shutdown()


def test_prompt_logprobs_need_a_decoder_only_model(tmp_path_factory):
    from cluster.engine.scheduler import RequestRejected

    d = tiny_model_dir(tmp_path_factory, "bart")
    engine = Engine(EngineConfig(model=str(d)))
    with pytest.raises(RequestRejected) as err:
        engine.add_request("hi", SamplingParams(prompt_logprobs=1), sink=lambda out: None)
    assert err.value.param == "prompt_logprobs"
