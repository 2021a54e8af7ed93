"""Prefill attention on a GPU: ATen's FlashAttention against the Triton varlen kernel
(`attention/triton_varlen.py`, the launches in LAUNCHES) and cuDNN's fused attention through SDPA
(one prompt); with --cudnn also cuDNN's ragged form (`aten::_cudnn_attention_forward`, which
rebuilds its graph each call) and, after a cached prefix, cuDNN with a bias mask or over prefix
and chunk apart. The shapes are the 8B model's causal prompts (32 q heads, 8 K/V heads, head
size 128, bf16). Each candidate is checked against the FlashAttention output before it is timed
(CUDA events, the median of 20 after warm-up). A candidate that fails prints why and is skipped.

    python3 scripts/prefill_attention_probe.py [--cudnn] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as `python3 scripts/...` from anywhere
from attention.gpu_prefill import _aten_flash  # noqa: E402 - the prefill's own call
from attention.triton_varlen import VarlenLaunch, varlen_attention  # noqa: E402

# the launches the H200 sweep compared (BENCHMARKS.md, 2026-11-29); the first is the default
LAUNCHES = [VarlenLaunch(128, 64, 8, 3), VarlenLaunch(64, 64, 4, 3), VarlenLaunch(128, 128, 8, 3),
            VarlenLaunch(128, 64, 8, 4)]

HEADS, KV_HEADS, D = 32, 8, 128
CASES = [(1, 2048), (4, 2048), (1, 8192), (2, 4096), (3, 1000)]  # (prompts, tokens each)


def causal_tflop(prompts: int, n: int) -> float:
    return prompts * 4 * HEADS * D * n * (n + 1) / 2 / 1e12


def time_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e))
    return statistics.median(out)


def flash(q, k, v, cu, n, scale):
    return _aten_flash(q, k, v, cu, cu, n, n, scale, True)


def cudnn(q, k, v, cu, n, scale):
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, n, n, False, 0.0, True, False,
                                                   scale=scale)[0]


def triton_varlen(q, k, v, cu, n, scale, launch=None):
    return varlen_attention(q, k, v, cu, cu, n, n, scale, True, launch)


def sdpa_cudnn(q, k, v, cu, n, scale):
    """One prompt only: [1, H, S, D] views through SDPA's cuDNN backend, GQA by enable_gqa."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, scale=scale,
            enable_gqa=True)
    return out[0].transpose(0, 1)


