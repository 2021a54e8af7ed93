"""The vLLM/SGLang request extensions a client may send, through the real server with the real
`openai` client: `include_stop_str_in_output`, `truncate_prompt_tokens`, and unknown fields,
nested ones included, refused with a 400 that names the exact field."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.test_server import MODEL, PROMPT, oai, stack  # noqa: F401 - fixtures

GREEDY = dict(model=MODEL, temperature=0, extra_body={"ignore_eos": True})


def _text(oai, stream=False, **kw) -> str:  # noqa: F811
    if stream:
        return "".join(c.choices[0].text for c in oai.completions.create(stream=True, **kw) if c.choices)
    return oai.completions.create(**kw).choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output(stack, oai, stream):  # noqa: F811
    full = _text(oai, prompt=PROMPT, max_tokens=12, **GREEDY)
    stop = full[4:7]
    assert len(stop) == 3 and full.index(stop) == 4
    cut = _text(oai, stream, prompt=PROMPT, max_tokens=12, stop=[stop], **GREEDY)
    assert cut == full[:4]
    body = dict(GREEDY, extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    kept = _text(oai, stream, prompt=PROMPT, max_tokens=12, stop=[stop], **body)
    assert kept == full[:7] and kept.endswith(stop)


def test_truncate_prompt_tokens(stack, oai):  # noqa: F811
    ids = stack["engine"].tokenizer(PROMPT).input_ids
    k = 4
    truncated = oai.completions.create(prompt=PROMPT, max_tokens=5, **dict(
        GREEDY, extra_body={"ignore_eos": True, "truncate_prompt_tokens": k}))
    by_ids = oai.completions.create(prompt=ids[-k:], max_tokens=5, **GREEDY)
    assert truncated.usage.prompt_tokens == k
    assert truncated.choices[0].text == by_ids.choices[0].text
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=2,
                                       extra_body={"truncate_prompt_tokens": k})
    assert chat.usage.prompt_tokens == k
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(prompt=PROMPT, max_tokens=2, model=MODEL, extra_body={"truncate_prompt_tokens": 0})
    assert err.value.response.json()["error"]["param"] == "truncate_prompt_tokens"


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "frobnicate": 1}, "frobnicate"),
    ({"prompt": "hi", "stream": True, "stream_options": {"include_usage": True, "bogus": True}},
     "stream_options.bogus"),
])
def test_unknown_fields_are_named_exactly(stack, body, param):  # noqa: F811
    r = httpx.post(stack["url"] + "/v1/completions", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"]


def test_guidellm_stream_options_are_accepted(stack, oai):  # noqa: F811
    """guidellm sends continuous_usage_stats: usage on every chunk, the last one the total."""
    chunks = list(oai.completions.create(prompt=PROMPT, max_tokens=4, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}, **GREEDY))
    usage = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert usage and usage == sorted(usage) and usage[-1] == 4
