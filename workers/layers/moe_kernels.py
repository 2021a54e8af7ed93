"""The small kernels around the MoE grouped GEMM at decode sizes, one Triton program each.

At batch 1-64 a DeepSeek MoE layer's expert products read their weights in ~40 us, and before
these kernels the torch ops around them took longer: the router (float32 copies of x and the
router weight, the product, softmax, top-k, the scaling: 7 kernels), `moe_align` (a histogram,
cumsums, a sort, searchsorted: ~30 kernels) and the final sum over the k experts (2). Inside a
CUDA graph each costs ~1.5 us whatever its size (DeepSeek-V2-Lite shape on an H200: ~65 us of a
227 us layer, BENCHMARKS.md). Here:

- `route`: logits = x W^T in float32 (up to 32 programs a token share the experts; the last
  to arrive goes on, `attention.arrival`), the family's scores (softmax, or sigmoid plus the
  correction bias), the group limit (the best `topk_group` groups by their max, or by the sum of
  their top two), the top k by repeated argmax, the normalisation and the scaling factor (used
  up to `fused_moe.ROUTE_MAX_TOKENS` tokens). One program a token reading the whole router
  weight took 45 us on an H200.
- `align`: `fused_moe.moe_align`'s grouping of (token, slot) pairs by expert in one program:
  a one-hot [pairs, experts] tile gives each expert's count (column sums), each pair's rank
  among its expert's pairs (a column cumsum) and each block's expert (searchsorted as a count).
  Same output as `moe_align` (int32), for up to `ALIGN_MAX_CELLS` pair x expert cells.
- `combine`: the sum over each token's k products in float32, rounded once, plus an optional
  tensor (the shared experts' output) rounded as the unfused add.

The math matches the torch ops (`workers.models.deepseek_moe.DeepseekRouter`, `moe_align`, the
sum) up to float32 summation order; the tests hold them to it (tests/test_moe_kernels.py, on the
GPU and under Triton's interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention import pdl
from attention.arrival import arrival_counters

# Pairs x experts (padded) in the one program's one-hot tile: its column cumsum goes through
# shared memory at 2 bytes a cell (64 KB here; 1 << 16 int32 cells did not fit an H200's 227 KB).
ALIGN_MAX_CELLS = 1 << 15


@triton.jit
def _route_kernel(
    X, W, Bias, Logits, Counters, Weights, Ids, H, E, per_group, stride_x, stride_w, scale,
    K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
    SPLITS: tl.constexpr, SIGMOID: tl.constexpr, N_GROUP: tl.constexpr, NG_PAD: tl.constexpr,
    TOPK_GROUP: tl.constexpr, TOP2_GROUPS: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (token, split): the token's logits of BLOCK_E experts; the split that arrives last
    chooses the token's k expert ids and float32 weights (module docstring)."""
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    rmask = rows < E
    acc = tl.zeros([BLOCK_E, BLOCK_H], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + tl.arange(0, BLOCK_H)
        hmask = hh < H
        x = tl.load(X + t * stride_x + hh, mask=hmask, other=0.0).to(tl.float32)
        w = tl.load(W + rows[:, None] * stride_w + hh[None, :], mask=rmask[:, None] & hmask[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    tl.store(Logits + t * E + rows, tl.sum(acc, axis=1), mask=rmask)
    tl.debug_barrier()  # every thread's logits are written before the arrival is counted
    arrived = tl.atomic_add(Counters + t, 1, sem="acq_rel")
    if arrived == SPLITS - 1:  # the last split of this token: the choice
        e = tl.arange(0, E_PAD)
        emask = e < E
        logits = tl.load(Logits + t * E + e, mask=emask, other=float("-inf"), cache_modifier=".cg")
        if SIGMOID:  # V3: sigmoid scores; choose by scores + correction bias
            scores = tl.where(emask, tl.sigmoid(logits), 0.0)
            choice = tl.where(emask, scores + tl.load(Bias + e, mask=emask, other=0.0), float("-inf"))
        else:  # V2: softmax scores, chosen as they are
            p = tl.exp(logits - tl.max(logits, axis=0))
            scores = p / tl.sum(p, axis=0)
            choice = tl.where(emask, scores, float("-inf"))
        if N_GROUP > 1:  # only the TOPK_GROUP best groups stay eligible
            group = e // per_group
            g = tl.arange(0, NG_PAD)
            gscore = tl.full([NG_PAD], float("-inf"), tl.float32)
            for gi in tl.static_range(N_GROUP):
                mine = tl.where((group == gi) & emask, choice, float("-inf"))
                best = tl.max(mine, axis=0)
                if TOP2_GROUPS:  # a group scores the sum of its top two
                    first = tl.argmax(mine, axis=0)
                    best = best + tl.max(tl.where(e == first, float("-inf"), mine), axis=0)
                gscore = tl.where(g == gi, best, gscore)
            keep = e < 0
            for _ in tl.static_range(TOPK_GROUP):
                gbest = tl.argmax(gscore, axis=0)
                keep = keep | (group == gbest)
                gscore = tl.where(g == gbest, float("-inf"), gscore)
            if SIGMOID:
                choice = tl.where(keep, choice, float("-inf"))
            else:  # V2 zeroes the other groups' scores (they may still fill the top k)
                scores = tl.where(keep, scores, 0.0)
                choice = tl.where(emask, scores, float("-inf"))
        j = tl.arange(0, K_PAD)
        wv = tl.zeros([K_PAD], tl.float32)
        iv = tl.zeros([K_PAD], tl.int32)
        for i in tl.static_range(K):
            best = tl.argmax(choice, axis=0)
            wv = tl.where(j == i, tl.sum(tl.where(e == best, scores, 0.0), axis=0), wv)
            iv = tl.where(j == i, best.to(tl.int32), iv)
            choice = tl.where(e == best, float("-inf"), choice)
        if NORM:
            wv = wv / (tl.sum(wv, axis=0) + 1e-20)
        tl.store(Weights + t * K + j, wv * scale, mask=j < K)
        tl.store(Ids + t * K + j, iv, mask=j < K)
        tl.atomic_xchg(Counters + t, 0)


def route(x: torch.Tensor, weight: torch.Tensor, top_k: int, *, sigmoid: bool, bias: torch.Tensor | None,
          n_group: int, topk_group: int, top2_groups: bool, norm: bool, scale: float, programs: int | None = None,
          num_warps: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, hidden], weight [E, hidden] -> (weights [T, k] float32, ids [T, k] int32).
    sigmoid: V3's scores (with `bias`, the correction), else V2's softmax; n_group > 1 limits
    the choice to the `topk_group` best groups (top2_groups: a group's score is the sum of its top
    two, else its max); norm: weights over their sum; scale: the routed scaling factor.
    programs / num_warps: the launch (programs a token). The defaults are the best of a sweep on
    an H200 (64 experts: 32 programs of one warp up to 16 tokens, 4.9 us at one; 8 past that)."""
    t, h = x.shape
    e = weight.shape[0]
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=x.device)
    if t == 0:
        return weights, ids
    e_pad = triton.next_power_of_2(e)
    block_e = max(1, e_pad // (programs or (32 if t <= 16 else 8)))
    splits = triton.cdiv(e, block_e)
    logits = torch.empty(t, e, dtype=torch.float32, device=x.device)
    use_pdl = pdl.enabled(x.device)
    _route_kernel[(t, splits)](
        x, weight, bias if bias is not None else weights, logits, arrival_counters(x.device, t), weights, ids,
        h, e, e // n_group, x.stride(0), weight.stride(0), float(scale),
        K=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=e_pad, BLOCK_E=block_e,
        BLOCK_H=min(triton.next_power_of_2(h), 4096 // block_e), SPLITS=splits, SIGMOID=sigmoid, N_GROUP=n_group,
        NG_PAD=triton.next_power_of_2(n_group), TOPK_GROUP=topk_group, TOP2_GROUPS=top2_groups, NORM=norm,
        PDL=use_pdl, num_warps=num_warps, launch_pdl=use_pdl,
    )  # fmt: skip
    return weights, ids


@triton.jit
def _align_kernel(
    Ids, Sorted, BlockExpert, P, E, NB,
    BLOCK_M: tl.constexpr, P_PAD: tl.constexpr, E_PAD: tl.constexpr, NB_PAD: tl.constexpr, FILL: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    p = tl.arange(0, P_PAD)
    pmask = p < P
    ids = tl.load(Ids + p, mask=pmask, other=-1).to(tl.int32)
    e = tl.arange(0, E_PAD)
    onehot = (ids[:, None] == e[None, :]).to(tl.int16)  # [P_PAD, E_PAD]; P < 2^15
    counts = tl.sum(onehot.to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    rank = tl.sum((tl.cumsum(onehot, axis=0) * onehot).to(tl.int32), axis=1) - 1  # among its expert's pairs
    dest = tl.sum(onehot.to(tl.int32) * padded_start[None, :], axis=1) + rank
    for s0 in range(0, NB * BLOCK_M, FILL):  # every slot the sentinel P, then the pairs over it
        s = s0 + tl.arange(0, FILL)
        tl.store(Sorted + s, tl.full([FILL], P, tl.int32), mask=s < NB * BLOCK_M)
    tl.debug_barrier()
    tl.store(Sorted + dest, p, mask=pmask)
    b = tl.arange(0, NB_PAD)
    # The first expert whose padded range ends after the block's start (searchsorted, right).
    ex = tl.sum((padded_end[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
    tl.store(BlockExpert + b, tl.where(ex < E, ex, -1), mask=b < NB)


def align_fits(num_pairs: int, num_experts: int) -> bool:
    """Whether `align`'s one program takes this many pairs and experts."""
    return triton.next_power_of_2(max(num_pairs, 1)) * triton.next_power_of_2(num_experts) <= ALIGN_MAX_CELLS


def align(ids: torch.Tensor, num_experts: int, block_m: int, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused_moe.moe_align`'s (sorted_pair_ids [num_blocks * block_m], block_expert
    [num_blocks]) in int32, in one program (`align_fits` must hold)."""
    flat = ids.reshape(-1)
    p = flat.numel()
    sorted_pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=ids.device)
    p_pad, e_pad = triton.next_power_of_2(max(p, 1)), triton.next_power_of_2(num_experts)
    use_pdl = pdl.enabled(ids.device)
    _align_kernel[(1,)](
        flat, sorted_pairs, block_expert, p, num_experts, num_blocks,
        BLOCK_M=block_m, P_PAD=p_pad, E_PAD=e_pad, NB_PAD=triton.next_power_of_2(num_blocks), FILL=1024,
        PDL=use_pdl, num_warps=4 if p_pad * e_pad <= 8192 else 8, launch_pdl=use_pdl,
    )  # fmt: skip
    return sorted_pairs, block_expert


@triton.jit
def _combine_kernel(Prod, Add, Out, N, stride_p, stride_a, stride_o,
                    K: tl.constexpr, HAS_ADD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(K):
        acc += tl.load(Prod + (t * K + j) * stride_p + cols, mask=mask, other=0.0).to(tl.float32)
    out = acc.to(Out.dtype.element_ty)
    if HAS_ADD:
        out = (out.to(tl.float32) + tl.load(Add + t * stride_a + cols, mask=mask, other=0.0).to(tl.float32))
        out = out.to(Out.dtype.element_ty)
    tl.store(Out + t * stride_o + cols, out, mask=mask)


def combine(prod: torch.Tensor, top_k: int, add: torch.Tensor | None = None) -> torch.Tensor:
    """prod [T * k, N] (each token's k rows together) -> [T, N]: their float32 sum rounded to
    prod's dtype, plus `add` [T, N] (rounded as the unfused add)."""
    n = prod.shape[1]
    t = prod.shape[0] // top_k
    out = torch.empty(t, n, dtype=prod.dtype, device=prod.device)
    if t == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    use_pdl = pdl.enabled(prod.device)
    _combine_kernel[(t, triton.cdiv(n, block))](
        prod, add if add is not None else out, out, n, prod.stride(0), add.stride(0) if add is not None else 0,
        out.stride(0), K=top_k, HAS_ADD=add is not None, BLOCK=block, PDL=use_pdl, num_warps=4, launch_pdl=use_pdl,
    )  # fmt: skip
    return out
