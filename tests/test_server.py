"""The OpenAI-compatible HTTP server end to end: a tiny Llama in an in-process engine behind
`LocalEngineClient`, served by uvicorn on 127.0.0.1, driven by the real `openai` client and httpx.

A second app over a stub client checks the error mapping of failures a tiny engine cannot be
made to produce on demand (queue full, no replica, crashes, a replica failing mid-stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from cluster.api.metrics import ServerMetrics
from cluster.api.protocol import render_chat
from cluster.api.server import BackgroundServer, build_app
from cluster.engine.client import HealthStatus, LocalEngineClient, NoReplicaAvailable
from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from cluster.engine.request import RequestOutput
from tests.fixtures import tiny_model_dir
from workers.request_errors import QueueFull
from workers.sampling_params import SamplingParams

MODEL = "tiny"
PROMPT = "The quick brown fox jumps over the lazy dog"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello"}]
N_TOKENS = 8
API_KEY = "sekrit"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model_dir = tiny_model_dir(tmp_path_factory, "llama")
    engine = Engine(EngineConfig(model=str(model_dir), served_model_name=MODEL, kv_cache_tokens=4096,
                                 max_running_requests=16))
    greedy = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
    chat_ids = render_chat(engine.tokenizer, CHAT)
    expected = engine.generate([PROMPT, chat_ids], greedy)  # offline, before the loop starts
    metrics = ServerMetrics()
    client = LocalEngineClient(engine, metrics=metrics)
    server = BackgroundServer(build_app(client, metrics))
    keyed = BackgroundServer(build_app(client, ServerMetrics(), api_key=API_KEY))
    try:
        yield {"engine": engine, "client": client, "metrics": metrics, "url": server.url, "keyed_url": keyed.url,
               "expected": expected[0], "chat_expected": expected[1]}
    finally:
        server.stop()
        keyed.stop()
        asyncio.run(client.aclose())


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def oai(stack):
    return openai_client(stack["url"])


@contextlib.contextmanager
def served_with(stack, **app_options):
    """The stack's engine behind a second app built with other options (a parser, say); its URL."""
    server = BackgroundServer(build_app(stack["client"], ServerMetrics(), **app_options))
    try:
        yield server.url
    finally:
        server.stop()


def post(stack, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(stack["url"] + path, content=content, headers={"content-type": "application/json"},
                      timeout=60, **kw)


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    return err


# ------------------------------------------------------------------------------------------------
# Completions
# ------------------------------------------------------------------------------------------------


def test_completion_greedy_matches_offline_engine(stack, oai):
    exp = stack["expected"]
    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N_TOKENS, temperature=0,
                               extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].text == exp.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == exp.prompt_tokens
    assert r.usage.completion_tokens == N_TOKENS
    assert r.usage.total_tokens == exp.prompt_tokens + N_TOKENS
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_stream_with_usage(stack, oai):
    exp = stack["expected"]
    chunks = list(oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N_TOKENS, temperature=0,
                                         stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == exp.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == N_TOKENS


def test_completion_fan_out(stack, oai):
    r = oai.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], n=2, max_tokens=4, seed=7,
                               temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    tok = stack["engine"].tokenizer
    assert r.usage.prompt_tokens == len(tok(PROMPT).input_ids) + len(tok("Hello").input_ids)
    assert 4 <= r.usage.completion_tokens <= 16
    # Seeded sampling is reproducible: the same request gives the same choices.
    again = oai.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], n=2, max_tokens=4, seed=7,
                                   temperature=1.0)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    # A token-id prompt is the same prompt as its text.
    ids = stack["engine"].tokenizer(PROMPT).input_ids
    by_ids = oai.completions.create(model=MODEL, prompt=ids, max_tokens=N_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == stack["expected"].text


def test_completion_logprobs(stack, oai):
    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                               extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0.0 and 1 <= len(top) <= 3
        assert val == pytest.approx(max(top.values()))  # greedy: the sampled token is the best
        assert tok in top


# ------------------------------------------------------------------------------------------------
# Chat
# ------------------------------------------------------------------------------------------------


def test_chat_greedy_matches_offline_engine(stack, oai):
    exp = stack["chat_expected"]
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=N_TOKENS,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == exp.text
    assert r.usage.prompt_tokens == exp.prompt_tokens and r.usage.completion_tokens == N_TOKENS


def test_chat_stream_with_usage(stack, oai):
    chunks = list(oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=N_TOKENS, temperature=0,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == stack["chat_expected"].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == N_TOKENS
    assert chunks[-1].usage.prompt_tokens == stack["chat_expected"].prompt_tokens


def test_chat_logprobs_and_n(stack, oai):
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=2,
                                    n=2, seed=3, extra_body={"ignore_eos": True})
    assert len(r.choices) == 2
    for choice in r.choices:
        content = choice.logprobs.content
        assert len(content) == 3
        for entry in content:
            assert entry.logprob <= 0.0 and len(entry.top_logprobs) == 2
            raw = bytes(entry.bytes)  # the token's own bytes; a piece of a character in OpenAI's escaped form
            assert entry.token == (raw.decode("utf-8") if raw.decode("utf-8", "ignore").encode() == raw
                                   else "bytes:" + "".join(f"\\x{b:02x}" for b in raw))
    assert r.usage.completion_tokens == 6


def test_chat_default_max_tokens_fills_the_context(stack, oai):
    # No max_tokens: the budget is the context left; stop after a short min via stop_token_ids.
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=None,
                                    extra_body={"min_tokens": 2, "stop_token_ids": list(range(stack["client"].vocab_size))})
    assert r.usage.completion_tokens == 2 and r.choices[0].finish_reason == "stop"


