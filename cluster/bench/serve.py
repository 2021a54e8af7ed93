"""Serving benchmark: requests arrive by a Poisson process; TTFT, TPOT, ITL and throughput.

Two targets: a running HTTP server (`--url`, OpenAI streaming completions), or the in-process
engine loop with the same arrival process (`--in-process`, for machines without the server's
dependencies). Also the `transformers` continuous-batching baseline for the offline workload.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time
from dataclasses import dataclass, field

from cluster.engine.step_times import step_summary


@dataclass
class RequestTiming:
    """One request as the client saw it: when each token arrived (tokens that came in one
    streamed chunk share its time) and when each chunk with tokens arrived."""

    start: float
    token_times: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None  # the kind: "HTTP 503", "stream error: ...", an exception's name

    def add(self, now: float, n_tokens: int) -> None:
        if n_tokens > 0:
            self.token_times += [now] * n_tokens
            self.chunk_times.append(now)
            self.tokens += n_tokens

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def tpot(self) -> float | None:
        if self.tokens < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.tokens - 1)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summarize(timings: list[RequestTiming], wall: float) -> dict:
    """Throughput and latency over the requests that succeeded; errors counted by kind.
    itl: between consecutive tokens (0 within one chunk); chunk_gap: between consecutive
    streamed chunks that carried tokens (what a reader of the stream waits)."""
    ok = [t for t in timings if t.error is None and t.token_times]
    itl = [b - a for t in ok for a, b in zip(t.token_times, t.token_times[1:])]
    gaps = [b - a for t in ok for a, b in zip(t.chunk_times, t.chunk_times[1:])]
    tpots = [t.tpot for t in ok if t.tpot is not None]
    ttfts = [t.ttft for t in ok]
    out_tokens = sum(t.tokens for t in ok)
    errors: dict[str, int] = {}
    for t in timings:
        if t.error is not None or not t.token_times:
            kind = t.error or "no tokens"
            errors[kind] = errors.get(kind, 0) + 1
    res = {"requests": len(timings), "errors": len(timings) - len(ok), "errors_by_kind": errors, "seconds": wall,
           "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / wall,
           "request_rate_achieved": len(ok) / wall}
    for name, xs in (("ttft_ms", ttfts), ("tpot_ms", tpots), ("itl_ms", itl), ("chunk_gap_ms", gaps)):
        res[f"{name}_mean"] = 1e3 * statistics.mean(xs) if xs else float("nan")
        res[f"{name}_p50"] = 1e3 * percentile(xs, 0.5)
        res[f"{name}_p99"] = 1e3 * percentile(xs, 0.99)
    # The first gap apart (first to second token: under prefill/decode disaggregation, the KV
    # hand-off; otherwise a step like the rest) and the gaps after it.
    second = [t.token_times[1] - t.token_times[0] for t in ok if len(t.token_times) > 1]
    later = [b - a for t in ok for a, b in zip(t.token_times[1:], t.token_times[2:])]
    res["second_token_ms_p50"] = 1e3 * percentile(second, 0.5)
    res["second_token_ms_p99"] = 1e3 * percentile(second, 0.99)
    res["itl_after_second_ms_p99"] = 1e3 * percentile(later, 0.99)
    return res


def summarize_steps(trace: list[tuple[float, float, str, int, int]]) -> dict:
    """Where the engine's time went: per kind of step (DECODE by batch size, MIXED/EXTEND by
    prefill tokens), how many, and the mean time from the previous completion (or from the
    step call's start, after an idle wait) to this one: under overlapped scheduling about the
    step's device time."""
    groups: dict[str, list[float]] = {}
    for (_, t_prev, *_), (start, t, mode, reqs, tokens) in zip(trace, trace[1:]):
        if mode == "DECODE":
            key = f"DECODE batch {'<=32' if reqs <= 32 else '33-128' if reqs <= 128 else '>128'}"
        else:
            prompt = tokens - reqs  # about: each decode row is one token
            bound = next((b for b in (256, 512, 1024, 2048) if prompt <= b), None)
            key = f"{mode} {f'<={bound}' if bound else '>2048'} prefill tokens"
        groups.setdefault(key, []).append(t - max(t_prev, start))
    return {k: {"steps": len(v), "mean_ms": 1e3 * statistics.mean(v), "p99_ms": 1e3 * percentile(v, 0.99),
                "total_s": sum(v)} for k, v in sorted(groups.items())}


async def _arrivals(n: int, rate: float, seed: int):
    rng = random.Random(seed)
    for i in range(n):
        yield i
        if rate > 0:
            await asyncio.sleep(rng.expovariate(rate))


async def run_in_process(engine, prompts: list[list[int]], output_len: int, rate: float, seed: int = 0) -> dict:
    from workers.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.start()

    async def one(i: int) -> RequestTiming:
        t = RequestTiming(time.perf_counter())
        async for out in engine.generate_stream(prompts[i], params):
            t.add(time.perf_counter(), len(out.delta_token_ids))
            if out.error:
                t.error = out.error
        return t

    t0 = time.perf_counter()
    engine.step_trace = []
    tasks = [asyncio.create_task(one(i)) async for i in _arrivals(len(prompts), rate, seed)]
    timings = await asyncio.gather(*tasks)
    res = summarize(list(timings), time.perf_counter() - t0)
    trace, engine.step_trace = engine.step_trace, None
    res["steps"] = summarize_steps(trace)
    if engine.scheduler.step_budget is not None:  # --itl-target-ms: what the budget learned and capped
        res["step_budget"] = engine.scheduler.step_budget.stats()
    return res


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) the process `pid` has used (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class BenchFailed(RuntimeError):
    """The benchmark could not run (its server is not there, or refused the warm-up)."""


async def run_http(url: str, model: str, prompts: list[list[int]], output_len: int, rate: float,
                   seed: int = 0, api_key: str = "none", warmup: list[list[int]] = (),
                   server_pid: int | None = None) -> dict:
    """Streamed /v1/completions against a running server, from an aiohttp client (its per-chunk
    cost is a fraction of httpx's: with 200 streams the client's own event loop would otherwise
    add tens of ms to the latencies it measures). Tokens are counted from the usage the server
    reports: on every chunk where it supports vLLM's `continuous_usage_stats` (manta, vLLM),
    else once at the end (`include_usage`), the chunks' tokens then being spread one per chunk
    with the rest on the last. Never from text: a byte-level token may decode to nothing until
    its character completes. `warmup`: prompts sent first (4 tokens each, untimed), as the
    in-process run warms its engine: a server's first requests pay its kernels' compiles.
    `server_pid` (the HTTP server's process, on this host): its CPU time over the timed run, per
    streamed token: the server's one event loop formats and sends every token of every stream."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(base_url=url, connector=connector, timeout=timeout,
                                     headers={"Authorization": f"Bearer {api_key}"}) as session:
        async def one(i: int, prompt: list[int] | None = None, max_tokens: int = output_len) -> RequestTiming:
            t = RequestTiming(time.perf_counter())
            body = {"model": model, "prompt": prompts[i] if prompt is None else prompt, "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            counted, chunks_without_usage = 0, []
            try:
                async with session.post("/v1/completions", json=body) as resp:
                    if resp.status != 200:
                        t.error = f"HTTP {resp.status}"
                        return t
                    async for raw in resp.content:
                        if not raw.startswith(b"data: ") or raw.startswith(b"data: [DONE]"):
                            continue
                        now = time.perf_counter()
                        chunk = json.loads(raw[6:])
                        if "error" in chunk:
                            t.error = f"stream error: {chunk['error'].get('type', 'unknown')}"
                            continue
                        usage = chunk.get("usage")
                        if usage is not None:
                            total = usage.get("completion_tokens", 0)
                            if chunks_without_usage:  # the final usage of a server without per-chunk usage
                                per = [1] * len(chunks_without_usage)
                                per[-1] += max(0, total - counted - len(per))
                                for when, n in zip(chunks_without_usage, per):
                                    t.add(when, n)
                                chunks_without_usage, counted = [], total
                            t.add(now, total - counted)
                            counted = max(counted, total)
                        elif chunk.get("choices") and (chunk["choices"][0].get("text")
                                                       or chunk["choices"][0].get("finish_reason")):
                            chunks_without_usage.append(now)
            except (aiohttp.ClientError, TimeoutError) as exc:
                t.error = type(exc).__name__
            return t

        warm = await asyncio.gather(*(one(-1, p, 4) for p in warmup))
        if any(w.error for w in warm):
            raise BenchFailed(f"the warm-up requests to {url} failed ({', '.join(sorted({w.error for w in warm if w.error}))}): "
                              "is a server there, serving this model?")
        replicas0 = await _replica_stats(session)  # (after the warm-up's steps were polled)
        t0, cpu0 = time.perf_counter(), process_cpu_s(server_pid) if server_pid else None
        tasks = [asyncio.create_task(one(i)) async for i in _arrivals(len(prompts), rate, seed)]
        timings = await asyncio.gather(*tasks)
        res = summarize(list(timings), time.perf_counter() - t0)
        if cpu0 is not None:
            cpu = process_cpu_s(server_pid) - cpu0
            res["server_cpu_s"] = cpu
            res["server_cpu_us_per_token"] = 1e6 * cpu / max(1, res["output_tokens"])
        replicas1 = await _replica_stats(session) if replicas0 else {}
        for name, st in replicas1.items():  # the replicas' steps over the timed run, by mode
            res.setdefault("replica_steps", {})[name] = step_summary(
                st.get("steps") or {}, (replicas0.get(name) or {}).get("steps"))
            if st.get("step_budget"):  # its plan counters over the run, the rest as it ends
                before = (replicas0.get(name) or {}).get("step_budget") or {}
                res.setdefault("replica_step_budget", {})[name] = {
                    **st["step_budget"], **{k: st["step_budget"][k] - before.get(k, 0)
                                            for k in ("capped_steps", "relaxed_steps") if k in st["step_budget"]}}
        return res


# The router polls its replicas' stats every 0.5 s (RouterOptions.stats_interval_s) and
# /admin/replicas answers its last poll: wait two polls for one taken after what came before.
STATS_SETTLE_S = 1.0


async def _replica_stats(session) -> dict[str, dict]:
    """Each replica's stats from the server's GET /admin/replicas, once the router has polled
    them afresh ({} from a server without it: another system, or one that refuses)."""
    await asyncio.sleep(STATS_SETTLE_S)
    try:
        async with session.get("/admin/replicas") as resp:
            if resp.status != 200:
                return {}
            body = await resp.json()
    except Exception:  # noqa: BLE001 - optional: the benchmark's figures do not depend on it
        return {}
    return {r["name"]: r.get("stats") or {} for r in body.get("replicas", []) if "name" in r}


def run_transformers_offline(model_dir: str, prompts: list[list[int]], output_len: int, device: str,
                             dtype: str | None) -> dict:
    """The same offline workload through transformers' continuous batching (generate_batch)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch_dtype = getattr(torch, dtype) if dtype else "auto"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()
    gen = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate_batch(inputs=prompts[:2], generation_config=gen)  # warm-up
    t0 = time.perf_counter()
    outputs = model.generate_batch(inputs=prompts, generation_config=gen)
    dt = time.perf_counter() - t0
    tokens = sum(len(o.generated_tokens) for o in outputs.values())
    del model
    return {"seconds": dt, "output_tokens": tokens, "output_tokens_per_s": tokens / dt}
