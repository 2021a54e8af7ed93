"""Overload, per-request timeouts and disconnects, against the real app over a tiny in-process
engine whose queue is bounded (2 running + 2 waiting).

After every burst, timeout and disconnect the engine is idle again: nothing running or waiting,
KV usage 0 (pages a finished request leaves in the radix cache are evictable: not "used"), and
the Prometheus gauges say so.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from cluster.api.metrics import ServerMetrics
from cluster.api.server import BackgroundServer, build_app
from cluster.engine.client import LocalEngineClient
from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from tests.fixtures import tiny_model_dir

PROMPT = "The quick brown fox jumps over the lazy dog"
TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def bounded(tmp_path_factory):
    d = tiny_model_dir(tmp_path_factory, "llama")
    engine = Engine(EngineConfig(model=str(d), served_model_name="tiny", kv_cache_tokens=2048,
                                 max_running_requests=2, max_waiting=2))
    metrics = ServerMetrics()
    client = LocalEngineClient(engine, metrics=metrics)
    server = BackgroundServer(build_app(client, metrics))
    timed = BackgroundServer(build_app(client, metrics, request_timeout_s=TIMEOUT_S))
    try:
        yield {"engine": engine, "metrics": metrics, "url": server.url, "timed_url": timed.url,
               "limit": client.max_context_len}
    finally:
        server.stop()
        timed.stop()
        asyncio.run(client.aclose())


class SlowSteps:
    """Makes every engine step take at least `seconds` (a step listener on the engine thread),
    and counts steps."""

    def __init__(self, engine: Engine, seconds: float):
        self.engine, self.seconds, self.steps = engine, seconds, 0

    def __call__(self, engine: Engine, dt: float) -> None:
        self.steps += 1
        time.sleep(self.seconds)

    def __enter__(self) -> SlowSteps:
        self.engine.step_listeners.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self.engine.step_listeners.remove(self)


def assert_idle(b, timeout: float = 10.0) -> None:
    """Nothing running or waiting, no KV page in use, in the scheduler and in /metrics."""
    engine = b["engine"]
    deadline = time.monotonic() + timeout
    while engine.has_work() and time.monotonic() < deadline:
        time.sleep(0.01)
    sched = engine.scheduler
    assert not sched.running and not sched.waiting, (len(sched.running), len(sched.waiting))
    assert sched.kv_usage() == 0.0
    sched.check_integrity()
    reg = b["metrics"].registry
    for name in ("manta:num_requests_running", "manta:num_requests_waiting", "manta:kv_cache_usage_perc"):
        assert reg.get_sample_value(name, {"replica": "local"}) == 0.0, name


def aborts(b, reason: str) -> float:
    return b["metrics"].registry.get_sample_value("manta:request_aborts_total", {"reason": reason}) or 0.0


def long_body(b, stream: bool) -> dict:
    n_prompt = len(b["engine"].tokenizer(PROMPT).input_ids)
    return {"prompt": PROMPT, "max_tokens": b["limit"] - n_prompt, "ignore_eos": True, "stream": stream}


def test_burst_over_the_queue_bound(bounded):
    """16 requests at once against 2 running + 2 waiting: the overflow gets 503 + Retry-After
    and the OpenAI error body; the admitted ones finish whole; then everything is back to 0."""

    async def burst():
        async with httpx.AsyncClient(base_url=bounded["url"], timeout=60) as http:
            async def one(i: int) -> tuple[int, dict, dict]:
                body = {"prompt": f"{PROMPT} {i}", "max_tokens": 24, "ignore_eos": True, "stream": i % 2 == 1}
                r = await http.post("/v1/completions", json=body)
                if r.status_code == 200 and body["stream"]:
                    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
                    assert events[-1] == "[DONE]"
                    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
                    return 200, dict(r.headers), {"text": text, "stream": True}
                return r.status_code, dict(r.headers), r.json()

            return await asyncio.gather(*(one(i) for i in range(16)))

    with SlowSteps(bounded["engine"], 0.005):
        results = asyncio.run(burst())
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {200, 503}, statuses
    # At least the running and waiting slots' worth is admitted (a burst that comes between
    # two steps waits for free running slots too), more when slots free up meanwhile.
    assert statuses.count(503) >= 1 and statuses.count(200) >= 4, statuses
    for status, headers, body in results:
        if status == 503:
            assert headers["retry-after"] == "1"
            assert body["error"]["code"] == "queue_full" and body["error"]["type"] == "server_overloaded"
        elif not body.get("stream"):
            assert body["usage"]["completion_tokens"] == 24 and body["choices"][0]["finish_reason"] == "length"
    assert_idle(bounded)
    # A second burst after the first drained is admitted the same way (the queue really emptied).
    with SlowSteps(bounded["engine"], 0.005):
        again = [s for s, _, _ in asyncio.run(burst())]
    assert again.count(200) >= 2 and again.count(503) >= 1
    assert_idle(bounded)


def test_request_timeout_non_streaming(bounded):
    with SlowSteps(bounded["engine"], 0.02):
        before = aborts(bounded, "timeout")
        t0 = time.monotonic()
        r = httpx.post(bounded["timed_url"] + "/v1/completions", json=long_body(bounded, False), timeout=30)
        took = time.monotonic() - t0
        assert r.status_code == 504, r.text
        err = r.json()["error"]
        assert err["code"] == "request_timeout" and f"{TIMEOUT_S:g} s" in err["message"]
        assert took < TIMEOUT_S + 2.0
        assert_idle(bounded)
    assert aborts(bounded, "timeout") == before + 1


def test_request_timeout_streaming(bounded):
    """A stream that has started cannot change its status: it ends with one error event and
    [DONE], and the request is aborted."""
    with SlowSteps(bounded["engine"], 0.02):
        before = aborts(bounded, "timeout")
        r = httpx.post(bounded["timed_url"] + "/v1/completions", json=long_body(bounded, True), timeout=30)
        assert r.status_code == 200
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "request_timeout"
        assert any("choices" in json.loads(e) for e in events[:-2])  # tokens came before the cut
        assert_idle(bounded)
    assert aborts(bounded, "timeout") == before + 1


def test_short_requests_are_not_cut_by_the_timeout(bounded):
    r = httpx.post(bounded["timed_url"] + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_streaming_disconnect_aborts_within_one_step_and_frees_kv(bounded):
    engine = bounded["engine"]
    before = aborts(bounded, "client_gone")
    registry = bounded["metrics"].registry
    finished = registry.get_sample_value("manta:request_finished_total",
                                         {"replica": "local", "finish_reason": "abort"}) or 0.0
    generated = registry.get_sample_value("manta:generation_tokens_total", {"replica": "local"}) or 0.0
    # Steps of 50 ms: the server's thread has that long to see the EOF and abort, on a loaded
    # 2-core machine too (the engine thread holds the GIL for most of a tiny model's step).
    with SlowSteps(engine, 0.05) as slow:
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", bounded["url"] + "/v1/completions", json=long_body(bounded, True)) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                assert [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
                req = engine.scheduler.running[0]
                assert engine.scheduler.kv_usage() > 0
                steps_at_close = slow.steps
        # The connection is closed: the abort lands before the engine runs another full step.
        deadline = time.monotonic() + 5
        while not req.finished and time.monotonic() < deadline:
            time.sleep(0.001)
        assert req.finished and req.aborted
        assert slow.steps - steps_at_close <= 1, slow.steps - steps_at_close
        assert_idle(bounded)
    assert aborts(bounded, "client_gone") == before + 1
    # It finished, as aborted, with the tokens it had streamed.
    assert registry.get_sample_value("manta:request_finished_total",
                                     {"replica": "local", "finish_reason": "abort"}) == finished + 1
    assert registry.get_sample_value("manta:generation_tokens_total", {"replica": "local"}) > generated
    text = httpx.get(bounded["url"] + "/metrics").text
    assert 'manta:request_aborts_total{reason="client_gone"}' in text
    assert 'manta:kv_cache_usage_perc{replica="local"} 0.0' in text
    assert 'manta:num_requests_running{replica="local"} 0.0' in text


def test_waiting_request_disconnect_leaves_the_queue(bounded):
    """A client that gives up while its request is still queued takes it out of the queue."""
    engine = bounded["engine"]
    with SlowSteps(engine, 0.02):
        stop = threading.Event()

        def hog(i: int) -> None:
            with httpx.Client(timeout=30) as http:
                with http.stream("POST", bounded["url"] + "/v1/completions", json=long_body(bounded, True)) as r:
                    for _ in r.iter_lines():
                        if stop.is_set():
                            return

        hogs = [threading.Thread(target=hog, args=(i,)) for i in range(2)]
        for t in hogs:
            t.start()
        deadline = time.monotonic() + 10
        while len(engine.scheduler.running) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)

        async def queued_then_gone() -> None:
            async with httpx.AsyncClient(timeout=30) as http:
                task = asyncio.create_task(http.post(bounded["url"] + "/v1/completions",
                                                     json={"prompt": PROMPT, "max_tokens": 4}))
                t_end = time.monotonic() + 10
                while not engine.scheduler.waiting and time.monotonic() < t_end:
                    await asyncio.sleep(0.005)
                assert len(engine.scheduler.waiting) == 1
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

        asyncio.run(queued_then_gone())
        deadline = time.monotonic() + 5
        while engine.scheduler.waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.scheduler.waiting
        stop.set()
        for t in hogs:
            t.join(timeout=30)
        assert_idle(bounded)


def test_serve_flags_bound_the_router_and_the_replicas(tmp_path_factory):
    """`--max-waiting W` bounds each replica's queue and, unless `--router-max-inflight` is
    given, the router at replicas x (max-running-requests + W); `--request-timeout` parses."""
    import argparse

    from cluster.serve_cli import add_serve_parser, cluster_options_from_args

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    model = str(tiny_model_dir(tmp_path_factory, "llama"))

    def opts(*argv):
        args = parser.parse_args(["serve", "--model", model, *argv])
        return args, cluster_options_from_args(args)

    args, o = opts("--replicas", "3", "--max-running-requests", "8", "--max-waiting", "4", "--request-timeout", "2.5")
    assert o.engine.max_waiting == 4 and o.router.max_inflight == 3 * (8 + 4) and args.request_timeout == 2.5
    _, o = opts("--max-waiting", "4", "--router-max-inflight", "7")
    assert o.router.max_inflight == 7
    args, o = opts()
    assert o.engine.max_waiting == 0 and o.router.max_inflight == 0 and args.request_timeout is None
