"""Bad input, case by case, against the real app over a tiny in-process engine (context 512).

Extends tests/test_server.py (which covers malformed JSON, wrong field types, top-level non-
objects, oversize bodies, 17 stop strings on /v1/completions and the token-id prompt over the
context): every answer here is a 4xx with the OpenAI error body naming the parameter, never a
5xx, and nothing is left running or holding KV pages afterwards.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from cluster.api.metrics import ServerMetrics
from cluster.api.server import BackgroundServer, build_app
from cluster.engine.client import LocalEngineClient
from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from tests.fixtures import tiny_model_dir

MODEL = "tiny"
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
EMB = "/v1/embeddings"
GEN = "/generate"


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    d = tiny_model_dir(tmp_path_factory, "llama")
    engine = Engine(EngineConfig(model=str(d), served_model_name=MODEL, kv_cache_tokens=4096,
                                 max_running_requests=16))
    metrics = ServerMetrics()
    client = LocalEngineClient(engine, metrics=metrics)
    server = BackgroundServer(build_app(client, metrics))
    try:
        yield {"url": server.url, "engine": engine, "limit": client.max_context_len}
    finally:
        server.stop()
        asyncio.run(client.aclose())


def post(app, path: str, body) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(app["url"] + path, content=raw, headers={"content-type": "application/json"}, timeout=60)


def error(r: httpx.Response, status: int = 400, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


def chat(content: str, **kw) -> dict:
    return {"messages": [{"role": "user", "content": content}], **kw}


def test_invalid_utf8_lone_surrogates_and_deep_nesting(app):
    assert "JSON" in error(post(app, COMP, b'{"prompt": "\xff\xfe", "max_tokens": 2}'))["message"]
    assert "JSON" in error(post(app, COMP, b'{"prompt": "caf\xc3", "max_tokens": 2}'))["message"]
    # "\ud800" is valid JSON but no text: refused before the tokenizer sees it, on every route.
    for path, body in ((COMP, b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
                       (CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'),
                       (EMB, b'{"input": "\\udbff"}'),
                       (GEN, b'{"text": "\\ud800", "sampling_params": {"max_tokens": 2}}')):
        assert "surrogate" in error(post(app, path, body))["message"], path
    # A correctly paired surrogate escape is text (U+1F600).
    assert post(app, COMP, b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}').status_code == 200
    assert "nested" in error(post(app, COMP, b"[" * 100_000 + b"]" * 100_000))["message"]


def test_control_characters_are_text(app):
    weird = "a\x00b\x1b[31mred\x7f\u202eevil\u200b\ufeff\r\n\t"
    r = post(app, COMP, {"prompt": weird, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert post(app, CHAT, chat(weird, max_tokens=2)).status_code == 200
    assert post(app, GEN, {"text": weird, "sampling_params": {"max_tokens": 2}}).status_code == 200
    # Control characters in a stop string or a model name are just characters.
    assert post(app, COMP, {"prompt": "x", "max_tokens": 2, "stop": ["\x00", "\n"]}).status_code == 200
    err = error(post(app, COMP, {"prompt": "x", "model": "\x00<script>"}), 404, "model")
    assert err["code"] == "model_not_found"


def test_empty_prompts(app):
    for body in ({"prompt": ""}, {"prompt": []}, {"prompt": [""]}, {"prompt": [[]]}, {"prompt": ["ok", ""]}):
        error(post(app, COMP, body), 400, "prompt")
    error(post(app, CHAT, {"messages": []}), 400, "messages")
    error(post(app, EMB, {"input": ""}), 400, "input")
    error(post(app, EMB, {"input": []}), 400, "input")
    error(post(app, GEN, {"text": "", "sampling_params": {"max_tokens": 2}}), 400, "text")
    error(post(app, GEN, {"input_ids": [], "sampling_params": {"max_tokens": 2}}), 400, "input_ids")
    error(post(app, GEN, {"sampling_params": {"max_tokens": 2}}), 400, "text")


def test_prompts_over_the_context_name_the_limit(app):
    limit, long_text = app["limit"], "hello " * 600
    for path, body, param in ((COMP, {"prompt": long_text, "max_tokens": 1}, "prompt"),
                              (CHAT, chat(long_text, max_tokens=1), "messages"),
                              (EMB, {"input": ["short", long_text]}, "input"),
                              (GEN, {"text": long_text, "sampling_params": {"max_tokens": 1}}, "prompt")):
        err = error(post(app, path, body), 400, param)
        assert err["code"] == "context_length_exceeded" and f"{limit} tokens" in err["message"], (path, err)
    # The boundary: limit - 1 prompt tokens leave room for exactly one generated token.
    ids = app["engine"].tokenizer(long_text).input_ids
    assert post(app, COMP, {"prompt": ids[: limit - 1], "max_tokens": 1}).status_code == 200
    error(post(app, COMP, {"prompt": ids[: limit - 1], "max_tokens": 2}), 400, "max_tokens")
    error(post(app, COMP, {"prompt": ids[:limit], "max_tokens": 1}), 400, "prompt")


def test_huge_n_and_max_tokens(app):
    for n in (0, -1, 129, 10**12, 10**30):
        error(post(app, COMP, {"prompt": "x", "n": n}), 400, "n")
        error(post(app, CHAT, chat("x", n=n)), 400, "n")
    huge = 10**30  # past int64: must not overflow anywhere
    err = error(post(app, COMP, {"prompt": "x", "max_tokens": huge}), 400, "max_tokens")
    assert err["code"] == "context_length_exceeded"
    error(post(app, CHAT, chat("x", max_completion_tokens=huge)), 400, "max_completion_tokens")
    error(post(app, CHAT, chat("x", max_tokens=huge)), 400, "max_tokens")
    error(post(app, GEN, {"text": "x", "sampling_params": {"max_tokens": huge}}), 400, "sampling_params.max_tokens")
    error(post(app, COMP, {"prompt": "x", "max_tokens": 2, "min_tokens": huge}), 400, "min_tokens")
    error(post(app, COMP, {"prompt": "x", "max_tokens": 2, "seed": huge}), 400, "seed")
    error(post(app, COMP, {"prompt": "x", "max_tokens": 2, "stop_token_ids": [huge]}), 400, "stop_token_ids")
    error(post(app, COMP, {"prompt": [huge], "max_tokens": 2}), 400, "prompt")
    # Non-finite numbers: Python's JSON parser reads NaN/Infinity; the server refuses them.
    error(post(app, COMP, b'{"prompt": "x", "temperature": NaN}'), 400, "temperature")
    error(post(app, COMP, b'{"prompt": "x", "top_p": -Infinity}'), 400, "top_p")
    # The most a request may ask for is served: 128 choices of a 2-token answer.
    r = post(app, COMP, {"prompt": "x", "n": 128, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 128


def test_stop_lists(app):
    too_many = [f"s{i}" for i in range(17)]
    error(post(app, CHAT, chat("x", stop=too_many)), 400, "stop")
    error(post(app, GEN, {"text": "x", "sampling_params": {"stop": too_many}}), 400, "sampling_params.stop")
    error(post(app, COMP, {"prompt": "x", "stop": ["a" * 1025]}), 400, "stop")
    error(post(app, COMP, {"prompt": "x", "stop": [""]}), 400, "stop")
    error(post(app, COMP, {"prompt": "x", "stop": [1, 2]}), 400, "stop[0]")
    error(post(app, GEN, {"text": "x", "sampling_params": {"stop": 5}}), 400, "sampling_params.stop")
    ok = post(app, COMP, {"prompt": "x", "max_tokens": 2, "stop": [f"s{i}" for i in range(16)]})
    assert ok.status_code == 200


def test_unknown_model_on_every_route(app):
    for path, body in ((COMP, {"prompt": "x"}), (CHAT, chat("x")), (EMB, {"input": "x"})):
        err = error(post(app, path, {**body, "model": "gpt-9"}), 404, "model")
        assert err["code"] == "model_not_found" and MODEL in err["message"]
    error(httpx.get(app["url"] + "/v1/models/gpt-9"), 404, "model")


def test_wrong_types_beyond_the_completions_route(app):
    for body, param in ((chat("x", n="2"), "n"), ({"messages": "hi"}, "messages"),
                        ({"messages": [{"role": 5, "content": "x"}]}, "messages[0].role"),
                        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
                        ({"messages": [{"role": "user", "content": [{"type": "image", "url": "x"}]}]},
                         "messages[0].content[0].type"),
                        (chat("x", logprobs="yes"), "logprobs")):
        error(post(app, CHAT, body), 400, param)
    error(post(app, EMB, {"input": {"a": 1}}), 400, "input")
    error(post(app, EMB, {"input": "x", "dimensions": 0}), 400, "dimensions")
    error(post(app, GEN, {"input_ids": ["a"]}), 400, "input_ids[0]")
    error(post(app, GEN, {"text": "x", "sampling_params": "hot"}), 400, "sampling_params")
    error(post(app, GEN, {"text": "x", "sampling_params": {"temperature": "hot"}}), 400, "sampling_params.temperature")


def test_nested_fields_are_named_by_their_path(app):
    """`param` is the field's path in the body, in the form the other errors use, without the
    union members pydantic tried on its way (`str`, `list[TextPart]`)."""
    for body, param in (({"messages": [{"content": "hi"}]}, "messages[0].role"),
                        (chat("x", tools=[{"type": "function", "function": {}}]), "tools[0].function.name"),
                        (chat("x", response_format={"type": "xml"}), "response_format.type"),
                        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": 1}]}]},
                         "messages[0].content[0].cache_control"),
                        ({"messages": [{"role": "user", "content": "x"},
                                       {"role": "assistant", "content": None, "tool_calls": [
                                           {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}]}]},
                         "messages[1].tool_calls[0].function.arguments")):
        err = error(post(app, CHAT, body), 400, param)
        assert param in err["message"], err


def test_null_is_the_default_for_every_optional_field(app):
    """OpenAI types optional fields "T or null" and SDKs send null for a setting given as None."""
    for path, body in ((CHAT, chat("x", max_tokens=2, n=None, stream=None, logprobs=None, top_logprobs=None,
                                   stop=None, temperature=None, stream_options=None)),
                       (COMP, {"prompt": "x", "max_tokens": 2, "n": None, "stream": None, "echo": None,
                               "logprobs": None, "ignore_eos": None, "min_tokens": None})):
        r = post(app, path, body)
        assert r.status_code == 200, (path, r.text)
        assert len(r.json()["choices"]) == 1 and r.json()["usage"]["completion_tokens"] <= 2
    error(post(app, CHAT, {"messages": None}), 400, "messages")  # a required field is still required
    error(post(app, COMP, {"prompt": None}), 400, "prompt")


def test_an_answer_sent_back_as_it_came_continues_the_chat(app):
    """A response's message, dumped with every field the OpenAI SDK gives it (`model_dump()`), is
    the usual way to build the history: its `refusal`, `annotations`, `audio` and
    `function_call` come too."""
    first = post(app, CHAT, chat("hello", max_tokens=3))
    assert first.status_code == 200
    said = {"refusal": None, "annotations": None, "audio": None, "function_call": None, "tool_calls": None,
            **first.json()["choices"][0]["message"]}
    history = [{"role": "user", "content": "hello"}, said, {"role": "user", "content": "more"}]
    r = post(app, CHAT, {"messages": history, "max_tokens": 2})
    assert r.status_code == 200, r.text
    said_annotated = {**said, "annotations": [{"type": "url_citation"}]}
    assert post(app, CHAT, {"messages": [history[0], said_annotated, history[2]], "max_tokens": 2}).status_code == 200
    # What this server does not do is refused unless null.
    for field, value in (("audio", {"id": "a1"}), ("function_call", {"name": "f", "arguments": "{}"})):
        error(post(app, CHAT, {"messages": [history[0], {**said, field: value}, history[2]]}), 400,
              f"messages[1].{field}")


def test_a_tool_message_names_its_call(app):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    error(post(app, CHAT, {"messages": turns + [{"role": "tool", "content": "x"}]}), 400, "messages[2].tool_call_id")
    r = post(app, CHAT, {"messages": turns + [{"role": "tool", "content": "x", "tool_call_id": "call_1"}],
                         "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_generate_takes_sglang_names(app):
    r = post(app, GEN, {"text": "The cat", "sampling_params": {"max_new_tokens": 3, "min_new_tokens": 3}})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 3
    error(post(app, GEN, {"text": "x", "sampling_params": {"max_new_tokens": 3, "max_tokens": 3}}), 400,
          "sampling_params.max_new_tokens")


def test_nothing_left_behind(app):
    engine = app["engine"]
    deadline = time.monotonic() + 10
    while engine.has_work() and time.monotonic() < deadline:
        time.sleep(0.02)
    sched = engine.scheduler
    assert not sched.running and not sched.waiting and sched.kv_usage() == 0.0
    sched.check_integrity()
    text = httpx.get(app["url"] + "/metrics").text
    assert 'manta:request_errors_total{code="500"} 0.0' in text  # exported from the start, never counted


def test_sse_events_survive_splitlines_readers():
    """A token whose text holds U+0085/U+2028/U+2029 (JSON leaves them raw) must not split an
    SSE line for clients that read lines with str.splitlines (httpx's aiter_lines): the soak
    found this with the tiny model's random tokens."""
    from cluster.api import responses as R
    from cluster.api.sse import sse

    chunk = R.CompletionChunk(id="c", created=0, model="m",
                              choices=[R.CompletionChoice(index=0, text="a\x85b\u2028c\u2029d\r\ne")])
    event = sse(chunk)
    assert event.endswith("\n\n") and len(event[:-2].splitlines()) == 1
    assert json.loads(event[6:])["choices"][0]["text"] == "a\x85b\u2028c\u2029d\r\ne"
