"""The one placement rule of `workers.input_batch.InputBatch.place` in one Triton kernel (CUDA
only: that method imports it there).

Before a forward reads the request table, each new token's KV slot goes into it, and overlapped
scheduling's placeholders are resolved (an input id < 0 reads its row's last sampled token): in
torch a cast, an index_put, a gather, a compare and a where — five launches. Token i of this
kernel does both: req_to_token[row_i, col_i] = slot_i and ids_i = last_token[row_i] if ids_i < 0
else ids_i. The same kernel serves an eager batch (rows repeated per token, columns = positions
or an encoder-decoder's decoder columns) and a decode graph's in-graph preparation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _place_tokens_kernel(Rows, Cols, Slots, ReqToToken, Ids, LastToken, OutIds, n, stride_r,
                         HAS_IDS: tl.constexpr, HAS_LAST: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    rows = tl.load(Rows + offs, mask=mask, other=0).to(tl.int64)
    cols = tl.load(Cols + offs, mask=mask, other=0).to(tl.int64)
    slots = tl.load(Slots + offs, mask=mask, other=0)
    tl.store(ReqToToken + rows * stride_r + cols, slots.to(tl.int32), mask=mask)
    if HAS_IDS:
        ids = tl.load(Ids + offs, mask=mask, other=0)
        if HAS_LAST:
            last = tl.load(LastToken + rows, mask=mask & (ids < 0), other=0)
            ids = tl.where(ids < 0, last.to(ids.dtype), ids)
        tl.store(OutIds + offs, ids, mask=mask)


def place_tokens(rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor, req_to_token: torch.Tensor,
                 input_ids: torch.Tensor | None, last_token: torch.Tensor | None) -> torch.Tensor | None:
    """Record the slots in `req_to_token` (int32, rows of contiguous columns) and return the
    input ids (None: none given) with placeholders resolved from `last_token` (None: no
    placeholders to resolve)."""
    n = slots.numel()
    out = torch.empty_like(input_ids) if input_ids is not None else None
    if n == 0:
        return out
    if req_to_token.stride(1) != 1:
        raise ValueError("place_tokens: req_to_token rows must have contiguous columns")
    block = min(1024, triton.next_power_of_2(n))
    _place_tokens_kernel[(triton.cdiv(n, block),)](
        rows, cols, slots, req_to_token,
        input_ids if input_ids is not None else slots,
        last_token if last_token is not None else slots,
        out if out is not None else slots, n, req_to_token.stride(0),
        HAS_IDS=input_ids is not None, HAS_LAST=input_ids is not None and last_token is not None,
        BLOCK=block, num_warps=4,
    )
    return out
