"""Stage 1 of the paged decode over an FP8 cache with the keys on the MMA's M side (Hopper).

`attention.triton_decode._decode_stage1` puts a KV head's query heads on the M side of its
products (GROUP of them, padded to 16) and so runs `mma.sync` on float16: every cached e4m3
element is widened in registers before it meets a tensor core, and at serve batches that
widening, not the memory, bounds the kernel (BENCHMARKS.md, 2026-12-02: the FP8 cache at ~80% of
the copy bandwidth where bf16's reaches ~90%).

Here a program computes S^T = K q^T, with a block of BLOCK_N = 64 keys on the M side of one
warpgroup's `wgmma`, so the keys go from shared memory to the tensor cores as e4m3, unwidened
(`wgmma ... e4m3.e4m3`). That needs q in e4m3 too: each query head is quantized per head in the
kernel, q = s_q q8 with s_q = max|q| / 448, and s_q multiplies its column of scores (the
round-off this adds to each score is the same kind the e4m3 keys already add: what FA3's FP8
path and vLLM's FP8 attention do to q). The values are widened to float16 as before, and
O^T = V^T P^T runs on float16 `wgmma` with the values on the M side again. The split-K and merge
are the other decodes' (`attention.decode_splits`): the partials are the same.

`paged_decode` sends an FP8 cache here where `mma_applies` (the kernel option `fp8_kv_mma`,
`MANTA_FP8_KV_MMA=1`, off by default: 3-5% slower than the shipped loads on an H100; a Hopper GPU or Triton's
interpreter; 16-bit queries; decode batches of at least MIN_PROGRAMS (request, KV head) pairs;
head dims of 17 to 256, value dims up to 256).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from attention import kernel_options, pdl
from attention.decode_blocks import _block_slots, _first_block, _load_block
from attention.decode_splits import VARYING, _merge_if_last, _zero_output, split_bounds

BLOCK_N = 64  # keys a block: one warpgroup's wgmma M side
STAGES = 3  # (not measured: a guess for the first GPU sweep)
# Fewest (request, KV head) programs it takes: below, the words launch of `triton_decode` issues
# fewer instructions a block (1,650 warp-instructions against 1,928, `scripts/decode_sass.py`).
MIN_PROGRAMS = 65
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def mma_applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the FP8 cache's decode runs here: the option on, an e4m3 cache under 16-bit
    queries, at least MIN_PROGRAMS (request, KV head) pairs, head dims of 17-256 (e4m3 wgmma
    takes K in 32s; past 256 the tiles outgrow the registers), on a Hopper GPU (or the
    interpreter)."""
    if not kernel_options.current().fp8_kv_mma or k_cache.dtype != torch.float8_e4m3fn:
        return False
    if q.shape[0] * k_cache.shape[1] < MIN_PROGRAMS:
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or not 17 <= q.shape[-1] <= 256 or v_cache.shape[-1] > 256:
        return False
    if _INTERPRETED:
        return True
    return q.is_cuda and _hopper(q.device.index if q.device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=8)
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


@triton.jit
def _quantize_heads(q):
    """(q8, s_q): q [BLOCK_H, D] float32 as e4m3 with one scale per head (row), s_q = max|q| / 448
    (heads of zeros get scale 1)."""
    amax = tl.max(tl.abs(q), 1)
    s_q = tl.where(amax > 0, amax / 448.0, 1.0)
    q8 = (q / s_q[:, None]).to(tl.float8e4nv)
    return q8, s_q


@triton.jit
def _attend_block_t(q8, sq_log2, k8, v, mask_n, m_i, l_i, acc_t):
    """One block into the online softmax with keys on the M side: scores S^T [BLOCK_N, BLOCK_H]
    from e4m3 keys and queries (`sq_log2`: each head's s_q times the softmax scale, base 2), then
    acc_t [BLOCK_DV, BLOCK_H] += V^T P^T in float16."""
    s = tl.dot(k8, tl.trans(q8)) * sq_log2[None, :]
    s = tl.where(mask_n[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))  # every block holds a key: finite
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[None, :])
    l_i = l_i * alpha + tl.sum(p, 0)
    acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(v.to(tl.float16)), p.to(tl.float16))
    return m_new, l_i, acc_t


@triton.jit(do_not_specialize=VARYING)
def _decode_stage1_t(
    Q, K, V, PageTable, SeqLens, MidO, MidLse, Out, Counters,
    sm_scale_log2, num_splits,
    stride_qb, stride_qh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_pb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    stride_outb, stride_outh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr, MERGE: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_G: tl.constexpr, CHUNK_S: tl.constexpr, EARLY: tl.constexpr, WIDEN: tl.constexpr,
):
    """`triton_decode._decode_stage1`'s grid, arguments and outputs (the partials, the merge by
    the last split to arrive, EARLY's loads before the PDL wait), for an e4m3 cache: module
    docstring."""
    pdl.launch_dependents(PDL)
    if not EARLY:
        pdl.wait(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    start, end, per_split = split_bounds(seq_len, split, num_splits, BLOCK_N)
    offs_h = tl.arange(0, BLOCK_H)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_h = offs_h < GROUP
    mask_dv = offs_dv < V_DIM
    heads = kvh * GROUP + offs_h
    if start < end:
        page_row = PageTable + b * stride_pb
        k, v, mask_n = _first_block(K, V, page_row, kvh, start, end, seq_len, stride_kt, stride_kh, stride_vt,
                                    stride_vh, HEAD_DIM, V_DIM, PAGE_SIZE, BLOCK_N, BLOCK_D, BLOCK_DV, False, WIDEN,
                                    EARLY, PDL)  # the keys as e4m3
        offs_d = tl.arange(0, BLOCK_D)
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_h[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0).to(tl.float32)
        q8, s_q = _quantize_heads(q)
        sq_log2 = s_q * sm_scale_log2
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc_t = tl.zeros([BLOCK_DV, BLOCK_H], tl.float32)
        m_i, l_i, acc_t = _attend_block_t(q8, sq_log2, k, v, mask_n, m_i, l_i, acc_t)
        for t0 in range(start + BLOCK_N, end, BLOCK_N):
            slot, mask_n = _block_slots(page_row, t0, end, PAGE_SIZE, BLOCK_N)
            k = _load_block(K, slot, stride_kt, kvh * stride_kh, mask_n, HEAD_DIM, BLOCK_N, BLOCK_D, False, False)
            v = _load_block(V, slot, stride_vt, kvh * stride_vh, mask_n, V_DIM, BLOCK_N, BLOCK_DV, WIDEN, False)
            m_i, l_i, acc_t = _attend_block_t(q8, sq_log2, k, v, mask_n, m_i, l_i, acc_t)
        o_ptrs = MidO + b * stride_ob + heads[None, :] * stride_oh + split * stride_os + offs_dv[:, None]
        tl.store(o_ptrs, acc_t / l_i[None, :], mask=mask_h[None, :] & mask_dv[:, None])
        tl.store(MidLse + b * stride_lb + heads * stride_lh + split, m_i + tl.log2(l_i), mask=mask_h)
        if MERGE:
            _merge_if_last(MidO, MidLse, Out, Counters, b, kvh, seq_len, per_split,
                           stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
                           GROUP, V_DIM, BLOCK_G, BLOCK_DV, BLOCK_S, CHUNK_S)
    elif MERGE and split == 0 and seq_len == 0:
        _zero_output(Out, b, heads, mask_h, stride_outb, stride_outh, V_DIM, BLOCK_H, BLOCK_DV, EARLY, PDL)
