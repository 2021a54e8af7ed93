"""The prefill's matrix products alone, at a model's shapes: TFLOP/s of each against the
GPU's dense bf16 peak, so a prefill MFU can be split into what the GEMMs could reach and what
the rest of the step costs.

    python3 scripts/prefill_gemms.py [--tokens 1024 2048] [--hidden 4096 --inter 14336 --qkv 6144] [--zero-bias]

The figures here do not carry over to a model's step as they are. On an H200, products of
2,048 rows ran at 778-785 TFLOP/s here against 712-715 at 8,192 rows. Yet the prefill step with
its 8,192-row products cut into 2,048-row pieces was 0.6-0.8% slower (BENCHMARKS.md, 2026-11-29).
One likely reason is that each product here repeats on the same x and weight, so part of its
working set may stay in the 50 MB L2 between calls. Not verified.

--zero-bias also times each product with a zero bias (cuBLASLt's bias epilogue, whose heuristic
picks other kernels; what `workers/layers/lt_bias.py` does for some decode batches).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F


def time_ms(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 512, 1024, 1216, 2048, 4096])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--qkv", type=int, default=6144)
    ap.add_argument("--zero-bias", action="store_true", help="also each product with a zero bias")
    a = ap.parse_args()
    shapes = {"qkv": (a.qkv, a.hidden), "o": (a.hidden, a.hidden), "gate_up": (2 * a.inter, a.hidden),
              "down": (a.hidden, a.inter)}
    dev = "cuda"
    for m in a.tokens:
        row = []
        total_flop = total_ms = 0.0
        for name, (n, k) in shapes.items():
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
            ms = time_ms(lambda x=x, w=w: F.linear(x, w))
            flop = 2 * m * n * k
            total_flop += flop
            total_ms += ms
            row.append(f"{name} {ms * 1e3:6.1f} us {flop / ms / 1e9:5.0f} TF/s")
            if a.zero_bias:
                zero = torch.zeros(n, device=dev, dtype=torch.bfloat16)
                zb = time_ms(lambda x=x, w=w, zero=zero: F.linear(x, w, zero))
                row[-1] += f" (zero bias {zb * 1e3:6.1f} us {flop / zb / 1e9:5.0f})"
        print(f"M={m:5d}: " + " | ".join(row) + f" | layer {total_ms * 1e3:6.1f} us {total_flop / total_ms / 1e9:5.0f} TF/s")


if __name__ == "__main__":
    main()
