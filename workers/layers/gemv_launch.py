"""The launches of the one-row linear kernel (`workers.layers.gemv`): its prologue modes, the
launch configuration (`GemvConfig`), the choice per shape from the in-graph sweeps
(`bench_gemv`, BENCHMARKS.md) and the kernel options' overrides (`MANTA_GEMV_CONFIGS`). Imports
no Triton.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from attention import kernel_options

logger = logging.getLogger(__name__)

# The prologue f of y = f(x) W^T (`workers.layers.gemv`'s module docstring).
PLAIN, ADD_RMS, SILU_MUL, NORM = 0, 1, 2, 3


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool = False  # tensor-core dot against x padded to 16 rows (else FMA + row sums)
    vec: int = 0  # FMA over vectors of `vec` columns summed per thread (0: a [block_n, block_k] accumulator)
    prefetch: bool = True  # each iteration requests the next tile (else loads its own, pipelined by the compiler)

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "split_k"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1) or (name == "block_n" and v < 2):
                raise ValueError(f"GemvConfig.{name} = {v}: a power of two (block_n at least 2)")
        if self.vec and (self.vec & (self.vec - 1) or self.vec > self.block_k or self.use_dot):
            raise ValueError(f"GemvConfig.vec = {self.vec}: a power of two up to block_k, not with use_dot")


# FP8 weights: (rows, columns, warps, vec, prefetch) per program by (prologue, adds to the residual,
# wide: n >= 16384), from the in-graph sweeps (`bench_gemv --fp8`, BENCHMARKS.md). H200, 2026-11-28:
# the step's four products on four warps with 16-column vectors per thread (`vec`), and, for gate/up,
# o_proj + add and down + SiLU + add, each iteration loading its own tile (`prefetch` off: 39.0 ->
# 31.7, 7.5 -> 6.2, 23.9 -> 22.7 us; qkv + norm kept it, 11.0 against 11.9); the batch-1 step took
# 2.84 against 3.14 ms. The rest from the H100's sweep: 8 x 1024 for plain and SiLU products, 16 x
# 512 with a norm prologue. Absent: bf16's launch with 16-column vectors.
FP8_LAUNCH: dict[tuple[int, bool, bool], tuple[int, int, int, int, bool]] = {
    (PLAIN, False, False): (8, 1024, 8, 16, True), (PLAIN, True, False): (4, 2048, 4, 16, False),
    (PLAIN, False, True): (4, 1024, 4, 16, False),
    (ADD_RMS, False, False): (16, 512, 8, 16, True), (ADD_RMS, False, True): (4, 1024, 4, 16, True),
    (NORM, False, False): (4, 1024, 4, 16, True), (NORM, False, True): (4, 1024, 4, 16, True),
    (SILU_MUL, False, False): (8, 1024, 8, 16, True), (SILU_MUL, True, False): (4, 2048, 4, 16, False),
}


@functools.lru_cache(maxsize=8)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count if index >= 0 else 132


def choose_config(n: int, k: int, device: torch.device, mode: int = PLAIN, adds: bool = False,
                  fp8: bool = False) -> GemvConfig:
    """The launch for an N x K weight, from the in-graph sweep on the H200 (`bench_gemv`,
    BENCHMARKS.md): FMA over 4 rows x 1024 columns per program for plain and `NORM` products (8
    rows for wide plain outputs); with a full-row prologue, more rows per program (each prologue
    element is loaded once per program, so few rows per program spend load bandwidth on it):
    32 x 256 for ADD_RMS, 8 x 512 for SiLU. The residual-adding epilogue (`adds`) is slower on
    4 x 1024 programs (o_proj 12.1 vs 9.6 us at 4 x 512) and fastest with SiLU on 16 x 512.
    K is split over programs only when the row blocks are fewer than half the SMs. FP8 weights
    (one byte an element): FP8_LAUNCH, with each thread summing 16 adjacent products (one 16-byte
    load) as `fp8_gemm`'s GEMV does, and most products loading each tile in its own iteration
    (`bench_gemv --fp8`)."""
    index = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else -1)
    sms = _num_sms(index if device.type == "cuda" else -1)
    block_n, block_k, warps = {PLAIN: (4, 1024, 4), ADD_RMS: (32, 256, 8), SILU_MUL: (8, 512, 8), NORM: (4, 1024, 4)}[mode]
    if mode == PLAIN and n >= 16384:  # gate/up (28,672 rows): 8 x 512; the LM head: 8 x 256
        block_n, block_k = 8, 256 if n >= 65536 else 512
    if adds:
        block_n, block_k = (16, 512) if mode == SILU_MUL else (4, 512)
    vec, prefetch = 0, True
    if fp8:
        block_n, block_k, warps, vec, prefetch = FP8_LAUNCH.get((mode, adds, n >= 16384),
                                                                (block_n, block_k, warps, 16, True))
    block_k = min(block_k, max(16, 1 << (k - 1).bit_length()))
    split = 1
    while -(-n // block_n) * split < sms // 2 and split < 8 and k // (2 * split) >= block_k:
        split *= 2
    return GemvConfig(block_n, block_k, split, num_warps=warps, num_stages=3, vec=min(vec, block_k), prefetch=prefetch)


def fuse_norm(n: int, k: int) -> bool:
    """Whether an RMSNorm goes into the product's prologue (else `add_rms_norm`, then a plain
    product). Each program loads the prologue's vectors for its rows: for wide outputs (gate/up
    of an 8B model: 28,672 rows) that costs more than a separate one-row kernel (bench_gemv)."""
    return n < 16384


def _override(n: int, k: int) -> GemvConfig | None:
    """The kernel options' launch for this shape (`MANTA_GEMV_CONFIGS`): launches to try in a
    whole model step (a tuning knob; `bench_gemv` times one product alone, where a launch that
    loads its whole slice of the weight before the PDL wait gains nothing)."""
    launch = kernel_options.current().gemv_launch(n, k)
    if launch is None:
        return None
    bn, bk, split, warps, *rest = launch
    return GemvConfig(bn, bk, split, warps, 3, vec=rest[0] if rest else 0, prefetch=rest[1:] != [0])


@functools.lru_cache(maxsize=256)
def logged_choice(n: int, k: int, device: torch.device, mode: int, adds: bool, fp8: bool = False) -> GemvConfig:
    """The launch of an N x K product (the kernel options' override, else `choose_config`), logged
    once per shape."""
    cfg = _override(n, k) or choose_config(n, k, device, mode, adds, fp8)
    logger.info("one-row linear %d x %d%s (prologue %d%s): Triton GEMV %s", n, k, " FP8" if fp8 else "", mode,
                ", adds to the residual" if adds else "", cfg)
    return cfg


def best_launches(results: list[dict]) -> str:
    """The fastest Triton launch of each N x K in `bench_gemv`'s results, as `MANTA_GEMV_CONFIGS`
    reads it (`bench_gemv --emit-configs`). The override is per shape, whatever the prologue:
    sweep only the products a model step runs (`--only 5 6 8 9`: the 8B bf16 step's qkv + norm,
    o_proj + add, down + SiLU + add, gate/up; `--fp8 --only 5 6 10 11`: the FP8 step's, whose
    gate/up writes silu(gate) * up and whose down is plain + add)."""
    best: dict[str, dict] = {}
    for r in results:
        if r["config"] is None or not r["kind"].startswith("triton") or r["kind"] == "triton-norm+plain":
            continue
        key = f"{r['n']}x{r['k']}"
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    return ";".join(f"{key}:{c['block_n']},{c['block_k']},{c['split_k']},{c['num_warps']},{c['vec']},"
                    f"{int(c.get('prefetch', True))}"
                    for key, c in ((key, r["config"]) for key, r in best.items()))
