"""Entry points for a model's linear layers that fuse the op before them at batch 1 on CUDA.

Each takes the unfused path's arguments and runs one `workers.layers.gemv` kernel when
`applies` (one row, CUDA, bf16/fp16; a weight of that dtype, or FP8 with one scale per row;
the kernel options' `one_row_gemv`, which `MANTA_GEMV=0` turns off for comparisons), else the
torch ops the CPU path and larger batches use. This module imports no Triton: the kernel module
is imported on the first CUDA call.

Without tensor parallelism down_proj also adds its output to the residual stream and sums its
squares (`linear_add` -> `Summed`), and the next layer's qkv product normalises with those sums
(`norm_linear`) instead of reading the whole row in every program (o_proj's add stays in the
norm kernel before gate/up, measured faster).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from attention import kernel_options
from workers.layers import fp8, fused, gemv_launch, lt_bias


def enabled() -> bool:
    """Off (`KernelOptions.one_row_gemv`): every one-row product on the unfused torch ops."""
    return kernel_options.current().one_row_gemv


def applies(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> bool:
    """True where `gemv` runs: one row, CUDA, bf16/fp16, a weight with contiguous rows of x's
    dtype or FP8 with one scale per row (`scale`, the layer's `weight_scale`)."""
    if fp8.is_fp8(weight):
        fits = scale is not None and scale.dim() == 2 and scale.shape[1] == 1 and scale.dtype == torch.float32
    else:
        fits = x.dtype == weight.dtype
    return (enabled() and fits and x.is_cuda and x.dim() == 2 and x.shape[0] == 1
            and x.dtype in (torch.bfloat16, torch.float16) and weight.stride(1) == 1)


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             scale: torch.Tensor | None) -> torch.Tensor:
    """The unfused product: F.linear (with cuBLASLt's zero bias where `lt_bias` applies), or an
    FP8 weight's with its per-row `scale`."""
    if scale is None:
        return lt_bias.linear(x, weight, bias)
    return fp8.linear(x, weight, scale, weight.shape[1], bias)


class Summed(NamedTuple):
    """A one-row residual stream just written by a product (`linear_add`), with the float32
    sums of its squares over that product's blocks of rows: the next RMSNorm's statistic,
    already summed where the row was produced (`norm_linear` reads it)."""

    row: torch.Tensor
    square_sums: torch.Tensor


@dataclass(frozen=True)
class RopeKV:
    """What a one-row qkv product needs to finish the job `workers.layers.rope_store` does after
    it: RoPE on its q and k heads (cos/sin [max_pos, head_dim / 2] float32 at `positions`) and
    its k and v heads written to the caches ([slots, kv_heads, head_dim]) at slot `loc`. Given
    by `RotaryEmbedding.fused_qkv_target`; the product's epilogue does it (`gemv`)."""

    positions: torch.Tensor
    loc: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


def _rope_kv(qkv: torch.Tensor, rope: RopeKV) -> torch.Tensor:
    """The unfused ops of the RoPE epilogue on a qkv row: rotate q and k, write k and v."""
    d, hq, hk = rope.head_dim, rope.num_q_heads, rope.num_kv_heads
    q, k, v = qkv.view(-1, hq + 2 * hk, d).split([hq, hk, hk], dim=1)
    q, k = fused.rope(rope.positions, q, k, rope.cos, rope.sin)
    rope.k_cache[rope.loc] = k
    rope.v_cache[rope.loc] = v
    return torch.cat([q, k, v], dim=1).view_as(qkv)


