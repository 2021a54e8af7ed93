"""`manta bench soak`: a bounded soak of a live server with mixed traffic, on loopback only.

The project's own asyncio client (httpx) runs `concurrency` closed-loop workers against a
`manta serve` for `duration` seconds and stops by itself. Each worker picks its next request by
weight:

- stream:     a streaming completion (ignore_eos, so it must bring exactly max_tokens tokens);
- chat:       a non-streaming chat completion (same check on usage);
- fanout:     a non-streaming completion with n = 2..3 choices;
- bad:        one of a set of bad requests (malformed JSON, wrong types, a prompt over the
              context, an unknown model, too many stop strings, a lone surrogate, ...): it must
              be answered 4xx with the OpenAI error body;
- disconnect: a streaming completion the client abandons after a few chunks (the server must
              abort it and free its pages).

Outcomes are classified as `ok`, `expected` (the right 4xx for a bad request; 503 + Retry-After
when the server sheds load with --max-waiting; 504 with --request-timeout) or `unexpected`
(5xx, a bad request answered 200, a short or malformed answer, a transport error). Nothing that
was acknowledged may be lost: an `ok` answer is a whole answer.

Memory: the resident set (VmRSS, from /proc: Linux) of the server process and of every process
under it, split into Ray workers (`ray::...` process titles: replicas, ranks, the KV store) and
Ray's own daemons, sampled every `sample_s`; the report gives the first sample after warm-up,
the last and the peak. At the end the server's /metrics must show an idle cluster (no request
running or waiting, no KV page in use).

Without `--url` the soak starts `manta serve` itself (with `--serve-arg`s, on a free loopback
port) and stops it with SIGTERM at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from cluster.bench.ports import free_port
from cluster.bench.proc_memory import tree_memory

KINDS = {"stream": 0.35, "chat": 0.2, "fanout": 0.1, "bad": 0.2, "disconnect": 0.15}
WORDS = ("alpha", "beta", "gamma", "delta", "river", "mountain", "serving", "cluster", "token", "cache",
         "request", "replica", "router", "queue", "page", "prefix", "model", "batch", "decode", "prefill")


@dataclass
class SoakOptions:
    duration_s: float = 600.0
    concurrency: int = 8
    url: str | None = None  # None: start `manta serve` here
    server_pid: int | None = None  # with url: the server's pid, for memory (None: not measured)
    serve_args: list[str] = field(default_factory=list)
    model: str | None = None  # None: ask the server (/v1/models)
    max_tokens: int = 48
    warmup_s: float = 10.0
    sample_s: float = 10.0
    seed: int = 0
    start_timeout_s: float = 300.0


@dataclass
class Outcome:
    kind: str
    status: str  # ok | expected | unexpected
    what: str  # e.g. "200", "400 bad_json", "503 queue_full", "transport ReadError"
    latency_s: float
    ttft_s: float | None = None


# ---------------------------------------------------------------------------------------------
# traffic


def _bad_requests(model: str, context: int) -> list[tuple[str, str, bytes | dict, int]]:
    """(name, path, body, expected status)."""
    long_prompt = "token " * (context + 16)
    return [
        ("bad_json", "/v1/completions", b'{"prompt": "x",', 400),
        ("invalid_utf8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400),
        ("lone_surrogate", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400),
        ("wrong_type", "/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400),
        ("over_context", "/v1/completions", {"prompt": long_prompt, "max_tokens": 4}, 400),
        ("huge_max_tokens", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**12}, 400),
        ("huge_n", "/v1/completions", {"prompt": "x", "n": 10**9}, 400),
        ("too_many_stops", "/v1/completions", {"prompt": "x", "stop": [f"s{i}" for i in range(17)]}, 400),
        ("unknown_model", "/v1/completions", {"prompt": "x", "model": "no-such-model"}, 404),
        ("empty_prompt", "/v1/completions", {"prompt": ""}, 400),
        ("unknown_field", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "bogus": 1}, 400),
    ]


class Soak:
    def __init__(self, opts: SoakOptions, url: str, model: str, context: int):
        self.opts, self.url, self.model, self.context = opts, url, model, context
        self.outcomes: list[Outcome] = []
        self.bad = _bad_requests(model, context)
        self.stop_at = 0.0

    def _prompt(self, rng: random.Random) -> str:
        # A few shared openings (prefix-cache hits) and random tails.
        head = ["You are a helpful assistant.", "Summarize the following:", "Translate to French:"][rng.randrange(3)]
        return head + " " + " ".join(rng.choice(WORDS) for _ in range(rng.randrange(4, 40)))

    async def worker(self, http: httpx.AsyncClient, wid: int) -> None:
        rng = random.Random(self.opts.seed * 1000 + wid)
        kinds, weights = zip(*KINDS.items())
        while time.monotonic() < self.stop_at:
            kind = rng.choices(kinds, weights)[0]
            t0 = time.monotonic()
            try:
                out = await getattr(self, f"_{kind}")(http, rng, t0)
            except (httpx.TransportError, httpx.HTTPStatusError) as exc:
                out = Outcome(kind, "unexpected", f"transport {type(exc).__name__}", time.monotonic() - t0)
            except Exception as exc:  # a malformed answer (bad JSON, missing fields)
                out = Outcome(kind, "unexpected", f"malformed {type(exc).__name__}: {str(exc)[:80]}",
                              time.monotonic() - t0)
            self.outcomes.append(out)

    @staticmethod
    def _error_outcome(kind: str, r: httpx.Response, t0: float) -> Outcome:
        """A non-200 answer to a request that should have been served."""
        dt = time.monotonic() - t0
        code = ""
        try:
            code = r.json()["error"].get("code") or ""
        except Exception:
            pass
        if r.status_code == 503 and r.headers.get("retry-after") and code in ("queue_full", "no_replica"):
            return Outcome(kind, "expected", f"503 {code}", dt)
        if r.status_code == 504 and code == "request_timeout":
            return Outcome(kind, "expected", "504 request_timeout", dt)
        return Outcome(kind, "unexpected", f"{r.status_code} {code}".strip(), dt)

    async def _stream(self, http, rng, t0) -> Outcome:
        n = rng.randrange(4, self.opts.max_tokens + 1)
        body = {"model": self.model, "prompt": self._prompt(rng), "max_tokens": n, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}, "temperature": rng.choice([0.0, 0.8])}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return self._error_outcome("stream", r, t0)
            ttft, done, usage, finish, err = None, False, None, None, None
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"].get("code") or chunk["error"]["type"]
                    continue
                if chunk["choices"]:
                    ttft = ttft or time.monotonic() - t0
                    finish = chunk["choices"][0]["finish_reason"] or finish
                usage = chunk.get("usage") or usage
        dt = time.monotonic() - t0
        if err == "request_timeout" and done:
            return Outcome("stream", "expected", "stream 504 request_timeout", dt, ttft)
        if err is not None or not done or finish != "length" or not usage or usage["completion_tokens"] != n:
            return Outcome("stream", "unexpected", f"stream incomplete (error={err}, done={done}, finish={finish})",
                           dt, ttft)
        return Outcome("stream", "ok", "200", dt, ttft)

    async def _chat(self, http, rng, t0) -> Outcome:
        n = rng.randrange(4, self.opts.max_tokens + 1)
        body = {"model": self.model, "messages": [{"role": "user", "content": self._prompt(rng)}],
                "max_tokens": n, "ignore_eos": True}
        r = await http.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            return self._error_outcome("chat", r, t0)
        j = r.json()
        ok = j["usage"]["completion_tokens"] == n and j["choices"][0]["finish_reason"] == "length"
        return Outcome("chat", "ok" if ok else "unexpected", "200" if ok else "200 short answer", time.monotonic() - t0)

    async def _fanout(self, http, rng, t0) -> Outcome:
        k, n = rng.randrange(2, 4), rng.randrange(4, 17)
        body = {"model": self.model, "prompt": self._prompt(rng), "max_tokens": n, "n": k, "ignore_eos": True,
                "seed": rng.randrange(1000)}
        r = await http.post("/v1/completions", json=body)
        if r.status_code != 200:
            return self._error_outcome("fanout", r, t0)
        j = r.json()
        ok = len(j["choices"]) == k and j["usage"]["completion_tokens"] == k * n
        return Outcome("fanout", "ok" if ok else "unexpected", "200" if ok else "200 short answer",
                       time.monotonic() - t0)

    async def _bad(self, http, rng, t0) -> Outcome:
        name, path, body, want = self.bad[rng.randrange(len(self.bad))]
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = await http.post(path, content=raw, headers={"content-type": "application/json"})
        dt = time.monotonic() - t0
        try:
            err = r.json()["error"]
            well_formed = set(err) == {"message", "type", "param", "code"} and bool(err["message"])
        except Exception:
            well_formed = False
        if r.status_code == want and well_formed:
            return Outcome("bad", "expected", f"{want} {name}", dt)
        return Outcome("bad", "unexpected", f"{r.status_code} for {name}", dt)

    async def _disconnect(self, http, rng, t0) -> Outcome:
        body = {"model": self.model, "prompt": self._prompt(rng), "max_tokens": self.opts.max_tokens * 4,
                "ignore_eos": True, "stream": True}
        keep = rng.randrange(1, 4)
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return self._error_outcome("disconnect", r, t0)
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen >= keep:
                        break  # leaving the block closes the connection mid-stream
        return Outcome("disconnect", "expected", "client went away", time.monotonic() - t0)


# ---------------------------------------------------------------------------------------------
# the run


def _pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def _scrape(text: str, name: str) -> dict[str, float]:
    """{labels: value} of one metric in a Prometheus text exposition."""
    out = {}
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        out[m.group(1) or ""] = float(m.group(2))
    return out


def start_server(serve_args: list[str], timeout_s: float, log_path: str | None = None) -> tuple[subprocess.Popen, str]:
    """`manta serve` on a free loopback port; its output goes to `log_path` (None: discarded)."""
    port = free_port()
    cmd = [sys.executable, "-m", "cluster.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *serve_args]
    env = {**os.environ, "RAY_ADDRESS": ""}
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115 (the child writes it)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"manta serve exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"manta serve did not become healthy within {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


async def _sampler(pid: int | None, every: float, stop_at: float, samples: list[dict]) -> None:
    if pid is None:
        return
    t0 = time.monotonic()
    while True:
        samples.append({"t_s": round(time.monotonic() - t0, 1), **tree_memory(pid)})
        if time.monotonic() >= stop_at:
            return
        await asyncio.sleep(min(every, max(0.0, stop_at - time.monotonic())))


async def _drive(opts: SoakOptions, url: str, pid: int | None) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120, connect=10),
                                 limits=httpx.Limits(max_connections=opts.concurrency * 2)) as http:
        card = (await http.get("/v1/models")).json()["data"][0]
        model = opts.model or card["id"]
        soak = Soak(opts, url, model, card["max_model_len"])
        samples: list[dict] = []
        # Warm-up traffic first (the first requests load caches, compile paths), then the run.
        t_start = time.monotonic()
        soak.stop_at = t_start + opts.warmup_s
        await asyncio.gather(*(soak.worker(http, -1 - i) for i in range(opts.concurrency)))
        warm = len(soak.outcomes)
        soak.outcomes.clear()
        t_run = time.monotonic()
        soak.stop_at = t_run + opts.duration_s
        sampler = asyncio.create_task(_sampler(pid, opts.sample_s, soak.stop_at, samples))
        await asyncio.gather(*(soak.worker(http, i) for i in range(opts.concurrency)))
        wall = time.monotonic() - t_run
        await sampler
        # The cluster is idle again once the last aborts and finishes land.
        idle, metrics_text = False, ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            metrics_text = (await http.get("/metrics")).text
            busy = [v for name in ("manta:num_requests_running", "manta:num_requests_waiting",
                                   "manta:kv_cache_usage_perc") for v in _scrape(metrics_text, name).values()]
            if not any(busy):
                idle = True
                break
            await asyncio.sleep(0.5)
        if pid is not None:
            samples.append({"t_s": round(time.monotonic() - t_run, 1), "after_drain": True, **tree_memory(pid)})
    return _report(opts, soak.outcomes, wall, warm, samples, idle, metrics_text)


def _report(opts: SoakOptions, outs: list[Outcome], wall: float, warm: int, samples: list[dict], idle: bool,
            metrics_text: str) -> dict:
    ok = [o for o in outs if o.status == "ok"]
    lat = [o.latency_s for o in ok]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    by_status = Counter(o.status for o in outs)
    res: dict = {
        "duration_s": round(wall, 1), "concurrency": opts.concurrency, "warmup_requests": warm,
        "requests": len(outs), "served_ok": len(ok), "expected_errors": by_status["expected"],
        "unexpected_errors": by_status["unexpected"], "requests_per_s": round(len(outs) / wall, 2),
        "by_kind": dict(Counter(o.kind for o in outs)),
        "outcomes": dict(Counter(f"{o.status}: {o.what}" for o in outs).most_common()),
        "latency_ms": {"p50": _ms(_pct(lat, 0.5)), "p99": _ms(_pct(lat, 0.99)), "max": _ms(max(lat, default=None))},
        "ttft_ms": {"p50": _ms(_pct(ttft, 0.5)), "p99": _ms(_pct(ttft, 0.99))},
        "idle_after": idle,
        "server_metrics": {"aborts": _scrape(metrics_text, "manta:request_aborts_total"),
                           "errors": _scrape(metrics_text, "manta:request_errors_total")},
    }
    if samples:
        first, last = samples[0], samples[-1]
        peak = max(s["total_mib"] for s in samples)
        res["memory_mib"] = {
            "start": {k: round(v, 1) for k, v in first.items() if k.endswith("_mib")},
            "end": {k: round(v, 1) for k, v in last.items() if k.endswith("_mib")},
            "peak_total": round(peak, 1),
            "growth": {k: round(last[k] - first[k], 1) for k in first if k.endswith("_mib")},
            "processes": {"ray_workers": last["ray_workers"], "ray_daemons": last["ray_daemons"]},
        }
        res["memory_samples"] = samples
    return res


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1e3 * x, 1)


def run_soak(opts: SoakOptions) -> dict:
    proc = None
    url, pid = opts.url, opts.server_pid
    log_path = None
    if url is None:
        log_path = os.path.join(tempfile.mkdtemp(prefix="manta-soak-"), "serve.log")
        proc, url = start_server(opts.serve_args, opts.start_timeout_s, log_path)
        pid = proc.pid
    try:
        res = asyncio.run(_drive(opts, url, pid))
    finally:
        if proc is not None:
            res_rc = stop_server(proc)
    if proc is not None:
        res["server_exit_code"] = res_rc
        res["server_log"] = log_path
        res["kv_store"] = _startup_line(log_path, "KV store: ")  # what the server said it ran with
    res["url"], res["serve_args"] = url, opts.serve_args
    return res


def _startup_line(log_path: str, marker: str) -> str | None:
    try:
        for line in Path(log_path).read_text(errors="replace").splitlines():
            if marker in line:
                return line.split(marker, 1)[1].strip()
    except OSError:
        pass
    return None


def print_report(res: dict) -> None:
    rows = [("duration (s)", res["duration_s"]), ("concurrency", res["concurrency"]),
            ("requests", res["requests"]), ("served ok", res["served_ok"]),
            ("expected errors", res["expected_errors"]), ("unexpected errors", res["unexpected_errors"]),
            ("requests/s", res["requests_per_s"]),
            ("latency p50 / p99 (ms)", f"{res['latency_ms']['p50']} / {res['latency_ms']['p99']}"),
            ("TTFT p50 / p99 (ms)", f"{res['ttft_ms']['p50']} / {res['ttft_ms']['p99']}"),
            ("idle after", res["idle_after"]), ("KV store", res.get("kv_store"))]
    mem = res.get("memory_mib")
    if mem:
        for part in ("server_mib", "ray_workers_mib", "ray_daemons_mib", "total_mib"):
            rows.append((f"RSS {part[:-4]} start -> end (MiB)",
                         f"{mem['start'][part]} -> {mem['end'][part]} ({mem['growth'][part]:+})"))
    width = max(len(k) for k, _ in rows)
    print("\nsoak")
    print("-" * (width + 40))
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("\noutcomes:")
    for k, v in res["outcomes"].items():
        print(f"  {v:>7}  {k}")


# ---------------------------------------------------------------------------------------------
# `manta bench soak`


def add_soak_args(p) -> None:
    p.add_argument("--duration", type=float, default=600.0, help="soak: seconds of traffic after warm-up")
    p.add_argument("--concurrency", type=int, default=8,
                   help="soak: closed-loop clients; routing: conversations at once")
    p.add_argument("--warmup", type=float, default=10.0, help="soak: seconds of traffic before measuring")
    p.add_argument("--serve-arg", action="append", default=[], dest="serve_args",
                   help="soak: an argument for the `manta serve` it starts (repeat; e.g. --serve-arg=--replicas=2)")
    p.add_argument("--server-pid", type=int, default=None, help="with --url: the server's pid (soak: its memory; serve: its CPU per streamed token)")


def bench_soak(args) -> dict:
    """`manta bench soak`: `--output-len` is the longest answer asked for; `--url` a running
    server (loopback), else one is started with the `--serve-arg`s."""
    if args.url and not re.match(r"^https?://(127\.\d+\.\d+\.\d+|localhost|\[::1\])(:\d+)?(/|$)", args.url):
        raise SystemExit("manta bench soak: --url must be a loopback address (127.0.0.0/8, localhost, [::1])")
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    opts = SoakOptions(duration_s=args.duration, concurrency=args.concurrency, url=args.url,
                       server_pid=args.server_pid, serve_args=list(args.serve_args), max_tokens=args.output_len,
                       warmup_s=args.warmup, seed=0)
    res = run_soak(opts)
    print_report(res)
    return res
