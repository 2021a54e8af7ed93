"""Time the FP8 product inputs of one 8B layer both ways (CUDA): the 16-bit op then
`fp8_gemm.quantize_rows` against the fused kernels of `workers.layers.quant_rows`, per row
count; each in a CUDA graph, us. Also checks the fused values against the unfused ones."""

from __future__ import annotations

import argparse

import torch

from workers.layers import fused, quant_rows, silu_mul
from workers.layers.bench_gemv import time_in_graph
from workers.layers.fp8_gemm import quantize_rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--m", type=int, nargs="+", default=[64, 128, 2048, 8192])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=14336)
    a = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (1 + 0.1 * torch.randn(a.hidden, device="cuda", generator=g)).to(torch.bfloat16)
    norm = torch.compile(fused._add_rms_norm, dynamic=True, fullgraph=True)
    print(f"{'rows':>6} {'norm+quant':>11} {'fused norm':>11} {'silu+quant':>11} {'fused silu':>11}  q differ (norm, silu)")
    for m in a.m:
        x = torch.randn(m, a.hidden, device="cuda", generator=g).to(torch.bfloat16)
        r = torch.randn(m, a.hidden, device="cuda", generator=g).to(torch.bfloat16)
        gu = (2 * torch.randn(m, 2 * a.inter, device="cuda", generator=g)).to(torch.bfloat16)
        ops = {
            "norm+quant": lambda _, x=x, r=r: quantize_rows(norm(x, r, w, 1e-5)[0]),
            "fused norm": lambda _, x=x, r=r: quant_rows.add_rms_norm(x, r, w, 1e-5),
            "silu+quant": lambda _, gu=gu: quantize_rows(silu_mul.silu_and_mul(gu)),
            "fused silu": lambda _, gu=gu: quant_rows.silu_and_mul(gu),
        }
        us = {name: time_in_graph(op, [None], calls=20) for name, op in ops.items()}
        q0, _ = quantize_rows(norm(x, r, w, 1e-5)[0])
        q1 = quant_rows.add_rms_norm(x, r, w, 1e-5)[0].q
        s0, _ = quantize_rows(silu_mul.silu_and_mul(gu))
        s1 = quant_rows.silu_and_mul(gu).q
        diff = [(u.view(torch.uint8) != v.view(torch.uint8)).float().mean().item() for u, v in ((q0, q1), (s0, s1))]
        print(f"{m:6d} " + " ".join(f"{us[n]:11.1f}" for n in ops) + f"  {diff[0]:.2e} {diff[1]:.2e}")


if __name__ == "__main__":
    main()
