"""The key/value blocks of the paged decodes' stage 1 (`attention.triton_decode`,
`attention.triton_decode_mma`): the cache slots of a block of keys (`_block_slots`), a block's
tile (`_load_block`, FP8 optionally widened as 16-bit words), and a split's first block with
EARLY's loads before the PDL wait (`_first_block`)."""

from __future__ import annotations

import triton
import triton.language as tl

from attention import pdl


@triton.jit
def _block_slots(page_row, t0, end, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """(cache slot of each of the BLOCK_N keys from t0, which of them are before `end`)."""
    offs_n = t0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < end
    page = tl.load(page_row + offs_n // PAGE_SIZE, mask=mask_n, other=0)
    return page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE, mask_n


@triton.jit
def _first_block(K, V, page_row, kvh, start, end, seq_len, stride_kt, stride_kh, stride_vt, stride_vh,
                 HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, WIDEN_K: tl.constexpr, WIDEN_V: tl.constexpr,
                 EARLY: tl.constexpr, PDL: tl.constexpr):
    """(k, v, mask_n) of a split's first block (`_load_block`'s tiles; WIDEN_K / WIDEN_V for each).
    With EARLY (one row) the keys and values but the newest token's are read before the PDL wait:
    the newest is written by this layer's qkv product or RoPE kernel, a predecessor, and is read
    after the wait, past L1 (a line loaded before may hold part of it from before it was written)."""
    slot, mask_n = _block_slots(page_row, start, end, PAGE_SIZE, BLOCK_N)
    offs_n = start + tl.arange(0, BLOCK_N)
    old = mask_n & (offs_n < seq_len - 1)
    k = _load_block(K, slot, stride_kt, kvh * stride_kh, old, HEAD_DIM, BLOCK_N, BLOCK_D, WIDEN_K, False)
    v = _load_block(V, slot, stride_vt, kvh * stride_vh, old, V_DIM, BLOCK_N, BLOCK_DV, WIDEN_V, False)
    if EARLY:
        pdl.wait(PDL)
    newest = mask_n & (offs_n == seq_len - 1)
    k = tl.where(newest[:, None],
                 _load_block(K, slot, stride_kt, kvh * stride_kh, newest, HEAD_DIM, BLOCK_N, BLOCK_D, WIDEN_K, True), k)
    v = tl.where(newest[:, None],
                 _load_block(V, slot, stride_vt, kvh * stride_vh, newest, V_DIM, BLOCK_N, BLOCK_DV, WIDEN_V, True), v)
    return k, v, mask_n


@triton.jit
def _load_block(base, slot, stride_t, col0, rows, width, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                WIDEN: tl.constexpr, CG: tl.constexpr):
    """The [BLOCK_N, BLOCK_D] tile of `base` at rows `slot` (stride_t apart), columns col0 + [0,
    width), zero where `rows` is false or past `width`; read past L1 with CG. With WIDEN (an e4m3
    cache under float16 products) the tile is loaded as 16-bit words of two elements and each
    word widened to float16 by one `cvt.rn.f16x2.e4m3x2` in registers, before it meets a shared
    memory layout: loaded as e4m3 and converted afterwards, Triton moves the conversion past the
    dot operands' layout change and reshuffles single bytes in shared memory (~40% more
    instructions in the loop, BENCHMARKS.md)."""
    if WIDEN:
        offs = tl.arange(0, BLOCK_D // 2)
        ptrs = base.to(tl.pointer_type(tl.int16)) + slot[:, None] * (stride_t // 2) + col0 // 2 + offs[None, :]
        mask = rows[:, None] & (offs[None, :] < width // 2)
        if CG:
            w = tl.load(ptrs, mask=mask, other=0, cache_modifier=".cg")
        else:
            w = tl.load(ptrs, mask=mask, other=0)
        pair = tl.inline_asm_elementwise(asm="cvt.rn.f16x2.e4m3x2 $0, $1;", constraints="=r,h", args=[w],
                                         dtype=tl.int32, is_pure=True, pack=1)
        lo = (pair & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
        hi = (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True)
        tile = tl.reshape(tl.join(lo, hi), [BLOCK_N, BLOCK_D])
    else:
        offs = tl.arange(0, BLOCK_D)
        ptrs = base + slot[:, None] * stride_t + col0 + offs[None, :]
        mask = rows[:, None] & (offs[None, :] < width)
        if CG:
            tile = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
        else:
            tile = tl.load(ptrs, mask=mask, other=0.0)
    return tile
