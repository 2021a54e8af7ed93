"""Route kernel launch sweep (DeepSeek-V2-Lite router: 64 experts, hidden 2048, k 6).
Run (call 5) with bench_moe's former `time_graph(fn, reps=200)`: one call captured, replayed 200
times; `time_in_graph(..., calls=1, replays=200)` below times the same way (its warm-up differs)."""

import torch

from workers.layers import moe_kernels
from workers.layers.bench_gemv import time_in_graph

w = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16) * 0.05
for t in (1, 16, 64):
    x = torch.randn(t, 2048, device="cuda", dtype=torch.bfloat16)
    for progs in (8, 16, 32, 64):
        for warps in (1, 2, 4):
            def route(_, x=x, progs=progs, warps=warps):
                return moe_kernels.route(x, w, 6, sigmoid=False, bias=None, n_group=1, topk_group=1, top2_groups=False,
                                         norm=False, scale=1.0, programs=progs, num_warps=warps)
            us = time_in_graph(route, [None], calls=1, replays=200)
            print(f"tokens {t} programs {progs} warps {warps}: {us:.2f} us")
