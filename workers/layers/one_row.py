"""Entry points for a model's linear layers that fuse the op before them at batch 1 on CUDA.

Each takes the unfused path's arguments and runs one `workers.layers.gemv` kernel when
`applies` (one row, CUDA, bf16/fp16; `MANTA_GEMV=0` turns it off for comparisons), else the
torch ops the CPU path and larger batches use. This module imports no Triton: the kernel module
is imported on the first CUDA call.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from workers.layers import fused


def enabled() -> bool:
    """`MANTA_GEMV=0` keeps every one-row product on the unfused torch ops (a benchmark knob)."""
    return os.environ.get("MANTA_GEMV") != "0"


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True where `gemv` runs: one row, CUDA, bf16/fp16 matching the weight, contiguous rows."""
    return (enabled() and x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and weight.stride(1) == 1)


def _gemv():
    from workers.layers import gemv

    return gemv


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through `gemv` where it applies."""
    if applies(x, weight):
        return _gemv().gemv(x, weight, bias)[0]
    return F.linear(x, weight, bias)


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(RMSNorm(x + residual)), x + residual); residual None: (linear(RMSNorm(x)), x).
    Where `gemv` applies: one kernel, or for wide outputs a one-row norm kernel and a plain
    product (`gemv.fuse_norm`); else the fused-elementwise norm and F.linear."""
    if applies(x, weight):
        gemv = _gemv()
        if gemv.fuse_norm(*weight.shape):
            y, s = gemv.gemv(x, weight, bias, mode=gemv.ADD_RMS, residual=residual, norm_weight=norm_weight, eps=eps)
        else:
            h, s = gemv.add_rms_norm(x, residual, norm_weight, eps)
            y = gemv.gemv(h, weight, bias)[0]
        return y, (x if s is None else s)
    if residual is None:
        h, s = fused.rms_norm(x, norm_weight, eps), x
    else:
        h, s = fused.add_rms_norm(x, residual, norm_weight, eps)
    return F.linear(h, weight, bias), s


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """linear(silu(gate) * up) for gate_up = [gate | up]: one kernel where `gemv` applies."""
    if applies(gate_up, weight):
        gemv = _gemv()
        return gemv.gemv(gate_up, weight, bias, mode=gemv.SILU_MUL)[0]
    return F.linear(fused.silu_and_mul(gate_up), weight, bias)