# ------------------------------------------------------------------------------------------------
# Native, models, health, metrics
# ------------------------------------------------------------------------------------------------


def test_native_generate(stack):
    exp = stack["expected"]
    body = {"text": PROMPT, "sampling_params": {"max_tokens": N_TOKENS, "temperature": 0, "ignore_eos": True}}
    r = post(stack, "/generate", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["text"] == exp.text and out["output_ids"] == exp.token_ids
    assert out["meta_info"]["finish_reason"] == "length"
    assert out["meta_info"]["prompt_tokens"] == exp.prompt_tokens
    assert out["meta_info"]["completion_tokens"] == N_TOKENS
    r = post(stack, "/generate", {**body, "stream": True})
    events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["text"] for e in events[:-1]) == exp.text
    assert_error(post(stack, "/generate", {"text": "x", "sampling_params": {"bogus": 1}}), 400,
                 "sampling_params.bogus")
    assert_error(post(stack, "/generate", {"text": "x", "sampling_params": {"top_p": 0}}), 400,
                 "sampling_params.top_p")


def test_models_and_health(stack, oai):
    models = oai.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].owned_by == "manta"
    card = httpx.get(stack["url"] + "/v1/models").json()["data"][0]
    assert card["max_model_len"] == stack["client"].max_context_len
    assert oai.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("nope")
    r = httpx.get(stack["url"] + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_metrics_exposed(stack, oai):
    oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    post(stack, "/v1/completions", {"prompt": PROMPT, "top_p": 2})
    text = httpx.get(stack["url"] + "/metrics").text
    for name in ("manta:num_requests_running", "manta:num_requests_waiting",
                 "manta:time_to_first_token_seconds_bucket", "manta:time_per_output_token_seconds_bucket",
                 "manta:e2e_request_latency_seconds_count", "manta:prompt_tokens_total",
                 "manta:generation_tokens_total", "manta:kv_cache_usage_perc",
                 "manta:prefix_cache_hit_tokens_total", "manta:prefix_cache_query_tokens_total",
                 "manta:prompt_token_cap", "manta:inter_token_latency_seconds_bucket"):
        assert name + "{" in text, name
    assert 'manta:request_errors_total{code="400"}' in text
    assert 'manta:generation_tokens_total{replica="local"}' in text


def test_inter_token_latency_counts_the_gaps_a_stream_waits(stack, oai):
    """manta:inter_token_latency_seconds: one sample per output after a request's first that
    brings tokens, the gap since the previous one; together they span the stream from its
    first token to its last, as the client saw it."""
    from prometheus_client.parser import text_string_to_metric_families

    def itl() -> tuple[float, float]:
        text = httpx.get(stack["url"] + "/metrics").text
        fam = next(f for f in text_string_to_metric_families(text) if f.name == "manta:inter_token_latency_seconds")
        got = {s.name: s.value for s in fam.samples if s.labels.get("replica") == "local" and "le" not in s.labels}
        return got.get("manta:inter_token_latency_seconds_count", 0.0), got.get("manta:inter_token_latency_seconds_sum", 0.0)

    count0, sum0 = itl()
    seen = []  # when each chunk with text reached the client
    stream = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.0, stream=True,
                                    extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            seen.append(time.monotonic())
    count1, sum1 = itl()
    assert 1 <= count1 - count0 <= 15  # 16 tokens: at most 15 gaps (fewer where an output carried several)
    span = seen[-1] - seen[0]
    assert 0 < sum1 - sum0 <= span + 0.25


def test_engine_step_seconds_count_the_steps_a_stream_took(stack, oai):
    """manta:engine_step_seconds{mode}: every completed engine step once, by its mode. A
    16-token stream takes at least 16 steps (its prompt's, then one per token), all in one engine
    thread, so their summed time fits in the wall time around them; the buckets are cumulative."""
    from prometheus_client.parser import text_string_to_metric_families

    def steps() -> tuple[float, float, dict]:
        text = httpx.get(stack["url"] + "/metrics").text
        fam = next(f for f in text_string_to_metric_families(text) if f.name == "manta:engine_step_seconds")
        mine = [s for s in fam.samples if s.labels.get("replica") == "local"]
        count = sum(s.value for s in mine if s.name.endswith("_count"))
        total = sum(s.value for s in mine if s.name.endswith("_sum"))
        buckets = {}
        for s in mine:
            if s.name.endswith("_bucket"):
                buckets.setdefault(s.labels["mode"], []).append(s.value)
        return count, total, buckets

    count0, sum0, _ = steps()
    t0 = time.monotonic()
    stream = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.0, stream=True,
                                    extra_body={"ignore_eos": True})
    assert sum(len(c.choices[0].text) > 0 for c in stream if c.choices) >= 1
    time.sleep(0.2)  # (the engine thread publishes a step's stats after it has sent its outputs)
    wall = time.monotonic() - t0
    count1, sum1, buckets = steps()
    assert count1 - count0 >= 16
    assert 0 < sum1 - sum0 <= wall
    assert buckets["DECODE"][-1] > 0
    for counts in buckets.values():  # (a kind this engine has not run yet is exported at 0)
        assert counts == sorted(counts)


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------


