"""Launch sweep of the MoE grouped GEMM at decode sizes (DeepSeek-V2-Lite's expert shapes by
default): each block configuration's time for the whole `fused_moe` (router ids fixed, one
CUDA graph replayed), so the table shows what `fused_moe._config` should pick per pair count.

    python3 -m workers.layers.bench_moe [--tokens 1 16 64] [--experts 64] [--hidden 2048]
        [--inter 1408] [--top-k 6] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from workers.layers import fused_moe
from workers.layers.bench_gemv import time_in_graph


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=1408)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--out")
    a = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    w13 = torch.randn(a.experts, 2 * a.inter, a.hidden, device=dev, dtype=dt) * 0.02
    w2 = torch.randn(a.experts, a.hidden, a.inter, device=dev, dtype=dt) * 0.02
    default = fused_moe._config
    rows = []
    for t in a.tokens:
        x = torch.randn(t, a.hidden, device=dev, dtype=dt)
        ids = torch.rand(t, a.experts, device=dev).argsort(dim=1)[:, : a.top_k].int().contiguous()
        weights = torch.rand(t, a.top_k, device=dev)
        hit = int(torch.unique(ids).numel())
        roof_us = hit * 3 * a.hidden * a.inter * 2 / 4.2e6  # the experts hit, at ~4.2 TB/s
        configs = [None] + [dict(BLOCK_M=16, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
                            for n, k, w, s in itertools.product((32, 64, 128), (64, 128, 256), (4,), (2, 3, 4))]
        for cfg in configs:
            fused_moe._config = default if cfg is None else (lambda p, c=cfg: dict(c))
            try:
                us = time_in_graph(lambda _, x=x, weights=weights, ids=ids: fused_moe.fused_moe(x, w13, w2, weights, ids),
                                   [None], calls=1, replays=50)
            except Exception as e:  # a launch the GPU cannot take (shared memory)
                us = float("nan")
                print(f"  {cfg}: {type(e).__name__}")
            rows.append(dict(tokens=t, config=cfg or "default", us=us, experts_hit=hit, roofline_us=roof_us))
        fused_moe._config = default
        best = min((r for r in rows if r["tokens"] == t and r["us"] == r["us"]), key=lambda r: r["us"])
        base = next(r for r in rows if r["tokens"] == t and r["config"] == "default")
        print(f"tokens {t}: {hit} experts hit, roofline {roof_us:.1f} us; default {base['us']:.1f} us; "
              f"best {best['us']:.1f} us {best['config']}")
    for r in sorted(rows, key=lambda r: (r["tokens"], r["us"]))[:]:
        print(f"{r['tokens']:4d} {r['us']:8.1f} {r['config']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
