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
