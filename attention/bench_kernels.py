"""Time the GPU attention kernels: `python -m attention.bench_kernels [--quick]`.

Decode at B = 1/16/64 and context 1k/4k for the Llama-3-8B head shape (32 q / 8 kv heads,
head dim 128) and the DeepSeek-V2-Lite absorbed MLA shape (16 heads, 512 latent + 64 rope), bf16,
page size 16; plus ragged prefill (Llama shape) for each available implementation. Each line
prints the median microseconds (triton.testing.do_bench, L2 flushed between runs), the same
under CUDA-graph replay for the Triton decodes (launch overhead removed), the bytes the kernel
must read over that time (GB/s), and the max abs error against the torch reference measured
on the first call. Baselines: SDPA over gathered K/V (the CPU path run on GPU) and the torch
absorbed MLA decode.
"""

from __future__ import annotations

import argparse
import functools
import gc

import torch
import triton

from attention import gpu_prefill, kernels, torch_ops
from attention.triton_decode import choose_num_splits, paged_decode, stage1_launch
from attention.triton_mla_decode import MLA_BLOCK_H, mla_decode


def _bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def _bench_graph(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3


def _paged(batch: int, ctx: int, page_size: int, kv_heads: int, k_dim: int, v_dim: int, dtype, gen):
    pages_per = triton.cdiv(ctx, page_size)
    num_pages = batch * pages_per + 1
    kc = torch.randn(num_pages * page_size, kv_heads, k_dim, device="cuda", dtype=dtype, generator=gen)
    vc = None
    if v_dim:
        vc = torch.randn(num_pages * page_size, kv_heads, v_dim, device="cuda", dtype=dtype, generator=gen)
    perm = torch.randperm(num_pages - 1, device="cuda", generator=gen) + 1
    page_table = perm[: batch * pages_per].reshape(batch, pages_per).to(torch.int32)
    seqlens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return kc, vc, page_table, seqlens


def _row(name: str, us: float, us_graph: float | None, nbytes: int, err: float) -> str:
    graph = f"{us_graph:9.1f}" if us_graph is not None else f"{'-':>9}"
    return f"{name:<44} {us:9.1f} {graph} {nbytes / us / 1e3:9.0f} {err:9.1e}"


def bench_decode(batches, contexts, page_size: int) -> list[str]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    heads, kv_heads, dim = 32, 8, 128
    for ctx in contexts:
        for batch in batches:
            kc, vc, pt, lens = _paged(batch, ctx, page_size, kv_heads, dim, dim, torch.bfloat16, gen)
            q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
            out = torch.empty(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
            tt = kernels._pages_to_token_table(pt, page_size)
            scale = dim**-0.5
            nbytes = batch * ctx * kv_heads * dim * 2 * 2
            splits = choose_num_splits(batch * kv_heads, pt.shape[1] * page_size, q.device)

            def tri(q=q, kc=kc, vc=vc, pt=pt, lens=lens, out=out, scale=scale):
                paged_decode(q, kc, vc, pt, lens, scale, page_size, out=out)

            def sdpa(q=q, kc=kc, vc=vc, tt=tt, lens=lens, ctx=ctx, scale=scale):
                torch_ops.paged_decode_sdpa(q, kc, vc, tt, lens, ctx, scale)

            tri()
            ref = torch_ops.paged_decode_sdpa(q.float(), kc, vc, tt, lens, ctx, scale)
            err = (out.float() - ref).abs().max().item()
            tag = f"llama B={batch} ctx={ctx} P={page_size}"
            rows.append(_row(f"decode triton {tag} s={splits}", _bench(tri), _bench_graph(tri), nbytes, err))
            if batch * ctx <= 16 * 4096:  # the gather baseline copies the whole cache
                rows.append(_row(f"decode sdpa   {tag}", _bench(sdpa), None, nbytes, 0.0))
            del kc, vc
    return rows


def bench_mla(batches, contexts, page_size: int) -> list[str]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows = []
    heads, lora, rope = 16, 512, 64
    for ctx in contexts:
        for batch in batches:
            kv, _, pt, lens = _paged(batch, ctx, page_size, 1, lora + rope, 0, torch.bfloat16, gen)
            q = torch.randn(batch, heads, lora + rope, device="cuda", dtype=torch.bfloat16, generator=gen)
            out = torch.empty(batch, heads, lora, device="cuda", dtype=torch.bfloat16)
            scale = (128 + rope) ** -0.5
            nbytes = batch * ctx * (lora + rope) * 2
            blocks = triton.cdiv(heads, MLA_BLOCK_H)
            splits = choose_num_splits(batch * blocks, pt.shape[1] * page_size, q.device)

            def tri(q=q, kv=kv, pt=pt, lens=lens, out=out, scale=scale):
                mla_decode(q, kv, pt, lens, scale, page_size, lora, out=out)

            def ref_fn(q=q, kv=kv, pt=pt, lens=lens, scale=scale):
                return kernels.torch_mla_decode(q, kv, pt, lens, scale, page_size, lora)

            tri()
            ref = kernels.torch_mla_decode(q.float(), kv.float(), pt, lens, scale, page_size, lora)
            err = (out.float() - ref).abs().max().item()
            tag = f"dsv2-lite B={batch} ctx={ctx} P={page_size}"
            rows.append(_row(f"mla triton {tag} s={splits}", _bench(tri), _bench_graph(tri), nbytes, err))
            if batch * ctx <= 16 * 4096:
                rows.append(_row(f"mla torch  {tag}", _bench(ref_fn), None, nbytes, 0.0))
            del kv
    return rows


def bench_prefill() -> list[str]:
    gen = torch.Generator(device="cuda").manual_seed(2)
    heads, kv_heads, dim, page_size = 32, 8, 128, 16
    cases = {"4x1024 new": ([1024] * 4, [1024] * 4), "3072 prefix + 1024 new": ([1024], [4096])}
    impls: dict[str, object] = {"triton": gpu_prefill.TritonExtend(), "sdpa": torch_ops.paged_extend_sdpa}
    if gpu_prefill.flash_attn_available():
        impls["flash_attn"] = gpu_prefill.RaggedFlashExtend("flash_attn")
    if gpu_prefill.torch_varlen_available() and gpu_prefill.torch_varlen_bottom_right("cuda"):
        impls["torch_varlen"] = gpu_prefill.RaggedFlashExtend("torch_varlen")
    if gpu_prefill.hopper("cuda"):
        impls["triton_varlen"] = gpu_prefill.RaggedFlashExtend("triton_varlen")
    rows = []
    for name, (q_lens, kv_lens) in cases.items():
        pages = [triton.cdiv(k, page_size) for k in kv_lens]
        num_pages = sum(pages) + 1
        kc = torch.randn(num_pages * page_size, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        vc = torch.randn(num_pages * page_size, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        perm = (torch.randperm(num_pages - 1, device="cuda", generator=gen) + 1).to(torch.int32)
        pt = torch.zeros(len(kv_lens), max(pages), dtype=torch.int32, device="cuda")
        start = 0
        for i, n in enumerate(pages):
            pt[i, :n] = perm[start : start + n]
            start += n
        tt = kernels._pages_to_token_table(pt, page_size)
        q = torch.randn(sum(q_lens), heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        scale = dim**-0.5
        # causal FLOPs: 2 matmuls x 2 flop x (visible keys per query) x H x D
        visible = sum(sum(k - ql + r + 1 for r in range(ql)) for ql, k in zip(q_lens, kv_lens))
        flops = 4 * visible * heads * dim
        ref = torch_ops.paged_extend_sdpa(q, kc, vc, tt, q_lens, kv_lens, scale, True).float()
        for impl, fn in impls.items():
            call = functools.partial(fn, q, kc, vc, tt, q_lens, kv_lens, scale, True)
            err = (call().float() - ref).abs().max().item()
            us = _bench(call)
            rows.append(f"{'prefill ' + impl + ' ' + name:<44} {us:9.1f} {'-':>9} "
                        f"{flops / us / 1e6:7.0f}TF {err:9.1e}")
    return rows


def sweep_decode(cases: list[tuple[int, int]], page_size: int = 16, cache_dtype=torch.bfloat16) -> list[str]:
    """Stage-1 launch parameters of the Triton paged decode (Llama-8B heads, bf16 queries, a
    bf16 or FP8 cache) per (B, ctx): microseconds under CUDA-graph replay and GB/s of cache read,
    fastest first within each case."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    heads, kv_heads, dim = 32, 8, 128
    rows = []
    for batch, ctx in cases:
        kc, vc, pt, lens = _paged(batch, ctx, page_size, kv_heads, dim, dim, torch.bfloat16, gen)
        kc, vc = kc.to(cache_dtype), vc.to(cache_dtype)
        q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        out = torch.empty(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
        nbytes = batch * ctx * kv_heads * dim * 2 * kc.element_size()
        default_splits = choose_num_splits(batch * kv_heads, pt.shape[1] * page_size, q.device)
        results = []
        split_options = {default_splits, min(32, default_splits * 2)}
        if batch * kv_heads < 64:  # few requests: what the engine's graphs use (a bound of 4,096 tokens) too
            split_options |= {4, 8, 16, choose_num_splits(batch * kv_heads, 4096, q.device)}
        for splits in sorted(split_options):
            for block_n in (32, 64, 128) + ((256,) if kc.element_size() == 1 else ()):
                for warps in (2, 4, 8):
                    for stages in (1, 2, 3):
                        def tri(splits=splits, block_n=block_n, warps=warps, stages=stages,
                                args=(q, kc, vc, pt, lens, dim**-0.5, page_size), out=out):
                            paged_decode(*args, num_splits=splits, out=out, block_n=block_n, num_warps=warps,
                                         num_stages=stages)
                        try:
                            tri()
                            us = _bench_graph(tri)
                        except Exception as e:  # noqa: BLE001 - out of shared memory etc.: skip the config
                            rows.append(f"  skip s={splits} n={block_n} w={warps} st={stages}: "
                                        f"{type(e).__name__}: {str(e)[:160]}")
                            continue
                        results.append((us, splits, block_n, warps, stages))
        results.sort()
        for us, splits, block_n, warps, stages in results[:6]:
            rows.append(f"sweep B={batch} ctx={ctx} s={splits} n={block_n} w={warps} st={stages}"
                        f"{'':4} {us:9.1f} {nbytes / us / 1e3:9.0f}" + ("  (default splits)" if splits == default_splits else ""))
        launch = stage1_launch(batch * kv_heads, torch.bfloat16, cache_dtype)
        default = [r for r in results if r[1:] == (default_splits, *launch)]
        if default:
            rows.append(f"sweep B={batch} ctx={ctx} current default {default[0][0]:9.1f} {nbytes / default[0][0] / 1e3:9.0f}"
                        f"  (n={launch[0]} w={launch[1]} st={launch[2]})")
        del kc, vc
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="B=16, ctx 4k only")
    parser.add_argument("--sweep", action="store_true", help="tune the paged decode's launch parameters")
    parser.add_argument("--cases", nargs="*", default=None, help="B:ctx pairs for --sweep (default: large batches)")
    parser.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="bf16", help="the cache --sweep reads")
    args = parser.parse_args()
    if args.sweep:
        cases = [tuple(int(v) for v in c.split(":")) for c in args.cases] if args.cases else [(256, 1536), (192, 2048),
                                                                                                (128, 1536)]
        cache_dtype = torch.float8_e4m3fn if args.kv_dtype == "fp8" else torch.bfloat16
        print(f"{torch.cuda.get_device_name()}, cache {cache_dtype}")
        print("\n".join(sweep_decode(cases, cache_dtype=cache_dtype)))
        return
    batches, contexts = ([16], [4096]) if args.quick else ([1, 16, 64], [1024, 4096])
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"kernels: {kernels.select_kernels('cuda', page_size=16).description}")
    rows = [f"{'kernel':<44} {'us':>9} {'us graph':>9} {'GB/s':>9} {'max err':>9}"]
    rows += bench_decode(batches, contexts, 16)
    rows += bench_decode([16], [4096], 1)
    rows += bench_mla(batches, contexts, 16)
    rows += bench_prefill()
    print("\n".join(rows))


if __name__ == "__main__":
    main()
