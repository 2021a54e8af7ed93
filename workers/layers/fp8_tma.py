"""FP8 products of decode batches on Hopper: per-token e4m3 rows times a per-channel e4m3 weight,
both read by TMA (the tensor memory accelerator), the weight on the MMA's M side.

A decode batch has few rows (2-256) against a weight of thousands: cuBLAS's FP8 kernels with
row-wise scales tile the output 128 x 128 without splitting K, so a 4,096-wide product (o, down)
runs on 32 of 132 SMs, and the Triton tile kernel of `fp8_gemm` (pointer loads) compiles at its
decode launch to 255 registers and 2.7 KB of spilled stack a thread. Here a program takes BLOCK_W
weight rows and all the rows of the batch (padded to a power of two, 16-128 at the rows `launch`
takes: the MMA's N side), steps through its slice of K with one TMA request per operand and
tile, and multiplies in float32 on FP8 tensor cores. K may be split (the launches `launch`
gives do not): each program writes a float32 partial and the last of a tile to arrive adds
them up in order (`sum_split_k`, an `attention.arrival` counter, left at zero). The scales (one
a row, one a weight row) and the bias are applied once, in the epilogue.

Measured against what shipped (BENCHMARKS.md, `scripts/fp8_tma_probe.py`).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from attention import pdl
from attention.arrival import arrival_counters

try:  # host-side TMA descriptors (Triton 3.4+)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover (an older Triton: the product stays on the other kernels)
    TensorDescriptor = None


MAX_M = 128  # the most rows `launch` gives a launch for (at 256 cuBLAS was faster on every product)


@functools.lru_cache(maxsize=8)
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def available(device: torch.device) -> bool:
    """TMA descriptors and FP8 tensor cores (sm_90), on a real GPU (not Triton's interpreter)."""
    if TensorDescriptor is None or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _hopper(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def sum_split_k(acc, part, omask, Counters, tile, pid_k, SPLIT_K, stride_split):
    """(acc, last) of a program that holds one K slice's float32 sums `acc` of an output tile
    (`part`: their addresses in split 0 of a [SPLIT_K, ...] partials buffer, `stride_split`
    apart; `tile`: the tile's arrival counter). Unsplit: (acc, True). Split: it writes its
    partial and counts itself in; the last of the tile to arrive gets the partials added up in
    order (and resets the counter to zero), the others get last False and write nothing."""
    last = pid_k >= 0  # a tensor, as the split branch reassigns it
    if SPLIT_K > 1:
        tl.store(part + pid_k * stride_split, acc, mask=omask)
        tl.debug_barrier()  # every thread's partial is written before the arrival is counted
        last = tl.atomic_add(Counters + tile, 1, sem="acq_rel") == SPLIT_K - 1
        if last:
            acc = tl.zeros_like(acc)
            for j in range(SPLIT_K):
                acc += tl.load(part + j * stride_split, mask=omask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(Counters + tile, 0)
    return acc, last


def split_k_buffers(y: torch.Tensor, split: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partials, counters) that `sum_split_k` takes for an output y [M, N] of `tiles` tiles: a
    float32 [split, M, N] buffer and this stream's arrival counters; unsplit, y twice (unused)."""
    if split == 1:
        return y, y
    return torch.empty(split, *y.shape, dtype=torch.float32, device=y.device), arrival_counters(y.device, tiles)


@triton.jit
def _tma_kernel(w_desc, x_desc, SW, SX, B, Y, Part, Counters, M, N, K, SPLIT_K, stride_ym,
                HAS_BIAS: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                PDL: tl.constexpr):
    pdl.launch_dependents(PDL)
    pid_w = tl.program_id(0)
    pid_t = tl.program_id(1)
    pid_k = tl.program_id(2)
    chunk = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K  # split edges on whole steps: no step straddles one
    k_lo = pid_k * chunk
    k_hi = tl.minimum(k_lo + chunk, K)
    pdl.wait(PDL)
    acc = tl.zeros([BLOCK_W, BLOCK_T], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):  # (TMA fills what lies past K or past the rows with zeros)
        w = w_desc.load([pid_w * BLOCK_W, k0])
        x = x_desc.load([pid_t * BLOCK_T, k0])
        acc = tl.dot(w, x.T, acc)
    rw = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    rt = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    wmask = rw < N
    tmask = rt < M
    omask = wmask[:, None] & tmask[None, :]
    part = Part + rt.to(tl.int64)[None, :] * N + rw[:, None]
    acc, last = sum_split_k(acc, part, omask, Counters, pid_t * tl.num_programs(0) + pid_w, pid_k, SPLIT_K, M * N)
    if last:
        acc = acc * tl.load(SW + rw, mask=wmask, other=0.0)[:, None] * tl.load(SX + rt, mask=tmask, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(B + rw, mask=wmask, other=0.0).to(tl.float32)[:, None]
        tl.store(Y + rt.to(tl.int64)[None, :] * stride_ym + rw[:, None], acc.to(Y.dtype.element_ty), mask=omask)


def token_tile(m: int) -> int:
    """The batch's rows padded to the MMA's N side: a power of two, 16-256."""
    return max(16, min(256, triton.next_power_of_2(m)))


def linear(q: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
           bias: torch.Tensor | None, launch: tuple[int, ...]) -> torch.Tensor:
    """q [M, K] e4m3 (contiguous rows) with float32 scales sx [M, 1]; weight [N, K] e4m3 with
    per-channel scales [N, 1]; bias [N] in out_dtype or None. Returns [M, N] in out_dtype.
    launch: (weight rows a program, K a step, warps, stages, K splits[, token rows a program:
    default `token_tile(M)`; fewer tile the batch over the grid's second axis])."""
    block_w, block_k, warps, stages, split = launch[:5]
    m, k = q.shape
    n = weight.shape[0]
    block_t = launch[5] if len(launch) > 5 else token_tile(m)
    w_desc = TensorDescriptor.from_tensor(weight, [block_w, block_k])
    x_desc = TensorDescriptor.from_tensor(q, [block_t, block_k])
    y = torch.empty(m, n, dtype=out_dtype, device=q.device)
    grid = (triton.cdiv(n, block_w), triton.cdiv(m, block_t), split)
    part, counters = split_k_buffers(y, split, grid[0] * grid[1])
    use_pdl = pdl.enabled(q.device)
    _tma_kernel[grid](w_desc, x_desc, scale, sx, bias if bias is not None else scale, y, part, counters,
                      m, n, k, split, y.stride(0), HAS_BIAS=bias is not None, BLOCK_W=block_w, BLOCK_T=block_t,
                      BLOCK_K=block_k, PDL=use_pdl, num_warps=warps, num_stages=stages, launch_pdl=use_pdl)
    return y


def launch(m: int, n: int, k: int) -> tuple[int, int, int, int, int] | None:
    """`linear`'s launch (weight rows a program, K a step, warps, stages, K splits) for
    a per-channel product of `m` rows, or None where it does not take the shape: 2 to MAX_M
    rows, K a multiple of 16 (TMA's row stride), and from 65 rows not the wide products (N >=
    16,384: gate/up), which fill the SMs on cuBLAS's tiles. H100 (`scripts/fp8_tma_probe.py`,
    Llama-3.1-8B products, BENCHMARKS.md 2026-12-06): 64 weight rows and 256-column steps, six
    stages up to 48 rows (the best or within 0.3 us of it at 8-48 rows), four from 49 (the best
    at 64 and 128 but for gate/up at 128); K split in two gained 0.1 us at most."""
    if m < 2 or m > MAX_M or k % 16 or (m > 64 and n >= 16384):
        return None
    return (64, 256, 4, 6, 1) if m <= 48 else (64, 256, 4, 4, 1)
