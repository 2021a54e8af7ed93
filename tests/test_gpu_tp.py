"""Tensor parallelism over NCCL on two GPUs (torch multiprocessing ranks, the same rank code as
the Ray actors): greedy tokens equal TP=1, with CUDA graphs on. Skipped without 2 GPUs."""

from __future__ import annotations

import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from tests.fixtures import tiny_model_dir
from tests.test_engine import PROMPTS, greedy, run_staggered

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


@pytest.mark.parametrize("arch,kw", [("llama", {}), ("llama", {"kv_heads": 1}), ("deepseek_v2", {})])
def test_nccl_tp2_equals_tp1(tmp_path_factory, arch, kw):
    d = tiny_model_dir(tmp_path_factory, arch, **kw)
    common = dict(model=str(d), device="cuda", dtype="float32", page_size=4, max_running_requests=16)
    tp1 = Engine(EngineConfig(**common))
    want = [r.token_ids for r in run_staggered(tp1, PROMPTS, greedy())]
    tp1.shutdown()
    del tp1
    tp2 = Engine(EngineConfig(tp_size=2, **common))
    try:
        got = [r.token_ids for r in run_staggered(tp2, PROMPTS, greedy())]
    finally:
        tp2.shutdown()
    assert got == want
