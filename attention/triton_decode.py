"""Paged decode attention for MHA/GQA/MQA in Triton, split over the keys (flash-decoding).

Stage 1 (grid B x Hkv x num_splits): one program takes one request, one KV head and one
contiguous slice of that request's keys; it loads each K/V block once for all the query heads of
the KV head (GQA), runs an online softmax and writes a partial (output, log-sum-exp) per head. The last program
of a (request, KV head) to finish (an arrival counter, `attention.arrival`) merges the
partials by their log-sum-exps and writes the output: one launch, no second stage. The MLA
decode, and batches with more (request, KV head) pairs than there are counters, keep the
separate merge kernel (`merge_splits`, grid B x H).

CUDA-graph safety: the grid depends only on B, Hkv and `num_splits`, all known on the host
without reading device memory; each program reads its request's length from `cache_seqlens`
and derives its slice from it, so a replay with other lengths and page tables is correct for
any `num_splits` (the split count only changes how the work is spread). Programs whose slice is
empty write nothing and are not counted; the merge reads only the slices that exist.

At one row (batch 1), under programmatic dependent launch, a program loads the length,
page-table entries and first block of keys and values before waiting for its predecessor: only
the newest token's K/V row (written in this forward by the qkv product or the RoPE kernel) and q
are read after the wait, so the cache reads overlap the end of the qkv product
(measured: BENCHMARKS.md). Only at one row: speculative verification replays the decode
graphs with one row per new token (`workers.input_batch.InputBatch.decode_rows`), where a row
reads tokens that other rows write in the same forward; one row reads only its own newest.

The log-sum-exps are kept in base 2 (scores are pre-multiplied by log2(e)) and never leave
this module.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from attention import kernel_options, pdl, triton_decode_mma
from attention.arrival import COUNTERS, arrival_counters
from attention.decode_blocks import _block_slots, _first_block, _load_block
from attention.decode_splits import VARYING, _merge_if_last, _zero_output, merge_splits, split_bounds

LOG2E = 1.4426950408889634

# Tokens per K/V block of stage 1 (float32 caches: half, to bound shared memory); a split
# always covers whole blocks.
DECODE_BLOCK_N = 64
# Fewest tokens worth a split of their own, and the most splits any request is cut into.
MIN_TOKENS_PER_SPLIT = 64
MAX_SPLITS = 32


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: pretend to be an H100
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(programs_per_split: int, max_context: int, device: torch.device) -> int:
    """Splits per request so that about two waves of programs fill the GPU, never cutting the
    longest possible context into slices shorter than MIN_TOKENS_PER_SPLIT.

    Reads no device memory: `max_context` is a host-side bound (e.g. page_table width * page
    size, static under CUDA graphs), so the result is fixed for a captured graph."""
    target = 2 * _num_sms(device)
    want = triton.cdiv(target, max(programs_per_split, 1))
    cap = max(1, triton.cdiv(max(max_context, 1), MIN_TOKENS_PER_SPLIT))
    return max(1, min(want, cap, MAX_SPLITS))


# At least this many (request, KV head) programs: the many-small-programs launch of stage 1.
MANY_PROGRAMS = 1024
# Triton's interpreter (read when the kernels are defined, as Triton reads it) runs no inline PTX.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Fewer (request, KV head) programs than this load an FP8 cache as 16-bit words (`widens_words`):
# past it the element loads on their launch were 2-3% faster (B=64-256, 2026-12-02).
FP8_WORDS_PROGRAMS = 512
# (request, KV head) programs, inclusive, where 32-token blocks on two warps with three stages
# beat the default launch: B=72-96 at 8 KV heads.
MID_PROGRAMS = (576, 768)


def stage1_launch(programs_per_split: int, dtype: torch.dtype,
                  cache_dtype: torch.dtype | None = None, words: bool = False) -> tuple[int, int, int]:
    """(block_n, num_warps, num_stages) of stage 1 for products in `dtype` over a cache of
    `cache_dtype` (default: the same), an FP8 cache loaded as `words` or as elements. From the
    sweeps on the H200 (`bench_kernels --sweep`, `scripts/fp8_kv_decode_probe.py`, Llama-8B
    heads; BENCHMARKS.md, 2026-11-28, 2026-11-29 and 2026-12-02):
    - bf16, the default: 64-token blocks on four warps, two stages. The best at B=56-64 (ctx 544:
      42.2-42.5 us at B=64; ctx 1,536: 101.9), and within 1% of it at B=112-120 (ctx 1,024-2,048).
    - bf16 at MID_PROGRAMS: 32-token blocks on two warps, three stages. The best or within 1% of
      it at B=72 (ctx 544: 53.5 us against the default's 61.4), B=80 (ctx 544 / 1,024: 54.2 /
      93.6 against 64.9 / 108.7) and B=96 (ctx 544 / 1,536: 58.4 / 147.7 against 69.6 / 167.1).
      At B=112 (896 programs) it lost to the default, so the band stops at B=96.
    - bf16 past MANY_PROGRAMS: 32-token blocks on two warps with two stages: the best at B=128
      (ctx 544: 76.0 us; ctx 1,024: 134.5; ctx 1,536: 195.6) and B=256 (ctx 1,024: 257.5), 2% off it
      at B=192 (ctx 1,536). Three stages there had cost 7-24% (167.3, 241.0, 278.5 us).
    - An FP8 cache (widened to float16, `decode_dtype`), loaded as e4m3 elements: 64-token blocks
      on two warps with five stages, the fewest at which Triton double-buffers this loop (at
      three and four it keeps one buffer and waits for it at the top of every iteration): the best
      at B=64-256 (ctx 544 / 1,024 / 1,536 / 1,024: 30.9 / 90.8 / 187.7 / 177.5 us, against three
      stages' 34.0 / 100.3 / 209.8 / 196.3; 2026-12-02).
    - FP8 loaded as 16-bit words (`words`, below FP8_WORDS_PROGRAMS, `widens_words`): 64-token
      blocks on two warps with three stages up to 64 programs: the batch-1 step (ctx ~530, a split
      or two of one block each) took 2.78 ms against the element loads' 2.87. 128-token blocks on
      four warps with five stages, the best alone at ctx 4,096 (9.2 against 11.3 us), took 2.94 ms
      there: fewer, longer splits. Past 64 programs, 64-token blocks on four warps with five stages
      (B=16, ctx 2,048: 33.2 us against the element loads' 34.8 and their old launch's 37.5)."""
    if dtype == torch.float32:
        return DECODE_BLOCK_N // 2, 4, 2
    if cache_dtype == torch.float8_e4m3fn:
        if words:
            return (DECODE_BLOCK_N, 2, 3) if programs_per_split <= 64 else (DECODE_BLOCK_N, 4, 5)
        return DECODE_BLOCK_N, 2, 5
    if programs_per_split >= MANY_PROGRAMS:
        return 32, 2, 2
    if MID_PROGRAMS[0] <= programs_per_split <= MID_PROGRAMS[1]:
        return 32, 2, 3
    return DECODE_BLOCK_N, 4, 2


def compute_dtype(q: torch.Tensor, cache: torch.Tensor) -> torch.dtype:
    """The dtype a kernel's products run in: the cache's (a float32 cache wants float32 q), but
    an FP8 cache is widened to q's dtype as it is loaded (`workers.kv_quant`)."""
    return q.dtype if cache.dtype == torch.float8_e4m3fn else cache.dtype


def decode_dtype(q: torch.Tensor, cache: torch.Tensor) -> torch.dtype:
    """The paged decode's product dtype: `compute_dtype`, except that an FP8 cache under 16-bit
    queries is widened to float16. The decode reads each cached element once for a few query
    heads, so widening is most of its arithmetic: e4m3 -> float16 is one exact conversion per two
    elements on sm_89+, e4m3 -> bf16 a chain of them (the FP8 decode ran at 1.6-2.0 TB/s widened
    to bf16, BENCHMARKS.md). float16 holds every e4m3 value and q to 65,504 (a query past that
    would overflow: none of the models served here comes near); its products accumulate in
    float32 as before."""
    if cache.dtype == torch.float8_e4m3fn and q.dtype in (torch.bfloat16, torch.float16):
        return torch.float16
    return compute_dtype(q, cache)


def can_widen_words(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether stage 1 can load this cache as 16-bit words and widen them with inline PTX
    (`_load_block`): an e4m3 cache under float16 products, on a GPU (Triton's interpreter runs
    no PTX), with every address and width a whole number of words."""
    if decode_dtype(q, k_cache) != torch.float16 or k_cache.dtype != torch.float8_e4m3fn:
        return False
    if _INTERPRETED or not k_cache.is_cuda:
        return False
    return all(t.data_ptr() % 2 == 0 and t.shape[-1] % 2 == 0 and all(st % 2 == 0 for st in t.stride()[:-1])
               for t in (k_cache, v_cache))


def _words_chosen(programs: int) -> bool:
    """Words for `programs` (request, KV head) pairs where the cache can take them: the kernel
    option `fp8_kv_words` on and fewer than FP8_WORDS_PROGRAMS."""
    return kernel_options.current().fp8_kv_words and programs < FP8_WORDS_PROGRAMS


def widens_words(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, programs: int) -> bool:
    """Whether stage 1 loads words for `programs` (request, KV head) pairs: `_words_chosen` and
    `can_widen_words`."""
    return _words_chosen(programs) and can_widen_words(q, k_cache, v_cache)


def dot_precision(dtype: torch.dtype) -> str:
    """float32 caches get true float32 products (tf32 would cost ~1e-3 relative error)."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit(do_not_specialize=VARYING)
def _decode_stage1(
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
    DOT_PREC: tl.constexpr, PDL: tl.constexpr, MERGE: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_G: tl.constexpr, CHUNK_S: tl.constexpr, EARLY: tl.constexpr, Q_TO_F16: tl.constexpr,
    WIDEN: tl.constexpr,
):
    pdl.launch_dependents(PDL)
    if not EARLY:
        pdl.wait(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # With EARLY (one row), before the PDL wait: the lengths and page table (written before the
    # forward's first kernel, which is not launched early, so complete), and the first block's
    # keys and values except the newest token's (`_first_block`). The cache reads then overlap
    # the product's last programs; after the wait only q and one K/V row are loaded.
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
                                    stride_vh, HEAD_DIM, V_DIM, PAGE_SIZE, BLOCK_N, BLOCK_D, BLOCK_DV, WIDEN, WIDEN,
                                    EARLY, PDL)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=mask_h[:, None] & mask_d[None, :],
            other=0.0,
        )
        if Q_TO_F16:  # (`decode_dtype`): the FP8 blocks below are widened to q's dtype
            q = q.to(tl.float16)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
        m_i, l_i, acc = _attend_block(q, k, v, mask_n, m_i, l_i, acc, sm_scale_log2, DOT_PREC)
        for t0 in range(start + BLOCK_N, end, BLOCK_N):
            slot, mask_n = _block_slots(page_row, t0, end, PAGE_SIZE, BLOCK_N)
            k = _load_block(K, slot, stride_kt, kvh * stride_kh, mask_n, HEAD_DIM, BLOCK_N, BLOCK_D, WIDEN, False)
            v = _load_block(V, slot, stride_vt, kvh * stride_vh, mask_n, V_DIM, BLOCK_N, BLOCK_DV, WIDEN, False)
            m_i, l_i, acc = _attend_block(q, k, v, mask_n, m_i, l_i, acc, sm_scale_log2, DOT_PREC)
        o_ptrs = MidO + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_dv[None, :]
        tl.store(o_ptrs, acc / l_i[:, None], mask=mask_h[:, None] & mask_dv[None, :])
        tl.store(MidLse + b * stride_lb + heads * stride_lh + split, m_i + tl.log2(l_i), mask=mask_h)
        if MERGE:
            _merge_if_last(MidO, MidLse, Out, Counters, b, kvh, seq_len, per_split,
                           stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
                           GROUP, V_DIM, BLOCK_G, BLOCK_DV, BLOCK_S, CHUNK_S)
    elif MERGE and split == 0 and seq_len == 0:
        _zero_output(Out, b, heads, mask_h, stride_outb, stride_outh, V_DIM, BLOCK_H, BLOCK_DV, EARLY, PDL)


@triton.jit
def _attend_block(q, k, v, mask_n, m_i, l_i, acc, sm_scale_log2, DOT_PREC: tl.constexpr):
    """One block of keys into the online softmax: (m_i, l_i, acc) updated. An FP8 cache's
    block is widened to q's dtype here (its scales are folded into sm_scale and the output)."""
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * sm_scale_log2
    s = tl.where(mask_n[None, :], s, float("-inf"))
    # Every block holds at least one key, so m_new is finite.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    scaling: float,
    page_size: int,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    words: bool | None = None,
) -> torch.Tensor:
    """One query per request over its paged K/V.

    q: [B, H, D]; k_cache: [slots, Hkv, D]; v_cache: [slots, Hkv, Dv] (slot = page * page_size
    + offset; last dim contiguous); page_table: [B, max_pages] int32/int64 page ids;
    cache_seqlens: [B] int32 keys per request (device). H must be a multiple of Hkv; query
    head j reads KV head j // (H // Hkv). Returns `out` (or a new tensor): [B, H, Dv] in q's
    dtype. num_splits=None picks a count from B, Hkv and page_table's width (host values only:
    pass a fixed count when capturing CUDA graphs whose page table width may vary). block_n,
    num_warps and num_stages are stage 1's launch parameters (`bench_kernels --sweep` tunes
    them); None: `stage1_launch`'s choice. `words`: load an FP8 cache as 16-bit words (where
    `can_widen_words`) or as elements; None: `widens_words`'s choice. Where the keys-on-M kernel
    takes an FP8 cache (`triton_decode_mma.mma_applies`) its block and warps are fixed (64 keys on
    one warpgroup), `num_stages` is honoured, and `words=None` means words wherever they can be
    (the kernel option `fp8_kv_words` off: elements)."""
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    v_dim = v_cache.shape[-1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_decode needs K/V caches with a contiguous last dim")
    group = heads // kv_heads
    if out is None:
        out = q.new_empty(batch, heads, v_dim)
    if batch == 0:
        return out
    # An FP8 cache under bf16 queries: q is widened to float16 in the kernel (no copy here).
    to_f16 = decode_dtype(q, k_cache) == torch.float16 != q.dtype
    asked_words, words = words, can_widen_words(q, k_cache, v_cache) and (_words_chosen(batch * kv_heads) if words is None else words)
    q = q.to(compute_dtype(q, k_cache))
    if q.stride(-1) != 1:
        q = q.contiguous()
    if num_splits is None:
        num_splits = choose_num_splits(batch * kv_heads, page_table.shape[1] * page_size, q.device)
    mid_o = torch.empty(batch, heads, num_splits, v_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_dv = max(16, triton.next_power_of_2(v_dim))
    kernel, variant = _decode_stage1, {"DOT_PREC": dot_precision(q.dtype), "Q_TO_F16": to_f16}
    auto_n, auto_warps, auto_stages = stage1_launch(batch * kv_heads, q.dtype, k_cache.dtype, words)
    if triton_decode_mma.mma_applies(q, k_cache, v_cache):  # an FP8 cache's keys as e4m3 on the MMA's M side
        kernel, variant = triton_decode_mma._decode_stage1_t, {}
        auto_n, auto_warps, auto_stages = triton_decode_mma.BLOCK_N, 4, triton_decode_mma.STAGES
        block_n, num_warps = auto_n, auto_warps  # one warpgroup's M side; the values as words where they can be
        words = (can_widen_words(q, k_cache, v_cache) and kernel_options.current().fp8_kv_words
                 if asked_words is None else asked_words and can_widen_words(q, k_cache, v_cache))
    block_n, num_warps, num_stages = block_n or auto_n, num_warps or auto_warps, num_stages or auto_stages
    use_pdl = pdl.enabled(q.device)
    # The last-arriving program merges; past the counters (e.g. 32 KV heads x 2,049 requests)
    # the separate merge kernel does.
    merge = batch * kv_heads <= COUNTERS
    counters = arrival_counters(q.device, batch * kv_heads) if merge else mid_lse
    block_s, block_g = max(2, triton.next_power_of_2(num_splits)), triton.next_power_of_2(group)
    kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, page_table, cache_seqlens, mid_o, mid_lse, out, counters,
        scaling * LOG2E, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        page_table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, V_DIM=v_dim, PAGE_SIZE=page_size,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d, BLOCK_DV=block_dv, BLOCK_N=block_n,
        PDL=use_pdl, MERGE=merge,
        BLOCK_S=block_s, BLOCK_G=block_g, CHUNK_S=min(block_s, max(1, 8192 // (block_g * block_dv))),
        EARLY=use_pdl and batch == 1, WIDEN=words, **variant,
        num_warps=num_warps, num_stages=num_stages, launch_pdl=use_pdl,
    )
    if not merge:
        merge_splits(mid_o, mid_lse, cache_seqlens, out, block_n)
    return out


def token_table_to_page_table(token_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """[B, max_tokens] slot per token -> [B, ceil(max_tokens / P)] page ids (as the metadata
    builder does; no copy for page_size 1). Graph-safe: no host sync."""
    if page_size == 1:
        return token_table
    return token_table[:, ::page_size] // page_size


__all__ = [
    "paged_decode",
    "choose_num_splits",
    "token_table_to_page_table",
    "dot_precision",
    "compute_dtype",
    "decode_dtype",
    "widens_words",
    "LOG2E",
    "DECODE_BLOCK_N",
]
