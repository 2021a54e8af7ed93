"""RMSNorm (as HF Llama) and LayerNorm (as HF BERT), computed in float32 and cast back."""

from __future__ import annotations

import torch
from torch import nn

from workers.layers import fp8, fused
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
        return fused.rms_norm(x, self.weight, self.eps)

    def forward_with_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one fused kernel on CUDA."""
        return fused.add_rms_norm(x, residual, self.weight, self.eps)

    def forward_for(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None
                    ) -> tuple[torch.Tensor | fp8.Fp8Rows, torch.Tensor]:
        """(norm(x + residual), x + residual), or without a residual (norm(x), x), the norm's
        output as `layer`'s product takes it: quantized per row by the norm's own kernel where
        the product would do that to it (`fp8.takes_rows`: FP8 weights, W8A8 batches), else as
        `forward_with_residual` gives it."""
        if fp8.takes_rows(layer, x):
            from workers.layers import quant_rows

            return quant_rows.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self(x), x
        return self.forward_with_residual(x, residual)


class LayerNorm(nn.Module):
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the last dim (replicated
    parameters), computed in float32 and cast back to x's dtype."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = make_param((hidden_size,), dtype, device)
        self.bias = make_param((hidden_size,), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.layer_norm(
            x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps
        )
        return h.to(x.dtype)
