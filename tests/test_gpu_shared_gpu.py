"""Replicas sharing one GPU (`--gpus-per-rank 0.5`): Ray places two replicas' ranks on a single
GPU (with whole GPUs the second could not be placed on a one-GPU machine) and both serve the
same greedy tokens as an in-process engine. Needs a GPU and Ray (the device recipe in shared/gpu)."""

from __future__ import annotations

import asyncio

import pytest
import torch

ray = pytest.importorskip("ray")

from cluster.api.metrics import ServerMetrics  # noqa: E402
from cluster.engine.config import EngineConfig  # noqa: E402
from cluster.engine.loop import Engine  # noqa: E402
from cluster.launch import ClusterOptions, ServingCluster  # noqa: E402
from cluster.router import RouterOptions  # noqa: E402
from tests.fixtures import tiny_model_dir  # noqa: E402
from tests.test_engine import PROMPTS, greedy  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def test_two_replicas_share_one_gpu(tmp_path_factory):
    d = tiny_model_dir(tmp_path_factory, "llama")
    cfg = EngineConfig(model=str(d), device="cuda", page_size=16, mem_fraction=0.5, gpus_per_rank=0.5)
    ref = Engine(EngineConfig(model=str(d), device="cuda", page_size=16, mem_fraction=0.2)).generate(PROMPTS, greedy())
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=4, num_gpus=1, include_dashboard=False, namespace="manta-shared-gpu")
    cluster = ServingCluster(ClusterOptions(engine=cfg, replicas=2, router=RouterOptions(policy="round_robin")),
                             ServerMetrics())
    try:
        router = cluster.start()  # two placement groups of half a GPU each, on the one GPU Ray has
        assert ray.available_resources().get("GPU", 0) == 0

        async def run():
            await router.start()
            outs = []
            for p in PROMPTS:
                outs.append([o async for o in router.generate_stream(p, greedy())])
            await router.aclose()
            return outs

        outs = asyncio.run(run())
        assert {o[-1].replica for o in outs} == {"replica-0", "replica-1"}
        assert [[t for o in out for t in o.delta_token_ids] for out in outs] == [r.token_ids for r in ref]
    finally:
        cluster.shutdown()
        ray.shutdown()
