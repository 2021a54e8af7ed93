"""completions `echo` and vLLM's `prompt_logprobs` through the real server with the real
`openai` client: lm-eval's loglikelihood request (echo, max_tokens 0, logprobs 1) returns the
prompt's tokens with their logprobs (the first null), equal to transformers' own log-softmax."""

from __future__ import annotations

import httpx
import pytest

from tests.test_prompt_logprobs import hf_prompt_logprobs
from tests.test_server import MODEL, PROMPT, oai, stack  # noqa: F401 - fixtures


def _model_dir(stack):  # noqa: F811
    return stack["engine"].config.model


@pytest.mark.parametrize("stream", [False, True])
def test_loglikelihood_request_as_lm_eval_sends_it(stack, oai, stream):  # noqa: F811
    ids = stack["engine"].tokenizer(PROMPT).input_ids
    want, _ = hf_prompt_logprobs(_model_dir(stack), ids, 1)
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0)
    if stream:
        every = list(oai.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        assert every[-1].usage.completion_tokens == 0 and every[-1].usage.prompt_tokens == len(ids)
        chunks = [c for c in every if c.choices]
        text = "".join(c.choices[0].text for c in chunks)
        lp = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
        tokens = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.tokens]
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = oai.completions.create(**kw)
        c = r.choices[0]
        text, lp, tokens, finish = c.text, c.logprobs.token_logprobs, c.logprobs.tokens, c.finish_reason
        assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
        assert c.logprobs.top_logprobs[0] is None and all(len(t) >= 1 for t in c.logprobs.top_logprobs[1:])
    assert text == PROMPT and finish == "length"
    assert len(lp) == len(ids) == len(tokens) and lp[0] is None
    assert lp[1:] == pytest.approx(want, abs=1e-4)


def test_echo_with_generation_and_prompt_logprobs(stack, oai):  # noqa: F811
    ids = stack["engine"].tokenizer(PROMPT).input_ids
    want, want_top = hf_prompt_logprobs(_model_dir(stack), ids, 2)
    plain = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1,
                                   extra_body={"ignore_eos": True}).choices[0]
    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1,
                               extra_body={"ignore_eos": True, "prompt_logprobs": 2}).choices[0]
    assert r.text == PROMPT + plain.text
    assert r.logprobs.token_logprobs[len(ids):] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-4)
    assert r.logprobs.token_logprobs[1:len(ids)] == pytest.approx(want, abs=1e-4)
    vllm = r.model_extra["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == len(ids)
    for entry, tok, lp, top in zip(vllm[1:], ids[1:], want, want_top):
        assert entry[str(tok)]["logprob"] == pytest.approx(lp, abs=1e-4)
        assert {int(t) for t, e in entry.items() if e["rank"] in (1, 2)} >= set(top[:1])


def test_max_tokens_zero_needs_echo(stack):  # noqa: F811
    r = httpx.post(stack["url"] + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 0},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_chat_prompt_logprobs_in_vllm_layout(stack, oai):  # noqa: F811
    from cluster.api.protocol import render_chat

    messages = [{"role": "user", "content": "Say hello"}]
    ids = render_chat(stack["engine"].tokenizer, messages)
    want, _ = hf_prompt_logprobs(_model_dir(stack), ids, 1)
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body={"prompt_logprobs": 1})
    got = r.model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    assert [e[str(t)]["logprob"] for e, t in zip(got[1:], ids[1:])] == pytest.approx(want, abs=1e-4)
    plain = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert "prompt_logprobs" not in plain.model_extra
    r = httpx.post(stack["url"] + "/v1/chat/completions", timeout=30, json={
        "messages": messages, "max_tokens": 2, "stream": True, "prompt_logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


@pytest.mark.parametrize("as_ids", [False, True])
def test_echo_text_offsets_index_the_echoed_text(stack, oai, as_ids):  # noqa: F811
    """Each token's `text_offset` is where its text starts in the choice's text. The BOS token
    the tokenizer adds is not in an echoed prompt (given as text or as ids): it takes no
    characters, and neither do the special tokens generation skips."""
    ids = stack["engine"].tokenizer(PROMPT).input_ids
    special = set(stack["engine"].tokenizer.all_special_ids)
    assert ids[0] in special  # the tiny Llama's BOS: what made the offsets wrong
    c = oai.completions.create(model=MODEL, prompt=ids if as_ids else PROMPT, max_tokens=4, temperature=0,
                               echo=True, logprobs=1, extra_body={"ignore_eos": True}).choices[0]
    assert c.text.startswith(PROMPT)
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + 4 and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(c.text)
    for i, (tok, at) in enumerate(zip(lp.tokens, lp.text_offset)):
        if i < len(ids) and ids[i] in special:
            assert at == (lp.text_offset[i + 1] if i + 1 < len(lp.tokens) else len(c.text))
        elif not tok.startswith("bytes:"):
            assert c.text[at : at + len(tok)] == tok, (i, tok, at, c.text)


def test_a_prompt_that_fills_the_context_can_be_scored(stack, oai):  # noqa: F811
    """lm-eval's loglikelihood of a window as long as the model's context: scored, not refused
    (nothing is generated); one token more is refused."""
    limit = stack["client"].max_context_len
    base = stack["engine"].tokenizer(PROMPT).input_ids
    ids = (base + base[1:] * (limit // len(base) + 1))[:limit]
    want, _ = hf_prompt_logprobs(_model_dir(stack), ids, 1)
    r = oai.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
    lp = r.choices[0].logprobs.token_logprobs
    assert r.usage.prompt_tokens == limit and r.usage.completion_tokens == 0
    assert len(lp) == limit and lp[0] is None and lp[1:] == pytest.approx(want, abs=1e-4)
    over = httpx.post(stack["url"] + "/v1/completions", json={"model": MODEL, "prompt": ids + [ids[1]],
                                                             "max_tokens": 0, "echo": True, "logprobs": 1})
    assert over.status_code == 400 and over.json()["error"]["param"] == "prompt", over.text
    # Generating from a full window still needs a position for every token but the last.
    full = httpx.post(stack["url"] + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1})
    assert full.status_code == 400 and full.json()["error"]["param"] == "prompt", full.text


def test_the_default_max_tokens_fits_the_context(stack, oai):  # noqa: F811
    """No max_tokens: OpenAI's 16, or what the context holds after the prompt (vLLM's choice);
    a limit that was sent and does not fit is still refused, naming it."""
    limit = stack["client"].max_context_len
    base = stack["engine"].tokenizer(PROMPT).input_ids
    ids = (base + base[1:] * (limit // len(base) + 1))[: limit - 3]
    c = oai.completions.create(model=MODEL, prompt=ids, temperature=0, extra_body={"ignore_eos": True})
    assert c.usage.completion_tokens == 3 and c.choices[0].finish_reason == "length"
    assert oai.completions.create(model=MODEL, prompt=PROMPT, temperature=0,
                                  extra_body={"ignore_eos": True}).usage.completion_tokens == 16
    sent = httpx.post(stack["url"] + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 16})
    assert sent.status_code == 400 and sent.json()["error"]["param"] == "max_tokens", sent.text
