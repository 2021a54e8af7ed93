"""The Triton kernel of `workers.layers.fp8_heads` (imported on the first CUDA call)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.triton_decode import dot_precision


@triton.jit
def _head_products_kernel(
    X, W, S, Out, T, NI, NJ, per_head, row0, stride_xt, stride_xh, stride_ot, stride_oh, stride_w, stride_s,
    SCALE_K: tl.constexpr, SCALED: tl.constexpr, UV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr,
    BLOCK_J: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Out[t, h, j] = sum_i X[t, h, i] * D_h[i, j], D_h the weight (dequantized when SCALED): rows
    h * per_head + row0 + i (UV: + j) and columns j (UV: i); one head, BLOCK_J outputs and
    BLOCK_T tokens per program."""
    h = tl.program_id(0)
    offs_t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    offs_i = tl.arange(0, BLOCK_I)
    tmask, jmask = offs_t < T, offs_j < NJ
    base = h * per_head + row0
    acc = tl.zeros([BLOCK_T, BLOCK_J], tl.float32)
    for i0 in range(0, NI, BLOCK_I):
        ii = i0 + offs_i
        imask = ii < NI
        x = tl.load(X + offs_t[:, None] * stride_xt + h * stride_xh + ii[None, :],
                    mask=tmask[:, None] & imask[None, :], other=0.0)
        if UV:  # D[i, j] = W[base + j, i]
            rows = (base + offs_j[None, :]).to(tl.int64)
            cols = ii[:, None]
        else:  # D[i, j] = W[base + i, j]
            rows = (base + ii[:, None]).to(tl.int64)
            cols = offs_j[None, :]
        m = imask[:, None] & jmask[None, :]
        w = tl.load(W + rows * stride_w + cols, mask=m, other=0.0)
        if SCALED:
            s = tl.load(S + rows * stride_s + cols // SCALE_K, mask=m, other=0.0)
            d = (w.to(tl.float32) * s).to(X.dtype.element_ty)
        else:
            d = w.to(X.dtype.element_ty)
        acc = tl.dot(x, d, acc, input_precision=DOT_PREC)
    out = Out + offs_t[:, None] * stride_ot + h * stride_oh + offs_j[None, :]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=tmask[:, None] & jmask[None, :])


def launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, block_k: int, per_head: int, row0: int,
           j: int, uv: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H, I] (last dimension contiguous) -> `out` (or a new tensor) [T, H, j] in x's dtype
    (`fp8_heads`); scale None: a weight of x's dtype."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, h, i = x.shape
    if out is None:
        out = torch.empty(t, h, j, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    block_t = 16 if t <= 16 else 32 if t <= 32 else 64
    block_j = 64
    grid = (h, triton.cdiv(j, block_j), triton.cdiv(t, block_t))
    _head_products_kernel[grid](
        x, weight, scale if scale is not None else weight, out, t, i, j, per_head, row0, x.stride(0), x.stride(1),
        out.stride(0), out.stride(1), weight.stride(0), scale.stride(0) if scale is not None else 0,
        SCALE_K=max(block_k, 1), SCALED=scale is not None, UV=uv, BLOCK_T=block_t, BLOCK_I=64, BLOCK_J=block_j, DOT_PREC=dot_precision(x.dtype),
        num_warps=4, num_stages=3,
    )
    return out
