"""Time the paged decode over an FP8 KV cache both ways (CUDA): e4m3 elements converted where
Triton places the conversion against 16-bit words widened in registers as they are loaded (`attention.decode_blocks._load_block`), per (batch, context) and stage-1
launch; Llama-8B heads (32 q / 8 KV, dim 128), bf16 queries, page size 16, random page tables.
`--kv bf16` times a bf16 cache's launches instead (one way: "elements"). `--mma-stages N ...` also times
the keys-on-M kernel (`attention.triton_decode_mma`, 64 keys on four warps) at each stage count; its
error includes the queries' e4m3 round-off.
Microseconds under CUDA-graph replay, the cache's GB/s, and each output's largest difference
from the float32 reference on the dequantized cache. Prints a table, writes JSON (--out)."""

from __future__ import annotations

import argparse
import json

import torch

from attention import kernel_options, kernels, torch_ops, triton_decode_mma
from attention.bench_kernels import _bench_graph, _paged
from attention.kernel_options import KernelOptions
from attention.triton_decode import choose_num_splits, paged_decode, stage1_launch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cases", nargs="+", default=["1:4096", "16:2048", "64:544", "128:1024", "192:1536", "256:1024"],
                   help="B:ctx pairs")
    p.add_argument("--launches", nargs="+", default=["default", "64,2,3", "64,4,2", "64,4,3", "128,4,2", "32,2,3"],
                   help="block_n,num_warps,num_stages of stage 1 (default: stage1_launch's)")
    p.add_argument("--out", default=None)
    p.add_argument("--plain", type=int, default=0, metavar="N",
                   help="only run each kernel N times eagerly, untimed (for a profiler such as ncu)")
    p.add_argument("--words", choices=["both", "0", "1"], default="both")
    p.add_argument("--kv", choices=["fp8", "bf16"], default="fp8")
    p.add_argument("--mma-stages", type=int, nargs="*", default=[], help="FP8: the keys-on-M kernel at these stage counts")
    a = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    heads, kv_heads, dim, page = 32, 8, 128, 16
    results = []
    print(f"{torch.cuda.get_device_name()}: us under graph replay (GB/s), max |err| vs float32")
    print(f"{'B':>4} {'ctx':>5} {'launch':>9} {'elements':>18} {'words':>18} {'change':>7}  err (elements, words)")
    for case in a.cases:
        batch, ctx = (int(v) for v in case.split(":"))
        kc, vc, pt, lens = _paged(batch, ctx, page, kv_heads, dim, dim, torch.bfloat16, gen)
        cache = torch.float8_e4m3fn if a.kv == "fp8" else torch.bfloat16
        kc, vc = kc.to(cache), vc.to(cache)
        q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        out = torch.empty(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
        ref = torch_ops.paged_decode_sdpa(q.float(), kc, vc, kernels._pages_to_token_table(pt, page), lens, ctx,
                                         dim**-0.5)
        nbytes = batch * ctx * kv_heads * dim * 2 * kc.element_size()
        splits = choose_num_splits(batch * kv_heads, pt.shape[1] * page, q.device)
        for launch in a.launches:
            row = {"batch": batch, "ctx": ctx, "default": launch == "default", "splits": splits}
            ways = {"both": (False, True), "0": (False,), "1": (True,)}[a.words] if a.kv == "fp8" else (False,)
            for words in ways:
                n, w, st = stage1_launch(batch * kv_heads, q.dtype, kc.dtype, words) if launch == "default" else \
                    (int(v) for v in launch.split(","))

                def run(n=n, w=w, st=st, args=(q, kc, vc, pt, lens, dim**-0.5, page), splits=splits, out=out,
                        words=words):
                    paged_decode(*args, num_splits=splits, out=out, block_n=n, num_warps=w, num_stages=st, words=words)
                if a.plain:
                    for _ in range(a.plain):
                        run()
                    torch.cuda.synchronize()
                    continue
                try:
                    run()
                    err = (out.float() - ref).abs().max().item()
                    us = _bench_graph(run)
                except Exception as e:  # noqa: BLE001 - out of shared memory etc.: report and go on
                    print(f"  B={batch} ctx={ctx} {n},{w},{st} words={words}: {type(e).__name__}: {str(e)[:120]}")
                    us, err = None, None
                row["words" if words else "elements"] = {"launch": [n, w, st], "us": us,
                                                         "gbps": nbytes / us / 1e3 if us else None, "err": err}
            if a.plain:
                continue
            results.append(row)
            if len(ways) == 1:
                print(row)
                continue
            e, wd = row["elements"], row["words"]
            fmt = lambda r: f"{r['us']:8.1f} ({r['gbps']:5.0f})" if r["us"] else f"{'-':>16}"  # noqa: E731
            change = f"{(wd['us'] / e['us'] - 1) * 100:+6.1f}%" if e["us"] and wd["us"] else f"{'-':>7}"
            name = "default" if launch == "default" else launch
            print(f"{batch:>4} {ctx:>5} {name:>9} {fmt(e):>18} {fmt(wd):>18} {change}  {e['err']}, {wd['err']}"
                  + (f"  (elements {','.join(map(str, e['launch']))}, words {','.join(map(str, wd['launch']))})"
                     if launch == "default" else ""))
        for st in a.mma_stages if a.kv == "fp8" else ():
            before, least = kernel_options.current(), triton_decode_mma.MIN_PROGRAMS
            kernel_options.install(KernelOptions(fp8_kv_mma=True))
            triton_decode_mma.MIN_PROGRAMS = 1  # the kernel at every batch here
            try:
                def run_mma(st=st, args=(q, kc, vc, pt, lens, dim**-0.5, page), splits=splits, out=out):
                    paged_decode(*args, num_splits=splits, out=out, num_stages=st)
                if a.plain:
                    for _ in range(a.plain):
                        run_mma()
                    torch.cuda.synchronize()
                    continue
                run_mma()
                err = (out.float() - ref).abs().max().item()
                us = _bench_graph(run_mma)
            except Exception as e:  # noqa: BLE001
                print(f"  B={batch} ctx={ctx} mma stages {st}: {type(e).__name__}: {str(e)[:120]}")
                us, err = None, None
            finally:
                kernel_options.install(before)
                triton_decode_mma.MIN_PROGRAMS = least
            results.append({"batch": batch, "ctx": ctx, "mma": {"stages": st, "us": us, "err": err,
                                                                "gbps": nbytes / us / 1e3 if us else None}})
            print(f"{batch:>4} {ctx:>5} {'mma,' + str(st):>9} {(f'{us:8.1f} ({nbytes / us / 1e3:5.0f})' if us else '-'):>18}  {err}")
        del kc, vc
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
