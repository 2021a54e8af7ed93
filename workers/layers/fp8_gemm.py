"""Linear layers with FP8 (e4m3) weights on CUDA: y = x W^T (+ b), W dequantized by its scales.

The weight is [N, K] float8_e4m3fn with float32 scales [N, KB]: W[n, k] = w[n, k] * s[n, k // block_k].
Per-channel scales are KB = 1 (block_k = K); DeepSeek-style 128 x 128 block scales arrive expanded
to one row per output row (block_k = 128). `choose_kernel` picks one of:

- `GEMV` (M = 1, batch-1 decode, bound by reading the weight once): programs of 4 rows stream
  the weight 1024 columns a step as [rows, 64, 16] tiles; each thread sums its 16 products in
  registers (a block scale multiplies that sum), and the next tile, x slice and scales are
  requested before the current ones are used. The first tile is requested before the PDL wait.
- `W8A16` (2..A8_MIN_M - 1 rows, any scales): a `tl.dot` kernel that converts each weight tile
  to x's dtype in registers (after scaling by its k-block's scale for block scales: the weight
  rounded to bf16/fp16, relative error <= 2^-9) and multiplies on the tensor cores. Rows are
  padded to 16, 32 or 64; small grids split K (`TileConfig.split_k`): each program writes a float32
  partial, the last to arrive (an `attention.arrival` counter, left at zero) adds them in order.
- `TMA` (a Hopper GPU, per-channel weights, 2..fp8_tma.MAX_M rows where `fp8_tma.launch` gives a
  launch): x quantized per token, then `fp8_tma`'s kernel: FP8 tensor cores, the weight on the
  MMA's M side, both operands read by TMA. Where the kernel options' `fp8_tma` is on
  (the default; `MANTA_FP8_TMA=0` turns it off) it takes such products of 2-128 rows from W8A16, cuBLAS
  and `decode_a8`'s split-K kernel: decode batches, and prompt pieces that small.
- W8A8 (from A8_MIN_M rows): x quantized to e4m3 per token (and per 128 columns for block
  scales) by `quantize_rows`, then FP8 tensor cores: `SCALED_MM` (torch._scaled_mm, row-wise
  scales) for per-channel weights (but the Triton kernel with K split for decode batches on
  narrow long-K weights, on which cuBLAS's unsplit 128 x 128 tiles leave most SMs idle:
  `decode_a8`), `BLOCKWISE` (torch._scaled_mm, 1 x 128 / 128 x 128 scales)
  for block_k = 128 whose 128-row blocks share scales (checked once per scale tensor), the
  Triton `W8A8` kernel for what cuBLAS refuses. Rounding x to e4m3 adds ~2.6% relative error
  on Gaussian rows (3 mantissa bits), as rounding the weight did.

Measured on an H100 (2026-11-25, `python -m workers.layers.fp8_gemm [--sweep]`: each product in
a CUDA graph over weight copies larger than L2, Llama-3.1-8B shapes, against bf16 F.linear):
GEMV reads the weight at 63-87% of the copy bandwidth (per-channel gate_up and down 79-87%, qkv
and o 63-73%: 25 and 17 MB reads lose ~1.5 us a launch; block scales 5-10 points less; spread
between runs up to 10 points, lower in runs that followed prefill-sized products), 1.5-2.0x bf16. W8A16 gains 1.1-1.5x at 4-16 rows,
but converting tiles caps it near 250 TFLOP/s: at 32 rows it is 0.7-1.5x bf16, and at 64 rows
cuBLAS's FP8 product was faster on three of four shapes (gate_up 51 vs 83 us) and from 128 rows
on all, by 2-3x: hence A8_MIN_M = 64. W8A8 is 0.8-1.6x bf16 at 64-256 rows and 1.2-1.9x in
prefill (128 x 128 blocks 1.2-1.6x). Fast accumulation gains 3-17% for 3e-3 more error.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from attention import kernel_options, pdl
from workers.layers import fp8_tma
from workers.layers.fp8_rows import Fp8Rows

FP8 = torch.float8_e4m3fn
A8_MIN_M = 64  # rows from which FP8 activations (W8A8) replace the W8A16 tile kernel
DECODE_A8_MAX_M = 128  # up to this many rows a narrow long-K per-channel W8A8 product splits K (`decode_a8`)
GEMV_LAUNCH = (4, 1024, 4, 3)  # rows, columns per step, warps, stages: the best of nine, every shape and kind


class Kernel(enum.Enum):
    GEMV = "gemv"
    W8A16 = "w8a16"
    SCALED_MM = "scaled_mm"  # W8A8 through torch._scaled_mm, row-wise scales (per-channel weights)
    BLOCKWISE = "blockwise"  # W8A8 through torch._scaled_mm, 1 x 128 and 128 x 128 block scales
    W8A8 = "w8a8"  # W8A8 through the tiled Triton kernel
    TMA = "tma"  # W8A8 through `fp8_tma` (Hopper): per-channel weights at decode batches (`fp8_tma.launch`)


# The kernels that quantize a per-channel product's input per row (one scale a token), which
# can take it already quantized (`fp8_rows.Fp8Rows`, `fp8.takes_rows`).
PER_TOKEN_A8 = (Kernel.SCALED_MM, Kernel.W8A8, Kernel.TMA)


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1
    swap: bool = False  # compute (W x^T)^T: the weight tile is the MMA's M side (decode tiles)


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device.index or 0).multi_processor_count


def choose_kernel(m: int, n: int, k: int, kb: int, block_k: int, sms: int = 132, tma: bool = False) -> Kernel:
    """One row: GEMV; where `tma` (a Hopper GPU, `kernel_for`) and `fp8_tma.launch` has a launch for a
    per-channel product: TMA; up to A8_MIN_M - 1 rows: W8A16; from A8_MIN_M rows W8A8, through cuBLAS
    where it takes the shape (N, K multiples of 16; for block scales block_k = 128 and K a
    multiple of 512, and `fp8_linear` also checks `scales_in_128_row_blocks`), else the Triton
    kernel (whose fp8 dots take k-steps of 32: block scales of 16 columns stay on W8A16).
    Per-channel products of decode batches on narrow long-K weights go to the Triton kernel with
    K split (`decode_a8`; `sms`: the GPU's)."""
    if m == 1:
        return Kernel.GEMV
    if tma and kb == 1 and fp8_tma.launch(m, n, k) is not None:
        return Kernel.TMA
    if m < A8_MIN_M:
        return Kernel.W8A16
    aligned = n % 16 == 0 and k % 16 == 0
    if kb == 1:
        return Kernel.SCALED_MM if aligned and not decode_a8(m, n, k, sms) else Kernel.W8A8
    if block_k == 128 and aligned and k % 512 == 0:
        return Kernel.BLOCKWISE
    return Kernel.W8A8 if block_k >= 32 else Kernel.W8A16


def kernel_for(m: int, n: int, k: int, kb: int, block_k: int, device: torch.device) -> Kernel:
    """`choose_kernel` on `device`: its SMs, and TMA where `fp8_tma` runs there and the kernel
    options' `fp8_tma` is on."""
    tma = kernel_options.current().fp8_tma and fp8_tma.available(device)
    return choose_kernel(m, n, k, kb, block_k, num_sms(device), tma)


def decode_a8(m: int, n: int, k: int, sms: int) -> bool:
    """Whether a per-channel W8A8 product of `m` rows runs on the Triton kernel with K split
    rather than cuBLAS: decode batches (up to DECODE_A8_MAX_M rows) on a long-K weight (K >=
    8,192: the down projection) of fewer 128 x 128 output tiles than SMs. cuBLAS runs those tiles
    without splitting K, so most SMs idle through the long K. H200 (`bench_fp8 --sweep --a8-only
    --m 64 128 256`, BENCHMARKS.md): the 8B down (4,096 x 14,336) took 31.0 against cuBLAS's 42.3
    us at 64 rows and 34.6 against 42.8 at 128, but 44.8 against 43.9 at 256; on the short-K
    products (qkv, o: K = 4,096) no split launch beat cuBLAS by more than 1 us and most lost 5-15
    us (sending them too made the batch-64 FP8 step 0.2-0.35 ms slower), and gate/up fills the SMs."""
    return m <= DECODE_A8_MAX_M and k >= 8192 and triton.cdiv(m, 128) * triton.cdiv(n, 128) < sms


def choose_tile(m: int, n: int, k: int, kb: int, a8: bool, device: torch.device) -> TileConfig:
    """The tiled kernel's launch, chosen from the launches `--sweep` times. W8A16: up to 16 rows,
    16 x 64 x 256 tiles per-channel, 16 x 128 x 128 with block scales (which convert through
    float32 and prefer other tiles); more rows padded to 32 or 64 on 64 x 128 tiles, swapped
    per-channel (at 32 rows, 16-row tiles took 0.9x as long on qkv, 1.1-1.45x on o, down and
    gate_up); K split until the grid covers the SMs. W8A8: 128 x 128 x 128 (64 x 128 with block
    scales, whose per-k-block rescale serialises the tensor cores); per-channel decode batches
    (`decode_a8`) on 64 x 128 x 256 tiles (the fastest of five at 64 and 128 rows) with K split
    until the grid nearly covers the SMs (each split writes a float32 partial of the output: no
    more splits than that)."""
    if a8:
        if kb == 1 and decode_a8(m, n, k, num_sms(device)):
            return with_split(TileConfig(64, 128, 256, 4, 3), m, n, k, device, fill=0.9)
        return TileConfig(128, 128, 128, 8, 4) if kb == 1 else TileConfig(64, 128, 128, 4, 4)
    if m <= 16:
        cfg = TileConfig(16, 64, 256, 4, 4) if kb == 1 else TileConfig(16, 128, 128, 8, 3)
    else:
        cfg = TileConfig(min(64, triton.next_power_of_2(m)), 64, 128, 4, 4, swap=kb == 1)
    return with_split(cfg, m, n, k, device)


def with_split(cfg: TileConfig, m: int, n: int, k: int, device: torch.device, fill: float = 1.0) -> TileConfig:
    """K split in 2, 4 or 8 while the tiles are fewer than `fill` x the SMs (each split >= 2 steps)."""
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    split = 1
    while tiles * split < fill * num_sms(device) and split < 8 and k >= 4 * split * cfg.block_k:
        split *= 2
    return replace(cfg, split_k=split)


@triton.jit
def _block_scales(S, rows, rmask, gi, k0, KB, stride_sn, PER_CHANNEL: tl.constexpr, SCALE_K: tl.constexpr):
    """[BLOCK_N, G] scales of the 16-column vectors of the step at k0 (zeros for per-channel)."""
    if PER_CHANNEL:
        return tl.zeros([rows.shape[0], gi.shape[0]], tl.float32)
    kb = (k0 + gi * 16) // SCALE_K
    return tl.load(S + rows[:, None] * stride_sn + kb[None, :], mask=rmask[:, None] & (kb < KB)[None, :], other=0.0)


@triton.jit
def _gemv_kernel(X, W, S, B, Y, N, K, KB, stride_wn, stride_sn,
                 PER_CHANNEL: tl.constexpr, SCALE_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, G: tl.constexpr, PDL: tl.constexpr):
    """A step is BLOCK_N rows x G vectors of 16 columns: each thread sums its 16 products in
    registers, so the accumulator is [BLOCK_N, G] and a block scale multiplies 16 products."""
    pdl.launch_dependents(PDL)
    BLOCK_K: tl.constexpr = G * 16
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    gi = tl.arange(0, G)
    offs = gi[:, None] * 16 + tl.arange(0, 16)[None, :]  # [G, 16] columns of one step
    w_ptr = W + rows.to(tl.int64)[:, None, None] * stride_wn + offs[None, :, :]
    # The weights are never written: the first tile is requested before waiting for x (PDL).
    # Every iteration requests the next tile, x slice and block scales before using the current
    # ones, so each waits for one round trip, not for x (or the scales) after the weights.
    w = tl.load(w_ptr, mask=rmask[:, None, None] & (offs < K)[None, :, :], other=0.0)
    pdl.wait(PDL)
    xv = tl.load(X + offs, mask=offs < K, other=0.0)
    s = _block_scales(S, rows, rmask, gi, 0, KB, stride_sn, PER_CHANNEL, SCALE_K)
    acc = tl.zeros([BLOCK_N, G], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        nxt = k0 + BLOCK_K + offs
        w_next = tl.load(w_ptr + k0 + BLOCK_K, mask=rmask[:, None, None] & (nxt < K)[None, :, :], other=0.0)
        x_next = tl.load(X + nxt, mask=nxt < K, other=0.0)
        s_next = _block_scales(S, rows, rmask, gi, k0 + BLOCK_K, KB, stride_sn, PER_CHANNEL, SCALE_K)
        p = tl.sum(w.to(tl.float32) * xv.to(tl.float32)[None, :, :], 2)
        if PER_CHANNEL:
            acc += p
        else:
            acc += p * s
        w, xv, s = w_next, x_next, s_next
    y = tl.sum(acc, 1)
    if PER_CHANNEL:
        y = y * tl.load(S + rows * stride_sn, mask=rmask, other=0.0)
    if HAS_BIAS:
        y += tl.load(B + rows, mask=rmask, other=0.0).to(tl.float32)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=rmask)


@triton.jit
def _gemm_kernel(X, W, SW, SX, B, Y, Part, Counters, M, N, K, KB, SPLIT_K,
                 stride_xm, stride_wn, stride_swn, stride_sxm, stride_sxk, stride_ym,
                 A8: tl.constexpr, PER_CHANNEL: tl.constexpr, SCALE_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr,
                 GROUP_M: tl.constexpr, PDL: tl.constexpr):
    pdl.launch_dependents(PDL)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n  # GROUP_M row tiles walk the weight's column tiles together (L2 reuse)
    first_m = pid // width * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + pid % width % size_m
    pid_n = pid % width // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = rm < M
    nmask = rn < N
    chunk = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K  # BLOCK_K divides SCALE_K: no tile straddles
    k_lo = pid_k * chunk
    k_hi = tl.minimum(k_lo + chunk, K)
    ck = tl.arange(0, BLOCK_K)
    x_ptr = X + rm.to(tl.int64)[:, None] * stride_xm + ck[None, :]
    w_ptr = W + rn.to(tl.int64)[:, None] * stride_wn + ck[None, :]
    pdl.wait(PDL)
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kmask = k0 + ck < k_hi
        x = tl.load(x_ptr + k0, mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptr + k0, mask=nmask[:, None] & kmask[None, :], other=0.0)
        if A8:
            if PER_CHANNEL:
                acc = tl.dot(x, tl.trans(w), acc)
            else:
                sx = tl.load(SX + rm * stride_sxm + k0 // SCALE_K * stride_sxk, mask=mmask, other=0.0)
                sw = tl.load(SW + rn * stride_swn + k0 // SCALE_K, mask=nmask, other=0.0)
                acc += tl.dot(x, tl.trans(w)) * (sx[:, None] * sw[None, :])
        else:
            if PER_CHANNEL:
                wd = w.to(X.dtype.element_ty)
            else:
                sw = tl.load(SW + rn * stride_swn + k0 // SCALE_K, mask=nmask, other=0.0)
                wd = (w.to(tl.float32) * sw[:, None]).to(X.dtype.element_ty)
            if SWAP:
                acc = tl.dot(wd, tl.trans(x), acc)
            else:
                acc = tl.dot(x, tl.trans(wd), acc)
    if SWAP:
        acc = tl.trans(acc)
    if PER_CHANNEL:
        acc = acc * tl.load(SW + rn * stride_swn, mask=nmask, other=0.0)[None, :]
        if A8:
            acc = acc * tl.load(SX + rm * stride_sxm, mask=mmask, other=0.0)[:, None]
    out = Y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    omask = mmask[:, None] & nmask[None, :]
    part = Part + rm.to(tl.int64)[:, None] * N + rn[None, :]
    acc, last = fp8_tma.sum_split_k(acc, part, omask, Counters, pid_m * grid_n + pid_n, pid_k, SPLIT_K, M * N)
    if last:
        if HAS_BIAS:
            acc += tl.load(B + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(out, acc.to(Y.dtype.element_ty), mask=omask)


@triton.jit
def row_amax(amax):
    """The quantization's amax of a row from elementwise |x| maxima (never 0: a zero row gets
    scale 1e-12 / 448 and quantizes to zeros)."""
    return tl.maximum(tl.max(amax, 0), 1e-12)


@triton.jit
def to_e4m3(x, a):
    """x (float32) on the e4m3 grid of a row whose amax is `a` (scale a / 448), before the cast."""
    return tl.clamp(x * (448.0 / a), -448.0, 448.0)


@triton.jit
def _quant_kernel(X, Q, S, M, K, KB, stride_xm, stride_qm, stride_sm, stride_sk,
                  GROUP: tl.constexpr, GROUPS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Row m (GROUP = 0: one scale, two passes over the row) or GROUPS groups of GROUP columns
    of it: scale = amax / 448, q = e4m3(x / scale); rows from M on (padding) quantize zeros."""
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    m = tl.program_id(0).to(tl.int64)
    live = m < M  # a padding row reads nothing and writes zeros
    x_row = X + m * stride_xm
    q_row = Q + m * stride_qm
    if GROUP == 0:
        cols = tl.arange(0, BLOCK)
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_row + k0 + cols, mask=(k0 + cols < K) & live, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        a = row_amax(amax)
        tl.store(S + m * stride_sm, a / 448.0)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_row + k0 + cols, mask=(k0 + cols < K) & live, other=0.0).to(tl.float32)
            q = to_e4m3(x, a)
            tl.store(q_row + k0 + cols, q.to(Q.dtype.element_ty), mask=k0 + cols < K)
    else:
        g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        x = tl.load(x_row + cols, mask=(cols < K) & live, other=0.0).to(tl.float32)
        a = tl.maximum(tl.max(tl.abs(x), 1), 1e-12)
        tl.store(S + m * stride_sm + g * stride_sk, a / 448.0, mask=g < KB)
        q = tl.clamp(x * (448.0 / a)[:, None], -448.0, 448.0)
        tl.store(q_row + cols, q.to(Q.dtype.element_ty), mask=cols < K)


def quantize_rows(x: torch.Tensor, group: int = 0, column_major_scales: bool = False, pad_to: int = 1
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M', K], float32 scales): x ~ q * scale, one scale per row ([M', 1];
    group = 0) or per row and `group` columns ([M', ceil(K / group)], group a power of two;
    column-major if asked, as cuBLAS takes 1 x 128 scales). M' is M rounded up to `pad_to`;
    the extra rows are zeros."""
    m, k = x.shape
    mp = triton.cdiv(m, pad_to) * pad_to
    q = torch.empty(mp, k, dtype=FP8, device=x.device)
    groups = 1 if group == 0 else triton.cdiv(k, group)
    if column_major_scales:
        s = torch.empty(groups, mp, dtype=torch.float32, device=x.device).t()
    else:
        s = torch.empty(mp, groups, dtype=torch.float32, device=x.device)
    per = 1 if group == 0 else max(1, min(2048 // group, triton.next_power_of_2(groups)))
    use_pdl = pdl.enabled(x.device)
    _quant_kernel[(mp, triton.cdiv(groups, per))](
        x, q, s, m, k, groups, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
        GROUP=group, GROUPS=per, BLOCK=min(2048, triton.next_power_of_2(k)) if group == 0 else 1, PDL=use_pdl,
        num_warps=4, launch_pdl=use_pdl)
    return q, s


def gemv(x, weight, scale, block_k, bias=None, config: tuple[int, int, int, int] | None = None):
    """x [1, K] -> [1, N] (`_gemv_kernel`); config (rows, columns per step, warps, stages)."""
    n, k = weight.shape
    kb = scale.shape[1]
    block_n, cols, warps, stages = config or GEMV_LAUNCH
    cols = min(cols, max(16, triton.next_power_of_2(k)))
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    use_pdl = pdl.enabled(x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, scale, bias if bias is not None else scale, y, n, k, kb, weight.stride(0), scale.stride(0),
        PER_CHANNEL=kb == 1, SCALE_K=block_k if kb > 1 else 1, HAS_BIAS=bias is not None,
        BLOCK_N=block_n, G=cols // 16, PDL=use_pdl, num_warps=warps, num_stages=stages, launch_pdl=use_pdl)
    return y


def gemm(x, weight, scale, block_k, bias=None, a8: bool = False, config: TileConfig | None = None):
    """x [M, K] -> [M, N] by the tiled kernel: W8A16, or W8A8 with x quantized here (or x
    given quantized: `Fp8Rows`, per-channel weights)."""
    out_dtype, sx = x.dtype, scale  # (sx unused unless a8)
    if isinstance(x, Fp8Rows):
        x, sx = x.q, x.scale
    elif a8:
        x, sx = quantize_rows(x, 0 if scale.shape[1] == 1 else block_k)
    m, k = x.shape
    n, kb = weight.shape[0], scale.shape[1]
    cfg = config or choose_tile(m, n, k, kb, a8, x.device)
    bk = cfg.block_k if kb == 1 else min(cfg.block_k, block_k)
    y = torch.empty(m, n, dtype=out_dtype, device=x.device)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    part, counters = fp8_tma.split_k_buffers(y, cfg.split_k, tiles)
    use_pdl = pdl.enabled(x.device)
    _gemm_kernel[(tiles, cfg.split_k)](
        x, weight, scale, sx, bias if bias is not None else scale, y, part, counters, m, n, k, kb, cfg.split_k,
        x.stride(0), weight.stride(0), scale.stride(0), sx.stride(0), sx.stride(1) if kb > 1 else 0, y.stride(0),
        A8=a8, PER_CHANNEL=kb == 1, SCALE_K=block_k if kb > 1 else 1, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, SWAP=cfg.swap, GROUP_M=8, PDL=use_pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=use_pdl)
    return y


def scaled_mm(x, weight, scale, bias=None, fast_accum: bool = True):
    """Per-channel weights (scale [N, 1]), N and K multiples of 16: x quantized per token (or
    given quantized: `Fp8Rows`), then cuBLAS's FP8 product with row-wise scales; bias in x's
    dtype, added in its epilogue. Fast accumulation: 3-17% faster, relative error 3.3e-3
    against 1.7e-3 (K = 14,336)."""
    q, sx = (x.q, x.scale) if isinstance(x, Fp8Rows) else quantize_rows(x)
    return torch._scaled_mm(q, weight.t(), scale_a=sx, scale_b=scale.reshape(1, -1), bias=bias,
                            out_dtype=x.dtype, use_fast_accum=fast_accum)


def scales_in_128_row_blocks(scale: torch.Tensor) -> bool:
    """Whether the rows of each 128-row block share their scales, which is what cuBLAS's
    128 x 128 scales can express. The expanded DeepSeek layout does, but a fused part or a
    shard that starts inside a checkpoint block does not. Checked once per scale tensor object
    (a host sync; the answer is kept on the tensor, so pass the layer's own parameter, not a
    fresh view per call); while a CUDA graph is captured an unchecked tensor counts as no."""
    known = getattr(scale, "_fp8_in_128_row_blocks", None)
    if known is not None and known[0] == scale._version:
        return known[1]
    if scale.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    ok = torch.equal(scale[::128].repeat_interleave(128, 0)[: len(scale)], scale)
    scale._fp8_in_128_row_blocks = (scale._version, ok)
    return ok


def blockwise_mm(x, weight, scale, bias=None):
    """128 x 128 block scales expanded per row (scale [N, K / 128], one row per 128-row block
    read), N a multiple of 16, K of 512: x quantized per token and 128 columns, then cuBLAS's
    1 x 128 / 128 x 128 FP8 product. Seen on the H100: scale rows of K / 128 not a multiple of
    4, or M not a multiple of 4 (the scales' strides), are wrong or refused: x is padded to 4."""
    m = x.shape[0]
    q, sx = quantize_rows(x, 128, column_major_scales=True, pad_to=4)
    y = torch._scaled_mm(q, weight.t(), scale_a=sx, scale_b=scale[::128].contiguous().t(), bias=bias,
                         out_dtype=x.dtype)
    return y[:m]


def fp8_linear(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, scale: torch.Tensor, block_k: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bfloat16 or float16 on CUDA (contiguous rows), weight [N, K] torch.float8_e4m3fn (row-major),
    scale [N, KB] float32 with KB = ceil(K / block_k): the dequantized weight is
    W[n, k] = float(weight[n, k]) * scale[n, k // block_k]. Per-channel scales are block_k = K (KB = 1);
    DeepSeek-style 128x128 block scales arrive expanded to one row per output row (block_k = 128).
    Returns y = x @ W.T (+ bias) in x.dtype, [M, N]. x may come quantized per row (`fp8_rows.Fp8Rows`)
    where the product would quantize it that way (`PER_TOKEN_A8`, per-channel scales)."""
    if isinstance(x, Fp8Rows):
        return _rows_linear(x, weight, scale, bias)
    n, k = weight.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    kb = triton.cdiv(k, block_k)
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != FP8:
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} {x.dtype} against an {weight.dtype} weight of {k} columns")
    if tuple(scale.shape) != (n, kb) or scale.dtype != torch.float32:
        raise ValueError(f"fp8_linear: scale {tuple(scale.shape)} {scale.dtype}, expected float32 ({n}, {kb})")
    if kb > 1 and (block_k < 16 or block_k & (block_k - 1)):
        raise ValueError(f"fp8_linear: block_k = {block_k}: a power of two >= 16, or K")
    if weight.stride(1) != 1 or (kb > 1 and scale.stride(1) != 1):
        raise ValueError("fp8_linear: weight and scale need contiguous rows")
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    m = x.shape[0]
    if m == 0:
        return torch.empty(0, n, dtype=x.dtype, device=x.device)
    kernel = kernel_for(m, n, k, kb, block_k, x.device)
    if kernel is Kernel.BLOCKWISE and not scales_in_128_row_blocks(scale):
        # measured: W8A16 faster at 64 rows, the two mixed at 128-256, the Triton W8A8 from 512
        kernel = Kernel.W8A16 if m < 256 else Kernel.W8A8
    if kernel is Kernel.GEMV:
        return gemv(x, weight, scale, block_k, bias)
    if kernel is Kernel.TMA:
        return _tma_linear(Fp8Rows(*quantize_rows(x), x.dtype), weight, scale, bias)
    if kernel is Kernel.SCALED_MM:
        return scaled_mm(x, weight, scale, bias)
    if kernel is Kernel.BLOCKWISE:
        return blockwise_mm(x, weight, scale, bias)
    return gemm(x, weight, scale, block_k, bias, a8=kernel is Kernel.W8A8)


def _rows_linear(rows: Fp8Rows, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`fp8_linear` of rows already quantized per token: the product `choose_kernel` picks for
    their shape, which must be one that quantizes its input that way."""
    (m, k), n = rows.q.shape, weight.shape[0]
    if rows.q.dtype != FP8 or weight.dtype != FP8 or weight.shape[1] != k or tuple(rows.scale.shape) != (m, 1):
        raise ValueError(f"fp8_linear: quantized rows {tuple(rows.q.shape)} {rows.q.dtype} with scales "
                         f"{tuple(rows.scale.shape)} against an {weight.dtype} weight of {weight.shape[1]} columns")
    if tuple(scale.shape) != (n, 1):
        raise ValueError(f"fp8_linear: quantized rows take per-channel weight scales [{n}, 1], got {tuple(scale.shape)}")
    kernel = kernel_for(m, n, k, 1, k, rows.q.device)
    if kernel not in PER_TOKEN_A8:
        raise ValueError(f"fp8_linear: {m} quantized rows for a product that runs {kernel.value} (fp8.takes_rows)")
    if bias is not None and bias.dtype != rows.dtype:
        bias = bias.to(rows.dtype)
    if kernel is Kernel.TMA:
        return _tma_linear(rows, weight, scale, bias)
    if kernel is Kernel.SCALED_MM:
        return scaled_mm(rows, weight, scale, bias)
    return gemm(rows, weight, scale, k, bias, a8=True)


def _tma_linear(rows: Fp8Rows, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`fp8_tma.linear`, whose kernel reads one scale per row at consecutive addresses."""
    m, k = rows.q.shape
    return fp8_tma.linear(rows.q, rows.scale.contiguous(), weight, scale.contiguous(), rows.dtype, bias,
                          fp8_tma.launch(m, weight.shape[0], k))
