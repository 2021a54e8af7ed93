"""Per-head products against slices of one weight (FP8 with its scales, or 16-bit): MLA's
absorbed projections.

An MLA layer's kv_b_proj weight [H * (N + V), C] holds, per head h, W_UK (rows h(N+V) .. +N) and
W_UV (the V rows after). Decode multiplies each head's query by its W_UK (into the latent space)
and each head's latent output by its W_UV^T (`workers.models.deepseek`). With an FP8 checkpoint
(or `--quantization fp8`) the weight stays FP8 with its scales (`workers.layers.fp8`:
`weight_scale` [rows, ceil(C / block_k)], one row per weight row):

- `into_latent(x [T, H, N])` -> [T, H, C]: out[t, h] = x[t, h] @ W_h, W_h = Wd[h(N+V) : h(N+V) + N]
- `out_of_latent(x [T, H, C])` -> [T, H, V]: out[t, h] = x[t, h] @ U_h^T, U_h the V rows after W_h

where Wd is the dequantized weight. On CUDA one Triton kernel per product: each program takes a
head, a block of outputs and a block of tokens, dequantizes its weight tiles in registers to the
activations' dtype and multiplies them on the tensor cores (float32: IEEE products), so the
weight is read as FP8. Elsewhere the weight is dequantized and multiplied by einsum: the
reference the kernel is tested against (tests/test_fp8_heads.py).

A 16-bit kv_b_proj (scale None) takes the same kernel for decode's query on CUDA: it writes
into the caller's `out` (a slice of the absorbed query [T, H, C + R], so no concatenation
follows), where the einsum was a cuBLAS batched product and a concatenation (3.8 + 1.8 us at
batch 1 on an H200, against 3.1 us). The model keeps cuBLAS for a 16-bit output product, which
measured faster than this kernel (`DeepseekAttention.absorb_output`).
"""

from __future__ import annotations

import torch

from workers.layers import fp8


def into_latent(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, block_k: int, v_dim: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H, N] -> `out` (or a new tensor) [T, H, C] through each head's first N rows of
    `weight` (see the module; scale None: a weight of x's dtype)."""
    return _products(x, weight, scale, block_k, v_dim, uv=False, out=out)


def out_of_latent(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, block_k: int,
                  nope: int) -> torch.Tensor:
    """x [T, H, C] -> [T, H, V] through each head's rows after its first `nope` (see the module)."""
    return _products(x, weight, scale, block_k, nope, uv=True)


def _products(x, weight, scale, block_k, other, uv: bool, out: torch.Tensor | None = None):
    t, h, i = x.shape
    rows, c = weight.shape
    per_head = rows // h
    j = per_head - other if uv else c  # outputs per head
    want_i = c if uv else per_head - other
    if rows % h or i != want_i or j <= 0:
        raise ValueError(f"fp8_heads: x {tuple(x.shape)} against a {rows} x {c} weight of {h} heads "
                         f"({'V' if uv else 'N'} = {per_head - other})")
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32):
        from workers.layers import fp8_heads_kernel

        return fp8_heads_kernel.launch(x, weight, scale, block_k, per_head, other if uv else 0, j, uv, out=out)
    w = (weight if scale is None else fp8.dequantize(weight, scale, block_k)).to(x.dtype).view(h, per_head, c)
    y = torch.einsum("thc,hvc->thv", x, w[:, other:]) if uv else torch.einsum("thn,hnc->thc", x, w[:, :i])
    return y if out is None else out.copy_(y)
