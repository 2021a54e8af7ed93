"""Which cuBLAS kernel runs the 8B shape's bf16 products (o_proj 4,096 x 4,096 by default;
`--shapes NxK ...`) at decode batches, and how long it takes, for the input forms a step can
hand it: a contiguous [M, K] row block, a [M, K / 128, 128] head view flattened, and with a zero
bias (`torch.addmm` / `F.linear`: cuBLASLt's path, other heuristics). Each timed in a CUDA graph
over weight copies larger than L2, kernels named by the profiler.
`python3 scripts/decode_gemm_kernels_probe.py [--m 32 64 128] [--shapes 6144x4096 ...]` (issue 26:
the 2026-11-27 batch-64 profile named a 17 us kernel o_proj; it was qkv's).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from workers.layers.bench_gemv import time_in_graph  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, nargs="*", default=[32, 64, 128])
    p.add_argument("--shapes", nargs="*", default=["4096x4096"], help="NxK products (qkv 6144x4096, down 4096x14336)")
    args = p.parse_args()
    for shape in args.shapes:
        n, k = map(int, shape.split("x"))
        print(f"# {n} x {k}: bytes' time at 4,270 GB/s {2 * n * k / 4.27e6:.1f} us")
        _shape(n, k, args.m)


def _shape(n: int, k: int, ms: list[int]) -> None:
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(math.ceil(400e6 / (2 * n * k)))]
    zero = torch.zeros(n, device="cuda", dtype=torch.bfloat16)
    for m in ms:
        flat = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        heads = torch.randn(m, k // 128, 128, device="cuda", dtype=torch.bfloat16)
        forms = {"contiguous": lambda w, x=flat: F.linear(x, w),
                 "heads view": lambda w, x=heads.view(m, k): F.linear(x, w),
                 "addmm zero bias": lambda w, x=flat: torch.addmm(zero, x, w.t()),
                 "linear zero bias": lambda w, x=flat: F.linear(x, w, zero)}
        for name, op in forms.items():
            us = time_in_graph(op, ws, 2 * len(ws))
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                op(ws[0])
                torch.cuda.synchronize()
            kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
            print(f"m={m:4d} {name:18s} {us:6.1f} us  {' | '.join(kk[:70] for kk in kernels)}")


if __name__ == "__main__":
    main()
