"""The serving path of `manta serve` itself (embedded default: local Ray, one replica, the KV
store on), as a user runs it: a burst of 256 concurrent streams through the real HTTP server
and Ray, the messages that path exchanged per engine step, and what the idle cluster costs."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest
import ray

from tests.serve_process import ServeProcess, cpu_seconds

pytestmark = pytest.mark.slow

STREAMS = 256
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    if ray.is_initialized():
        ray.shutdown()
    log_dir = tmp_path_factory.mktemp("serve")
    proc = ServeProcess(log_dir / "cache")
    proc.log_dir = log_dir
    time.sleep(2.0)  # the router's first stats polls
    proc.fresh_metrics = httpx.get(f"{proc.url}/metrics").text  # before any request
    yield proc
    proc.stop()


def test_a_fresh_server_exports_every_series_the_dashboard_queries(served):
    """Before its first request, the server exports every metric a Grafana panel queries, at 0,
    so no panel says "no data" (the KV store is on in the embedded default)."""
    from tests.test_deploy import _dashboard, dashboard_metrics, exported_names

    exported = exported_names(served.fresh_metrics)
    missing = sorted(set(dashboard_metrics(_dashboard())) - exported)
    assert not missing, missing
    assert 'manta:request_errors_total{code="500"} 0.0' in served.fresh_metrics
    assert 'manta:request_finished_total{finish_reason="error",replica="replica-0"} 0.0' in served.fresh_metrics


def _counter(text: str, name: str) -> float:
    values = [float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M)]
    assert values, f"{name} is not exported"
    return sum(values)


def test_256_concurrent_streams_and_messages_per_step(served):
    async def run() -> list[tuple[str, int, str | None]]:
        client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=300)
        model = (await client.models.list()).data[0].id

        async def one(i: int) -> tuple[str, int, str | None]:
            stream = await client.completions.create(
                model=model, prompt=f"stream {i}: the river and the mountain", max_tokens=MAX_TOKENS,
                temperature=1.0, seed=i, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            text, usage, reason = "", 0, None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    reason = chunk.choices[0].finish_reason or reason
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
            return text, usage, reason

        try:
            return await asyncio.gather(*(one(i) for i in range(STREAMS)))
        finally:
            await client.close()

    before = httpx.get(f"{served.url}/metrics").text
    results = asyncio.run(run())
    assert len(results) == STREAMS
    assert all(usage == MAX_TOKENS and reason == "length" for _, usage, reason in results), results[:3]
    time.sleep(1.5)  # the router polls the replica's counters every 0.5 s
    after = httpx.get(f"{served.url}/metrics").text
    delta = {k: _counter(after, f"manta:replica_{k}_total") - _counter(before, f"manta:replica_{k}_total")
             for k in ("submit_messages", "admitted_requests", "output_messages", "output_steps")}
    assert delta["admitted_requests"] == STREAMS, delta
    # Out: at most one message per engine step that produced outputs, whatever the batch.
    assert 0 < delta["output_messages"] <= delta["output_steps"], delta
    assert delta["output_messages"] < STREAMS * MAX_TOKENS / 8, delta
    # In: admissions travel batched (a burst of 256 needs far fewer calls than requests).
    assert delta["submit_messages"] <= STREAMS / 4, delta
    assert _counter(after, "manta:request_errors_total") == _counter(before, "manta:request_errors_total")


def _stage_sums(text: str, stage: str) -> tuple[float, float]:
    """(count, sum) of manta:request_queue_time_seconds for one stage over the replicas."""
    def total(suffix: str) -> float:
        return sum(float(v) for v in re.findall(
            rf'^manta:request_queue_time_seconds_{suffix}{{[^}}]*stage="{stage}"[^}}]*}} (\S+)$', text, re.M))

    return total("count"), total("sum")


def test_the_serving_paths_hops_split_at_the_transport(served):
    """After the 256 streams: each hop of the serving path (to the engine, from it) is split
    into the server's part and the transport's, for every request, and the parts add up."""
    text = httpx.get(f"{served.url}/metrics").text
    for hop in ("to_engine", "from_engine"):
        count, total = _stage_sums(text, hop)
        assert count >= STREAMS, (hop, count)
        parts = [_stage_sums(text, f"{hop}_{part}") for part in ("server", "transit")]
        assert [n for n, _ in parts] == [count, count], (hop, count, parts)
        assert all(t > 0 for _, t in parts), (hop, parts)
        assert abs(sum(t for _, t in parts) - total) <= 1e-3 * count + 0.01 * total, (hop, total, parts)


def test_bench_serve_reports_the_replicas_steps_over_its_run(served):
    """`manta bench serve --url` against `manta serve`: each replica's engine steps over the timed
    run only (from /admin/replicas before and after, the warm-up left out), by mode: 6 streams of
    9 tokens take at least 8 decode steps after their prompts, fewer than one step per token."""
    from cluster.bench.serve import run_http

    model = httpx.get(f"{served.url}/v1/models").json()["data"][0]["id"]
    prompts = [[11 + i, 40, 41, 42, 43] for i in range(6)]
    res = asyncio.run(run_http(served.url, model, prompts, 9, rate=100.0, warmup=prompts[:2]))
    assert res["errors"] == 0
    steps = res["replica_steps"]["replica-0"]
    assert 8 <= steps["DECODE"]["steps"] < 6 * 9
    assert sum(m["steps"] for m in steps.values()) >= 9
    for m in steps.values():
        assert 0 < m["mean_ms"] <= m["max_ms"] and m["p50_ms_under"] <= m["p99_ms_under"]
        # its steps over 40 ms in the run (if any: a CPU step of the tiny model rarely is one)
        assert len(m["slow"]) <= m["over_40ms"] and all(40 < x["ms"] <= m["max_ms"] for x in m["slow"])


def test_idle_cluster_uses_no_cpu(served):
    """After the load above: every manta process (server, replica, rank, KV store) averages
    under 5% of one core over 30 s."""
    pids = served.manta_pids()
    assert {k.split("-")[0] for k in pids} >= {"server", "Replica", "RankWorker", "KVStore"}, pids
    time.sleep(3)  # let the last streams' bookkeeping settle
    start = {k: cpu_seconds(p) for k, p in pids.items()}
    t0 = time.monotonic()
    time.sleep(30)
    wall = time.monotonic() - t0
    usage = {k: (cpu_seconds(p) - start[k]) / wall for k, p in pids.items()}
    print({k: f"{100 * u:.1f}%" for k, u in usage.items()})
    assert all(u < 0.05 for u in usage.values()), usage


def test_large_n_does_not_starve_single_requests(served):
    """4 requests with n=64 (256 sequences: every running slot of the replica) and then 32
    single requests: the singles get slots within a step or two (fair share), so their TTFT
    stays under 5 s on the CPU machine while the big ones run, and everything finishes."""
    async def run() -> tuple[list, list[float]]:
        client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=600)
        model = (await client.models.list()).data[0].id

        async def big(i: int):
            r = await client.completions.create(model=model, prompt=f"big {i}: the river", n=64, max_tokens=200,
                                                temperature=1.0, seed=i, extra_body={"ignore_eos": True})
            return [c.finish_reason for c in r.choices]

        async def single(i: int) -> float:
            t0 = time.perf_counter()
            stream = await client.completions.create(model=model, prompt=f"single {i}: the city", max_tokens=16,
                                                     stream=True, extra_body={"ignore_eos": True})
            ttft = None
            async for chunk in stream:
                if ttft is None and chunk.choices and chunk.choices[0].text:
                    ttft = time.perf_counter() - t0
            return ttft if ttft is not None else float("inf")

        try:
            bigs = [asyncio.create_task(big(i)) for i in range(4)]
            await asyncio.sleep(3.0)  # the 256 sequences hold every running slot
            ttfts = await asyncio.gather(*(single(i) for i in range(32)))
            return await asyncio.gather(*bigs), list(ttfts)
        finally:
            await client.close()

    bigs, ttfts = asyncio.run(run())
    assert all(reasons == ["length"] * 64 for reasons in bigs)
    p50 = sorted(ttfts)[len(ttfts) // 2]
    print(f"single requests beside n=64 ones: TTFT p50 {p50:.2f} s, max {max(ttfts):.2f} s")
    assert p50 < 5.0, ttfts


def _histogram_quantile(text: str, name: str, q: float) -> float:
    """Prometheus' histogram_quantile over every label set of `name` (linear within a bucket)."""
    buckets: dict[float, float] = {}
    for le, v in re.findall(rf'^{name}_bucket{{le="([^"]+)",[^}}]*}} (\S+)$', text, re.M):
        buckets[float(le)] = buckets.get(float(le), 0.0) + float(v)
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    rank, prev_b, prev_c = q * total, 0.0, 0.0
    for b in bounds:
        if buckets[b] >= rank:
            return prev_b + (b - prev_b) * (rank - prev_c) / max(buckets[b] - prev_c, 1e-9)
        prev_b, prev_c = b, buckets[b]
    return bounds[-1]


