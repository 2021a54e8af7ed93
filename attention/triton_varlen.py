"""Varlen causal attention forward in Triton, for prompt steps on Hopper GPUs.

The arguments are `attention.gpu_prefill._aten_flash`'s: q [Tq, H, D] (rows at any stride, e.g. a
slice of the fused qkv product), k and v [Tk, Hkv, D] gathered per request in batch order,
cumulative lengths cu_q / cu_k [B + 1] int32. Request b's queries are the *last* q_len of its
kv_len positions (so a causal call needs kv_len >= q_len, as every caller's has), and the causal
mask is bottom-right aligned: query r sees keys 0 .. kv_len - q_len + r. GQA: query head h reads
K/V head h // (H / Hkv). The last dim of q, k, v is contiguous; offsets within one request's K/V
are 32-bit (`varlen_attention` refuses a request whose K/V span 2^31 elements).

Why it exists: ATen's FlashAttention (FA2) reaches ~170-320 TFLOP/s on an H200 at the prompt
shapes of the 8B model (BENCHMARKS.md); this kernel is FA2's algorithm written for Triton's
Hopper code generation (warp-group MMAs, software-pipelined K/V tiles):
- a program is BLOCK_M queries of one head of one request. The grid is (heads, query blocks,
  requests) with query blocks in reverse, so the longest causal rows start first and the
  programs of one K/V head run side by side (their K/V tiles are shared in L2);
- the keys every query of the block sees (all before the block's first query) are walked
  without a mask, then the last few tiles with one;
- the softmax is online in base 2, the scale folded into one multiply.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attention.triton_decode import LOG2E


@dataclass(frozen=True)
class VarlenLaunch:
    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3


DEFAULT_LAUNCH = VarlenLaunch()
# The GPU tests cover head dims up to 128 (padded to a power of two); the H200 runs measured 128
# only. `gpu_prefill.RaggedFlashExtend` sends the kernel the measured dims (`takes`), others to
# the FlashAttention the GPU would use without it (a padded dim does masked, wider dots).
MAX_HEAD_DIM = 128
MEASURED_HEAD_DIMS = (128,)


@triton.jit
def _tile(q, k_ptrs, v_ptrs, acc, m_i, l_i, n0, q_pos, kv_len, qk_scale, offs_n, dmask,
          MASKED: tl.constexpr, CAUSAL: tl.constexpr, stride_kt, stride_vt):
    """One BLOCK_N tile of keys at n0: scores, online softmax, weighted values. MASKED tiles
    mask the keys past kv_len (and the causal ones) and a padded head dim's columns."""
    if MASKED:
        live = (n0 + offs_n) < kv_len
        k = tl.load(k_ptrs + n0 * stride_kt, mask=live[:, None] & dmask[None, :], other=0.0)
        v = tl.load(v_ptrs + n0 * stride_vt, mask=live[:, None] & dmask[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs + n0 * stride_kt)
        v = tl.load(v_ptrs + n0 * stride_vt)
    s = tl.dot(q, tl.trans(k))
    if MASKED:
        keep = live[None, :]
        if CAUSAL:
            keep = keep & ((n0 + offs_n)[None, :] <= q_pos[:, None])
        s = tl.where(keep, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row that sees no key yet keeps m = -inf: subtract 0 there, not -inf (NaN)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_safe = m_new
        p = tl.exp2(s * qk_scale - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def _varlen_fwd_kernel(
    Q, K, V, Out, CuQ, CuK, qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    h = tl.program_id(0)
    mb = tl.num_programs(1) - 1 - tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(CuQ + b)
    q_len = tl.load(CuQ + b + 1) - q_start
    m0 = mb * BLOCK_M
    if m0 < q_len:
        k_start = tl.load(CuK + b)
        kv_len = tl.load(CuK + b + 1) - k_start
        offset = kv_len - q_len  # query r sits at key position offset + r
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        dmask = offs_d < HEAD_DIM
        qmask = offs_m < q_len
        tok_q = (q_start + offs_m).to(tl.int64)
        q = tl.load(Q + tok_q[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                    mask=qmask[:, None] & dmask[None, :], other=0.0)
        kvh = h // GROUP
        k_ptrs = K + (k_start + offs_n).to(tl.int64)[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :]
        v_ptrs = V + (k_start + offs_n).to(tl.int64)[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :]
        q_pos = offset + offs_m
        if CAUSAL:
            hi = tl.minimum(kv_len, offset + m0 + BLOCK_M)
            free = (offset + m0) // BLOCK_N * BLOCK_N  # every query of the block sees these keys
        else:
            hi = kv_len
            free = kv_len // BLOCK_N * BLOCK_N
        if BLOCK_D != HEAD_DIM:  # a padded head dim: every tile masks its columns past HEAD_DIM
            free = 0
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(0, free, BLOCK_N):
            acc, m_i, l_i = _tile(q, k_ptrs, v_ptrs, acc, m_i, l_i, n0, q_pos, kv_len, qk_scale, offs_n, dmask,
                                  False, CAUSAL, stride_kt, stride_vt)
        for n0 in range(free, hi, BLOCK_N):
            acc, m_i, l_i = _tile(q, k_ptrs, v_ptrs, acc, m_i, l_i, n0, q_pos, kv_len, qk_scale, offs_n, dmask,
                                  True, CAUSAL, stride_kt, stride_vt)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(Out + tok_q[:, None] * stride_ot + h * stride_oh + offs_d[None, :], out.to(Out.dtype.element_ty),
                 mask=qmask[:, None] & dmask[None, :])


def takes(q: torch.Tensor, kv_heads: int, max_k: int) -> bool:
    """Whether the prefill sends this call here: fp16/bf16, a measured head dim, q's last dim
    contiguous, and each request's gathered K/V ([kv_len, kv_heads, D]) within 32-bit offsets."""
    d = q.shape[-1]
    return (q.dtype in (torch.float16, torch.bfloat16) and d in MEASURED_HEAD_DIMS and q.stride(-1) == 1
            and max_k * kv_heads * d < 2**31)


def varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, scaling, causal, launch: VarlenLaunch | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """`_aten_flash`'s arguments and result ([Tq, H, D] in q's dtype, D <= MAX_HEAD_DIM; into
    `out` if given); see the module docstring."""
    total, heads, d = q.shape
    if out is None:
        out = torch.empty(total, heads, d, dtype=q.dtype, device=q.device)
    if total == 0:
        return out
    if d > MAX_HEAD_DIM or q.dtype not in (torch.float16, torch.bfloat16) or not k.dtype == v.dtype == q.dtype:
        raise ValueError(f"varlen_attention: head dim {d}, {q.dtype} q, {k.dtype} K/V; takes fp16/bf16 up to "
                         f"{MAX_HEAD_DIM}, K/V as q")
    if not q.stride(-1) == k.stride(-1) == v.stride(-1) == out.stride(-1) == 1 or tuple(out.shape) != (total, heads, d):
        raise ValueError("varlen_attention: q, k, v and out need a contiguous last dim (and out q's shape)")
    if max_k * max(k.stride(0), v.stride(0)) >= 2**31:
        raise ValueError(f"varlen_attention: {max_k} keys of a request span 2^31 elements of K/V (32-bit offsets)")
    cfg = launch or DEFAULT_LAUNCH
    block_d = max(16, triton.next_power_of_2(d))
    grid = (heads, triton.cdiv(max(max_q, 1), cfg.block_m), cu_q.shape[0] - 1)
    _varlen_fwd_kernel[grid](
        q, k, v, out, cu_q, cu_k, scaling * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        GROUP=heads // k.shape[1], HEAD_DIM=d, BLOCK_D=block_d, CAUSAL=bool(causal),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
