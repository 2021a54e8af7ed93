"""Activations already quantized for an FP8 product (`Fp8Rows`): what the elementwise kernels
of `workers.layers.quant_rows` write and the products of `workers.layers.fp8_gemm` take.
Imports nothing of the project, so both sides (and `fp8`, which decides: `fp8.takes_rows`)
can name it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Rows:
    """x [M, K] ~ q * scale, as `fp8_gemm.quantize_rows` would quantize it: q e4m3 and one
    float32 scale a row ([M, 1]); `dtype` is the 16-bit dtype the rows had (the product's
    output dtype). Written by the elementwise kernel that produced the rows where
    `fp8.takes_rows` says the next product would quantize them that way."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