def prefixed(q, k, v, prefix, scale, how):
    """One chunk of `len(q)` tokens after `prefix` cached ones: q attends to all of the prefix and
    causally (bottom-right) to itself. "fa": ATen FlashAttention varlen; "cudnn-bias": cuDNN with
    an additive mask; "cudnn-split": cuDNN over the prefix (no mask) and the chunk (causal), merged
    by their log-sum-exps."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    n, total = q.shape[0], k.shape[0]
    if how == "fa" or how.startswith("triton"):
        cu_q = torch.tensor([0, n], device="cuda", dtype=torch.int32)
        cu_k = torch.tensor([0, total], device="cuda", dtype=torch.int32)
        if how.startswith("triton"):
            return varlen_attention(q, k, v, cu_q, cu_k, n, total, scale, True, LAUNCHES[int(how[6:] or 0)])
        return _aten_flash(q, k, v, cu_q, cu_k, n, total, scale, True)
    tq, tk, tv = (x.transpose(0, 1)[None] for x in (q, k, v))
    if how == "cudnn-bias":
        mask = torch.ones(n, total, device="cuda", dtype=torch.bool).tril(diagonal=total - n)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, scale=scale,
                                                                   enable_gqa=True)
        return out[0].transpose(0, 1)
    rep = HEADS // KV_HEADS
    kk, vv = tk.repeat_interleave(rep, dim=1), tv.repeat_interleave(rep, dim=1)
    a, lse_a = torch.ops.aten._scaled_dot_product_cudnn_attention(tq, kk[:, :, :prefix], vv[:, :, :prefix], None, True,
                                                                  0.0, False, False, scale=scale)[:2]
    b, lse_b = torch.ops.aten._scaled_dot_product_cudnn_attention(tq, kk[:, :, prefix:], vv[:, :, prefix:], None, True,
                                                                  0.0, True, False, scale=scale)[:2]
    la, lb = lse_a.float().view(1, HEADS, n, 1), lse_b.float().view(1, HEADS, n, 1)
    m = torch.maximum(la, lb)
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    out = (a.float() * wa + b.float() * wb) / (wa + wb)
    return out.to(q.dtype)[0].transpose(0, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--cudnn", action="store_true", help="also cuDNN's ragged form and its prefix variants")
    a = ap.parse_args()
    print(torch.__version__, torch.cuda.get_device_name(), "cudnn", torch.backends.cudnn.version())
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for prompts, n in CASES:
        t = prompts * n
        wide = torch.randn(t, HEADS + 2 * KV_HEADS, D, device="cuda", dtype=torch.bfloat16, generator=g)
        q, k, v = wide[:, :HEADS], wide[:, HEADS:HEADS + KV_HEADS].contiguous(), wide[:, HEADS + KV_HEADS:].contiguous()
        cu = torch.arange(0, t + 1, n, device="cuda", dtype=torch.int32)
        scale = D ** -0.5
        want = flash(q, k, v, cu, n, scale).float()
        flops = causal_tflop(prompts, n)
        tri = [(f"triton {c.block_m}x{c.block_n} w{c.num_warps} s{c.num_stages}",
                functools.partial(triton_varlen, launch=c)) for c in LAUNCHES]
        extra = [("cudnn ragged", cudnn)] if a.cudnn else []
        for name, fn in [("flash (aten)", flash), ("sdpa cudnn (1 prompt)", sdpa_cudnn)] + extra + tri:
            if name.startswith("sdpa") and prompts != 1:
                continue
            try:
                got = fn(q, k, v, cu, n, scale).float()
                err = (got - want).abs().max().item()
                if err > 3e-2:
                    raise RuntimeError(f"differs from FlashAttention by {err:.3g}")
                ms = time_ms(functools.partial(fn, q, k, v, cu, n, scale))
            except Exception as e:  # noqa: BLE001 - the probe reports and goes on
                print(f"{prompts} x {n:5d}  {name:24s} failed: {str(e).splitlines()[0][:150]}")
                rows.append({"prompts": prompts, "tokens": n, "kernel": name, "error": str(e)[:300]})
                continue
            print(f"{prompts} x {n:5d}  {name:24s} {ms * 1e3:9.1f} us  {flops / ms * 1e3:6.0f} TFLOP/s  err {err:.2e}")
            rows.append({"prompts": prompts, "tokens": n, "kernel": name, "us": ms * 1e3,
                         "tflops": flops / ms * 1e3, "max_err": err})
    for prefix, n in ((2048, 2048), (6144, 2048), (1000, 1048)):
        wide = torch.randn(prefix + n, HEADS + 2 * KV_HEADS, D, device="cuda", dtype=torch.bfloat16, generator=g)
        q = wide[prefix:, :HEADS]
        k, v = wide[:, HEADS:HEADS + KV_HEADS].contiguous(), wide[:, HEADS + KV_HEADS:].contiguous()
        scale = D ** -0.5
        want = prefixed(q, k, v, prefix, scale, "fa").float()
        flops = 4 * HEADS * D * n * (prefix + (n + 1) / 2) / 1e12
        for how in ["fa"] + [f"triton{i}" for i in range(len(LAUNCHES))] + (["cudnn-bias", "cudnn-split"] if a.cudnn else []):
            try:
                err = (prefixed(q, k, v, prefix, scale, how).float() - want).abs().max().item()
                if err > 3e-2:
                    raise RuntimeError(f"differs from FlashAttention by {err:.3g}")
                ms = time_ms(functools.partial(prefixed, q, k, v, prefix, scale, how))
            except Exception as e:  # noqa: BLE001
                print(f"prefix {prefix} + {n}  {how:12s} failed: {str(e).splitlines()[0][:150]}")
                rows.append({"prefix": prefix, "tokens": n, "kernel": how, "error": str(e)[:300]})
                continue
            print(f"prefix {prefix} + {n}  {how:12s} {ms * 1e3:9.1f} us  {flops / ms * 1e3:6.0f} TFLOP/s  err {err:.2e}")
            rows.append({"prefix": prefix, "tokens": n, "kernel": how, "us": ms * 1e3, "tflops": flops / ms * 1e3,
                         "max_err": err})
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
