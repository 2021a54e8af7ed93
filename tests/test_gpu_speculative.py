"""On the GPU with CUDA graphs on: speculative decoding gives the same greedy tokens as plain
decoding (float32, where the GPU gives the CPU's tokens exactly), with a draft that agrees (a
copy of the target) and one that does not; the draft's decode steps and the ragged forwards
(TARGET_VERIFY, DRAFT_EXTEND_V2 as one decode row per token) replay captured graphs. Skipped
without CUDA."""

from __future__ import annotations

import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from tests.fixtures import tiny_model_dir
from tests.test_engine import PROMPTS, greedy, run_staggered
from workers.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return {"target": tiny_model_dir(tmp_path_factory, "llama"),
            "other": tiny_model_dir(tmp_path_factory, "llama", seed=1)}


def _config(dirs, **kw) -> EngineConfig:
    return EngineConfig(model=str(dirs["target"]), device="cuda", dtype="float32", page_size=16,
                        max_running_requests=32, **kw)


@pytest.mark.parametrize("draft", ["target", "other"])
def test_spec_greedy_equals_plain_with_cuda_graphs(dirs, draft):
    want = [r.token_ids for r in run_staggered(Engine(_config(dirs)), PROMPTS, greedy())]
    engine = Engine(_config(dirs, speculative_draft_model=str(dirs[draft]), speculative_num_tokens=3))
    runner = engine.workers.runner
    assert runner.pipeline.graphs is not None and runner.drafter.pipeline.graphs is not None
    replays = {"target": 0, "draft": 0}
    for name, gr in (("target", runner.pipeline.graphs), ("draft", runner.drafter.pipeline.graphs)):
        original = gr.replay

        def spy(fb, original=original, name=name):
            replays[name] += 1
            return original(fb)

        gr.replay = spy
    got = [r.token_ids for r in run_staggered(engine, PROMPTS, greedy())]
    assert got == want
    assert replays["target"] > 0 and replays["draft"] > 0
    st = engine.scheduler.stats
    if draft == "target":
        assert st.spec_accepted_tokens == st.spec_draft_tokens > 0
    sampled = engine.generate(PROMPTS[:2], SamplingParams(max_tokens=8, temperature=0.8, seed=1, ignore_eos=True))
    assert all(len(r.token_ids) == 8 for r in sampled)
    engine.scheduler.check_integrity()
