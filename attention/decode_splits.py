"""The split-K partials of the paged decodes (`attention.triton_decode`, the MLA decode): which
slice of a request's keys each split takes (`split_bounds`), and how the per-split partials
(output, base-2 log-sum-exp) of a (request, head) merge into its output (`_merge_heads`, run by
the last split to arrive: `_merge_if_last`; `merge_splits`, the separate stage-2 kernel), and
the zeros of a request with no keys (`_zero_output`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention import pdl


@triton.jit
def split_bounds(seq_len, split_id, num_splits, BLOCK_N: tl.constexpr):
    """Slice [start, end) of a request's keys taken by `split_id`; slices are whole blocks of
    BLOCK_N tokens, so the last splits of a short request are empty (start >= end)."""
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    per_split = tl.maximum(per_split, BLOCK_N)
    start = split_id * per_split
    end = tl.minimum(start + per_split, seq_len)
    return start, end, per_split


# Arguments that vary from step to step outside CUDA graphs (the split count and the eager page
# table's width): not specialised on (Triton compiles a variant per value that is 1 or a multiple
# of 16), so an eager step meets the variants the graphs compiled, not a ~1.3 s compile.
VARYING = ["num_splits", "stride_pb", "stride_lb", "stride_lh"]


@triton.jit
def _merge_heads(MidO, MidLse, Out, b, kvh, n_active,
                 stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
                 GROUP: tl.constexpr, V_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_DV: tl.constexpr,
                 BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr):
    """Out[b, heads of kvh] = sum_s 2^(lse_s - lse) * o_s over the n_active splits (stage 2's
    math). The partials are read past L1 (which may hold none of them), CHUNK_S splits of every
    head in one load: a split at a time costs a round trip to L2 each, and this runs after the
    other programs of its head, at the end of the kernel."""
    offs_g = tl.arange(0, BLOCK_G)
    mask_g = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < V_DIM
    offs_s = tl.arange(0, BLOCK_S)
    lse_rows = MidLse + b * stride_lb + heads[:, None] * stride_lh
    lse = tl.load(lse_rows + offs_s[None, :], mask=mask_g[:, None] & (offs_s[None, :] < n_active),
                  other=float("-inf"), cache_modifier=".cg")
    m = tl.where(mask_g, tl.max(lse, 1), 0.0)
    denom = tl.sum(tl.exp2(lse - m[:, None]), 1)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    offs_c = tl.arange(0, CHUNK_S)
    o_rows = MidO + b * stride_ob + heads[:, None, None] * stride_oh + offs_dv[None, None, :]
    for s0 in range(0, n_active, CHUNK_S):
        splits = s0 + offs_c
        cmask = mask_g[:, None] & (splits[None, :] < n_active)
        w = tl.exp2(tl.load(lse_rows + splits[None, :], mask=cmask, other=float("-inf"), cache_modifier=".cg")
                    - m[:, None])
        o = tl.load(o_rows + splits[None, :, None] * stride_os, mask=cmask[:, :, None] & mask_dv[None, None, :],
                    other=0.0, cache_modifier=".cg")
        acc += tl.sum(w[:, :, None] * o, 1)
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(Out + b * stride_outb + heads[:, None] * stride_outh + offs_dv[None, :],
             out.to(Out.dtype.element_ty), mask=mask_g[:, None] & mask_dv[None, :])


@triton.jit(do_not_specialize=[v for v in VARYING if v != "stride_pb"])
def merge_splits_kernel(
    MidO, MidLse, SeqLens, Out,
    num_splits,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    stride_outb, stride_outh,
    V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    """Stage 2, grid (B, H): out = sum_s 2^(lse_s - lse) * o_s over the request's non-empty
    splits (the same `split_bounds` as stage 1 says which exist). A request of length 0 gets 0."""
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(SeqLens + b)
    _, _, per_split = split_bounds(seq_len, 0, num_splits, BLOCK_N)
    n_active = tl.cdiv(seq_len, per_split)
    offs_s = tl.arange(0, BLOCK_S)
    lse_row = MidLse + b * stride_lb + h * stride_lh
    lse = tl.load(lse_row + offs_s, mask=offs_s < n_active, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(n_active > 0, m, 0.0)
    denom = tl.sum(tl.exp2(lse - m), 0)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < V_DIM
    acc = tl.zeros([BLOCK_DV], tl.float32)
    o_row = MidO + b * stride_ob + h * stride_oh
    for s in range(0, n_active):
        w = tl.exp2(tl.load(lse_row + s) - m)
        acc += w * tl.load(o_row + s * stride_os + offs_dv, mask=mask_dv, other=0.0)
    out = tl.where(denom > 0, acc / denom, 0.0)
    tl.store(Out + b * stride_outb + h * stride_outh + offs_dv, out.to(Out.dtype.element_ty), mask=mask_dv)


def merge_splits(mid_o: torch.Tensor, mid_lse: torch.Tensor, cache_seqlens: torch.Tensor,
                 out: torch.Tensor, block_n: int) -> None:
    """Stage 2 shared with the MLA kernel. mid_o: [B, H, S, Dv] f32; mid_lse: [B, H, S] f32
    (base 2); out: [B, H, Dv]; `block_n` must be the stage-1 block the splits were cut with."""
    batch, heads, num_splits, v_dim = mid_o.shape
    use_pdl = pdl.enabled(out.device)
    merge_splits_kernel[(batch, heads)](
        mid_o, mid_lse, cache_seqlens, out,
        num_splits,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        V_DIM=v_dim,
        BLOCK_DV=triton.next_power_of_2(v_dim),
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        BLOCK_N=block_n,
        PDL=use_pdl,
        num_warps=4 if v_dim >= 256 else 2,
        launch_pdl=use_pdl,
    )


@triton.jit
def _merge_if_last(MidO, MidLse, Out, Counters, b, kvh, seq_len, per_split,
                   stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
                   GROUP: tl.constexpr, V_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_DV: tl.constexpr,
                   BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr):
    """After a split wrote its partial: the last split of (request, KV head) to arrive merges them
    all (`_merge_heads`) and leaves the counter at zero."""
    tl.debug_barrier()  # every thread's partial is written before the arrival is counted
    arrived = tl.atomic_add(Counters + b * tl.num_programs(1) + kvh, 1, sem="acq_rel")
    n_active = tl.cdiv(seq_len, per_split)
    if arrived == n_active - 1:
        _merge_heads(MidO, MidLse, Out, b, kvh, n_active,
                     stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
                     GROUP, V_DIM, BLOCK_G, BLOCK_DV, BLOCK_S, CHUNK_S)
        tl.atomic_xchg(Counters + b * tl.num_programs(1) + kvh, 0)


@triton.jit
def _zero_output(Out, b, heads, mask_h, stride_outb, stride_outh, V_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_DV: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr):
    """A request with no keys: its output is 0, as stage 2 writes."""
    if EARLY:
        pdl.wait(PDL)
    offs_dv = tl.arange(0, BLOCK_DV)
    o_ptrs = Out + b * stride_outb + heads[:, None] * stride_outh + offs_dv[None, :]
    tl.store(o_ptrs, tl.zeros([BLOCK_H, BLOCK_DV], Out.dtype.element_ty), mask=mask_h[:, None] & (offs_dv[None, :] < V_DIM))
