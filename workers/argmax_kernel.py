"""Greedy sampling's argmax over the vocabulary on CUDA, each row split over many programs.

`torch.argmax(logits, dim=-1)` reduces a row in one thread block: on an H200 the float32
[1, 128256] logits of Llama-3 take ~28 us, a visible part of a 4.3 ms decode step, while
reading 0.5 MB at the GPU's bandwidth takes well under a microsecond. `argmax_rows` splits each
row into chunks of whole BLOCK-column tiles, one program per chunk (grid (B, S)); each program
writes its (key, index) partial, and the last program of the row to arrive (an arrival counter,
`attention.arrival`, reset by that program so CUDA-graph replays need no memset) combines
the S partials and stores the row's index. No second kernel; PDL as the decode step's kernels.

The result equals torch.argmax exactly: ties go to the lowest index, and NaN counts as larger
than everything, +inf included (the row's first NaN wins, as in torch); -0.0 equals 0.0. Values
are compared through an int32 key with that order (`_key`); partials are combined by max key,
then min index among equal keys, which is exact and order-free, so the result is deterministic.

Imported only on CUDA (the sampler's `_argmax`): CPU installs have no Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention import pdl
from attention.arrival import COUNTERS, arrival_counters

BLOCK = 4096  # columns per tile: 16 floats per thread at 8 warps
MAX_PROGRAMS = 256  # about two programs per SM of an H100/H200
_NUM_WARPS = 8
_INT32_MAX = tl.constexpr(2**31 - 1)  # the NaN key, and the index past every column
_INT32_MIN = tl.constexpr(-(2**31))  # below every key (no float maps to it)


@triton.jit
def _key(x):
    """int32 keys ordered as torch.argmax compares x: -inf < finite < +inf < NaN, -0.0 == 0.0.

    The bits of a non-negative float already order as ints; for a negative one flipping the
    magnitude bits reverses their order and keeps it below every non-negative. Every NaN
    (whatever its sign and payload) becomes the largest int32, which no other float maps to."""
    x = x.to(tl.float32)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 -> +0.0 (they compare equal)
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # arithmetic shift: all ones for negatives
    return tl.where(x != x, _INT32_MAX, key)


@triton.jit
def _tile_best(row, cols, V):
    """(largest key, lowest index with it) of one tile. Columns past V load as -inf: they can
    tie only with -inf values, and those sit at lower indices of the same tile, so they win."""
    k = _key(tl.load(row + cols, mask=cols < V, other=-float("inf")))
    top = tl.max(k, 0)
    return top, tl.min(tl.where(k == top, cols, _INT32_MAX), 0)


@triton.jit
def _argmax_kernel(X, Out, Part, Counters, V, stride_b, chunk, S, SPLIT: tl.constexpr, S_P2: tl.constexpr,
                   BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.launch_dependents(PDL)
    b = tl.program_id(0)
    s = tl.program_id(1)
    row = X + b.to(tl.int64) * stride_b
    lo = s * chunk
    hi = tl.minimum(lo + chunk, V)
    offs = tl.arange(0, BLOCK)
    pdl.wait(PDL)  # the logits are the previous kernel's output
    best, best_i = _tile_best(row, lo + offs, V)
    for start in range(lo + BLOCK, hi, BLOCK):  # later tiles hold higher indices: they win only if larger
        top, top_i = _tile_best(row, start + offs, V)
        better = top > best
        best = tl.where(better, top, best)
        best_i = tl.where(better, top_i, best_i)
    if not SPLIT:  # S == 1
        tl.store(Out + b, best_i.to(tl.int64))
    else:
        # Part is int32 [2, B, S]: the keys, then the indices.
        n = tl.num_programs(0) * S
        tl.store(Part + b * S + s, best)
        tl.store(Part + n + b * S + s, best_i)
        tl.debug_barrier()  # the partial is written before the arrival is counted
        arrived = tl.atomic_add(Counters + b, 1, sem="acq_rel")
        if arrived == S - 1:  # the row's last program: combine the S partials
            j = tl.arange(0, S_P2)
            live = j < S
            keys = tl.load(Part + b * S + j, mask=live, other=_INT32_MIN, cache_modifier=".cg")
            idx = tl.load(Part + n + b * S + j, mask=live, other=_INT32_MAX, cache_modifier=".cg")
            top = tl.max(keys, 0)
            tl.store(Out + b, tl.min(tl.where(keys == top, idx, _INT32_MAX), 0).to(tl.int64))
            tl.atomic_xchg(Counters + b, 0)


def _split(rows: int, cols: int, block: int, max_programs: int) -> tuple[int, int]:
    """(chunk, S): S programs per row, each over `chunk` columns (a power-of-two number of
    tiles, so few chunk sizes occur), about `max_programs` programs in all, at least one a row."""
    tiles = triton.cdiv(cols, block)
    per_program = min(triton.next_power_of_2(triton.cdiv(tiles * rows, max_programs)), triton.next_power_of_2(tiles))
    if rows > COUNTERS:  # one counter per split row: more rows than counters take one program each
        per_program = triton.next_power_of_2(tiles)
    chunk = per_program * block
    return chunk, triton.cdiv(cols, chunk)


def variant_rows(max_rows: int, cols: int, block: int = BLOCK, max_programs: int = MAX_PROGRAMS) -> list[int]:
    """The fewest rows of each distinct compiled launch (`SPLIT`, `S_P2`) that a [rows, cols]
    argmax with 1 <= rows <= max_rows takes: what `warm_up` runs."""
    seen: dict[tuple[bool, int], int] = {}
    for rows in range(1, max_rows + 1):
        _, s = _split(rows, cols, block, max_programs)
        seen.setdefault((s > 1, triton.next_power_of_2(s)), rows)
    return sorted(seen.values())


def warm_up(device: torch.device, cols: int, max_rows: int) -> None:
    """Compile every launch variant of [<= max_rows, cols] float32 argmaxes now: the split
    depends on the row count, and a compile met in a serving step (~0.5 s on a slow host)
    stalls every request of that step."""
    for rows in variant_rows(max_rows, cols):
        argmax_rows(torch.zeros(rows, cols, dtype=torch.float32, device=device))


def argmax_rows(logits: torch.Tensor, *, block: int = BLOCK, max_programs: int = MAX_PROGRAMS) -> torch.Tensor:
    """int64 [B]: `torch.argmax(logits, dim=-1)` of a 2-D float32/bf16/fp16 tensor whose rows
    may have any stride (e.g. `logits[:, :V]`). `block` (a power of two) and `max_programs`
    shape the split (tests and benchmarks); other dtypes and empty rows go to torch."""
    if logits.dim() != 2 or logits.dtype not in (torch.float32, torch.bfloat16, torch.float16) or logits.shape[1] == 0:
        return logits.argmax(dim=-1)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.long, device=logits.device)
    if B == 0:
        return out
    chunk, S = _split(B, V, block, max_programs)
    part = counters = out  # unused when S == 1
    if S > 1:
        part = torch.empty(2, B, S, dtype=torch.int32, device=logits.device)
        counters = arrival_counters(logits.device, B)
    use_pdl = pdl.enabled(logits.device)
    _argmax_kernel[(B, S)](
        logits, out, part, counters, V, logits.stride(0), chunk, S,
        SPLIT=S > 1, S_P2=triton.next_power_of_2(S), BLOCK=block, PDL=use_pdl, num_warps=_NUM_WARPS, launch_pdl=use_pdl,
    )
    return out
