"""On the GPU: the engine (Triton decode, varlen prefill, CUDA graphs) against the CPU path on
the same tiny checkpoints. Skipped without CUDA.

Tolerances: float32 on the GPU gives the CPU's greedy tokens exactly; bfloat16 logits of the
first step stay within 5% of the largest |logit| of float32 (bf16 keeps 8 mantissa bits, and
two bf16 layers compound their rounding)."""

from __future__ import annotations

import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from tests.fixtures import tiny_model_dir
from tests.test_engine import PROMPTS, greedy, run_staggered

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return {a: tiny_model_dir(tmp_path_factory, a) for a in ("llama", "qwen3", "deepseek_v2", "deepseek_v3")}


def cpu_tokens(d, **kw):
    return [r.token_ids for r in run_staggered(Engine(EngineConfig(model=str(d), **kw)), PROMPTS, greedy())]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graph", "eager"])
def test_gpu_greedy_equals_cpu(dirs, arch, page_size, graphs):
    d = dirs[arch]
    want = cpu_tokens(d, page_size=page_size)
    engine = Engine(EngineConfig(model=str(d), device="cuda", dtype="float32", page_size=page_size,
                                 disable_cuda_graph=not graphs, max_running_requests=32))
    runner = engine.workers.runner
    assert (runner.pipeline.graphs is not None) == graphs
    assert (runner.pipeline.prompt_graphs is not None) == graphs
    replays, mixed, prompts = [], [], []
    if graphs:
        original = runner.pipeline.graphs.replay
        runner.pipeline.graphs.replay = lambda fb, o=original, r=replays: r.append(fb.batch_size) or o(fb)
        split = runner.pipeline.forward_mixed
        runner.pipeline.forward_mixed = lambda d, p, o=split, m=mixed: m.append(len(d.reqs)) or o(d, p)
        pg = runner.pipeline.prompt_graphs.replay
        runner.pipeline.prompt_graphs.replay = lambda fb, o=pg, r=prompts: r.append(fb.num_tokens) or o(fb)
    got = [r.token_ids for r in run_staggered(engine, PROMPTS, greedy())]
    assert got == want
    assert not graphs or replays, "decode steps must replay CUDA graphs"
    assert not graphs or mixed, "MIXED steps must run their decode rows through the graphs"
    assert not graphs or prompts, "prompt pieces must run through the piecewise graphs"


@pytest.mark.parametrize("arch", ["llama", "deepseek_v2"])
def test_gpu_long_prompts_through_prompt_graphs_equal_cpu(dirs, arch):
    """Prompts of 150-480 tokens (no shared prefix; the tiny models' context is 512), in steps of
    up to 1,024 prompt tokens: pieces of the larger buckets (256-1,024 tokens, padded) replay
    their graphs; greedy tokens equal the CPU's."""
    prompts = [[(i * 97 + j * 31) % 500 + 3 for j in range(n)] for i, n in enumerate((150, 300, 480, 200))]
    cpu = Engine(EngineConfig(model=str(dirs[arch]), page_size=16))
    want = [r.token_ids for r in cpu.generate(prompts, greedy(8))]
    engine = Engine(EngineConfig(model=str(dirs[arch]), device="cuda", dtype="float32", page_size=16,
                                 max_num_batched_tokens=1024, chunked_prefill_size=1024))
    pg = engine.workers.runner.pipeline.prompt_graphs
    sizes = []
    replay = pg.replay
    pg.replay = lambda fb, o=replay, r=sizes: r.append(fb.num_tokens) or o(fb)
    assert [r.token_ids for r in engine.generate(prompts, greedy(8))] == want
    assert max(sizes) > 256, sizes


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_gpu_mla_greedy_equals_cpu(dirs, arch):
    d = dirs[arch]
    want = cpu_tokens(d, page_size=4)
    engine = Engine(EngineConfig(model=str(d), device="cuda", dtype="float32", page_size=4))
    pipeline = engine.workers.runner.pipeline
    assert pipeline.graphs is not None  # MLA decode (and the fused MoE) in graphs
    prompts = []
    pg = pipeline.prompt_graphs.replay
    pipeline.prompt_graphs.replay = lambda fb, o=pg, r=prompts: r.append(fb.num_tokens) or o(fb)
    assert [r.token_ids for r in run_staggered(engine, PROMPTS, greedy())] == want
    assert prompts, "MLA prompt pieces must run through the piecewise graphs"


def test_bf16_logits_close_to_fp32(dirs):
    d = dirs["llama"]
    logits = {}
    for dtype in ("float32", "bfloat16"):
        engine = Engine(EngineConfig(model=str(d), device="cuda", dtype=dtype, disable_cuda_graph=True))
        runner = engine.workers.runner
        captured = []
        original = runner.model.compute_logits
        runner.model.compute_logits = lambda h, o=original, c=captured: c.append(o(h)) or c[-1]
        engine.generate(PROMPTS[:3], greedy(1))
        logits[dtype] = captured[0].float().cpu()
    scale = logits["float32"].abs().max().item()
    assert (logits["bfloat16"] - logits["float32"]).abs().max().item() < 0.05 * scale