def _gemv():
    from workers.layers import gemv

    return gemv


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, *, scale: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear (then cast to `out_dtype`), through `gemv` where it applies: one kernel. `scale`:
    an FP8 weight's per-row scales [N, 1] (in every entry point here)."""
    if applies(x, weight, scale):
        return _gemv().gemv(x, weight, bias, out_dtype=out_dtype, scale=scale)[0]
    y = _product(x, weight, bias, scale)
    return y if out_dtype is None else y.to(out_dtype)


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, bias: torch.Tensor | None,
                        rope: RopeKV | None = None, *, scale: torch.Tensor | None = None, glu: bool = False,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(RMSNorm(x + residual)), x + residual); residual None: (linear(RMSNorm(x)), x).
    Where `gemv` applies: one kernel, or for wide outputs a one-row norm kernel and a plain
    product (`gemv_launch.fuse_norm`); else the fused-elementwise norm and F.linear. With `rope` (a
    qkv product) the q, k heads come out rotated and k, v are in the caches; with `glu` (a gate/up
    product) the first output is silu(gate) * up, in the product's epilogue where `gemv` applies."""
    if applies(x, weight, scale):
        gemv = _gemv()
        if gemv_launch.fuse_norm(*weight.shape):
            y, s = gemv.gemv(x, weight, bias, mode=gemv.ADD_RMS, residual=residual, norm_weight=norm_weight, eps=eps,
                             rope=rope, glu=glu, scale=scale)
        else:
            h, s = gemv.add_rms_norm(x, residual, norm_weight, eps)
            y = gemv.gemv(h, weight, bias, rope=rope, glu=glu, scale=scale)[0]
        return y, (x if s is None else s)
    if residual is None:
        h, s = fused.rms_norm(x, norm_weight, eps), x
    else:
        h, s = fused.add_rms_norm(x, residual, norm_weight, eps)
    y = _product(h, weight, bias, scale)
    if glu:
        y = fused.silu_and_mul(y)
    return (y if rope is None else _rope_kv(y, rope)), s


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
                    scale: torch.Tensor | None = None) -> torch.Tensor:
    """linear(silu(gate) * up) for gate_up = [gate | up]: one kernel where `gemv` applies."""
    if applies(gate_up, weight, scale):
        gemv = _gemv()
        return gemv.gemv(gate_up, weight, bias, mode=gemv.SILU_MUL, scale=scale)[0]
    return _product(fused.silu_and_mul(gate_up), weight, bias, scale)


def linear_add(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, *,
               silu_mul: bool = False, scale: torch.Tensor | None = None) -> Summed:
    """residual + linear(x) (x = silu(gate) * up of x = [gate | up] with `silu_mul`), rounded as
    the unfused add: one kernel that also sums the result's squares where `gemv` applies."""
    if applies(x, weight, scale):
        gemv = _gemv()
        return Summed(*gemv.gemv_add(x, weight, bias, residual, mode=gemv.SILU_MUL if silu_mul else gemv.PLAIN,
                                     scale=scale))
    s = residual + _product(fused.silu_and_mul(x) if silu_mul else x, weight, bias, scale)
    return Summed(s, s.float().pow(2).sum(-1))


def norm_linear(summed: Summed, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                bias: torch.Tensor | None, rope: RopeKV | None = None, *,
                scale: torch.Tensor | None = None) -> torch.Tensor:
    """linear(RMSNorm(summed.row)), taking the row's squares from `summed` where `gemv` applies;
    `rope` as in `add_rms_norm_linear`."""
    if applies(summed.row, weight, scale):
        gemv = _gemv()
        return gemv.gemv(summed.row, weight, bias, mode=gemv.NORM, norm_weight=norm_weight, eps=eps,
                         square_sums=summed.square_sums, rope=rope, scale=scale)[0]
    y = _product(fused.rms_norm(summed.row, norm_weight, eps), weight, bias, scale)
    return y if rope is None else _rope_kv(y, rope)


def rms_norm(x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of a row: the one-row norm kernel where `gemv` applies (it keeps the step's PDL
    chain), else the fused-elementwise op."""
    if applies(x, norm_weight.view(1, -1)):
        return _gemv().add_rms_norm(x, None, norm_weight, eps)[0]
    return fused.rms_norm(x, norm_weight, eps)
