"""On the GPU with CUDA graphs on: encoder-decoder greedy tokens equal transformers generate for
batches of 1, 8, 32 and 128 requests whose encoder lengths are all different, arriving together
and staggered (contract 4 under graph replay: every row's own encoder length, for any batch
size). float32 on the GPU gives the CPU's greedy tokens exactly (see test_gpu_engine.py).
Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from tests.fixtures import tiny_model_dir
from tests.test_encoder_decoder import INIT_STD, PROMPTS, assert_equal_to_hf, greedy, run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory, "bart", init_std=INIT_STD)


@pytest.mark.parametrize("page_size", [1, 16])
def test_gpu_cuda_graphs_equal_transformers(bart, page_size):
    engine = Engine(EngineConfig(model=str(bart), device="cuda", dtype="float32", page_size=page_size,
                                 max_running_requests=128))
    runner = engine.workers.runner
    assert runner.pipeline.graphs is not None, "CUDA graphs must be on"
    assert runner.pipeline.graphs.encoder_lens is not None
    replays: list[int] = []
    original = runner.pipeline.graphs.replay
    runner.pipeline.graphs.replay = lambda fb, o=original, r=replays: r.append(fb.batch_size) or o(fb)
    for batch in (1, 8, 32, 128):
        for stagger in (0, 3):
            replays.clear()
            assert_equal_to_hf(bart, PROMPTS[:batch], run(engine, PROMPTS[:batch], greedy(), stagger))
            assert replays, f"batch {batch}: decode steps must replay CUDA graphs"
    assert runner.req_to_token_pool.req_to_token[runner.pad_row].eq(0).all()


def test_gpu_eager_equals_transformers(bart):
    engine = Engine(EngineConfig(model=str(bart), device="cuda", dtype="float32", page_size=16,
                                 disable_cuda_graph=True, max_running_requests=128))
    assert_equal_to_hf(bart, PROMPTS, run(engine, PROMPTS, greedy(), stagger=5))
