"""What `manta bench latency`'s roofline counts as read per decode step (workers/roofline.py):
every weight once, except the rows of an input embedding table that a step does not look up
(a table tied to the LM head is read whole) and the routed experts no token selects."""

from __future__ import annotations

import pytest

from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from tests.fixtures import tiny_model_dir
from workers.roofline import step_weight_bytes, weight_bytes


def _model(tmp_path_factory, arch, **kw):
    return Engine(EngineConfig(model=str(tiny_model_dir(tmp_path_factory, arch, **kw)))).workers.runner.model


@pytest.mark.parametrize("tied", [False, True])
def test_llama_reads_its_embedding_rows_not_the_table(tmp_path_factory, tied):
    model = _model(tmp_path_factory, "llama", tie_word_embeddings=tied)
    table = model.model.embed_tokens.weight
    row = table[0].numel() * table.element_size()
    total = weight_bytes(model)
    for batch in (1, 7):
        want = total if tied else total - table.numel() * table.element_size() + batch * row
        assert step_weight_bytes(model, batch) == want


def test_moe_reads_the_experts_its_tokens_select(tmp_path_factory):
    from workers.models.deepseek_moe import DeepseekMoE

    model = _model(tmp_path_factory, "deepseek_v2")
    moes = [m for m in model.modules() if isinstance(m, DeepseekMoE)]
    assert moes
    experts = sum(p.numel() * p.element_size() for m in moes for p in m.experts.parameters())
    table = model.model.embed_tokens.weight
    dense = weight_bytes(model) - experts - table.numel() * table.element_size()
    e, k = moes[0].gate.num_experts, moes[0].gate.top_k
    row = table[0].numel() * table.element_size()
    for batch in (1, 4):
        touched = e * (1 - (1 - k / e) ** batch)
        assert step_weight_bytes(model, batch) == pytest.approx(dense + batch * row + experts * touched / e, abs=64)
    # Enough tokens select every expert: all of them are read.
    big = step_weight_bytes(model, 10_000)
    assert big == pytest.approx(dense + min(10_000, table.shape[0]) * row + experts, rel=1e-6)


def test_latency_sees_whole_batch_steps_when_prompts_outlast_the_steps(tmp_path_factory):
    """`manta bench latency` at a batch whose prompts take more chunked steps than it times (the
    first requests decode beside the later chunks): with only `steps` tokens each, the first
    would end before the last were prefilled and no step would hold the whole batch (the GPU
    run at batches 128 and 192 failed so). It times whole-batch steps and stops after them."""
    from cluster.bench.command import bench_latency

    d = tiny_model_dir(tmp_path_factory, "llama")
    engine = Engine(EngineConfig(model=str(d), chunked_prefill_size=32, max_num_batched_tokens=32))
    try:
        res = bench_latency(engine, [12], input_len=40, steps=4)
        assert res["12"]["step_ms_p50"] > 0 and res["12"]["fraction_of_roofline"] > 0
        assert not engine.has_work()  # the requests that outlived the timing were ended
    finally:
        engine.shutdown()
