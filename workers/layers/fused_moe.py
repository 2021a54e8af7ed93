"""Routed-expert MoE computation: a Python loop (CPU path, reference) and a fused Triton path.

`moe_loop` runs each expert hit on its tokens, one after the other. It needs the set of experts
hit on the host (`torch.unique(...).tolist()`, a device sync), so it cannot be captured in a
CUDA graph; it is the CPU path and the reference for the tests.

`fused_moe` does the same work with no host synchronisation and shapes that depend only on the
input shapes, so it can be captured in a CUDA graph and replayed with new routing:
1. `moe_align` (pure torch ops) groups the P = T * k (token, slot) pairs by expert, pads each
   expert's group to a multiple of BLOCK_M and says which expert each block of BLOCK_M rows
   belongs to (-1 for the unused blocks at the end; their number is bounded statically).
2. A grouped GEMM kernel (grid: blocks x cdiv(N, BLOCK_N)) multiplies the rows of each block by
   its expert's weight: first x[pair // k] @ w13[e].T -> [P, 2I], then, after silu(gate) * up
   in torch, h[pair] @ w2[e].T times the routing weight -> [P, hidden]. Rows are gathered and
   scattered by pair index (padding rows carry the sentinel P and are masked), so every output
   row is written by exactly one program: no atomics, deterministic.
3. The k rows of each token are summed in float32 and cast to x.dtype (plus the caller's
   `add`, the shared experts' output).
At decode sizes steps 1 and 3 and the router are one Triton kernel each (`moe_kernels`): as
torch ops they were ~40 graph nodes a layer, more time than the expert products.
The per-pair product of the second GEMM is stored in x.dtype (the loop rounds it there too),
which halves the [P, hidden] buffer for bf16 models; accumulation is always float32.

FP8 experts (an FP8 checkpoint's, `workers/models/deepseek_moe.py`): w13 and w2 are
`float8_e4m3fn` with float32 scales [E, N, ceil(K / block_k)] (`workers/layers/fp8.py`'s
layout); the kernel scales each weight tile by its rows' scales of that K block and rounds it to
x's dtype before the dot (BLOCK_K divides block_k), so a decode step reads half the bytes. The
loop dequantizes each expert it runs.

triton is imported under a guard: without it this module still imports and `moe_align` and
`moe_loop` work (CPU-only installs and CI have no triton).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from workers.layers import fused
from workers.layers.fp8 import dequantize

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: only moe_loop / moe_align are usable
    triton = None
    tl = None

logger = logging.getLogger(__name__)

# Up to this many tokens (decode batches) the router runs as one kernel (`moe_kernels.route`:
# each token's programs read the whole router weight between them); prompts keep the torch ops,
# whose one product reads it once.
ROUTE_MAX_TOKENS = 64


def moe_loop(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None, block_k13: int = 0,
    block_k2: int = 0, add: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, hidden], w13 [E, 2I, hidden], w2 [E, hidden, I], weights [T, k] float32, ids [T, k]
    -> [T, hidden] in x.dtype (plus `add`). A loop over the experts hit, in ascending order (as
    transformers sums them). FP8 experts come with their scales (module docstring)."""
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        tok, pos = torch.where(ids == e)
        a, b = w13[e], w2[e]
        if w13_scale is not None:
            a = dequantize(a, w13_scale[e], block_k13).to(x.dtype)
            b = dequantize(b, w2_scale[e], block_k2).to(x.dtype)
        gate, up = F.linear(x[tok], a).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, b) * weights[tok, pos, None]
        out.index_add_(0, tok, h.to(out.dtype))
    return out if add is None else out + add


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static bound on the blocks `moe_align` fills: at most min(E, P) experts are hit, each
    wasting fewer than block_m rows of padding."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (sorted_pair_ids [max_blocks * block_m], block_expert [max_blocks]).

    Pair p = t * k + j. Pairs are grouped by expert (ascending, pairs in ascending order within
    an expert); each group starts on a block boundary and is padded with the sentinel P.
    block_expert[b] is the expert of block b, or -1 past the last used block. No host sync:
    the shapes depend only on P, num_experts and block_m."""
    flat = ids.reshape(-1).long()
    p = flat.numel()
    nb = max_blocks(p, num_experts, block_m)
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    true_start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)  # pair indices grouped by expert
    expert_of = flat[order]
    rank = torch.arange(p, device=dev) - true_start[expert_of]  # position within its expert
    dest = padded_start[expert_of] + rank
    sorted_pair_ids = torch.full((nb * block_m,), p, dtype=torch.long, device=dev).scatter_(0, dest, order)
    block_start = torch.arange(nb, device=dev) * block_m
    # First expert whose padded range ends after the block start (empty experts are skipped).
    e = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(e < num_experts, e, torch.full_like(e, -1))
    return sorted_pair_ids, block_expert


def _moe_gemm_kernel(
    A, W, Out, Scale, WScale, SortedPairs, BlockExpert,
    N, K, num_pairs, a_div, scale_bk,
    stride_am, stride_ak,
    stride_we, stride_wn, stride_wk,
    stride_se, stride_sn,
    stride_om, stride_on,
    HAS_SCALE: tl.constexpr,
    FP8_W: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Out[pair, n] = (A[pair // a_div] . W[expert, n]) * Scale[pair] for the BLOCK_M pairs of
    block program_id(0) and the BLOCK_N columns of program_id(1)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(BlockExpert + pid_m).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(SortedPairs + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pair_ok = pairs < num_pairs
    rows = pairs // a_div
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = W + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if FP8_W:  # the tile's rows times their scales of this K block, rounded to a's dtype
            ws = tl.load(WScale + expert * stride_se + offs_n * stride_sn + k0 // scale_bk, mask=n_ok, other=0.0)
            w = (w.to(tl.float32) * ws[None, :]).to(a.dtype)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    if HAS_SCALE:
        acc = acc * tl.load(Scale + pairs, mask=pair_ok, other=0.0)[:, None]
    out_ptrs = Out + pairs[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=pair_ok[:, None] & n_ok[None, :])


if triton is not None:
    _moe_gemm_kernel = triton.jit(_moe_gemm_kernel)


def _config(num_pairs: int) -> dict:
    """Block sizes by the (static) number of pairs: small blocks for decode, where each expert
    gets a handful of rows, larger ones for prefill."""
    if num_pairs <= 1024:  # within 1% of the best of 27 launches at 1, 16 and 64 tokens (bench_moe, H200)
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3)


def _grouped_gemm(a, w, out, scale, sorted_pairs, block_expert, a_div: int, cfg: dict,
                  w_scale: torch.Tensor | None = None, block_k: int = 0) -> None:
    """out[pair] = a[pair // a_div] @ w[expert].T (* scale[pair]) for every pair of every used
    block; out rows of pairs not in a used block are left untouched. FP8 w: its scales
    [E, N, ceil(K / block_k)]."""
    n, k = w.shape[1], w.shape[2]
    if w_scale is not None and block_k < k and block_k % cfg["BLOCK_K"]:
        cfg = {**cfg, "BLOCK_K": block_k}  # a K tile never spans two scale blocks
    grid = (block_expert.numel(), triton.cdiv(n, cfg["BLOCK_N"]))
    _moe_gemm_kernel[grid](
        a, w, out, scale if scale is not None else out, w_scale if w_scale is not None else out,
        sorted_pairs, block_expert,
        n, k, out.shape[0], a_div, max(block_k, 1),
        a.stride(0), a.stride(1),
        w.stride(0), w.stride(1), w.stride(2),
        w_scale.stride(0) if w_scale is not None else 0, w_scale.stride(1) if w_scale is not None else 0,
        out.stride(0), out.stride(1),
        HAS_SCALE=scale is not None,
        FP8_W=w_scale is not None,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        **cfg,
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_k13: int = 0,
    block_k2: int = 0,
    block_m: int | None = None,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `moe_loop`, through the Triton grouped GEMM; graph-capturable.
    `block_m` (16 or a multiple) overrides the configured BLOCK_M (for tests). The grouping
    (`moe_kernels.align`) and the final sum (`moe_kernels.combine`) are one kernel each where
    they fit, the SiLU·up `fused.silu_and_mul`'s."""
    if triton is None:
        raise RuntimeError("fused_moe needs triton")
    from workers.layers import moe_kernels

    t, top_k = ids.shape
    p = t * top_k
    if p == 0:
        return torch.zeros_like(x) if add is None else add.clone()
    cfg = _config(p)
    if block_m is not None:
        cfg["BLOCK_M"] = block_m
    num_experts = w13.shape[0]
    if moe_kernels.align_fits(p, num_experts):
        nb = max_blocks(p, num_experts, cfg["BLOCK_M"])
        sorted_pairs, block_expert = moe_kernels.align(ids, num_experts, cfg["BLOCK_M"], nb)
    else:
        sorted_pairs, block_expert = moe_align(ids, num_experts, cfg["BLOCK_M"])
    h13 = torch.empty(p, w13.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, h13, None, sorted_pairs, block_expert, top_k, cfg, w13_scale, block_k13)
    h = fused.silu_and_mul(h13)
    out = torch.empty(p, w2.shape[1], dtype=x.dtype, device=x.device)
    scale = weights.reshape(-1).to(torch.float32).contiguous()
    _grouped_gemm(h, w2, out, scale, sorted_pairs, block_expert, 1, cfg, w2_scale, block_k2)
    return moe_kernels.combine(out, top_k, add)


@functools.lru_cache(maxsize=8)
def select_moe(device_type: str) -> Callable[..., torch.Tensor]:
    """The MoE implementation for a device type ("cuda", "cpu", ...), chosen and logged once:
    `fused_moe` on CUDA with triton, else `moe_loop`."""
    if device_type == "cuda" and triton is not None:
        logger.info("MoE experts on %s: fused Triton grouped GEMM (graph-capturable)", device_type)
        return fused_moe
    if device_type == "meta":  # a model built only for its shapes (`workers.loader.check_tp_split`)
        return moe_loop
    why = "no triton" if device_type == "cuda" else "not CUDA"
    logger.info("MoE experts on %s: per-expert torch loop (%s)", device_type, why)
    return moe_loop
