"""A MIXED batch (decodes beside prefill chunks) attends through the split path — decodes by
the paged decode kernel, prefill pieces by the ragged kernel — and equals the unsplit path."""

from __future__ import annotations

import pytest

from attention.flash import FlashAttentionBackend
from attention.reference import TorchReferenceBackend
from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from tests.fixtures import tiny_model_dir
from tests.test_engine import PROMPTS, greedy, hf_greedy, run_staggered


@pytest.mark.parametrize("backend", ["flash", "reference"])
def test_mixed_steps_split_and_match_transformers(tmp_path_factory, backend):
    d = tiny_model_dir(tmp_path_factory, "llama")
    engine = Engine(EngineConfig(model=str(d), chunked_prefill_size=4, max_num_batched_tokens=9, page_size=4,
                                 attention_backend=backend))
    attn = engine.workers.runner.attn_backend
    assert isinstance(attn, (FlashAttentionBackend, TorchReferenceBackend))
    splits = []
    original = attn.init_forward_metadata

    def spy(fb, original=original, splits=splits):
        original(fb)
        splits.append(attn.mixed is not None)

    attn.init_forward_metadata = spy
    results = run_staggered(engine, PROMPTS, greedy())
    assert any(splits), "the workload must contain MIXED steps"
    for prompt, res in zip(PROMPTS, results):
        assert res.token_ids == hf_greedy(d, engine.tokenize(prompt), len(res.token_ids))


@pytest.mark.parametrize("arch", ["llama", "deepseek_v2"])  # paged MHA/GQA and MLA decode graphs
@pytest.mark.parametrize("overlap", [True, False])
def test_mixed_steps_as_a_decode_graph_and_a_prefill_match_transformers(tmp_path_factory, arch, overlap):
    """A MIXED step's one-token rows through the decode graph path (static buffers, run eagerly
    here), its prompt pieces as a second forward: greedy tokens equal transformers', with
    continued chunks, last pieces sampled and one-token pieces among the decode rows."""
    d = tiny_model_dir(tmp_path_factory, arch)
    engine = Engine(EngineConfig(model=str(d), chunked_prefill_size=4, max_num_batched_tokens=9, page_size=4,
                                 max_running_requests=16, disable_overlap_schedule=not overlap))
    runner = engine.workers.runner
    runner.pipeline.use_graphs(16, runner.pad_row, batch_sizes=(1, 2, 4, 8, 16), capture=False)
    split = []
    original = runner.pipeline.forward_mixed

    def spy(decodes, prompts, original=original, split=split):
        split.append((len(decodes.reqs), [len(r.input_ids) for r in prompts.reqs]))
        return original(decodes, prompts)

    runner.pipeline.forward_mixed = spy
    results = run_staggered(engine, PROMPTS, greedy())
    assert len(split) >= 3 and all(n >= 1 and all(k > 1 for k in p) for n, p in split), split
    for prompt, res in zip(PROMPTS, results):
        assert res.token_ids == hf_greedy(d, engine.tokenize(prompt), len(res.token_ids))
