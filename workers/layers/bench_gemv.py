"""Time the one-row linear kernel against cuBLAS inside CUDA graphs:
`python -m workers.layers.bench_gemv [--out FILE.json] [--quick] [--fp8] [--shapes llama|deepseek]`.

For each matrix of a Llama-3.1-8B decoder step at batch 1 (bf16), one graph replays the op on
a rotation of weight copies larger than L2 (as a step reads 32 layers' weights, never the same
one twice in a row), so every figure is a DRAM-bound in-graph time, launch gaps included:

- `cublas`: F.linear alone; `unfused`: what the model runs today (the add + RMSNorm or SiLU
  kernel, then F.linear);
- each Triton launch configuration, in PLAIN mode for the plain products (o_proj, LM head)
  and with the shape's prologue for the others (what replaces `unfused`); `*-default` is
  `gemv_launch.choose_config`'s choice.

`--fp8`: the weights are FP8 with one scale per row (`--quantization fp8`); `cublas` is then
`fp8_gemm.gemv`, the unfused FP8 product the fused kernel replaces.

Prints microseconds per op, GB/s of weight read, and the fraction of the measured copy
bandwidth; writes every result to JSON.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

from workers.layers import fp8 as fp8_layer
from workers.layers import fp8_gemm, fused, gemv, gemv_launch
from workers.layers.gemv_launch import GemvConfig
from workers.roofline import measure_copy_bandwidth

# (name, prologue, N, K) of a Llama-3.1-8B step at batch 1; "+add": the residual-adding epilogue
# (`gemv_add`); NORM: the prologue that takes the row's square sums from it (1,024 blocks)
SHAPES = [
    ("qkv_proj", gemv.ADD_RMS, 6144, 4096),
    ("o_proj", gemv.PLAIN, 4096, 4096),
    ("gate_up_proj", gemv.ADD_RMS, 28672, 4096),
    ("down_proj", gemv.SILU_MUL, 4096, 14336),
    ("lm_head", gemv.PLAIN, 128256, 4096),
    ("qkv_proj", gemv.NORM, 6144, 4096),
    ("o_proj+add", gemv.PLAIN, 4096, 4096),
    ("gate_up_proj", gemv.NORM, 28672, 4096),
    ("down_proj+add", gemv.SILU_MUL, 4096, 14336),
    ("gate_up_plain", gemv.PLAIN, 28672, 4096),  # after the one-row norm kernel (`gemv_launch.fuse_norm`)
    # FP8's MLP at batch 1: gate/up writing silu(gate) * up (`glu`), then a plain down + add
    ("gate_up_glu", gemv.PLAIN, 28672, 4096),
    ("down_proj_plain+add", gemv.PLAIN, 4096, 14336),
]
# --shapes deepseek: the one-row products of a DeepSeek-V2-Lite layer (hidden 2,048; the shared
# experts' 2 x 1,408 intermediate; the MoE experts run on the grouped GEMM, `bench_moe`)
DEEPSEEK_SHAPES = [
    ("q_proj", gemv.PLAIN, 3072, 2048),
    ("kv_a_proj", gemv.PLAIN, 576, 2048),
    ("o_proj", gemv.PLAIN, 2048, 2048),
    ("shared_gate_up", gemv.PLAIN, 5632, 2048),
    ("shared_down", gemv.SILU_MUL, 2048, 2816),
]
FMA = [(4, 512, 4), (8, 256, 4), (8, 512, 4), (8, 512, 8), (16, 256, 4), (16, 512, 8), (4, 1024, 4), (32, 256, 8)]
DOT = [(64, 128, 4), (64, 256, 3), (32, 256, 4), (128, 128, 3)]
FUSED_FMA = [(8, 512, 8), (16, 512, 8), (32, 256, 8), (32, 512, 8), (64, 128, 8), (64, 256, 8), (128, 64, 8),
             (128, 128, 8), (64, 128, 4), (32, 256, 4)]
# --fp8: 16-column vectors per thread (GemvConfig.vec), and a few of bf16's [rows, columns] accumulators
FP8_VEC = [(4, 1024, 4), (4, 512, 4), (8, 512, 4), (8, 1024, 4), (8, 1024, 8), (16, 512, 8), (16, 1024, 8),
           (4, 2048, 4), (2, 2048, 4), (8, 2048, 8), (16, 2048, 8), (32, 1024, 8)]  # (the last three: more bytes in flight)
FP8_FUSED_VEC = [(8, 512, 8), (16, 512, 8), (32, 256, 8), (32, 512, 8), (16, 1024, 8), (64, 256, 8), (8, 1024, 8),
                 (4, 1024, 4), (64, 128, 8)]
FP8_PLAIN_ACC = [(8, 256, 4), (8, 512, 4), (4, 1024, 4)]
FP8_FUSED_ACC = [(8, 256, 4), (32, 256, 8), (16, 512, 8)]
# ... and some of them with each iteration loading its own tile (GemvConfig.prefetch off): a plain
# FP8 loop of 4 x 1024 on four warps read gate/up's weight ~15% faster that way (BENCHMARKS.md)
FP8_NO_PREFETCH = [(4, 1024, 4), (4, 512, 4), (8, 512, 4), (8, 1024, 4), (8, 1024, 8), (4, 2048, 4)]
FP8_FUSED_NO_PREFETCH = [(4, 1024, 4), (8, 512, 8), (16, 512, 8), (8, 1024, 8), (32, 256, 8), (8, 512, 4)]
FUSED_DOT = [(bn, bk, w) for bn in (64, 128) for bk in (64, 128) for w in (4, 8)]


def sweep_configs(k: int, quick: bool, fp8: bool = False) -> list[GemvConfig]:
    if fp8:
        return [GemvConfig(bn, bk, split, w, 3, vec=vec) for split in (1, 2)
                for vec, launches in ((16, FP8_VEC[:3] if quick else FP8_VEC), (0, FP8_PLAIN_ACC))
                for bn, bk, w in launches if k // split >= bk] + [
            GemvConfig(bn, bk, 1, w, 3, vec=16, prefetch=False) for bn, bk, w in FP8_NO_PREFETCH[:2 if quick else None]
            if k >= bk]
    out = []
    for split in (1, 2, 4, 8):
        for bn, bk, warps in FMA[:3] if quick else FMA:
            if k // split >= bk:
                out.append(GemvConfig(bn, bk, split, warps, 3))
        if not quick and k // split >= 512:
            out.append(GemvConfig(8, 512, split, 4, 1))  # does pipelining the FMA loop's loads matter?
        for bn, bk, stages in DOT[:1] if quick else DOT:
            if k // split >= bk:
                out.append(GemvConfig(bn, bk, split, 4, stages, use_dot=True))
    return out


def fused_configs(k: int, fp8: bool = False) -> list[GemvConfig]:
    if fp8:
        return [GemvConfig(bn, bk, split, w, 3, vec=vec) for split in (1, 2)
                for vec, launches in ((16, FP8_FUSED_VEC), (0, FP8_FUSED_ACC)) for bn, bk, w in launches
                if k // split >= bk] + [
            GemvConfig(bn, bk, 1, w, 3, vec=16, prefetch=False) for bn, bk, w in FP8_FUSED_NO_PREFETCH if k >= bk]
    out = []
    for split in (1, 2):
        out += [GemvConfig(bn, bk, split, w, 3) for bn, bk, w in FUSED_FMA if k // split >= bk]
        out += [GemvConfig(bn, bk, split, w, 3, use_dot=True) for bn, bk, w in FUSED_DOT if k // split >= max(bk, 2048)]
    return out


def time_in_graph(op, weights: list[torch.Tensor], calls: int, replays: int = 10) -> float:
    """Microseconds per op: `calls` ops per graph, weights taken in rotation."""
    for w in weights[:2]:
        op(w)  # compile / warm outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            op(weights[i % len(weights)])
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * calls)


def bench_shape(name: str, mode: int, n: int, k: int, quick: bool, copy_gbs: float, fp8: bool = False) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    dtype = torch.bfloat16
    nbytes = n * k * (1 if fp8 else 2)
    copies = max(2, math.ceil(400e6 / nbytes))
    weights = [torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) / k**0.5 for _ in range(copies)]
    scale = None
    if fp8:  # one scale per row, shared by the copies (what is timed is reading the weights)
        quantized = [fp8_layer.quantize_rows(w) for w in weights]
        weights, scale = [q for q, _ in quantized], quantized[0][1]
        del quantized
    width = 2 * k if mode == gemv.SILU_MUL else k
    x = torch.randn(1, width, device="cuda", dtype=dtype, generator=gen)
    r = torch.randn(1, k, device="cuda", dtype=dtype, generator=gen)
    nw = torch.ones(k, device="cuda", dtype=dtype)
    calls = max(16, 2 * copies)
    results = []

    def record(kind: str, us: float, config: GemvConfig | None = None, prologue: int = gemv.PLAIN) -> None:
        results.append(dict(shape=name, n=n, k=k, kind=kind, prologue=prologue, us=us, gb_s=nbytes / us / 1e3,
                            of_copy=nbytes / us / 1e3 / copy_gbs, config=None if config is None else vars(config)))

    h = x[:, :k] if mode == gemv.SILU_MUL else x
    default = gemv_launch.choose_config(n, k, x.device, mode, name.endswith("+add"), fp8)
    if name.endswith("+add") or mode == gemv.NORM:
        add = name.endswith("+add")
        sq = torch.rand(1024, device="cuda", dtype=torch.float32, generator=gen) * k / 1024
        res = torch.randn(1, n, device="cuda", dtype=dtype, generator=gen)
        configs = sweep_configs(k, quick, fp8)
        if not add:
            configs += fused_configs(k, fp8) if fp8 else [GemvConfig(bn, bk, 1, w, 3) for bn, bk, w in FUSED_FMA]

        def op(w, cfg):
            if add:
                return gemv.gemv_add(x, w, None, res, mode=mode, scale=scale, config=cfg)
            return gemv.gemv(x, w, mode=mode, norm_weight=nw, eps=1e-5, square_sums=sq, scale=scale, config=cfg)
        for cfg in dict.fromkeys([*configs, default]):
            try:
                us = time_in_graph(lambda w, cfg=cfg: op(w, cfg), weights, calls)
            except Exception as e:  # noqa: BLE001 - a launch that does not fit: skip it
                print(f"  skip {name} {cfg}: {type(e).__name__}: {str(e)[:120]}")
                continue
            record("triton-fused-default" if cfg == default else "triton-fused", us, cfg, prologue=mode)
        del weights
        torch.cuda.empty_cache()
        return results
    def product(a, w):  # what the model runs unfused
        return fp8_gemm.gemv(a, w, scale, k) if fp8 else F.linear(a, w)
    record("cublas", time_in_graph(lambda w: product(h, w), weights, calls))
    if mode == gemv.ADD_RMS:
        record("unfused", time_in_graph(lambda w: product(fused.add_rms_norm(h, r, nw, 1e-5)[0], w), weights, calls),
               prologue=mode)
    elif mode == gemv.SILU_MUL:
        record("unfused", time_in_graph(lambda w: product(fused.silu_and_mul(x), w), weights, calls), prologue=mode)
    if mode == gemv.PLAIN:
        for cfg in dict.fromkeys([*sweep_configs(k, quick, fp8), default]):
            try:
                us = time_in_graph(lambda w, cfg=cfg: gemv.gemv(h, w, scale=scale, glu=name.endswith("_glu"),
                                                                config=cfg), weights, calls)
            except Exception as e:  # noqa: BLE001 - a launch that does not fit (registers, shared memory): skip it
                print(f"  skip {name} {cfg}: {type(e).__name__}: {str(e)[:120]}")
                continue
            record("triton-default" if cfg == default else "triton", us, cfg)
    else:
        for cfg in dict.fromkeys([*(fused_configs(k, fp8)[:4] if quick else fused_configs(k, fp8)), default]):
            try:
                us = time_in_graph(lambda w, cfg=cfg: gemv.gemv(x, w, mode=mode, residual=r, norm_weight=nw, eps=1e-5,
                                                                scale=scale, config=cfg), weights, calls)
            except Exception as e:  # noqa: BLE001
                print(f"  skip {name} {cfg}: {type(e).__name__}: {str(e)[:120]}")
                continue
            record("triton-fused-default" if cfg == default else "triton-fused", us, cfg, prologue=mode)
        if mode == gemv.ADD_RMS:  # the norm as its own one-row kernel, then the plain product
            plain = gemv_launch.choose_config(n, k, x.device, fp8=fp8)

            def split_norm(w, plain=plain):
                h1, _ = gemv.add_rms_norm(x, r, nw, 1e-5)
                gemv.gemv(h1, w, scale=scale, config=plain)
            record("triton-norm+plain", time_in_graph(split_norm, weights, calls), plain, prologue=mode)
    del weights
    torch.cuda.empty_cache()
    return results


def _fmt(r: dict) -> str:
    c = r["config"]
    cfg = "" if c is None else (f"n{c['block_n']} k{c['block_k']} s{c['split_k']} w{c['num_warps']} "
                                f"st{c['num_stages']}{' dot' if c['use_dot'] else ''}{' v' + str(c['vec']) if c['vec'] else ''}"
                                f"{'' if c.get('prefetch', True) else ' np'}")
    return f"{r['shape']:<13} p{r['prologue']} {r['kind']:<15} {cfg:<28} {r['us']:8.1f} {r['gb_s']:7.0f} {100 * r['of_copy']:5.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="a few launch configurations only")
    parser.add_argument("--only", nargs="*", type=int, default=None, help="indices into the shapes")
    parser.add_argument("--fp8", action="store_true", help="FP8 weights with one scale per row")
    parser.add_argument("--shapes", choices=("llama", "deepseek"), default="llama",
                        help="Llama-3.1-8B's products (SHAPES) or DeepSeek-V2-Lite's (DEEPSEEK_SHAPES)")
    parser.add_argument("--emit-configs", default=None, metavar="FILE",
                        help="write each swept shape's fastest launch as a MANTA_GEMV_CONFIGS value (to A/B in a model step)")
    args = parser.parse_args()
    copy_gbs = measure_copy_bandwidth(torch.device("cuda")) / 1e9
    print(f"device: {torch.cuda.get_device_name()}, copy bandwidth {copy_gbs:.0f} GB/s")
    print(f"{'shape':<13} {'kind':<15} {'config':<28} {'us':>8} {'GB/s':>7} {'copy':>6}")
    everything = []
    for i, (name, mode, n, k) in enumerate(SHAPES if args.shapes == "llama" else DEEPSEEK_SHAPES):
        if args.only is not None and i not in args.only:
            continue
        if args.fp8 and name == "lm_head":
            continue  # (not quantized)
        rows = bench_shape(name, mode, n, k, args.quick, copy_gbs, args.fp8)
        everything += rows
        shown = [r for r in rows if r["kind"] in ("cublas", "unfused", "triton-norm+plain") or r["kind"].endswith("default")]
        shown += sorted((r for r in rows if r["kind"] in ("triton", "triton-fused")), key=lambda r: r["us"])[:6]
        print("\n".join(_fmt(r) for r in shown), flush=True)
    if args.emit_configs:
        with open(args.emit_configs, "w") as f:
            f.write(gemv_launch.best_launches(everything))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_gb_s=copy_gbs, fp8=args.fp8, results=everything), f,
                      indent=1)


if __name__ == "__main__":
    main()
