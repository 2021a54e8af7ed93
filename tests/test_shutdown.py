"""`manta serve` as a process: it starts, answers the `openai` client and stops cleanly under
`--shutdown-timeout S` and load: SIGTERM stops admissions (503), lets requests finish for S
seconds, then ends the streams still open with an error event (a client that does not read its
stream cannot hold the server), and every process of the server is gone within S + 15 s, leaving
nothing in /dev/shm.

The test shuts down any Ray instance of this pytest process first: the server starts its own.
No module fixture here holds one (a fixture's cluster whose router thread polls Ray while a test
shuts Ray down under it can crash the process)."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import openai
import pytest
import ray

from tests.serve_process import ServeProcess, alive

pytestmark = pytest.mark.slow

DEADLINE_S = 3.0


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _unread_stream(port: int) -> socket.socket:
    """A client that asks for a large stream (n=64 x 300 tokens) and never reads it."""
    body = json.dumps({"prompt": "the river", "max_tokens": 300, "n": 64, "stream": True,
                       "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


def _reader(url: str, out: list, streaming: threading.Semaphore, max_tokens: int = 480) -> None:
    """A client that reads its stream to the end and keeps the last event (releases
    `streaming` at its first)."""
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"prompt": "the mountain", "max_tokens": max_tokens, "stream": True,
                                "ignore_eos": True}) as r:
            last = None
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    if last is None:
                        streaming.release()
                    last = json.loads(line[6:])
            out.append(last)
    except httpx.HTTPError as exc:
        out.append(exc)


def test_manta_serve_answers_then_sigterm_ends_everything_by_the_deadline(tmp_path):
    """One server through its life: it starts and answers the `openai` client; then, under load,
    SIGTERM refuses new requests (503), ends the streams still open at the deadline with the
    shutdown error, and the server exits 0 with every process it started (Ray, replicas,
    ranks) gone and nothing left in /dev/shm. (One server for both halves: each start builds
    the embedded default and a Ray instance, ~30 s on the CI VM.)"""
    if ray.is_initialized():
        ray.shutdown()
    shm_before = _shm()
    served = ServeProcess(tmp_path / "cache", "--shutdown-timeout", str(DEADLINE_S))
    try:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=5)
        assert out.choices[0].message.content is not None and out.usage.completion_tokens >= 1

        unread = _unread_stream(served.port)
        results: list = []
        streaming = threading.Semaphore(0)
        readers = [threading.Thread(target=_reader, args=(served.url, results, streaming)) for _ in range(4)]
        for t in readers:
            t.start()
        for _ in readers:  # generation under way on every stream before the signal
            assert streaming.acquire(timeout=60), "a reader's stream did not start"
        tree = served.tree()
        served.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        time.sleep(0.3)
        refused = httpx.post(served.url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=10)
        for t in readers:
            t.join(timeout=DEADLINE_S + 10)
        rc = served.proc.wait(timeout=DEADLINE_S + 30)
        while any(alive(p) for p in tree) and time.monotonic() - t0 < DEADLINE_S + 30:
            time.sleep(0.1)
        gone_s = time.monotonic() - t0
        unread.close()
    finally:
        served.stop()
    assert rc == 0, served.log
    assert "placement" in served.log or "replica replica-0 ready" in served.log
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
    assert refused.headers.get("retry-after") == "1"
    # The readers' streams ended at the deadline with the shutdown error as their last event.
    assert len(results) == 4 and all(isinstance(r, dict) for r in results), results
    assert all(r.get("error", {}).get("code") == "server_shutting_down" for r in results), results
    # No orphans: every process the server started is gone. Only this server's own process
    # tree is looked at: other Ray instances may share the machine.
    assert len(tree) > 1 and not [p for p in tree if alive(p)]
    print(f"processes gone {gone_s:.1f} s after SIGTERM (deadline {DEADLINE_S} s)")
    # After the deadline: the server exits, then Ray's local instance and its actors. Measured on the
    # 2-core VM (2026-11-24): 6.5-7.9 s after SIGTERM idle, 8.9 s once during a full test run; the
    # bound leaves room for a loaded CI machine (a process left behind waits the loop's 30 s out).
    assert gone_s <= DEADLINE_S + 15, f"processes gone after {gone_s:.1f} s"
    assert _shm() <= shm_before, sorted(_shm() - shm_before)


def test_a_second_ctrl_c_exits_at_once_and_quietly(tmp_path):
    """Ctrl-C twice: the first starts the drain (here a long one, with a stream open), the second
    ends it now: the open stream gets the shutdown error event, and the server is gone long
    before the drain's deadline, exits 0, leaves no process behind and prints no traceback (a
    hurried exit once cancelled uvicorn's lifespan task and the stream's, and logged both)."""
    if ray.is_initialized():
        ray.shutdown()
    served = ServeProcess(tmp_path / "cache", "--shutdown-timeout", "60")
    try:
        results: list = []
        streaming = threading.Semaphore(0)
        # (2,000 tokens: ~6 s on the 2-core VM, so the stream is still open at the second signal on
        # a machine several times faster; the embedded model's context is 2,048)
        reader = threading.Thread(target=_reader, args=(served.url, results, streaming, 2000))
        reader.start()
        assert streaming.acquire(timeout=60), "the stream did not start"
        tree = served.tree()
        served.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        t0 = time.monotonic()
        served.proc.send_signal(signal.SIGINT)
        rc = served.proc.wait(timeout=45)
        while any(alive(p) for p in tree) and time.monotonic() - t0 < 45:
            time.sleep(0.1)
        gone_s = time.monotonic() - t0
        reader.join(timeout=30)
    finally:
        served.stop()
    assert rc == 0, served.log
    assert "shutting down" in served.log
    assert "Traceback" not in served.log, served.log
    assert not [p for p in tree if alive(p)]
    print(f"processes gone {gone_s:.1f} s after the second SIGINT")
    assert gone_s < 30, f"processes gone after {gone_s:.1f} s"  # the drain alone would wait 60 s
    assert not reader.is_alive() and len(results) == 1 and isinstance(results[0], dict), results
    assert results[0].get("error", {}).get("code") == "server_shutting_down", results
