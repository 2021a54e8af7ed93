"""`python -m workers.layers.bench_fp8 [--sweep] [--m M ...]`: the FP8 products of
`workers/layers/fp8_gemm.py` on the Llama-3.1-8B shapes against bf16 `F.linear`, each timed in a
CUDA graph over a rotation of weight copies larger than L2 (as a model step reads each layer's
weight once); `--sweep` times the candidate launches the kernel choice was made from."""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
import triton

from attention import pdl
from workers.layers.bench_gemv import time_in_graph
from workers.layers.fp8_gemm import (
    FP8,
    TileConfig,
    choose_kernel,
    fp8_linear,
    gemm,
    gemv,
    scaled_mm,
    with_split,
)
from workers.roofline import measure_copy_bandwidth

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]  # Llama-3.1-8B
SWEEP_GEMV = [(4, 2048, 4, 3), (8, 1024, 4, 3), (16, 1024, 8, 3), (8, 512, 4, 3), (2, 4096, 4, 3)]
SWEEP_TILE = [(16, 32, 256, 4, 4), (16, 64, 256, 4, 4), (16, 128, 128, 8, 3), (32, 64, 128, 4, 4, 1, True),
              (64, 64, 128, 4, 4, 1, True), (64, 128, 128, 8, 4, 1, True)]
# W8A8 on the Triton kernel for decode batches (`decode_a8`), K split to nearly cover the SMs
SWEEP_A8 = [(64, 128, 128, 4, 4), (64, 64, 128, 4, 4), (64, 128, 256, 4, 3), (64, 256, 128, 8, 3), (128, 128, 128, 8, 4)]


def _candidates(x: torch.Tensor, n: int, bk: int, sweep: bool, a8_only: bool = False) -> list:
    """(label, fn(weight, scale)) to time: `fp8_linear`, and with `sweep` the alternatives."""
    m, k = x.shape
    kb = triton.cdiv(k, bk)
    out = [(f"default: {choose_kernel(m, n, k, kb, bk).value}", lambda w, s: fp8_linear(x, w, s, bk))]
    if sweep and m == 1:
        out += [(f"gemv {c}", lambda w, s, c=c: gemv(x, w, s, bk, config=c)) for c in SWEEP_GEMV]
    if sweep and 64 <= m <= 256 and kb == 1:
        out += [(f"w8a8 {c} split", lambda w, s, c=c: gemm(
            x, w, s, bk, a8=True, config=with_split(TileConfig(*c), m, n, k, x.device, fill=0.9))) for c in SWEEP_A8]
    if sweep and 1 < m <= 128 and not a8_only:
        out += [(f"w8a16 {c}", lambda w, s, c=c: gemm(x, w, s, bk, config=with_split(TileConfig(*c), m, n, k, x.device)))
                for c in SWEEP_TILE]
    if sweep and m >= 16:  # (below A8_MIN_M: what W8A8 would cost there, against W8A16's tiles)
        zero = torch.zeros(n, device=x.device, dtype=x.dtype)  # cuBLASLt's heuristic may pick another kernel
        out += [("scaled_mm", lambda w, s: scaled_mm(x, w, s)),
                ("scaled_mm, exact accumulation", lambda w, s: scaled_mm(x, w, s, fast_accum=False)),
                ("scaled_mm + zero bias", lambda w, s: scaled_mm(x, w, s, bias=zero))] if kb == 1 else []
        out += [("w8a8 (Triton)", lambda w, s: gemm(x, w, s, bk, a8=True))]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="time the candidate launches too")
    parser.add_argument("--m", type=int, nargs="*", default=[1, 4, 16, 32, 64, 256, 1024, 4096])
    parser.add_argument("--scales", nargs="*", choices=("channel", "block128"), default=["channel", "block128"])
    parser.add_argument("--a8-only", action="store_true", help="with --sweep: skip the W8A16 tiles")
    args = parser.parse_args()
    dev = torch.device("cuda")
    copy = measure_copy_bandwidth(dev) / 1e9
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {copy:.0f} GB/s, PDL {pdl.enabled(dev)}")
    print(f"{'shape':<8}{'M':>5} {'scales':<9}{'kernel':<32}{'us':>8}{'GB/s':>6}{'copy':>5}{'TF/s':>6}{'bf16 us':>8}{'x':>6}")
    for name, n, k in SHAPES:
        nb, kb = triton.cdiv(n, 128), triton.cdiv(k, 128)
        ws = [((torch.randn(n, k, device=dev) * 32).to(FP8), torch.rand(n, 1, device=dev) / 3e3 + 1e-4,
               (torch.rand(nb, kb, device=dev) / 3e3 + 1e-4).repeat_interleave(128, 0)[:n].contiguous())
              for _ in range(max(2, math.ceil(400e6 / (n * k))))]
        wb = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(max(2, math.ceil(400e6 / (2 * n * k))))]
        for m in args.m:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            bf16 = time_in_graph(lambda w, x=x: F.linear(x, w), wb, max(8, 2 * len(wb)) if m <= 64 else len(wb))
            for kind, bk, col in (("channel", k, 1), ("block128", 128, 2)):
                if kind not in args.scales:
                    continue
                for label, fn in _candidates(x, n, bk, args.sweep, args.a8_only):
                    try:
                        us = time_in_graph(lambda w, fn=fn, col=col: fn(w[0], w[col]), ws,
                                           max(8, 2 * len(ws)) if m <= 64 else len(ws))
                    except (RuntimeError, ValueError) as e:  # a kernel that refuses the shape
                        print(f"{name:<8}{m:>5} {kind:<9}{label:<32} failed: {str(e)[:100]}", flush=True)
                        continue
                    gbs = n * k / us / 1e3
                    print(f"{name:<8}{m:>5} {kind:<9}{label:<32}{us:8.1f}{gbs:6.0f}{100 * gbs / copy:4.0f}%"
                          f"{2 * m * n * k / us / 1e6:6.0f}{bf16:8.1f}{bf16 / us:6.2f}", flush=True)
        del ws, wb
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
