"""The CUDA-graph replay path (static buffers, padding to a captured batch size, metadata copied
by the one builder) run eagerly on CPU: its tokens equal the plain eager path's."""

from __future__ import annotations

import pytest
import torch

from attention.metadata import build_attention_metadata
from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from tests.fixtures import tiny_model_dir
from tests.test_engine import PROMPTS, greedy, run_staggered
from workers.forward_batch import ForwardBatch, ForwardMode
from workers.memory_pool import ReqToTokenPool


@pytest.mark.parametrize("arch", ["llama", "deepseek_v2"])  # paged MHA/GQA and MLA decode
@pytest.mark.parametrize("overlap", [True, False])
def test_static_buffer_replay_equals_eager(tmp_path_factory, arch, overlap):
    """Decode batches staged straight into the graphs' static inputs (the request-table write,
    the overlapped-scheduling placeholders and the metadata all done by the graph's own
    preparation) give the eager path's tokens, at page sizes 1, 4 and 16."""
    d = tiny_model_dir(tmp_path_factory, arch)
    for page_size in (1, 4, 16):
        cfg = EngineConfig(model=str(d), page_size=page_size, max_running_requests=16,
                           disable_overlap_schedule=not overlap)
        eager = run_staggered(Engine(cfg), PROMPTS, greedy())
        engine = Engine(cfg)
        runner = engine.workers.runner
        gr = runner.pipeline.use_graphs(16, runner.pad_row, batch_sizes=(1, 2, 4, 8), capture=False)
        assert gr.metadata_in_graph
        inputs = runner.pipeline.inputs
        replayed, staged = [], []
        original_replay, original_stage = gr.replay, inputs.stage_decode

        def replay_spy(fb, original=original_replay, replayed=replayed):
            replayed.append(fb.batch_size)
            return original(fb)

        def stage_spy(plan, original=original_stage, staged=staged):
            staged.append(len(plan.reqs))
            return original(plan)

        gr.replay, inputs.stage_decode = replay_spy, stage_spy
        via_graph_path = run_staggered(engine, PROMPTS, greedy())
        assert [r.token_ids for r in via_graph_path] == [r.token_ids for r in eager], page_size
        assert staged and staged == replayed  # every decode step went through the staged inputs
        assert 3 in replayed or 5 in replayed  # padded sizes were exercised
        # Padding wrote only to the reserved page 0.
        assert runner.req_to_token_pool.req_to_token[runner.pad_row].eq(0).all()


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_page_table_without_token_table(page_size):
    """The builder's page-table-only form (what graph-filled decode metadata uses) gives the
    page table of the full form, over scattered pages and rows in any order."""
    torch.manual_seed(0)
    rows, width = 9, 64
    pool = ReqToTokenPool(rows, width, "cpu")
    pages = torch.randperm(1000)[: rows * width // page_size] + 1
    slots = (pages[:, None] * page_size + torch.arange(page_size)).reshape(rows, width)
    pool.req_to_token.copy_(slots.to(torch.int32))
    lens = [5, 64, 1, 17, 33]
    idx = torch.tensor([7, 0, 3, 8, 2])
    fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=len(lens), input_ids=torch.zeros(5, dtype=torch.long),
                      positions=torch.tensor(lens) - 1, req_pool_indices=idx,
                      seq_lens=torch.tensor(lens, dtype=torch.int32), seq_lens_cpu=torch.tensor(lens, dtype=torch.int32),
                      out_cache_loc=torch.zeros(5, dtype=torch.long), req_to_token_pool=pool)
    full = build_attention_metadata(fb, page_size)
    lean = build_attention_metadata(fb, page_size, with_token_table=False)
    assert lean.token_table is None and full.token_table is not None
    assert torch.equal(lean.page_table, full.page_table)
    assert torch.equal(full.page_table, slots[idx, ::page_size][:, : full.page_table.shape[1]].int() // page_size)
    for field in ("cache_seqlens_int32", "cu_seqlens_q", "cu_seqlens_k"):
        assert torch.equal(getattr(lean, field), getattr(full, field))
