"""End to end: Ray replicas × TP ranks behind the router and the HTTP server, driven by the real
`openai` client (`manta serve` itself as a process: tests/test_shutdown.py)."""

from __future__ import annotations

import asyncio
import os

import httpx
import openai
import pytest
import ray

from cluster.api.metrics import ServerMetrics
from cluster.api.server import BackgroundServer, build_app
from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from cluster.launch import ClusterOptions, ServingCluster
from cluster.router import RouterOptions
from tests.fixtures import tiny_model_dir
from workers.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NUM_REQUESTS = 64
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tiny_model_dir(tmp_path_factory, "llama")
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=8, num_gpus=0, include_dashboard=False, namespace="manta-e2e")
    metrics = ServerMetrics()
    cluster = ServingCluster(
        ClusterOptions(engine=EngineConfig(model=str(d), tp_size=2, page_size=4), replicas=2,
                       router=RouterOptions(policy="least_load", stats_interval_s=0.2)),
        metrics,
    )
    router = cluster.start()
    server = BackgroundServer(build_app(router, metrics))
    yield d, server, cluster
    server.stop()
    cluster.shutdown()
    ray.shutdown()


def test_64_concurrent_requests_equal_single_request_greedy(served):
    d, server, cluster = served
    prompts = [f"Request {i}: the answer to question {i * 7 % 13} is" for i in range(NUM_REQUESTS)]
    expected = Engine(EngineConfig(model=str(d))).generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    )

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)

        async def one(i: int) -> str:
            kw = dict(model=os.path.basename(str(d)), prompt=prompts[i], max_tokens=MAX_TOKENS, temperature=0,
                      extra_body={"ignore_eos": True})
            if i % 2:
                stream = await client.completions.create(stream=True, **kw)
                return "".join([c.choices[0].text async for c in stream if c.choices])
            return (await client.completions.create(**kw)).choices[0].text

        try:
            return await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))
        finally:
            await client.close()

    texts = asyncio.run(run())
    assert texts == [r.text for r in expected]
    metrics = httpx.get(f"{server.url}/metrics").text
    for replica in ("replica-0", "replica-1"):
        assert f'manta:router_requests_total{{policy="least_load",replica="{replica}"}}' in metrics
    assert "manta:time_to_first_token_seconds_bucket" in metrics
