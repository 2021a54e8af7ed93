"""A decode batch's attention metadata in one Triton kernel (CUDA only: `attention.metadata`
imports it there, CPU installs never do).

`build_attention_metadata` for a decode batch without a token table (what a decode CUDA graph
records: `attention.graph_buffers`) otherwise runs about fifteen small torch kernels — a cast,
two padded cumulative sums, a gather and a division for the page table, and the copies into
the graph's static buffers — each a launch and a drain of the GPU ahead of the first layer.
This kernel writes the same values straight into the buffers: program b takes row b's page
table (req_to_token[row, j * P] // P for j < pages) and program 0 also the lengths and the
offsets (cu_seqlens_q = 0..B, cu_seqlens_k = 0, cumsum of the lengths).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_metadata_kernel(
    SeqLens, Rows, ReqToToken, CacheLens, CuQ, CuK, PageTable,
    batch, pages, stride_r, stride_p,
    PAGE_SIZE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr,
):
    b = tl.program_id(0)
    table_row = ReqToToken + tl.load(Rows + b).to(tl.int64) * stride_r
    for p0 in range(0, pages, BLOCK_P):
        cols = p0 + tl.arange(0, BLOCK_P)
        mask = cols < pages
        first = tl.load(table_row + cols.to(tl.int64) * PAGE_SIZE, mask=mask, other=0)
        tl.store(PageTable + b * stride_p + cols, first // PAGE_SIZE, mask=mask)  # slots are >= 0
    if b == 0:
        offs = tl.arange(0, BLOCK_B)
        mask = offs < batch
        lens = tl.load(SeqLens + offs, mask=mask, other=0).to(tl.int32)
        tl.store(CacheLens + offs, lens, mask=mask)
        tl.store(CuK + 1 + offs, tl.cumsum(lens, 0), mask=mask)
        tl.store(CuQ + 1 + offs, offs + 1, mask=mask)
        tl.store(CuK, 0)
        tl.store(CuQ, 0)


def fill_decode_metadata(seq_lens: torch.Tensor, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                         page_size: int, pages: int, cache_seqlens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         cu_seqlens_k: torch.Tensor, page_table: torch.Tensor) -> None:
    """Write a decode batch's metadata (B = seq_lens.numel() rows, one new token each, `pages`
    page-table columns) into the given int32 tensors: [B], [B+1], [B+1], [B, >= pages]."""
    batch = seq_lens.numel()
    if batch == 0:
        cu_seqlens_q.zero_()
        cu_seqlens_k.zero_()
        return
    if page_table.shape[1] < pages or page_table.stride(1) != 1 or req_to_token.stride(1) != 1:
        raise ValueError(f"fill_decode_metadata: a page table of {list(page_table.shape)} for {pages} pages "
                         "(rows of contiguous columns)")
    _decode_metadata_kernel[(batch,)](
        seq_lens, req_pool_indices, req_to_token, cache_seqlens, cu_seqlens_q, cu_seqlens_k, page_table,
        batch, pages, req_to_token.stride(0), page_table.stride(0),
        PAGE_SIZE=page_size, BLOCK_B=triton.next_power_of_2(batch),
        BLOCK_P=min(1024, triton.next_power_of_2(max(pages, 1))), num_warps=4,
    )