def test_typed_errors_from_openai_client(stack, oai):
    cases = [
        (dict(top_p=2), "top_p"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(stop=[f"s{i}" for i in range(17)]), "stop"),
        (dict(suffix="and then"), "suffix"),
        (dict(n=1, best_of=3), "best_of"),
        (dict(logit_bias={"5": 101}), "logit_bias"),  # out of [-100, 100]
        (dict(logprobs=21), "logprobs"),
        (dict(extra_body={"bogus_field": 1}), "bogus_field"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as ei:
            oai.completions.create(model=MODEL, prompt=PROMPT, **kw)
        assert ei.value.param == param, (kw, ei.value.body)
        assert ei.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as ei:
        oai.completions.create(model=MODEL, prompt=list(range(600)), max_tokens=1)
    assert ei.value.param == "prompt" and str(stack["client"].max_context_len) in ei.value.message
    with pytest.raises(openai.BadRequestError) as ei:
        oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10_000)
    assert ei.value.param == "max_tokens" and ei.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as ei:
        oai.completions.create(model="gpt-9", prompt=PROMPT)
    assert ei.value.param == "model" and ei.value.code == "model_not_found"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as ei:
        oai.chat.completions.create(model=MODEL, messages=CHAT, tools=[tool],
                                    tool_choice={"type": "function", "function": {"name": "g"}})
    assert ei.value.param == "tool_choice.function.name"
    with pytest.raises(openai.BadRequestError) as ei:
        oai.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=0)
    assert ei.value.param == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as ei:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "x"}])
    assert ei.value.param == "messages[0].role"


