"""RMSNorm, computed in float32 and cast back, as HF Llama does."""

from __future__ import annotations

import torch
from torch import nn

from workers.layers.linear import make_param


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)); the normalisation runs in float32 and is cast
    to x's dtype before the (replicated) weight is applied."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = make_param((hidden_size,), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden_size] (the last dim is normalised: a head for per-head q/k norms)."""
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
