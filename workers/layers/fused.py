"""Elementwise pieces of a decoder layer, fused on CUDA.

Each function is written once in plain torch (the exact math the CPU path and the tests use)
and, for CUDA tensors, run through `torch.compile`, which fuses it into one Triton kernel. A
decode step of an 8B model otherwise launches ~40 tiny kernels per layer (RMSNorm alone is
seven), which costs more than the layer's matrix products at batch 1. Compiled lazily on the
first CUDA call (before CUDA-graph capture, whose warm-up runs every shape it will capture).
`silu_and_mul` is the exception: on CUDA it is a Triton kernel of its own (`silu_mul.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual
    return _rms_norm(s, weight, eps), s


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
          sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE; cos/sin cast to q's dtype before use, as HF does."""
    cos = cos_cache[positions].unsqueeze(1).to(q.dtype)
    sin = sin_cache[positions].unsqueeze(1).to(q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# Specialisations one process may need per function: each dtype, tensor rank and model family
# (a target and its draft, every checkpoint a test process loads) compiles its own graph. Past
# dynamo's default of 8, a fullgraph compile fails instead of running.
RECOMPILE_LIMIT = 64


@functools.cache
def _compiled(fn: Callable) -> Callable:
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    torch._dynamo.config.accumulated_recompile_limit = max(
        torch._dynamo.config.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT)
    return torch.compile(fn, dynamic=True, fullgraph=True)


def _dispatch(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def call(*args, **kwargs):
        first = args[0] if isinstance(args[0], torch.Tensor) else args[1]
        return (_compiled(fn) if first.is_cuda else fn)(*args, **kwargs)

    return call


rms_norm = _dispatch(_rms_norm)
add_rms_norm = _dispatch(_add_rms_norm)
rope = _dispatch(_rope)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x = [gate | up]: on CUDA a Triton kernel (`workers.layers.silu_mul`:
    the compiled version ran at a third of its bandwidth on prompts)."""
    if x.is_cuda:
        from workers.layers import silu_mul

        return silu_mul.silu_and_mul(x)
    return _silu_and_mul(x)
