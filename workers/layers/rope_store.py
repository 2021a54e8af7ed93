"""RoPE and the KV-cache write in one Triton kernel (CUDA).

A decoder layer rotates q and k, then the attention backend writes k and v into the paged cache:
at batch 1 that is four launches per layer (the rotation of q, of k, the K write, the V write),
each a few microseconds of mostly launch latency, ~0.3 ms of an 8B model's 4.7 ms step. This
kernel does all of it in one launch, one program per token and group of heads: q heads are
rotated in place; k heads are rotated in place and into `k_cache[loc]`, and their v heads
copied into `v_cache[loc]`. A group is one head for a few tokens (a single program per token
would serialise a small batch's heads) and up to 8 heads for many (`heads_per_program`).

The math is `workers.layers.fused.rope`'s (rotate-half, cos/sin cast to q's dtype as HF does,
products in float32, one rounding at the store); `rope_and_store_kv_ref` is that function plus
the plain cache write, the reference the GPU tests compare with. At batch 1 (one row) the qkv
product does the same in its epilogue (`workers.layers.gemv`, `one_row.RopeKV`) and this kernel
is not launched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention import pdl
from workers import kv_quant
from workers.layers import fused


# Each program loads one position and one slot: their alignment does not matter, and not
# specialising on it keeps an eager prefill (positions at any offset of the step's packed input
# buffer) on the variant the decode graphs compiled, not a compile at the first odd-length prompt.
@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "loc_ptr"])
def _rope_store_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, loc_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcs, stride_kch, stride_vcs, stride_vch, stride_cos, k_inv_scale, v_inv_scale,
    HQ: tl.constexpr, HB: tl.constexpr, HALF: tl.constexpr, DV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_DV: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):
    """Program (t, g): token t's q heads g*HB ... (g*HB < HQ), else its k/v heads from
    g*HB - HQ; HB divides both head counts, so a program's heads are all q or all k/v."""
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1) * HB
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    col_mask = offs < HALF
    heads = tl.arange(0, HB)[:, None]
    mask = col_mask[None, :] & (heads < HB)
    is_q = h0 < HQ
    kh = h0 - HQ + heads
    ptr = tl.where(is_q, q_ptr + t * stride_qt + (h0 + heads) * stride_qh, k_ptr + t * stride_kt + kh * stride_kh)
    x1 = tl.load(ptr + offs[None, :], mask=mask, other=0.0)
    x2 = tl.load(ptr + HALF + offs[None, :], mask=mask, other=0.0)
    dtype = x1.dtype
    # HF casts cos/sin to q's dtype before the products.
    cos = tl.load(cos_ptr + pos * stride_cos + offs, mask=col_mask, other=0.0).to(dtype).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + offs, mask=col_mask, other=0.0).to(dtype).to(tl.float32)[None, :]
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    y1 = (a * cos - b * sin).to(dtype)
    y2 = (b * cos + a * sin).to(dtype)
    tl.store(ptr + offs[None, :], y1, mask=mask)
    tl.store(ptr + HALF + offs[None, :], y2, mask=mask)
    if not is_q:
        loc = tl.load(loc_ptr + t).to(tl.int64)
        kc = kc_ptr + loc * stride_kcs + kh * stride_kch
        _store_cache(kc + offs[None, :], y1, k_inv_scale, mask, FP8)
        _store_cache(kc + HALF + offs[None, :], y2, k_inv_scale, mask, FP8)
        offs_v = tl.arange(0, BLOCK_DV)[None, :]
        vmask = (offs_v < DV) & (heads < HB)
        v = tl.load(v_ptr + t * stride_vt + kh * stride_vh + offs_v, mask=vmask)
        _store_cache(vc_ptr + loc * stride_vcs + kh * stride_vch + offs_v, v, v_inv_scale, vmask, FP8)


# From this many tokens on, a program rotates several heads of its token (`heads_per_program`).
WIDE_FROM_TOKENS = 32
MAX_HEADS_PER_PROGRAM = 8


def heads_per_program(tokens: int, hq: int, hk: int) -> int:
    """Heads one program rotates: 1 for a few tokens (every head its own program keeps a small
    decode batch spread over the SMs), else the largest power of two up to 8 that divides both
    head counts. One head a program is 128 values of work: at a 2,048-token prompt that was
    82k programs of one warp, 8x the kernel's bandwidth time (H200 profile, BENCHMARKS.md)."""
    if tokens < WIDE_FROM_TOKENS:
        return 1
    hb = 1
    while hb < MAX_HEADS_PER_PROGRAM and hq % (2 * hb) == 0 and hk % (2 * hb) == 0:
        hb *= 2
    return hb


@triton.jit
def _store_cache(ptr, x, inv_scale, mask, FP8: tl.constexpr):
    """Store x as the cache keeps it: as it is, or (FP8) x / scale saturated (`workers.kv_quant`)."""
    if FP8:
        tl.store(ptr, tl.clamp(x.to(tl.float32) * inv_scale, -448.0, 448.0).to(tl.float8e4nv), mask=mask)
    else:
        tl.store(ptr, x, mask=mask)


def can_fuse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             cos_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors (else: rope, then the plain write): caches of the
    activations' dtype, or FP8."""
    return (q.is_cuda and q.dtype == k.dtype == v.dtype and k_cache.dtype == v_cache.dtype
            and (k_cache.dtype == q.dtype or kv_quant.is_fp8(k_cache.dtype))
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and cos_cache.is_contiguous() and cos_cache.shape[-1] * 2 == q.shape[-1] == k.shape[-1])


def rope_and_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cos_cache: torch.Tensor, sin_cache: torch.Tensor, loc: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> None:
    """In place: q [T, Hq, D] and k [T, Hk, D] rotated; k_cache[loc] = rotated k,
    v_cache[loc] = v [T, Hk, Dv] (FP8 caches: divided by k_scale / v_scale and saturated).
    cos/sin caches: [max_pos, D/2] float32."""
    T, HQ, D = q.shape
    HK, DV = k.shape[1], v.shape[2]
    if T == 0:
        return
    use_pdl = pdl.enabled(q.device)
    hb = heads_per_program(T, HQ, HK)
    _rope_store_kernel[(T, (HQ + HK) // hb)](
        q, k, v, positions, loc, cos_cache, sin_cache, k_cache, v_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), cos_cache.stride(0),
        1.0 / k_scale, 1.0 / v_scale,
        HQ=HQ, HB=hb, HALF=D // 2, DV=DV, BLOCK_HALF=triton.next_power_of_2(D // 2),
        BLOCK_DV=triton.next_power_of_2(DV), FP8=kv_quant.is_fp8(k_cache.dtype), PDL=use_pdl,
        num_warps=1 if hb == 1 else 4,
        launch_pdl=use_pdl,
    )


def rope_and_store_kv_ref(positions, q, k, v, cos_cache, sin_cache, loc, k_cache, v_cache, k_scale=1.0,
                          v_scale=1.0):
    """The unfused reference: returns rotated (q, k) and writes the caches as the backend does."""
    q, k = fused.rope(positions, q, k, cos_cache, sin_cache)
    if kv_quant.is_fp8(k_cache.dtype):
        k_cache.view(torch.uint8)[loc] = kv_quant.quantize(k, k_scale).view(torch.uint8)
        v_cache.view(torch.uint8)[loc] = kv_quant.quantize(v, v_scale).view(torch.uint8)
    else:
        k_cache[loc] = k
        v_cache[loc] = v
    return q, k
