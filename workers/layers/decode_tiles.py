"""16-bit products of decode batches (2 to MAX_ROWS rows) on the Triton tile kernel of
`workers.layers.fp8_gemm`, for the shapes where it beat cuBLAS inside the decode step.

At batch 64 of the Llama-3.1-8B shape (H200, 2026-11-27 profile in BENCHMARKS.md) cuBLAS ran
o_proj (4,096 x 4,096) at ~45% of the copy bandwidth (64 output tiles of 64 x 64 on 132 SMs),
and down (4,096 x 14,336) as a split-K product plus a reduce kernel, after a SiLU·up kernel of
its own. Here down reads the gate_up product's two halves and forms silu(gate) * up per tile
as it loads it (rounded as `workers.layers.silu_mul` rounds, so the product sees the same
16-bit input), which removes the SiLU kernel and the reduce. Which shapes take this path, and
their launches, come from `scripts/bf16_decode_gemm_probe.py` (`LAUNCH`); the kernel options'
`tile_configs` (`MANTA_TILE_CONFIGS`) add or replace launches for tuning, and `decode_tiles`
(`MANTA_DECODE_TILES=0`) turns the path off for comparisons.

Imports no Triton until a product runs (the CPU path never does).
"""

from __future__ import annotations

import torch

from attention import kernel_options

MAX_ROWS = 64  # from 128 rows every tile launch lost to cuBLAS (BENCHMARKS.md, bf16 probe)

# (N, K, SiLU·up prologue) -> (block_n, block_k, num_warps, num_stages, split_k, swap); block_m is
# the rows rounded up to a power of two (16 to 64).
LAUNCH: dict[tuple[int, int, bool], tuple[int, int, int, int, int, bool]] = {}


def launch(n: int, k: int, silu_mul: bool) -> tuple[int, int, int, int, int, bool] | None:
    key = f"{n}x{k}{'s' if silu_mul else ''}"
    override = next((c for s, c in kernel_options.current().tile_configs if s == key), None)
    if override is not None:
        return override[:5] + (bool(override[5]),)  # type: ignore[return-value]
    return LAUNCH.get((n, k, silu_mul))


def applies(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False) -> bool:
    """Whether `linear` runs: CUDA, 2..MAX_ROWS rows of bf16/fp16 with contiguous columns, a
    weight of that dtype with contiguous rows, and a launch for its shape."""
    if not (x.is_cuda and x.dim() == 2 and 2 <= x.shape[0] <= MAX_ROWS and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and x.stride(1) == 1 and weight.stride(1) == 1
            and kernel_options.current().decode_tiles):
        return False
    n, k = weight.shape
    return x.shape[1] == (2 * k if silu_mul else k) and launch(n, k, silu_mul) is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           silu_mul: bool = False, config: tuple[int, int, int, int, int, bool] | None = None) -> torch.Tensor:
    """x W^T (+ bias), x = silu(x[:, :K]) * x[:, K:] with `silu_mul`. Callers check `applies`
    (or, like the probe, give the launch as `config`)."""
    import triton

    from attention import pdl
    from attention.arrival import arrival_counters
    from workers.layers.fp8_gemm import _gemm_kernel

    m = x.shape[0]
    n, k = weight.shape
    block_n, block_k, warps, stages, split, swap = config or launch(n, k, silu_mul)  # type: ignore[misc]
    block_m = max(16, min(64, triton.next_power_of_2(m)))
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    part = counters = y
    if split > 1:
        part = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        counters = arrival_counters(x.device, tiles)
    use_pdl = pdl.enabled(x.device)
    _gemm_kernel[(tiles, split)](
        x, weight, weight, weight, bias if bias is not None else weight, y, part, counters, m, n, k, 1, split,
        x.stride(0), weight.stride(0), 0, 0, 0, y.stride(0), k,
        A8=False, PER_CHANNEL=True, SCALE_K=1, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, SWAP=swap, GROUP_M=8, PDL=use_pdl, SCALED=False, SILU_MUL=silu_mul,
        num_warps=warps, num_stages=stages, launch_pdl=use_pdl)
    return y
