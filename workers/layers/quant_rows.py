"""The elementwise ops before an FP8 product, writing their rows already quantized (CUDA).

A per-channel FP8 product of a W8A8 kernel (from A8_MIN_M rows; from 2 on the TMA kernel on
Hopper, `fp8_gemm.kernel_for`) quantizes its input to e4m3 per token (`fp8_gemm.quantize_rows`:
scale = amax / 448) before the FP8 tensor cores. In a decoder layer
three of its four inputs come straight out of an elementwise kernel that holds the whole row
anyway: the two RMSNorms (qkv's and gate/up's input) and silu(gate) * up (down's). Each
kernel here does that op and the quantization in one launch: it writes e4m3 values and one
float32 scale per row (`fp8_rows.Fp8Rows`) instead of a 16-bit row that a quantization kernel
then reads twice. At a decode batch that is one launch less per product (the FP8 step's
four quantization kernels took 14.5 us of a 162 us batch-64 layer, BENCHMARKS.md); in prefill,
one write and two reads of the row less.

The values: the op rounded to the activations' dtype as torch's ops round it (the CPU path's
`fused._add_rms_norm`, `silu_mul`'s kernel), then `quantize_rows`' math on that rounded row
(`fp8_gemm.row_amax`, `fp8_gemm.to_e4m3`). SiLU·up gives the unfused path's bits. The norm's
sum of squares is reduced in its own order (as `gemv.add_rms_norm`'s is), so a row's 1/rms may
differ from torch's in the last float32 place; and the unfused path's norm on CUDA (compiled
by Inductor) skips the rounding of the normalised row to bf16 before the weight, so ~3% of
its e4m3 inputs differ from these by one step (`scripts/fp8_rows_probe.py`, H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention import pdl
from workers.layers.fp8_gemm import FP8, row_amax, to_e4m3
from workers.layers.fp8_rows import Fp8Rows
from workers.layers.silu_mul import silu_mul

# Columns a SiLU program takes at a time; both passes over the row are unrolled (the row's
# width is a compile-time constant), so each issues all of its loads before it reduces.
SILU_CHUNK = 2048


@triton.jit
def _norm_quant_kernel(X, R, NW, S, Q, SC, K, eps, stride_x, stride_r, stride_s, stride_q,
                       HAS_R: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Row m: s = x + r (in x's dtype, stored), h = dtype(dtype(s / rms(s)) * w), then h in
    e4m3 with its scale."""
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    m = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(X + m * stride_x + cols, mask=mask, other=0.0)
    if HAS_R:
        x = (x.to(tl.float32) + tl.load(R + m * stride_r + cols, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(S + m * stride_s + cols, x, mask=mask)
    s = x.to(tl.float32)
    h = (s * tl.rsqrt(tl.sum(s * s, 0) / K + eps)).to(x.dtype)
    w = tl.load(NW + cols, mask=mask, other=0.0)
    h = (h.to(tl.float32) * w.to(tl.float32)).to(x.dtype).to(tl.float32)
    a = row_amax(tl.abs(h))
    tl.store(SC + m, a / 448.0)
    tl.store(Q + m * stride_q + cols, to_e4m3(h, a).to(Q.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_quant_kernel(X, Q, SC, stride_x, stride_q, INTER: tl.constexpr, CHUNK: tl.constexpr,
                           PDL: tl.constexpr):
    """Row m of x = [gate | up]: y = silu(gate) * up (`silu_mul.silu_mul`'s rounding) in e4m3
    with its scale. The first pass finds the amax, the second recomputes y from the row (read
    again, mostly from L2) and stores it quantized: no 16-bit copy of y is kept anywhere."""
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    m = tl.program_id(0).to(tl.int64)
    row = X + m * stride_x
    offs = tl.arange(0, CHUNK)
    amax = tl.zeros([CHUNK], tl.float32)
    for c in tl.static_range(0, INTER, CHUNK):
        cols = c + offs
        mask = cols < INTER
        y = silu_mul(tl.load(row + cols, mask=mask, other=0.0), tl.load(row + INTER + cols, mask=mask, other=0.0))
        amax = tl.maximum(amax, tl.abs(y.to(tl.float32)))
    a = row_amax(amax)
    tl.store(SC + m, a / 448.0)
    for c in tl.static_range(0, INTER, CHUNK):
        cols = c + offs
        mask = cols < INTER
        y = silu_mul(tl.load(row + cols, mask=mask, other=0.0), tl.load(row + INTER + cols, mask=mask, other=0.0))
        tl.store(Q + m * stride_q + cols, to_e4m3(y.to(tl.float32), a).to(Q.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[Fp8Rows, torch.Tensor]:
    """(RMSNorm(x + residual) quantized per row, x + residual); residual None: (RMSNorm(x)
    quantized, x). x [..., K] bf16/fp16 on CUDA; the values of `fused.add_rms_norm` then
    `fp8_gemm.quantize_rows`."""
    rows = _rows(x)
    m, k = rows.shape
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    res = _rows(residual) if residual is not None else None
    s = torch.empty_like(rows) if res is not None else rows
    if m:
        use_pdl = pdl.enabled(x.device)
        block = triton.next_power_of_2(k)
        _norm_quant_kernel[(m,)](
            rows, res if res is not None else rows, weight, s, q, scale, k, eps,
            rows.stride(0), res.stride(0) if res is not None else 0, s.stride(0), q.stride(0),
            HAS_R=res is not None, BLOCK=block, PDL=use_pdl,
            num_warps=16 if block >= 16384 else 8 if block >= 4096 else 4, launch_pdl=use_pdl)
    return Fp8Rows(q, scale, x.dtype), (s.view(x.shape) if res is not None else x)


def silu_and_mul(gate_up: torch.Tensor) -> Fp8Rows:
    """silu(gate) * up of gate_up = [gate | up] ([..., 2I] bf16/fp16 on CUDA), quantized per
    row: the values of `fused.silu_and_mul` then `fp8_gemm.quantize_rows`."""
    rows = _rows(gate_up)
    m, inter = rows.shape[0], rows.shape[1] // 2
    q = torch.empty(m, inter, dtype=FP8, device=gate_up.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=gate_up.device)
    if m and inter:
        use_pdl = pdl.enabled(gate_up.device)
        _silu_mul_quant_kernel[(m,)](rows, q, scale, rows.stride(0), q.stride(0), INTER=inter,
                                     CHUNK=min(SILU_CHUNK, triton.next_power_of_2(inter)), PDL=use_pdl,
                                     num_warps=8, launch_pdl=use_pdl)
    return Fp8Rows(q, scale, gate_up.dtype)
