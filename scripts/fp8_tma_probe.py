"""FP8 products of serve batches (64-256 rows) on a Triton kernel fed by TMA, against what ships.

`python3 scripts/fp8_tma_probe.py [--m 128 256] [--quick]` on a GPU: for each Llama-3.1-8B product
(qkv, o, gate/up, down) and row count, the input quantized per token beforehand (as the model's
norms and SiLU·up hand it over, `fp8_rows.Fp8Rows`), each candidate in a CUDA graph over a rotation
of weight copies larger than L2 (`bench_gemv.time_in_graph`), checked against the dequantized
float32 product first:

- `ships`: `fp8_linear` on the quantized rows (cuBLAS's row-wise `_scaled_mm`, or the Triton
  pointer-load kernel with K split for down up to 128 rows: `fp8_gemm.decode_a8`);
- `cublas tensorwise`: `_scaled_mm` with one scale per operand (timing only: cuBLAS picks its
  kernels by scaling mode);
- `tma ...`: `workers.layers.fp8_tma` (the weight and the rows read by TMA, the weight on the
  MMA's M side) at each launch (weight rows, K step, warps, stages) and K split;
- bf16 `F.linear` on the same shape.

Prints a table (us, GB/s of weight, fraction of the copy bandwidth) and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import math
import re

import torch
import torch.nn.functional as F
import triton

from workers.layers import fp8 as fp8_layer
from workers.layers import fp8_tma
from workers.layers.bench_fp8 import SHAPES
from workers.layers.bench_gemv import time_in_graph
from workers.layers.fp8_gemm import fp8_linear, quantize_rows
from workers.layers.fp8_rows import Fp8Rows
from workers.roofline import measure_copy_bandwidth

# (weight rows a tile, K a step, warps, stages): the token side is the batch padded to 64-256
LAUNCHES = [(64, 128, 4, 4), (64, 128, 4, 6), (64, 256, 4, 4), (128, 128, 8, 4), (128, 128, 4, 4),
            (128, 256, 8, 3), (64, 256, 4, 3)]
# at 2-48 rows (a 16-64-row token tile): longer K steps, deeper pipelines
SMALL_LAUNCHES = [(64, 256, 4, 4), (64, 256, 4, 6), (64, 512, 4, 4), (128, 256, 4, 4), (128, 256, 8, 4), (64, 128, 4, 8)]


def tma_linear(q, sx, weight, scale, launch, split):
    return fp8_tma.linear(q, sx, weight, scale, torch.bfloat16, None, (*launch, split))


def splits_for(m: int, n: int, k: int, launch: tuple[int, int, int, int], sms: int) -> list[int]:
    """K splits worth timing: 1 and the powers of two up to about two waves of programs."""
    tiles = triton.cdiv(n, launch[0]) * triton.cdiv(m, fp8_tma.token_tile(m))
    out = [1]
    s = 2
    while s <= 16 and tiles * s <= 2 * sms and k // s >= 2 * launch[1]:
        out.append(s)
        s *= 2
    return out


def candidates(x: torch.Tensor, q: torch.Tensor, sx: torch.Tensor, k: int, launches: list, splits,
               tile_cap: int = 0) -> list:
    """(label, fn(weight pair)) to time for rows x (bf16) and their per-token quantization (q, sx);
    with `tile_cap`, the TMA launches also with the batch tiled in that many rows."""
    m = x.shape[0]
    ones = torch.ones((), device=x.device)
    out = [("ships (x bf16)", lambda w: fp8_linear(x, w[0], w[1], k))]
    if m >= 64:
        out.append(("ships", lambda w: fp8_linear(Fp8Rows(q, sx, torch.bfloat16), w[0], w[1], k)))
    out += [("cublas rowwise", lambda w: torch._scaled_mm(q, w[0].t(), scale_a=sx, scale_b=w[1].reshape(1, -1),
                                                          out_dtype=torch.bfloat16, use_fast_accum=True)),
            ("cublas tensorwise (timing only)", lambda w: torch._scaled_mm(
                q, w[0].t(), scale_a=ones, scale_b=ones, out_dtype=torch.bfloat16, use_fast_accum=True))]
    for launch in launches:
        for split in splits(launch):
            out.append((f"tma {launch} split {split}",
                        lambda w, launch=launch, split=split: tma_linear(q, sx, w[0], w[1], launch, split)))
            if tile_cap and m > tile_cap:  # the batch in tiles of tile_cap rows, one program each
                out.append((f"tma {launch} split {split} tile {tile_cap}", lambda w, launch=launch, split=split: (
                    fp8_tma.linear(q, sx, w[0], w[1], torch.bfloat16, None, (*launch, split, tile_cap)))))
    return out


def bench_rows(name: str, n: int, k: int, m: int, ws: list, wb: list, quick: bool, sms: int, copy: float,
               tile_cap: int = 0) -> list[dict]:
    """Every candidate for one product and row count, checked, then timed: table rows."""
    dev = ws[0][0].device
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    q, sx = quantize_rows(x)
    ref = (q.float() * sx) @ fp8_layer.dequantize(*ws[0], k).T
    rows = []

    def record(label: str, us: float, err: float = float("nan")) -> None:
        gbs = n * k / us / 1e3
        rows.append(dict(shape=name, m=m, kernel=label, us=round(us, 2), gbs=round(gbs), copy=round(gbs / copy, 3),
                         rel_err=err))
        print(f"{name:<8}{m:>5} {label:<40}{us:8.1f}{gbs:7.0f}{100 * gbs / copy:5.0f}%  err {err:.1e}", flush=True)

    launches = LAUNCHES if m >= 64 else SMALL_LAUNCHES
    for label, fn in candidates(x, q, sx, k, launches[:2] if quick else launches,
                                lambda launch: splits_for(m, n, k, launch, sms), tile_cap):
        try:
            err = float("nan")
            if "timing only" not in label:
                y = fn(ws[0]).float()
                err = ((y - ref).norm() / ref.norm()).item()
            us = time_in_graph(fn, ws, len(ws))
        except Exception as e:  # noqa: BLE001 (a launch that does not compile or fit: reported, not fatal)
            print(f"{name:<8}{m:>5} {label:<40} failed: {str(e)[:160]}", flush=True)
            continue
        record(label, us, err)
    tma = [r for r in rows if r["kernel"].startswith("tma") and r["rel_err"] < 0.05]
    if tma:  # o_proj's input is not quantized by the op before it: the best launch with quantize_rows
        best = min(tma, key=lambda r: r["us"])
        parts = re.match(r"tma \(([^)]*)\) split (\d+)(?: tile (\d+))?", best["kernel"])
        full = (*(int(v) for v in parts.group(1).split(",")), int(parts.group(2)))
        full += (int(parts.group(3)),) if parts.group(3) else ()
        record(f"{best['kernel']} + quantize_rows", time_in_graph(
            lambda w: fp8_tma.linear(*quantize_rows(x), w[0], w[1], torch.bfloat16, None, full), ws, len(ws)))
    record("bf16 F.linear", time_in_graph(lambda w: F.linear(x, w), wb, len(wb)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, nargs="*", default=[8, 16, 32, 48, 64, 128, 256])
    parser.add_argument("--shapes", nargs="*", default=[s[0] for s in SHAPES])
    parser.add_argument("--quick", action="store_true", help="only the first two launches")
    parser.add_argument("--tile-cap", type=int, default=0,
                        help="also time the TMA launches with the batch tiled in this many rows (e.g. 128 at 160-256 rows)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    copy = measure_copy_bandwidth(dev) / 1e9
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {copy:.0f} GB/s, {sms} SMs")
    rows = []
    for name, n, k in SHAPES:
        if name not in args.shapes:
            continue
        copies = max(2, math.ceil(400e6 / (n * k)))
        ws = [fp8_layer.quantize_rows(torch.randn(n, k, device=dev) / k**0.5) for _ in range(copies)]
        wb = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(max(2, copies // 2))]
        for m in args.m:
            rows += bench_rows(name, n, k, m, ws, wb, args.quick, sms, copy, args.tile_cap)
        del ws, wb
        torch.cuda.empty_cache()
    print("\n# best TMA launch against what ships")
    for (shape, m) in dict.fromkeys((r["shape"], r["m"]) for r in rows):
        case = [r for r in rows if r["shape"] == shape and r["m"] == m]
        ships = next(r for r in case if r["kernel"] == ("ships" if m >= 64 else "ships (x bf16)"))
        tma = [r for r in case if r["kernel"].startswith("tma") and "quantize" not in r["kernel"] and r["rel_err"] < 0.05]
        if tma:
            best = min(tma, key=lambda r: r["us"])
            print(f"{shape:<8}{m:>5}  ships {ships['us']:7.1f} us   {best['kernel']:<34}{best['us']:7.1f} us"
                  f"  x{ships['us'] / best['us']:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_gbs": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
