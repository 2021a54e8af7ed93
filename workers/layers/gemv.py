"""One-row linear layers (batch-1 decode) on CUDA, with the elementwise op before them fused in.

At batch 1 a decoder layer reads every weight once per step and is bound by memory bandwidth;
what separates a step from the roofline is the small kernels between the matrix products (each
costs a launch and a drain of the GPU, ~2-3 us inside a CUDA graph) and cuBLAS's split-K
reduction kernels. `gemv` computes y = f(x) W^T (+ b) for one row x in one Triton kernel, where
the prologue f is

- `PLAIN`: f(x) = x;
- `ADD_RMS`: s = x + residual (rounded to x's dtype, as the unfused add), f(x) = RMSNorm(s) * w.
  Because a linear map commutes with the scalar 1/rms, the kernel accumulates s*w against W and
  sum(s^2) in the same pass and scales at the end; it also writes s (the next residual);
- `SILU_MUL`: x = [gate | up] (2K wide), f(x) = silu(gate) * up, rounded as the unfused op;
- `NORM`: x is a residual sum whose squares a previous product already summed (`square_sums`,
  below), f(x) = RMSNorm(x) * w: no pass over the whole row, so no more rows per program than a
  plain product and K may be split.

An epilogue may add the product to the residual stream (`gemv_add`): s = y + residual, rounded
as the unfused add, is written in place of y, and each block of rows writes the float32 sum of
its s^2 (`square_sums`, one per block); the next product's `NORM` prologue adds those up for
its 1/rms. A decoder layer at batch 1 then needs no full-row prologue for its qkv product.

A gate/up product ([gate | up] rows, N = 2 x inter) may finish the MLP's activation (`glu`): its
programs take gate row j and up row j side by side, and the epilogue writes silu(gate) * up,
rounded as the unfused ops, so the output is [1, inter] and the down product's prologue is plain.
Computing the SiLU in the down product's prologue instead repeats it, and reads the 2 x inter
input, in every one of that product's programs (the models use `glu` on FP8 weights, where that
showed: `workers/models/llama.py`).

A qkv product may also finish RoPE and the K/V-cache write (`rope`, a `one_row.RopeKV`): its
programs take rotation pairs (j, j + head_dim/2) of one head side by side, so the epilogue
rotates q and k heads and writes k and v heads to the caches at the step's slot. That is
`workers.layers.rope_store`'s kernel, gone from the batch-1 layer.

K may be split over SPLIT_K programs per block of rows: each writes a float32 partial, and the
last to arrive (an atomic counter per row block, reset by that program, so CUDA-graph replays
need no memset) adds them up in order and stores the row. No second kernel.

The weight may be FP8 (float8_e4m3fn) with one float32 scale per output row (per-channel and
per-tensor checkpoints, `--quantization fp8`): each element is widened in registers and the
row's scale multiplies its sum at the end, so an FP8 layer at batch 1 keeps every fusion above
and reads half the bytes. (Block-wise scales, DeepSeek-V3's, stay on `fp8_gemm.gemv`.)

`GemvConfig` is the launch; `gemv_launch.choose_config` picks one from the shape (measured on the
H200 with `python -m workers.layers.bench_gemv`, BENCHMARKS.md). Everything else (more rows, CPU, float32)
uses the unfused torch ops: `workers.layers.one_row` says which and holds the callers' entry
points (it imports no Triton, so CPU installs without it load the models).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from attention import pdl
from attention.arrival import arrival_counters
from workers.layers.gemv_launch import ADD_RMS, NORM, PLAIN, SILU_MUL, GemvConfig, logged_choice

if TYPE_CHECKING:
    from workers.layers.one_row import RopeKV


@triton.jit
def _load(ptr, mask, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(ptr)
    return tl.load(ptr, mask=mask, other=0.0)


@triton.jit
def _load_tile(w_rows, cols, live, k_hi, rmask, EVEN: tl.constexpr):
    """W[rows, cols] (zeros where `live` is false or outside the matrix)."""
    if EVEN:
        return tl.load(w_rows + cols[None, :], mask=live & rmask[:, None], other=0.0)
    return tl.load(w_rows + cols[None, :], mask=live & rmask[:, None] & (cols < k_hi)[None, :], other=0.0)


@triton.jit
def _load_w(w_rows, cols, live, k_hi, rmask, EVEN: tl.constexpr, VEC: tl.constexpr):
    """The weight tile at `cols`: [BLOCK_N, BLOCK_K], or with VEC [BLOCK_N, BLOCK_K / VEC, VEC]
    (cols [BLOCK_K / VEC, VEC], w_rows [BLOCK_N, 1, 1])."""
    if VEC == 0:
        w = _load_tile(w_rows, cols, live, k_hi, rmask, EVEN)
    elif EVEN:
        w = tl.load(w_rows + cols[None, :, :], mask=live & rmask[:, None, None], other=0.0)
    else:
        w = tl.load(w_rows + cols[None, :, :], mask=live & rmask[:, None, None] & (cols < k_hi)[None, :, :],
                    other=0.0)
    return w


@triton.jit
def _prologue_load(X, R, NW, cols, cmask, K, MODE: tl.constexpr, HAS_R: tl.constexpr):
    """The prologue's inputs at `cols` as loaded (three tensors; unused ones repeat the first):
    requested an iteration ahead of their use, like the weights (see `_gemv_kernel`)."""
    a = tl.load(X + cols, mask=cmask, other=0.0)
    b = a
    c = a
    if MODE == 2:  # SILU_MUL: gate, up
        b = tl.load(X + K + cols, mask=cmask, other=0.0)
    elif MODE == 1:  # ADD_RMS: x, residual, norm weight
        if HAS_R:
            b = tl.load(R + cols, mask=cmask, other=0.0)
        c = tl.load(NW + cols, mask=cmask, other=0.0)
    elif MODE == 3:  # NORM: the row, norm weight
        c = tl.load(NW + cols, mask=cmask, other=0.0)
    return a, b, c


@triton.jit
def _prologue(a, b, c, MODE: tl.constexpr, HAS_R: tl.constexpr):
    """(the prologue's value in float32, its squares for ADD_RMS) from `_prologue_load`'s."""
    if MODE == 2:  # SILU_MUL, rounded as silu(gate) * up in the input dtype
        g = a.to(tl.float32)
        s = (g * tl.sigmoid(g)).to(a.dtype)
        xv = (s.to(tl.float32) * b.to(tl.float32)).to(a.dtype).to(tl.float32)
        sq = tl.zeros_like(xv)
    elif MODE == 1:  # ADD_RMS
        x = a
        if HAS_R:
            x = (a.to(tl.float32) + b.to(tl.float32)).to(a.dtype)
        s = x.to(tl.float32)
        sq = s * s
        xv = s * c.to(tl.float32)
    elif MODE == 3:  # NORM: the row's squares were summed by the product that wrote it
        xv = a.to(tl.float32) * c.to(tl.float32)
        sq = tl.zeros_like(xv)
    else:
        xv = a.to(tl.float32)
        sq = tl.zeros_like(xv)
    return xv, sq


@triton.jit
def _store_rows(X, Y, B, Res, SqOut, y, res, rows, rmask, pid_n, HAS_BIAS: tl.constexpr, ADD_RES: tl.constexpr):
    """Bias, then y rounded to the input's dtype (as F.linear) and stored as Y's; with ADD_RES
    s = y + res (rounded as the unfused add) in its place and this block's sum of s^2."""
    if HAS_BIAS:
        y += tl.load(B + rows, mask=rmask, other=0.0).to(tl.float32)
    out = y.to(X.dtype.element_ty).to(Y.dtype.element_ty)
    if ADD_RES:
        out = (out.to(tl.float32) + res.to(tl.float32)).to(Y.dtype.element_ty)
        sf = tl.where(rmask, out.to(tl.float32), 0.0)
        tl.store(SqOut + pid_n, tl.sum(sf * sf, 0))
    tl.store(Y + rows, out, mask=rmask)


@triton.jit
def _store_glu(Y, B, y, rows, pid_n, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, HALF_N):
    """A gate/up product's rows (gate j and up j interleaved, see GLU): bias, rounding to Y's
    dtype (as F.linear), then silu(gate) * up with the SILU_MUL prologue's ops and roundings
    (the unfused `fused.silu_and_mul` rounds the same way; its sigmoid may differ in the last
    float32 place), stored at j."""
    P: tl.constexpr = BLOCK_N // 2
    if HAS_BIAS:
        y += tl.load(B + rows, mask=rows < 2 * HALF_N, other=0.0).to(tl.float32)  # (stores are masked by pair)
    dtype = Y.dtype.element_ty
    g, u = tl.split(tl.reshape(y.to(dtype).to(tl.float32), (P, 2)))
    s = (g * tl.sigmoid(g)).to(dtype)
    j = pid_n * P + tl.arange(0, P)
    tl.store(Y + j, (s.to(tl.float32) * u).to(dtype), mask=j < HALF_N)


@triton.jit
def _store_rope(Y, B, KC, VC, y, cos, sin, loc, pid_n, stride_kcs, stride_kch, stride_vcs, stride_vch,
                HAS_BIAS: tl.constexpr, HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """A qkv product's rows (rotation pairs interleaved, see ROPE): bias, rounding to Y's dtype
    (as F.linear), RoPE on q and k heads (`workers.layers.rope_store`'s math), and the k and v
    heads also into the caches at slot `loc`."""
    P: tl.constexpr = BLOCK_N // 2
    g0 = pid_n * P
    head = g0 // HALF
    jj = g0 % HALF + tl.arange(0, P)
    i = tl.arange(0, BLOCK_N)
    rows = head * (2 * HALF) + g0 % HALF + i // 2 + (i % 2) * HALF
    if HAS_BIAS:
        y += tl.load(B + rows).to(tl.float32)
    dtype = Y.dtype.element_ty
    a, b = tl.split(tl.reshape(y.to(dtype).to(tl.float32), (P, 2)))
    if head < HQ + HK:
        y1 = (a * cos - b * sin).to(dtype)
        y2 = (b * cos + a * sin).to(dtype)
    else:
        y1 = a.to(dtype)
        y2 = b.to(dtype)
    out = Y + head * (2 * HALF) + jj
    tl.store(out, y1)
    tl.store(out + HALF, y2)
    if head >= HQ:
        if head < HQ + HK:
            cache = KC + loc * stride_kcs + (head - HQ) * stride_kch + jj
        else:
            cache = VC + loc * stride_vcs + (head - HQ - HK) * stride_vch + jj
        tl.store(cache, y1)
        tl.store(cache + HALF, y2)


@triton.jit
def _gemv_kernel(
    X, R, NW, W, WS, B, Y, S, Part, SqPart, Counters, SqIn, Res, SqOut,
    Pos, Loc, Cos, Sin, KC, VC,
    N, K, stride_wn, eps, n_sq, stride_cos, stride_kcs, stride_kch, stride_vcs, stride_vch,
    MODE: tl.constexpr, HAS_R: tl.constexpr, WRITE_S: tl.constexpr, HAS_BIAS: tl.constexpr,
    ADD_RES: tl.constexpr, SQ_BLOCK: tl.constexpr,
    ROPE: tl.constexpr, HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr, GLU: tl.constexpr,
    W_SCALED: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
    VEC: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
):
    pdl.launch_dependents(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if ROPE:  # rotation pairs (j, j + HALF) of one head side by side: (rows j0.. and j0+HALF..) interleaved
        i = tl.arange(0, BLOCK_N)
        g0 = pid_n * (BLOCK_N // 2)
        rows = (g0 // HALF) * (2 * HALF) + g0 % HALF + i // 2 + (i % 2) * HALF
        rmask = rows < N
    elif GLU:  # gate row j and up row j (N / 2 + j) side by side
        i = tl.arange(0, BLOCK_N)
        pair = pid_n * (BLOCK_N // 2) + i // 2  # (not `j`: the split-K loop below binds that name)
        rows = pair + (i % 2) * (N // 2)
        rmask = pair < N // 2
    else:
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
    chunk = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * chunk
    k_hi = tl.minimum(k_lo + chunk, K)
    if VEC == 0:
        w_rows = W + rows.to(tl.int64)[:, None] * stride_wn
        offs_k = tl.arange(0, BLOCK_K)
    else:  # each thread sums VEC adjacent products (one 16-byte load of FP8) into one accumulator
        w_rows = W + rows.to(tl.int64)[:, None, None] * stride_wn
        offs_k = tl.arange(0, BLOCK_K // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    # The weights are never written: with PREFETCH the first tile is requested before waiting
    # for the inputs (PDL), and every iteration requests the next tile before using the current
    # one; without, each iteration loads its own tile (the compiler's pipelining and the other
    # programs on the SM hide the wait, with half the tile registers).
    if PREFETCH:
        w = _load_w(w_rows, k_lo + offs_k, k_lo < k_hi, k_hi, rmask, EVEN_N and EVEN_K, VEC)
    ws = tl.zeros([BLOCK_N], tl.float32)
    if W_SCALED:  # an FP8 weight's per-row scales (never written either)
        ws = tl.load(WS + rows, mask=rmask, other=0.0)
    pdl.wait(PDL)
    # What the end needs from earlier kernels is requested now, to arrive during the loop.
    if MODE == 3:
        sq_in = tl.load(SqIn + tl.arange(0, SQ_BLOCK), mask=tl.arange(0, SQ_BLOCK) < n_sq, other=0.0)
    cos = tl.zeros([BLOCK_N // 2], tl.float32)
    sin = tl.zeros([BLOCK_N // 2], tl.float32)
    loc = 0
    if ROPE:
        jj = pid_n * (BLOCK_N // 2) % HALF + tl.arange(0, BLOCK_N // 2)
        pos = tl.load(Pos).to(tl.int64)
        loc = tl.load(Loc).to(tl.int64)
        # HF casts cos/sin to the activations' dtype before the products
        cos = tl.load(Cos + pos * stride_cos + jj).to(Y.dtype.element_ty).to(tl.float32)
        sin = tl.load(Sin + pos * stride_cos + jj).to(Y.dtype.element_ty).to(tl.float32)
    res = tl.zeros([BLOCK_N], tl.float32)
    if ADD_RES:
        res = tl.load(Res + rows, mask=rmask, other=0.0).to(tl.float32)
    if USE_DOT:
        acc = tl.zeros([16, BLOCK_N], tl.float32)
        pad_rows = tl.arange(0, 16)
    elif VEC == 0:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    sq = tl.zeros(offs_k.shape, tl.float32)
    # The prologue's inputs are requested an iteration ahead too: each iteration then waits
    # for one round trip (the weights'), not two in a row (the input's, then the weights').
    p0, p1, p2 = _prologue_load(X, R, NW, k_lo + offs_k, k_lo + offs_k < k_hi, K, MODE, HAS_R)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        cols = k0 + offs_k
        if PREFETCH:
            w_next = _load_w(w_rows, cols + BLOCK_K, k0 + BLOCK_K < k_hi, k_hi, rmask, EVEN_N and EVEN_K, VEC)
            n0, n1, n2 = _prologue_load(X, R, NW, cols + BLOCK_K, cols + BLOCK_K < k_hi, K, MODE, HAS_R)
            xv, sq_k = _prologue(p0, p1, p2, MODE, HAS_R)
            p0, p1, p2 = n0, n1, n2
        else:
            w = _load_w(w_rows, cols, k0 < k_hi, k_hi, rmask, EVEN_N and EVEN_K, VEC)
            q0, q1, q2 = _prologue_load(X, R, NW, cols, cols < k_hi, K, MODE, HAS_R)
            xv, sq_k = _prologue(q0, q1, q2, MODE, HAS_R)
        sq += sq_k
        if USE_DOT:
            xt = tl.where(pad_rows[:, None] == 0, xv[None, :], 0.0).to(X.dtype.element_ty)
            acc = tl.dot(xt, tl.trans(w.to(X.dtype.element_ty)), acc)
        elif VEC == 0:
            acc += w.to(tl.float32) * xv[None, :]
        else:
            acc += tl.sum(w.to(tl.float32) * xv[None, :, :], 2)
        if PREFETCH:
            w = w_next
    if WRITE_S:  # the residual sum, once: by the first row block, for its slice of K
        if pid_n == 0:
            for k0 in range(k_lo, k_hi, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                cmask = cols < k_hi
                x = _load(X + cols, cmask, EVEN_K)
                s = (x.to(tl.float32) + _load(R + cols, cmask, EVEN_K).to(tl.float32)).to(x.dtype)
                tl.store(S + cols, s, mask=cmask)
    if USE_DOT:
        y = tl.sum(tl.where(pad_rows[:, None] == 0, acc, 0.0), 0)
    else:
        y = tl.sum(acc, 1)
    sq_sum = tl.sum(sq)
    if SPLIT_K > 1:
        tl.store(Part + pid_k * N + rows, y, mask=rmask)
        if MODE == 1:
            tl.store(SqPart + pid_n * SPLIT_K + pid_k, sq_sum)
        tl.debug_barrier()  # every thread's partial is written before the arrival is counted
        arrived = tl.atomic_add(Counters + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # the last program of this row block: add the partials in order
            total = tl.zeros([BLOCK_N], tl.float32)
            total_sq = tl.zeros([1], tl.float32)
            for j in tl.static_range(SPLIT_K):
                total += tl.load(Part + j * N + rows, mask=rmask, other=0.0, cache_modifier=".cg")
                if MODE == 1:
                    total_sq += tl.load(SqPart + pid_n * SPLIT_K + j + tl.arange(0, 1), cache_modifier=".cg")
            if W_SCALED:
                total = total * ws
            if MODE == 1:
                total = total * tl.rsqrt(tl.sum(total_sq, 0) / K + eps)
            if MODE == 3:
                total = total * tl.rsqrt(tl.sum(sq_in, 0) / K + eps)
            if ROPE:
                _store_rope(Y, B, KC, VC, total, cos, sin, loc, pid_n, stride_kcs, stride_kch, stride_vcs,
                            stride_vch, HAS_BIAS, HQ, HK, HALF, BLOCK_N)
            elif GLU:
                _store_glu(Y, B, total, rows, pid_n, HAS_BIAS, BLOCK_N, N // 2)
            else:
                _store_rows(X, Y, B, Res, SqOut, total, res, rows, rmask, pid_n, HAS_BIAS, ADD_RES)
            tl.atomic_xchg(Counters + pid_n, 0)
    else:
        if W_SCALED:
            y = y * ws
        if MODE == 1:
            y = y * tl.rsqrt(sq_sum / K + eps)
        if MODE == 3:
            y = y * tl.rsqrt(tl.sum(sq_in, 0) / K + eps)
        if ROPE:
            _store_rope(Y, B, KC, VC, y, cos, sin, loc, pid_n, stride_kcs, stride_kch, stride_vcs, stride_vch,
                        HAS_BIAS, HQ, HK, HALF, BLOCK_N)
        elif GLU:
            _store_glu(Y, B, y, rows, pid_n, HAS_BIAS, BLOCK_N, N // 2)
        else:
            _store_rows(X, Y, B, Res, SqOut, y, res, rows, rmask, pid_n, HAS_BIAS, ADD_RES)


@triton.jit
def _add_rms_norm_kernel(X, R, NW, H, S, K, eps, HAS_R: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One row: s = x + r (in x's dtype), h = dtype(s / rms(s)) * w, as `fused.add_rms_norm`."""
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(X + cols, mask=mask, other=0.0)
    if HAS_R:
        x = (x.to(tl.float32) + tl.load(R + cols, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(S + cols, x, mask=mask)
    s = x.to(tl.float32)
    h = (s * tl.rsqrt(tl.sum(s * s, 0) / K + eps)).to(x.dtype)
    w = tl.load(NW + cols, mask=mask, other=0.0)
    tl.store(H + cols, (h.to(tl.float32) * w.to(tl.float32)).to(x.dtype), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One row [1, K]: (RMSNorm(x + residual), x + residual or None) in one small kernel that
    keeps the PDL chain of the step's other kernels."""
    k = x.shape[-1]
    x = x.contiguous()
    h = torch.empty_like(x)
    s = torch.empty_like(x) if residual is not None else None
    use_pdl = pdl.enabled(x.device)
    _add_rms_norm_kernel[(1,)](
        x, residual.contiguous() if residual is not None else x, norm_weight, h, s if s is not None else h, k, eps,
        HAS_R=residual is not None, BLOCK=triton.next_power_of_2(k), PDL=use_pdl,
        num_warps=8 if k >= 4096 else 4, launch_pdl=use_pdl,
    )
    return h, s


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    mode: int = PLAIN,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    square_sums: torch.Tensor | None = None,
    rope: RopeKV | None = None,
    glu: bool = False,
    out_dtype: torch.dtype | None = None,
    scale: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: [1, K] ([1, 2K] for SILU_MUL); weight: [N, K] with contiguous rows (bf16/fp16 as x,
    or float8_e4m3fn with `scale` [N, 1] float32: W = weight * scale per row) -> ([1, N],
    residual sum [1, K] for ADD_RMS with a residual, else None). NORM takes x's `square_sums`
    (from `gemv_add`) and the norm's weight. With `rope` the weight is a qkv projection's:
    the output's q and k heads come out rotated and its k and v heads are written to the
    caches (`one_row.RopeKV`). With `glu` the weight is a gate/up projection's ([gate | up],
    N even) and the output is silu(gate) * up, [1, N / 2]. `out_dtype` (PLAIN): y rounded to
    x's dtype, stored as this (float32 logits without a cast kernel)."""
    if mode == NORM and square_sums is None:
        raise ValueError("gemv: NORM needs the square sums of its input row (gemv_add's)")
    if out_dtype not in (None, x.dtype) and (mode != PLAIN or rope is not None or glu):
        raise ValueError("gemv: out_dtype is for plain products")
    if glu and (rope is not None or mode == SILU_MUL or weight.shape[0] % 2):
        raise ValueError(f"gemv: glu takes a gate/up weight of an even number of rows ({weight.shape[0]}), "
                         "without rope or a SiLU prologue")
    return _launch(x, weight, bias, mode, residual, norm_weight, eps, square_sums, None, config, rope, out_dtype,
                   scale, glu)


def gemv_add(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    *,
    mode: int = PLAIN,
    scale: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s = residual + f(x) W^T (+ b) as [1, N], float32 sums of s^2 over its blocks of rows):
    the product's output added to the residual stream, with what a `NORM` product needs of s.
    `mode` is PLAIN or SILU_MUL; `scale` as in `gemv`."""
    if mode not in (PLAIN, SILU_MUL):
        raise ValueError(f"gemv_add: prologue {mode} (PLAIN or SILU_MUL)")
    if residual.numel() != weight.shape[0] or residual.dtype != x.dtype:
        raise ValueError(f"gemv_add: residual of {residual.numel()} {residual.dtype} for {weight.shape[0]} "
                         f"{x.dtype} outputs")
    return _launch(x, weight, bias, mode, None, None, 0.0, None, residual.contiguous(), config, None, None, scale,
                   False)


def _rope_args(rope: RopeKV | None, n: int, block_n: int, dtype: torch.dtype) -> tuple[list, dict, int]:
    """(pointer and stride arguments, constexprs, block_n) of the RoPE epilogue: block_n is
    lowered until a program's rotation pairs stay inside one head."""
    if rope is None:
        return [None] * 6 + [0] * 5, dict(ROPE=False, HQ=0, HK=0, HALF=1), block_n
    d = rope.head_dim
    half = d // 2
    if d % 2 or n != (rope.num_q_heads + 2 * rope.num_kv_heads) * d:
        raise ValueError(f"gemv: a RoPE epilogue over {n} rows for {rope.num_q_heads} q / {rope.num_kv_heads} "
                         f"kv heads of {d}")
    if rope.k_cache.dtype != dtype or rope.v_cache.dtype != dtype or rope.v_cache.shape[-1] != d:
        raise ValueError("gemv: the RoPE epilogue writes caches of the product's dtype and head size")
    if rope.cos.shape[-1] != half or rope.positions.numel() != 1 or rope.loc.numel() != 1:
        raise ValueError("gemv: the RoPE epilogue takes one position and one slot, cos/sin of head_dim / 2")
    while block_n > 2 and half % (block_n // 2):
        block_n //= 2  # (a tensor-core launch lowered under 16 rows runs FMA: `_launch`)
    kc, vc = rope.k_cache, rope.v_cache
    ptrs = [rope.positions, rope.loc, rope.cos, rope.sin, kc, vc,
            rope.cos.stride(0), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1)]
    return ptrs, dict(ROPE=True, HQ=rope.num_q_heads, HK=rope.num_kv_heads, HALF=half), block_n


def _check_weight(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> None:
    """A weight of x's dtype, or FP8 with one float32 scale per row."""
    if weight.dtype == torch.float8_e4m3fn:
        if scale is None or scale.dtype != torch.float32 or scale.shape != (weight.shape[0], 1):
            got = None if scale is None else (tuple(scale.shape), scale.dtype)
            raise ValueError(f"gemv: an FP8 weight of {weight.shape[0]} rows needs float32 scales [{weight.shape[0]}, 1]"
                             f" (one per row), got {got}")
    elif scale is not None:
        raise ValueError(f"gemv: a scale for a {weight.dtype} weight (scales are for float8_e4m3fn weights)")
    elif weight.dtype != x.dtype:
        raise ValueError(f"gemv: a {weight.dtype} weight for a {x.dtype} input")


def _launch(x, weight, bias, mode, residual, norm_weight, eps, square_sums, add_to, config, rope, out_dtype, scale,
            glu):
    n, k = weight.shape
    x = x.contiguous()
    _check_weight(x, weight, scale)
    if x.shape[-1] != (2 * k if mode == SILU_MUL else k):
        raise ValueError(f"gemv: input of width {x.shape[-1]} for a weight of {k} columns (mode {mode})")
    if mode in (ADD_RMS, NORM) and norm_weight is None:
        raise ValueError("gemv: a norm prologue needs the norm's weight")
    fp8 = scale is not None
    cfg = config or logged_choice(n, k, x.device, mode, add_to is not None, fp8)
    if cfg.use_dot and mode in (ADD_RMS, NORM) and x.dtype == torch.float16:
        raise ValueError("gemv: the tensor-core path rounds the un-normalised row to the input dtype, "
                         "which overflows float16")
    rope_ptrs, rope_consts, block_n = _rope_args(rope, n, cfg.block_n, x.dtype)
    if block_n != cfg.block_n:
        cfg = replace(cfg, block_n=block_n, use_dot=cfg.use_dot and block_n >= 16)
    y = torch.empty(1, n // 2 if glu else n, dtype=out_dtype or x.dtype, device=x.device)
    has_r = mode == ADD_RMS and residual is not None
    s = torch.empty_like(x) if has_r else None
    blocks = triton.cdiv(n // 2, cfg.block_n // 2) if glu else triton.cdiv(n, cfg.block_n)
    part = sq_part = counters = y
    if cfg.split_k > 1:
        part = torch.empty(cfg.split_k, n, dtype=torch.float32, device=x.device)
        sq_part = torch.empty(blocks, cfg.split_k, dtype=torch.float32, device=x.device)
        counters = arrival_counters(x.device, blocks)
    sq_out = torch.empty(blocks, dtype=torch.float32, device=x.device) if add_to is not None else None
    n_sq = square_sums.numel() if square_sums is not None else 1
    use_pdl = pdl.enabled(x.device)
    _gemv_kernel[(blocks, cfg.split_k)](
        x, residual.contiguous() if has_r else x, norm_weight if norm_weight is not None else x,
        weight, scale if fp8 else y, bias if bias is not None else y, y, s if s is not None else y,
        part, sq_part, counters,
        square_sums if square_sums is not None else y, add_to if add_to is not None else y,
        sq_out if sq_out is not None else y,
        *[p if p is not None else y for p in rope_ptrs[:6]],
        n, k, weight.stride(0), eps, n_sq, *rope_ptrs[6:],
        MODE=mode, HAS_R=has_r, WRITE_S=has_r, HAS_BIAS=bias is not None,
        ADD_RES=add_to is not None, SQ_BLOCK=triton.next_power_of_2(n_sq), **rope_consts, GLU=glu, W_SCALED=fp8,
        EVEN_N=n % cfg.block_n == 0, EVEN_K=k % (cfg.split_k * cfg.block_k) == 0,
        SPLIT_K=cfg.split_k, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_DOT=cfg.use_dot, VEC=cfg.vec,
        PREFETCH=cfg.prefetch, PDL=use_pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=use_pdl,
    )
    return (y, sq_out) if add_to is not None else (y, s)
