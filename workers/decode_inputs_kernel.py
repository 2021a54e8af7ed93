"""A decode graph's input preparation in one Triton kernel (CUDA only: `workers.cuda_graph`
imports it there).

Before its first layer a decode graph records each row's new KV slot in the request table and
resolves overlapped scheduling's placeholders (an input id < 0 reads its row's last sampled
token): in torch a cast, an index_put, a gather, a compare and a where — five launches. Row i
of this kernel does both: req_to_token[row_i, position_i] = slot_i and
ids_i = last_token[row_i] if ids_i < 0 else ids_i.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_inputs_kernel(Ids, Positions, Rows, Slots, ReqToToken, LastToken, OutIds, n, stride_r,
                          HAS_LAST: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    rows = tl.load(Rows + offs, mask=mask, other=0).to(tl.int64)
    positions = tl.load(Positions + offs, mask=mask, other=0).to(tl.int64)
    slots = tl.load(Slots + offs, mask=mask, other=0)
    tl.store(ReqToToken + rows * stride_r + positions, slots.to(tl.int32), mask=mask)
    ids = tl.load(Ids + offs, mask=mask, other=0)
    if HAS_LAST:
        last = tl.load(LastToken + rows, mask=mask & (ids < 0), other=0)
        ids = tl.where(ids < 0, last.to(ids.dtype), ids)
    tl.store(OutIds + offs, ids, mask=mask)


def prepare_decode_inputs(input_ids: torch.Tensor, positions: torch.Tensor, req_pool_indices: torch.Tensor,
                          out_cache_loc: torch.Tensor, req_to_token: torch.Tensor,
                          last_token: torch.Tensor | None) -> torch.Tensor:
    """Record the slots in `req_to_token` (int32, rows of contiguous columns) and return the
    input ids with placeholders resolved from `last_token` (None: no placeholders to resolve)."""
    n = input_ids.numel()
    out = torch.empty_like(input_ids)
    if n == 0:
        return out
    if req_to_token.stride(1) != 1:
        raise ValueError("prepare_decode_inputs: req_to_token rows must have contiguous columns")
    block = min(1024, triton.next_power_of_2(n))
    _decode_inputs_kernel[(triton.cdiv(n, block),)](
        input_ids, positions, req_pool_indices, out_cache_loc, req_to_token,
        last_token if last_token is not None else input_ids, out, n, req_to_token.stride(0),
        HAS_LAST=last_token is not None, BLOCK=block, num_warps=4,
    )
    return out
