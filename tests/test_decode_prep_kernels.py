"""The decode graph's two preparation kernels against the torch ops they replace:
`attention.decode_metadata_kernel` (lengths, offsets and page table of a decode batch, what
`build_attention_metadata(..., with_token_table=False)` computes) and
`workers.place_tokens_kernel` (the new tokens' slots into the request table, overlapped
scheduling's placeholder ids resolved from the last sampled tokens; decode rows and ragged rows). Random request tables over
scattered pages, rows in any order, page sizes 1/4/16, batch sizes 1 to 70; the buffers'
columns past the batch's pages are left as they were.

Skipped without CUDA; `TRITON_INTERPRET=1` runs the kernels on CPU through Triton's interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not torch.cuda.is_available() and not INTERPRET:
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1 to run the Triton kernels on CPU)", allow_module_level=True)
pytest.importorskip("triton")

from attention.decode_metadata_kernel import fill_decode_metadata  # noqa: E402
from attention.metadata import AttentionMetadata, build_attention_metadata  # noqa: E402
from tests.triton_interpreter import install_interpreter_shims  # noqa: E402
from workers.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from workers.memory_pool import ReqToTokenPool  # noqa: E402
from workers.place_tokens_kernel import place_tokens  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
if INTERPRET:
    install_interpreter_shims()


def _decode_batch(page_size: int, batch: int, seed: int, rows: int = 80, width: int = 96):
    gen = torch.Generator().manual_seed(seed)
    pool = ReqToTokenPool(rows, width, DEVICE)
    pages = torch.randperm(20_000, generator=gen)[: rows * width // page_size] + 1
    slots = (pages[:, None] * page_size + torch.arange(page_size)).reshape(rows, width)
    pool.req_to_token.copy_(slots.to(torch.int32))
    idx = torch.randperm(rows, generator=gen)[:batch]
    lens = torch.randint(1, width + 1, (batch,), generator=gen)
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=batch,
        input_ids=torch.zeros(batch, dtype=torch.long, device=DEVICE), positions=(lens - 1).to(DEVICE),
        req_pool_indices=idx.to(DEVICE), seq_lens=lens.to(DEVICE), seq_lens_cpu=lens.to(torch.int32),
        out_cache_loc=torch.zeros(batch, dtype=torch.long, device=DEVICE), req_to_token_pool=pool,
    )
    return fb, pool


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("batch", [1, 5, 70])
def test_decode_metadata_kernel_matches_builder(page_size, batch):
    fb, pool = _decode_batch(page_size, batch, seed=batch * 31 + page_size)
    want = build_attention_metadata(fb, page_size, with_token_table=False)
    pages = want.page_table.shape[1]
    i32 = dict(dtype=torch.int32, device=DEVICE)
    lens, cu_q, cu_k = torch.full((batch + 3,), -7, **i32), torch.full((batch + 4,), -7, **i32), torch.full(
        (batch + 4,), -7, **i32)
    table = torch.full((batch + 2, pages + 5), -7, **i32)
    fill_decode_metadata(fb.seq_lens, fb.req_pool_indices, pool.req_to_token, page_size, pages,
                         lens, cu_q, cu_k, table)
    assert torch.equal(lens[:batch], want.cache_seqlens_int32)
    assert torch.equal(cu_q[: batch + 1], want.cu_seqlens_q)
    assert torch.equal(cu_k[: batch + 1], want.cu_seqlens_k)
    assert torch.equal(table[:batch, :pages], want.page_table)
    # nothing written past the batch or its pages
    assert lens[batch:].eq(-7).all() and cu_q[batch + 1:].eq(-7).all() and cu_k[batch + 1:].eq(-7).all()
    assert table[batch:].eq(-7).all() and table[:, pages:].eq(-7).all()


@pytest.mark.skipif(INTERPRET, reason="the builder takes the kernel on CUDA devices only")
def test_builder_writes_decode_metadata_in_place():
    """`into` (a graph's static buffers): the builder's decode result is those buffers, holding
    what the torch form computes."""
    fb, pool = _decode_batch(16, 6, seed=3)
    want = build_attention_metadata(fb, 16, with_token_table=False)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    into = AttentionMetadata(
        cache_seqlens_int32=torch.zeros(8, **i32), cu_seqlens_q=torch.zeros(9, **i32),
        cu_seqlens_k=torch.zeros(9, **i32), max_seqlen_q=1, max_seqlen_k=96, token_table=None,
        page_table=torch.zeros(8, 6, **i32), extend_seq_lens_cpu=[1] * 8, cache_seqlens_cpu=[96] * 8)
    got = build_attention_metadata(fb, 16, with_token_table=False, into=into)
    assert got.page_table.data_ptr() == into.page_table.data_ptr()
    assert got.cache_seqlens_int32.data_ptr() == into.cache_seqlens_int32.data_ptr()
    for name in ("cache_seqlens_int32", "cu_seqlens_q", "cu_seqlens_k", "page_table"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert (got.max_seqlen_k, got.cache_seqlens_cpu) == (want.max_seqlen_k, want.cache_seqlens_cpu)


@pytest.mark.parametrize("ids_mode", ["last", "no_last", "no_ids"])
@pytest.mark.parametrize("batch,per_row", [(1, 1), (9, 1), (300, 1), (7, 5), (3, 33)])
def test_place_tokens_kernel_matches_torch(batch, per_row, ids_mode):
    """Decode rows (one token per row) and ragged rows (several consecutive columns per row, as
    an eager batch writes them), with and without placeholders to resolve or ids at all."""
    gen = torch.Generator().manual_seed(batch * 100 + per_row)
    rows, width = 320, 64
    table = torch.randint(0, 10_000, (rows, width), generator=gen, dtype=torch.int32)
    row_idx = torch.randperm(rows, generator=gen)[:batch].repeat_interleave(per_row)
    start = torch.randint(0, width - per_row + 1, (batch,), generator=gen).repeat_interleave(per_row)
    cols = start + torch.arange(per_row).repeat(batch)
    n = batch * per_row
    slots = torch.randint(0, 1 << 20, (n,), generator=gen)
    ids = torch.randint(0, 1000, (n,), generator=gen)
    ids[torch.rand(n, generator=gen) < 0.5] = -1
    last = torch.randint(0, 1000, (rows,), generator=gen)
    want_table = table.clone()
    want_table[row_idx, cols] = slots.to(torch.int32)
    want_ids = torch.where(ids < 0, last[row_idx], ids) if ids_mode == "last" else ids
    got_table = table.to(DEVICE)
    got_ids = place_tokens(row_idx.to(DEVICE), cols.to(DEVICE), slots.to(DEVICE), got_table,
                           None if ids_mode == "no_ids" else ids.to(DEVICE),
                           last.to(DEVICE) if ids_mode == "last" else None)
    if ids_mode == "no_ids":
        assert got_ids is None
    else:
        assert torch.equal(got_ids.cpu(), want_ids)
    assert torch.equal(got_table.cpu(), want_table)
