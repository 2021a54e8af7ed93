"""An MLA layer's work between its projections and the absorbed decode, as one Triton kernel.

In decode, after q = q_proj(x) and [latent | k_pe] = kv_a_proj_with_mqa(x), a DeepSeek layer
normalises the latent (kv_a_layernorm), rotates q_pe and k_pe (interleaved pairs, stored as
[rotated evens | rotated odds]: `workers.models.deepseek._rope`), joins the latent and k_pe into
the cache entry and writes it at the step's slot. As torch ops that is ~25 kernels of ~1.5 us
each inside a CUDA graph (DeepSeek-V2-Lite shape on an H200: ~38 us of a 227 us layer,
BENCHMARKS.md). Here one program per token does all of it: the entry goes straight to the cache
and the rotated q_pe [T, H, R] comes back for the absorbed query.

The math is the unfused path's, rounding included: RMSNorm in float32, cast, times the weight
(`fused._rms_norm`); the rotation in float32 then cast (V2, `fp32=True`) or op by op in the
activations' dtype with the cos/sin cast to it (V3). Used for caches of the activations' dtype
(an FP8 cache keeps the torch path: its quantizing write). Tested against `_rope`, RMSNorm and
`set_mla_kv_buffer` (tests/test_mla_rope_store.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention import pdl


@triton.jit
def _rotate(x1, x2, cos, sin, FP32: tl.constexpr):
    """(x1 cos - x2 sin, x2 cos + x1 sin) rounded to x's dtype as the unfused ops round."""
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    if FP32:
        c, s = cos.to(tl.float32), sin.to(tl.float32)
        return (a * c - b * s).to(x1.dtype), (b * c + a * s).to(x1.dtype)
    # each op in x's dtype: float32 math rounded after every op (cos/sin rounded first)
    c, s = cos.to(x1.dtype).to(tl.float32), sin.to(x1.dtype).to(tl.float32)
    r1 = ((a * c).to(x1.dtype).to(tl.float32) - (b * s).to(x1.dtype).to(tl.float32)).to(x1.dtype)
    r2 = ((b * c).to(x1.dtype).to(tl.float32) + (a * s).to(x1.dtype).to(tl.float32)).to(x1.dtype)
    return r1, r2


@triton.jit
def _mla_rope_store_kernel(
    Q, KVA, NormW, Cos, Sin, Pos, Loc, Cache, QPe,
    num_heads, eps,
    stride_qt, stride_qh, stride_kt, stride_cos, stride_ct, stride_pt, stride_ph,
    NOPE: tl.constexpr, LORA: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
    FP32: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + t).to(tl.int64)
    slot = tl.load(Loc + t).to(tl.int64)
    j = tl.arange(0, HALF)
    cos = tl.load(Cos + pos * stride_cos + j)
    sin = tl.load(Sin + pos * stride_cos + j)
    # The latent: RMSNorm in float32, cast, times the weight.
    c = tl.arange(0, BLOCK_C)
    cmask = c < LORA
    lat = tl.load(KVA + t * stride_kt + c, mask=cmask, other=0.0)
    h = lat.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, axis=0) / LORA + eps)
    normed = (tl.load(NormW + c, mask=cmask, other=0.0).to(tl.float32) * h.to(lat.dtype).to(tl.float32))
    row = Cache + slot * stride_ct
    tl.store(row + c, normed.to(Cache.dtype.element_ty), mask=cmask)
    # k_pe: pairs (2j, 2j + 1) rotated, stored as [rotated evens | rotated odds].
    k1 = tl.load(KVA + t * stride_kt + LORA + 2 * j)
    k2 = tl.load(KVA + t * stride_kt + LORA + 2 * j + 1)
    r1, r2 = _rotate(k1, k2, cos, sin, FP32)
    tl.store(row + LORA + j, r1.to(Cache.dtype.element_ty))
    tl.store(row + LORA + HALF + j, r2.to(Cache.dtype.element_ty))
    # q_pe of every head, the same way.
    hh = tl.arange(0, BLOCK_H)
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + hh
        hmask = heads[:, None] < num_heads
        q_row = Q + t * stride_qt + heads[:, None] * stride_qh + NOPE
        q1 = tl.load(q_row + 2 * j[None, :], mask=hmask, other=0.0)
        q2 = tl.load(q_row + 2 * j[None, :] + 1, mask=hmask, other=0.0)
        s1, s2 = _rotate(q1, q2, cos[None, :], sin[None, :], FP32)
        out = QPe + t * stride_pt + heads[:, None] * stride_ph + j[None, :]
        tl.store(out, s1, mask=hmask)
        tl.store(out + HALF, s2, mask=hmask)


def applies(q: torch.Tensor, kv_a: torch.Tensor, cache: torch.Tensor, cos_cache: torch.Tensor, rope_dim: int) -> bool:
    """Whether the kernel takes these: CUDA, a cache of the activations' dtype (no FP8 scale),
    a power-of-two rotary dim whose cos/sin rows are contiguous, contiguous last dims."""
    half = rope_dim // 2
    return (q.is_cuda and cache.dtype == q.dtype == kv_a.dtype and q.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and rope_dim % 2 == 0 and half == triton.next_power_of_2(half) and cos_cache.shape[-1] == half
            and cos_cache.stride(-1) == 1 and q.stride(-1) == 1 and kv_a.stride(-1) == 1 and cache.stride(-1) == 1)


def rope_norm_store(
    positions: torch.Tensor, q: torch.Tensor, kv_a: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    cos_cache: torch.Tensor, sin_cache: torch.Tensor, cache: torch.Tensor, loc: torch.Tensor, nope: int, fp32: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, N + R], kv_a [T, C + R] -> q_pe [T, H, R] rotated (into `out`, e.g. a slice of
    the absorbed query, last dim contiguous); cache[loc[t], 0] = [RMSNorm(latent), rotated k_pe]
    (cache [slots, 1, C + R]). `applies` must hold."""
    t, heads, width = q.shape
    rope = width - nope
    lora = kv_a.shape[1] - rope
    q_pe = torch.empty(t, heads, rope, dtype=q.dtype, device=q.device) if out is None else out
    if t == 0:
        return q_pe
    use_pdl = pdl.enabled(q.device)
    _mla_rope_store_kernel[(t,)](
        q, kv_a, norm_weight, cos_cache, sin_cache, positions, loc, cache, q_pe,
        heads, float(eps),
        q.stride(0), q.stride(1), kv_a.stride(0), cos_cache.stride(0), cache.stride(0), q_pe.stride(0),
        q_pe.stride(1),
        NOPE=nope, LORA=lora, HALF=rope // 2, BLOCK_H=min(16, triton.next_power_of_2(heads)),
        BLOCK_C=triton.next_power_of_2(lora), FP32=fp32, PDL=use_pdl, num_warps=4, launch_pdl=use_pdl,
    )  # fmt: skip
    return q_pe
