"""Whether a Triton tile kernel beats cuBLAS on the 8B shape's bf16 products at decode batches
(issue 26: batch 64 at 72.6% of roofline; the step profile has o_proj at ~45% of the copy
bandwidth, down at ~73%, qkv at ~75%, gate/up at ~88%).

`python3 scripts/bf16_decode_gemm_probe.py [--m 64 128]`: each product timed in a CUDA graph
over a rotation of weight copies larger than L2 (as a step reads each layer's weight once):
bf16 `F.linear` against `workers.layers.fp8_gemm`'s tile kernel on the same bf16 weight (its
per-channel path with unit scales: the weight tile goes to the tensor cores as loaded), over
tile shapes, warps, stages and K splits. Each candidate is checked against `F.linear` first.
Prints a table (best first per product) and writes JSON with `--out`."""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch
import torch.nn.functional as F

from workers.layers.bench_gemv import time_in_graph
from workers.layers.fp8_gemm import TileConfig, gemm
from workers.roofline import measure_copy_bandwidth

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]


def candidates(m: int) -> list[TileConfig]:
    out = []
    for bn, bk, warps, stages, swap, split in itertools.product(
            (32, 64, 128), (64, 128, 256), (4, 8), (3, 4), (True, False), (1, 2, 4, 8)):
        if bn * bk > 128 * 128 and stages > 3:  # shared memory: 64 x 256 and 128 x 256 tiles over 4 stages
            continue
        out.append(TileConfig(min(64, m), bn, bk, warps, stages, split, swap))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, nargs="*", default=[64, 128])
    parser.add_argument("--only", nargs="*", default=[s[0] for s in SHAPES])
    parser.add_argument("--top", type=int, default=6)
    parser.add_argument("--out")
    args = parser.parse_args()
    dev = torch.device("cuda")
    copy = measure_copy_bandwidth(dev) / 1e9
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {copy:.0f} GB/s")
    rows = []
    for name, n, k in SHAPES:
        if name not in args.only:
            continue
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / 64 for _ in range(max(2, math.ceil(400e6 / (2 * n * k))))]
        ones = torch.ones(n, 1, device=dev, dtype=torch.float32)
        bytes_us = 2 * n * k / copy / 1e3
        for m in args.m:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            calls = max(8, 2 * len(ws))
            ref = F.linear(x, ws[0]).float()
            base = time_in_graph(lambda w, x=x: F.linear(x, w), ws, calls)
            results = []
            for cfg in candidates(m):
                try:
                    y = gemm(x, ws[0], ones, k, config=cfg).float()
                except Exception as e:  # a launch this GPU refuses (shared memory, registers)
                    results.append((math.inf, cfg, f"refused: {type(e).__name__}"))
                    continue
                err = ((y - ref).abs().max() / ref.abs().max()).item()
                if err > 2e-2:
                    results.append((math.inf, cfg, f"wrong: {err:.3g}"))
                    continue
                us = time_in_graph(lambda w, x=x, cfg=cfg: gemm(x, w, ones, k, config=cfg), ws, calls)  # noqa: B023 (timed at once)
                results.append((us, cfg, ""))
            results.sort(key=lambda r: r[0])
            print(f"{name} m={m}: F.linear {base:.1f} us ({100 * bytes_us / base:.0f}% of copy); "
                  f"bytes' time {bytes_us:.1f} us")
            for us, cfg, note in results[: args.top]:
                print(f"  {us:7.1f} us {100 * bytes_us / us:4.0f}%  x{base / us:5.2f}  bm{cfg.block_m} bn{cfg.block_n} "
                      f"bk{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} split{cfg.split_k} swap{int(cfg.swap)} {note}")
            bad = [r for r in results if r[2].startswith("wrong")]
            if bad:
                print(f"  {len(bad)} launches gave wrong products, e.g. {bad[0][1]} {bad[0][2]}")
            rows.append({"shape": name, "n": n, "k": k, "m": m, "f_linear_us": base, "bytes_us": bytes_us,
                         "best": [{"us": us, **cfg.__dict__, "note": note} for us, cfg, note in results[: args.top]]})
        del ws
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_gbs": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
