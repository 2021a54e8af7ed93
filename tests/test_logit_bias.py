"""OpenAI's `logit_bias`: added to the logits before sampling, in the sampler (every path: plain
steps, overlapped steps and speculative rounds), through the real server with the real `openai`
client, and refused with a 400 naming the field when a key or a value is bad."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from tests.fixtures import tiny_model_dir
from tests.test_sampler import LOGITS6, log_softmax, processed_logprobs, st
from tests.test_server import MODEL, PROMPT, oai, stack  # noqa: F401 - fixtures
from workers.sampler import Sampler
from workers.sampling_params import SamplingParams, SamplingParamsError


def test_bias_is_added_before_the_logprobs(device="cpu"):
    s = st(logit_bias=((1, 4.0), (3, -100.0)), temperature=0.0, logprobs=6)
    expected = list(LOGITS6)
    expected[1] += 4.0
    expected[3] -= 100.0
    assert processed_logprobs(device, s) == pytest.approx(log_softmax(expected), abs=1e-4)


def test_a_banned_token_is_never_drawn_and_a_forced_one_always_is():
    torch.manual_seed(0)
    V = 6
    logits = torch.tensor([LOGITS6] * 64)
    sampler = Sampler(V, "cpu")
    banned = [st(logit_bias=((3, -100.0),), temperature=1.0) for _ in range(64)]
    assert 3 not in sampler.sample(logits, banned).token_ids
    forced = [st(logit_bias=((4, 100.0),), temperature=1.0) for _ in range(64)]
    assert set(sampler.sample(logits, forced).token_ids) == {4}
    plain = [st(temperature=1.0) for _ in range(64)]
    assert 3 in sampler.sample(logits, plain).token_ids  # the favourite, without the ban


@pytest.mark.parametrize("bias", [((5, 100.5),), ((-1, 1.0),), ((1000, 1.0),), ((1, float("nan")),), ((1,),),
                                  "nope"])
def test_validate_names_logit_bias(bias):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(logit_bias=bias).validate(vocab_size=1000)
    assert err.value.param == "logit_bias"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
@pytest.mark.parametrize("overlap", [True, False])
def test_forced_token_through_the_engine_and_a_speculative_round(tmp_path_factory, overlap, device):
    d = tiny_model_dir(tmp_path_factory, "llama")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias=((42, 100.0),))
    for extra in ({}, {"speculative_draft_model": str(d), "speculative_num_tokens": 3}):
        engine = Engine(EngineConfig(model=str(d), page_size=4, disable_overlap_schedule=not overlap, device=device,
                                     dtype="float32", **extra))
        out = engine.generate(["hello there", "the quick brown fox"], params)
        assert [r.token_ids for r in out] == [[42] * 6] * 2, extra
        engine.shutdown()


def test_logit_bias_over_http(stack, oai):  # noqa: F811
    tok = stack["engine"].tokenizer
    target = tok(" river", add_special_tokens=False).input_ids[0]
    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=1,
                               logit_bias={str(target): 100}, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].text == tok.decode([target] * 5)
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       logit_bias={str(target): 100}, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == tok.decode([target] * 3)
    # Banning the greedy choice changes the first token.
    plain = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0)
    first = tok(plain.choices[0].text, add_special_tokens=False).input_ids[0]
    banned = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                    logit_bias={str(first): -100})
    assert banned.choices[0].text != plain.choices[0].text
    # The native endpoint takes the same map.
    native = httpx.post(stack["url"] + "/generate", json={"text": PROMPT, "sampling_params": {
        "max_tokens": 2, "temperature": 0, "ignore_eos": True,
        "logit_bias": {str(target): 100}}}, timeout=60)
    assert native.status_code == 200 and native.json()["output_ids"] == [target, target]


@pytest.mark.parametrize("bias,needle", [({"x": 1}, "token ids"), ({"5": 101}, "[-100, 100]"),
                                          ({"99999": 1}, "out of range")])
def test_bad_logit_bias_is_a_400_naming_it(stack, oai, bias, needle):  # noqa: F811
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logit_bias=bias)
    body = err.value.response.json()["error"]
    assert body["param"] == "logit_bias" and needle in body["message"]