def test_malformed_requests(stack):
    err = assert_error(post(stack, "/v1/completions", b'{"prompt": "x",'), 400)
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"]
    assert_error(post(stack, "/v1/completions", [1, 2]), 400)
    assert_error(post(stack, "/v1/completions", {"prompt": "x", "max_tokens": "5"}), 400, "max_tokens")
    assert_error(post(stack, "/v1/completions", {"prompt": "x", "temperature": "hot"}), 400, "temperature")
    assert_error(post(stack, "/v1/completions", {"prompt": "x", "stream": "yes"}), 400, "stream")
    assert_error(post(stack, "/v1/completions", {"prompt": 3}), 400, "prompt")
    assert_error(post(stack, "/v1/completions", {"prompt": [10**9]}), 400, "prompt")
    assert_error(post(stack, "/v1/completions", {}), 400, "prompt")
    assert_error(post(stack, "/v1/chat/completions", {"messages": []}), 400, "messages")
    assert_error(post(stack, "/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}), 400, "top_logprobs")
    big = {"prompt": "x" * (4 * 1024 * 1024 + 10)}
    assert_error(post(stack, "/v1/completions", big), 413)
    assert_error(httpx.get(stack["url"] + "/v1/nothing"), 404)
    assert_error(httpx.get(stack["url"] + "/v1/completions"), 405)


def test_api_key(stack):
    url = stack["keyed_url"]
    anon = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anon.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        anon.models.list()
    ok = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    assert ok.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens <= 2
    assert httpx.get(url + "/health").status_code == 200
    assert_error(httpx.get(url + "/metrics"), 401)
    assert assert_error(httpx.post(url + "/generate", json={"text": "x"}), 401)["code"] == "invalid_api_key"
    r = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200 and "manta:request_errors_total" in r.text


# ------------------------------------------------------------------------------------------------
# Disconnects abort
# ------------------------------------------------------------------------------------------------


def _running_request(engine, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        running = list(engine.scheduler.running)
        if running:
            return running[0]
        time.sleep(0.005)
    raise AssertionError("no request started running")


def _wait_aborted(engine, req, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if req.finished and not engine.scheduler.running and not engine.scheduler.waiting:
            break
        time.sleep(0.01)
    assert req.finished and req.aborted, (req.status, req.finish_reason, len(req.output_ids))
    assert not engine.scheduler.running and not engine.scheduler.waiting


def _long_body(stack, stream: bool) -> dict:
    n_prompt = len(stack["engine"].tokenizer(PROMPT).input_ids)
    return {"prompt": PROMPT, "max_tokens": stack["client"].max_context_len - n_prompt,
            "ignore_eos": True, "stream": stream}


def test_streaming_disconnect_aborts(stack):
    engine = stack["engine"]
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", stack["url"] + "/v1/completions", json=_long_body(stack, True)) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
            assert got
            req = _running_request(engine)
    _wait_aborted(engine, req)  # leaving both `with`s closed the connection mid-stream


def test_nonstreaming_disconnect_aborts(stack):
    engine = stack["engine"]

    async def go():
        async with httpx.AsyncClient(timeout=30) as http:
            task = asyncio.create_task(http.post(stack["url"] + "/v1/completions", json=_long_body(stack, False)))
            req = await asyncio.to_thread(_running_request, engine)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return req

    req = asyncio.run(go())
    _wait_aborted(engine, req)


# ------------------------------------------------------------------------------------------------
# Error mapping over a stub client
# ------------------------------------------------------------------------------------------------


class StubClient:
    model_name = MODEL
    max_context_len = 64
    is_encoder_decoder, matryoshka_dimensions, embedding_size = False, None, None

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.mode = "ok"
        self.ok = True
        self.restart: list[bool] = []  # what each request allowed: a rerun elsewhere after outputs

    async def generate_stream(self, prompt, params, rid=None, is_embedding=False, group=None,
                              announce=False, restart=False) -> AsyncIterator[RequestOutput]:
        self.restart.append(restart)
        if self.mode == "queue_full":
            raise QueueFull("3 waiting")
        if self.mode == "no_replica":
            raise NoReplicaAvailable("all down")
        if self.mode == "crash":
            raise RuntimeError("secret internal detail")
        yield RequestOutput(rid or "r", delta_text="a", delta_token_ids=[5], prompt_tokens=len(prompt),
                            completion_tokens=1)
        yield RequestOutput(rid or "r", finished=True, finish_reason="error", error="replica died",
                            prompt_tokens=len(prompt), completion_tokens=1)

    def health(self) -> HealthStatus:
        return HealthStatus(self.ok, {"why": "test"})

    async def aclose(self) -> None:
        pass


def test_error_mapping_with_stub_client(stack):
    stub = StubClient(stack["engine"].tokenizer, stack["client"].vocab_size)
    metrics = ServerMetrics()
    server = BackgroundServer(build_app(stub, metrics, max_body_bytes=1000))
    try:
        body = {"prompt": "hi", "max_tokens": 2}
        url = server.url + "/v1/completions"
        stub.mode = "queue_full"
        r = httpx.post(url, json=body)
        assert_error(r, 503)
        assert r.headers["retry-after"] == "1"
        stub.mode = "no_replica"
        assert_error(httpx.post(url, json=body), 503)
        stub.mode = "crash"
        err = assert_error(httpx.post(url, json=body), 500)
        assert "secret" not in err["message"] and "Traceback" not in err["message"]
        stub.mode = "ok"
        stub.restart.clear()
        assert_error(httpx.post(url, json=body), 500)  # the replica failed the request
        r = httpx.post(url, json={**body, "stream": True})
        assert stub.restart == [True, False]  # only a response not streamed may run again elsewhere
        events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "replica died" in json.loads(events[-2])["error"]["message"]
        oai = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIError):
            list(oai.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=True))
        assert_error(httpx.post(url, json={"prompt": "x" * 2000}), 413)
        stub.ok = False
        assert_error(httpx.get(server.url + "/health"), 503)
        text = metrics.render().decode()
        for code in ("413", "500", "503"):
            assert f'manta:request_errors_total{{code="{code}"}}' in text
    finally:
        server.stop()


def test_metrics_count_what_clients_were_told(stack, oai):
    """A request with n choices counts its prompt once (as its usage does); an embedding is no
    time-to-first-token sample; counters polled from a replica that rebuilt its engine (its
    counts begin again at 0) go on from where they were."""
    reg = stack["metrics"].registry

    def value(name: str, **labels) -> float:
        return reg.get_sample_value(name, {"replica": "local", **labels}) or 0.0

    prompt, ttft = value("manta:prompt_tokens_total"), value("manta:time_to_first_token_seconds_count")
    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=3)
    assert value("manta:prompt_tokens_total") - prompt == r.usage.prompt_tokens
    assert value("manta:time_to_first_token_seconds_count") - ttft == 3  # one per choice
    prompt, ttft = value("manta:prompt_tokens_total"), value("manta:time_to_first_token_seconds_count")
    e = oai.embeddings.create(model=MODEL, input=["one", "two"])
    assert value("manta:prompt_tokens_total") - prompt == e.usage.prompt_tokens
    assert value("manta:time_to_first_token_seconds_count") == ttft

    m = ServerMetrics()
    m.update_replica_stats("r0", {"prefix_hit_tokens": 40, "prefix_query_tokens": 100})
    m.update_replica_stats("r0", {"prefix_hit_tokens": 5, "prefix_query_tokens": 20})  # its engine was rebuilt
    m.update_replica_stats("r0", {"prefix_hit_tokens": 8, "prefix_query_tokens": 30})
    assert m.registry.get_sample_value("manta:prefix_cache_hit_tokens_total", {"replica": "r0"}) == 48
    assert m.registry.get_sample_value("manta:prefix_cache_query_tokens_total", {"replica": "r0"}) == 130
    m.update_replica_stats("r0", {"kvstore": {"hit_pages": 7, "ranks": [{"tp_rank": 0, "pages_written": 9}]}})
    m.render()  # (exported values are taken at each scrape)
    m.update_replica_stats("r0", {"kvstore": {"hit_pages": 2, "ranks": [{"tp_rank": 0, "pages_written": 1}]}})
    assert m.registry.get_sample_value("manta:kvstore_hit_pages_total", {"replica": "r0"}) == 9
    written = {"replica": "r0", "layout": "", "tp_rank": "0"}
    assert m.registry.get_sample_value("manta:kvstore_pages_written_total", written) == 10
    # The step histogram across an engine rebuild: rebased as a whole, its buckets stay cumulative.
    from cluster.engine.step_times import STEP_BUCKETS, StepTimes

    def steps(times: list[float]) -> dict:
        st = StepTimes()
        for t in times:
            st.observe("DECODE", t)
        return st.stats()

    m.update_replica_stats("r0", {"steps": steps([0.004] * 100)})
    m.update_replica_stats("r0", {"steps": steps([0.004] * 60 + [0.008] * 60)})  # rebuilt: 60 under 5 ms < 100
    le = {"replica": "r0", "mode": "DECODE"}
    got = [m.registry.get_sample_value("manta:engine_step_seconds_bucket", {**le, "le": str(b)}) for b in STEP_BUCKETS[:2]]
    count = m.registry.get_sample_value("manta:engine_step_seconds_count", le)
    assert got == [160, 220] and count == 220
    assert b"_created" not in m.render()


def test_server_metrics_unit(stack):
    m = ServerMetrics()
    out = RequestOutput("r", finished=True, prompt_tokens=10, completion_tokens=5, ttft_s=0.5, e2e_s=1.3)
    m.observe_finished("r0", out)
    reg = m.registry
    assert reg.get_sample_value("manta:prompt_tokens_total", {"replica": "r0"}) == 10
    assert reg.get_sample_value("manta:generation_tokens_total", {"replica": "r0"}) == 5
    assert reg.get_sample_value("manta:time_per_output_token_seconds_sum", {"replica": "r0"}) == pytest.approx(0.2)
    assert reg.get_sample_value("manta:e2e_request_latency_seconds_count", {"replica": "r0"}) == 1
    m.record_route("cache_aware", "r0")
    m.record_error(503)
    # A replica's whole stats dict may be passed: unknown keys are ignored.
    m.update_replica_stats("r0", {"num_running": 3, "num_waiting": 1, "kv_usage": 0.25, "prefix_hit_tokens": 40,
                                  "prefix_query_tokens": 100, "healthy": True, "restarts": 0})
    assert reg.get_sample_value("manta:num_requests_running", {"replica": "r0"}) == 3
    assert reg.get_sample_value("manta:prefix_cache_hit_tokens_total", {"replica": "r0"}) == 40
    assert reg.get_sample_value("manta:prefix_cache_query_tokens_total", {"replica": "r0"}) == 100
    assert reg.get_sample_value("manta:router_requests_total", {"policy": "cache_aware", "replica": "r0"}) == 1
    assert reg.get_sample_value("manta:request_errors_total", {"code": "503"}) == 1
    m.set_kv_capacity("r0", {"kv_pages": 9, "page_size": 16, "kv_cache_dtype": "fp8_e4m3"})  # page 0 reserved
    capacity = {"replica": "r0", "kv_cache_dtype": "fp8_e4m3"}
    assert reg.get_sample_value("manta:kv_cache_capacity_tokens", capacity) == 128
    m.remove_replica("r0")
    assert reg.get_sample_value("manta:kv_cache_capacity_tokens", capacity) is None
    for name in ("manta:num_requests_running", "manta:kv_cache_usage_perc", "manta:prefix_cache_hit_tokens_total"):
        assert reg.get_sample_value(name, {"replica": "r0"}) is None
    assert reg.get_sample_value("manta:prompt_tokens_total", {"replica": "r0"}) == 10  # history stays
    assert b"manta:request_errors_total" in m.render()
    # metrics_public: /metrics is open while the API stays behind the key.
    server = BackgroundServer(build_app(StubClient(stack["engine"].tokenizer, 512), m, api_key="k",
                                        metrics_public=True))
    try:
        assert httpx.get(server.url + "/metrics").status_code == 200
        assert_error(httpx.get(server.url + "/v1/models"), 401)
    finally:
        server.stop()


def test_a_failed_stream_says_which_choice_failed_and_is_counted(stack):
    """A replica that fails a request mid-stream: the stream's last chunk for that choice has
    finish_reason "error", then one error event and [DONE]; the failure is counted in
    manta:request_finished_total{finish_reason="error"}."""
    import threading

    engine = stack["engine"]
    url = stack["url"]
    before = httpx.get(url + "/metrics").text
    events: list[dict] = []
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 200, "stream": True, "ignore_eos": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                events.append({"done": True})
                break
            events.append(json.loads(line[6:]))
            if len(events) == 2:  # streaming: the replica fails everything it runs
                threading.Thread(target=engine.fail_all, args=("a worker died",)).start()
    assert events[-1] == {"done": True}
    err, last_chunk = events[-2], events[-3]
    assert err["error"]["type"] == "server_error" and "a worker died" in err["error"]["message"]
    assert last_chunk["choices"][0]["finish_reason"] == "error"

    def errors(text: str) -> float:
        line = next((ln for ln in text.splitlines() if ln.startswith("manta:request_finished_total")
                     and 'finish_reason="error"' in ln), None)
        return float(line.rsplit(" ", 1)[1]) if line else 0.0

    assert errors(httpx.get(url + "/metrics").text) == errors(before) + 1


def test_streamed_tokens_arrive_as_they_come_on_a_reused_connection(stack):
    """Each token is sent when generated, on every request of a keep-alive connection: with Nagle's
    algorithm on the server's socket, the second response waited for the client's delayed ACK and
    came in one piece about 40 ms later."""
    body = {"prompt": PROMPT, "max_tokens": 8, "stream": True, "ignore_eos": True, "temperature": 0}

    def paced(engine, dt):  # runs on the engine thread after each step: 8 tokens take >= 35 ms
        time.sleep(0.005)

    # A tiny model's step on CI takes ~0.2 ms: unpaced, 8 tokens can all be written before the
    # client thread runs, and would arrive together with Nagle's algorithm off as well.
    stack["engine"].step_listeners.append(paced)
    try:
        with httpx.Client(timeout=60) as client:
            for _ in range(3):
                t0, arrivals = time.perf_counter(), []
                with client.stream("POST", stack["url"] + "/v1/completions", json=body) as r:
                    for _chunk in r.iter_raw():
                        arrivals.append(time.perf_counter() - t0)
                # With Nagle's algorithm the 2nd and 3rd responses come in one piece.
                assert len(arrivals) >= 4 and arrivals[-1] - arrivals[0] > 0.02, arrivals
    finally:
        stack["engine"].step_listeners.remove(paced)


def test_bench_serve_counts_tokens_from_usage_not_text_events(stack):
    """`manta bench serve --url`'s client: tokens from the server's usage (byte-level tokens that
    decode to nothing still count), every latency it reports measured, the warm-up untimed,
    and a failed request counted by kind."""
    from cluster.bench.serve import run_http

    rng = random.Random(3)
    prompts = [[rng.randrange(10, 250) for _ in range(12 + i)] for i in range(6)]
    # The server runs in this process here: its CPU time is this process's.
    res = asyncio.run(run_http(stack["url"], MODEL, prompts, 9, rate=100.0, warmup=prompts[:2],
                               server_pid=os.getpid()))
    assert res["requests"] == 6 and res["errors"] == 0 and res["output_tokens"] == 6 * 9
    for key in ("ttft_ms_p50", "tpot_ms_mean", "itl_ms_p99", "chunk_gap_ms_p99", "server_cpu_s", "second_token_ms_p99",
                "itl_after_second_ms_p99"):
        assert res[key] > 0, key
    assert res["second_token_ms_p50"] <= res["second_token_ms_p99"]
    assert res["server_cpu_us_per_token"] == pytest.approx(1e6 * res["server_cpu_s"] / 54)
    bad = asyncio.run(run_http(stack["url"], "no-such-model", prompts[:2], 4, rate=100.0))
    assert bad["errors"] == 2 and bad["errors_by_kind"] == {"HTTP 404": 2}


def test_process_cpu_seconds_count_this_process_burning_cpu():
    from cluster.bench.serve import process_cpu_s

    before, end = process_cpu_s(os.getpid()), time.process_time() + 0.2
    while time.process_time() < end:
        pass
    assert 0.15 < process_cpu_s(os.getpid()) - before < 5.0