def test_server_ttft_is_what_clients_see(served):
    """A burst of 500 requests at once: the server's TTFT histogram (measured from the moment
    the HTTP server received each request) agrees with the clients' own TTFT within 10% at p50."""
    from tests.serve_process import ServeProcess

    fresh = ServeProcess(served.log_dir / "burst-cache", "--max-running-requests", "64")
    try:
        async def run() -> list[float]:
            async def one(i: int) -> float:
                # A bare HTTP/1.1 client: its own overhead stays out of the measured TTFT.
                body = json.dumps({"prompt": f"burst {i}: the river", "max_tokens": 4, "stream": True,
                                   "ignore_eos": True}).encode()
                reader, writer = await asyncio.open_connection("127.0.0.1", fresh.port)
                t0 = time.perf_counter()
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                try:
                    async for line in reader:
                        if line.startswith(b"data: {") and b'"text"' in line:
                            return time.perf_counter() - t0
                    return float("inf")
                finally:
                    writer.close()

            return await asyncio.gather(*(one(i) for i in range(500)))

        client = sorted(asyncio.run(run()))
        server = _histogram_quantile(httpx.get(f"{fresh.url}/metrics").text, "manta:time_to_first_token_seconds", 0.5)
    finally:
        fresh.stop()
    c50 = client[len(client) // 2]
    print(f"burst of 500: client TTFT p50 {c50:.2f} s, server's histogram p50 {server:.2f} s")
    assert c50 > 0.3  # a real queue formed (unqueued, a first token takes tens of ms here)
    # The server's clock starts when the request's bytes reached the kernel and stops before the
    # client reads the token, so it can only be below the client's, by the client's own loop lag
    # over 500 sockets (and above by the histogram's interpolation within a bucket).
    assert 0.85 * c50 <= server <= 1.1 * c50, (server, c50)
