"""Absorbed MLA decode in Triton, split over the keys (flash-decoding).

Every head attends over the one shared latent per token (MQA): k = [latent, k_pe] (L + R
dims) and v = latent (the first L dims of the same cache row), so each cache row is loaded once
and serves both the scores and the output. Stage 1 (grid B x ceil(H / BLOCK_H) x num_splits)
writes a partial (output, log-sum-exp) per head and split; stage 2 is the merge of
`attention.triton_decode`. CUDA-graph safety as there: the grid depends only on B, H and
`num_splits`, and each program reads its request's length on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention import pdl
from attention.decode_splits import VARYING, merge_splits, split_bounds
from attention.triton_decode import LOG2E, choose_num_splits, compute_dtype, dot_precision

# Tokens per latent block (a [BLOCK_N, L] bf16 tile is 32 KB at L = 512; float32 caches take
# half as many tokens) and heads per program.
MLA_BLOCK_N = 32
MLA_BLOCK_H = 16


@triton.jit(do_not_specialize=VARYING)
def _mla_stage1(
    Q, KV, PageTable, SeqLens, MidO, MidLse,
    sm_scale_log2, num_heads, num_splits,
    stride_qb, stride_qh,
    stride_kvt,
    stride_pb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    LORA: tl.constexpr, ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr, PDL: tl.constexpr,
):
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    b = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    start, end, _ = split_bounds(seq_len, split, num_splits, BLOCK_N)
    if start < end:
        heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_h = heads < num_heads
        offs_l = tl.arange(0, BLOCK_L)
        offs_r = tl.arange(0, BLOCK_R)
        mask_l = offs_l < LORA
        mask_r = offs_r < ROPE
        q_row = Q + b * stride_qb + heads[:, None] * stride_qh
        q_lat = tl.load(q_row + offs_l[None, :], mask=mask_h[:, None] & mask_l[None, :], other=0.0)
        q_pe = tl.load(q_row + LORA + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
        page_row = PageTable + b * stride_pb
        for t0 in range(start, end, BLOCK_N):
            offs_n = t0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            page = tl.load(page_row + offs_n // PAGE_SIZE, mask=mask_n, other=0)
            row = KV + (page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE)[:, None] * stride_kvt
            # (an FP8 cache widened to q's dtype: its scale is folded into sm_scale and the output)
            lat = tl.load(row + offs_l[None, :], mask=mask_n[:, None] & mask_l[None, :], other=0.0).to(q_lat.dtype)
            pe = tl.load(row + LORA + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :], other=0.0).to(q_pe.dtype)
            s = tl.dot(q_lat, tl.trans(lat), input_precision=DOT_PREC)
            s = tl.dot(q_pe, tl.trans(pe), s, input_precision=DOT_PREC) * sm_scale_log2
            s = tl.where(mask_n[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every block holds a key
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat, input_precision=DOT_PREC)
            m_i = m_new
        o_ptrs = MidO + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_l[None, :]
        tl.store(o_ptrs, acc / l_i[:, None], mask=mask_h[:, None] & mask_l[None, :])
        tl.store(MidLse + b * stride_lb + heads * stride_lh + split, m_i + tl.log2(l_i), mask=mask_h)


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    scaling: float,
    page_size: int,
    kv_lora_rank: int,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode: one latent-space query per request over its cached latents.

    q: [B, H, L + R] (= [q_nope W_UK, q_pe]); kv_cache: [slots, 1, L + R] (latent, k_pe; slot =
    page * page_size + offset; last dim contiguous); page_table: [B, max_pages] page ids;
    cache_seqlens: [B] int32 (device); L = kv_lora_rank. Returns `out` (or a new tensor):
    [B, H, L] in q's dtype. num_splits as in `attention.triton_decode.paged_decode`."""
    batch, heads, width = q.shape
    lora, rope = kv_lora_rank, width - kv_lora_rank
    if kv_cache.shape[-1] != width or rope < 0:
        raise ValueError(f"q has {width} dims, the cache {kv_cache.shape[-1]}, kv_lora_rank {lora}")
    if kv_cache.stride(-1) != 1:
        raise ValueError("mla_decode needs a cache with a contiguous last dim")
    if out is None:
        out = q.new_empty(batch, heads, lora)
    if batch == 0:
        return out
    q = q.to(compute_dtype(q, kv_cache))
    if q.stride(-1) != 1:
        q = q.contiguous()
    head_blocks = triton.cdiv(heads, MLA_BLOCK_H)
    if num_splits is None:
        num_splits = choose_num_splits(batch * head_blocks, page_table.shape[1] * page_size, q.device)
    mid_o = torch.empty(batch, heads, num_splits, lora, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    block_n = MLA_BLOCK_N // 2 if q.dtype == torch.float32 else MLA_BLOCK_N
    use_pdl = pdl.enabled(q.device)
    _mla_stage1[(batch, head_blocks, num_splits)](
        q, kv_cache, page_table, cache_seqlens, mid_o, mid_lse,
        scaling * LOG2E, heads, num_splits,
        q.stride(0), q.stride(1),
        kv_cache.stride(0),
        page_table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        LORA=lora, ROPE=rope, PAGE_SIZE=page_size,
        BLOCK_H=MLA_BLOCK_H,
        BLOCK_L=max(16, triton.next_power_of_2(lora)),
        BLOCK_R=max(16, triton.next_power_of_2(max(rope, 1))),
        BLOCK_N=block_n,
        DOT_PREC=dot_precision(q.dtype), PDL=use_pdl,
        num_warps=8 if lora >= 256 else 4, num_stages=2, launch_pdl=use_pdl,
    )
    merge_splits(mid_o, mid_lse, cache_seqlens, out, block_n)
    return out
