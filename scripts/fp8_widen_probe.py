"""Is the one-row FP8 product bound by widening e4m3 to float32? Bare kernels, timed in CUDA graphs
over weight copies larger than L2 (BENCHMARKS.md, thirteenth session). Usage on a GPU:
`python3 scripts/fp8_widen_probe.py [--sass]` (--sass: the kernels' most frequent SASS opcodes).

Variants of y = (x W^T) * s over [N, K] weights, one row x:
  raw   - int32 words bitcast to float32 and multiplied (garbage values): loads + 1 FMA a word
  bits  - e4m3 widened by integer ops (sign and exponent|mantissa moved into f32 bit places,
          value * 2^-120, folded back at the end; x pre-scaled by 2^64 so no product is subnormal)
  cvt   - tl .to(float32) on float8e4nv (what workers.layers.gemv does), VEC-16 layout
  bf16  - the cvt kernel on a bf16 copy of the weight (the bandwidth reference)
"""
import sys
import time

import torch
import triton
import triton.language as tl


@triton.jit
def k_words(X, W, S, Y, N, KW, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    words = tl.arange(0, BLOCK_W)
    acc = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
    w_rows = W + rows.to(tl.int64)[:, None] * KW
    for kw in range(0, KW, BLOCK_W):
        v = tl.load(w_rows + kw + words[None, :])
        xs = tl.load(X + (kw + words)[:, None] * 4 + tl.arange(0, 4)[None, :]).to(tl.float32)
        if MODE == 0:
            x0 = tl.sum(xs, 1)
            acc += v.to(tl.float32, bitcast=True) * x0[None, :]
        else:
            xs = xs * 18446744073709551616.0  # 2^64
            a, b = tl.split(tl.reshape(xs, (BLOCK_W, 2, 2)))  # a: cols 0, 2; b: cols 1, 3
            x0, x2 = tl.split(a)
            x1, x3 = tl.split(b)
            SIGN: tl.constexpr = -2147483648
            EM: tl.constexpr = 0x07F00000
            f0 = (((v << 24) & SIGN) | ((v << 20) & EM)).to(tl.float32, bitcast=True)
            f1 = (((v << 16) & SIGN) | ((v << 12) & EM)).to(tl.float32, bitcast=True)
            f2 = (((v << 8) & SIGN) | ((v << 4) & EM)).to(tl.float32, bitcast=True)
            f3 = ((v & SIGN) | ((v >> 4) & EM)).to(tl.float32, bitcast=True)
            acc += f0 * x0[None, :] + f1 * x1[None, :] + f2 * x2[None, :] + f3 * x3[None, :]
    y = tl.sum(acc, 1)
    if MODE == 1:
        y = y * 72057594037927936.0  # 2^56 = 2^120 / 2^64
    y = y * tl.load(S + rows)
    tl.store(Y + rows, y)


@triton.jit
def k_cvt(X, W, S, Y, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs = tl.arange(0, BLOCK_K // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    w_rows = W + rows.to(tl.int64)[:, None, None] * K
    for k0 in range(0, K, BLOCK_K):
        w = tl.load(w_rows + k0 + offs[None, :, :])
        xv = tl.load(X + k0 + offs).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * xv[None, :, :], 2)
    y = tl.sum(acc, 1) * tl.load(S + rows)
    tl.store(Y + rows, y)


def rel_err(fn, y, ref) -> float:
    """Run `fn` once on weight copy 0 and compare with that copy's reference."""
    fn(0)
    torch.cuda.synchronize()
    return ((y - ref).abs().max() / ref.abs().max()).item()


def timed(fn, copies, reps=20):
    g = torch.cuda.CUDAGraph()
    fn(0)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(i % copies)
    g.replay()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def opcode_hist(compiled):
    try:
        sass = compiled.asm["sass"]
    except Exception as e:  # noqa: BLE001
        return f"no sass ({e})"
    hist = {}
    for line in sass.splitlines():
        parts = line.strip().split()
        for p in parts:
            if p.isupper() and p[0].isalpha() and len(p) > 2 and "." not in p[:3]:
                op = p.split(".")[0]
                hist[op] = hist.get(op, 0) + 1
                break
    return sorted(hist.items(), key=lambda t: -t[1])[:18]


def words_launch(x, ws, s, y, bn, bw, warps, mode):
    n, kw = ws[0].shape
    return lambda i: k_words[(n // bn,)](x, ws[i], s, y, n, kw, BLOCK_N=bn, BLOCK_W=bw, MODE=mode,
                                         num_warps=warps, num_stages=3)


def cvt_launch(x, ws, s, y, bn, bk, warps, vec):
    n, k = ws[0].shape
    return lambda i: k_cvt[(n // bn,)](x, ws[i], s, y, n, k, BLOCK_N=bn, BLOCK_K=bk, VEC=vec,
                                       num_warps=warps, num_stages=3)


def bench_shape(n: int, k: int, copy_bw: float, dev) -> list[tuple]:
    copies = max(2, int(200e6 // (n * k)) + 1)
    w8 = [(torch.randn(n, k, device=dev) * 0.05).to(torch.float8_e4m3fn) for _ in range(copies)]
    w16 = [w.to(torch.bfloat16) for w in w8]
    w32 = [w.view(torch.int32) for w in w8]
    x = torch.randn(k, device=dev, dtype=torch.bfloat16)
    s = torch.rand(n, device=dev) + 0.5
    y = torch.empty(n, device=dev, dtype=torch.float32)
    ref = (w8[0].float() @ x.float()) * s
    rows = []
    for bn, bw, warps in [(4, 256, 4), (8, 256, 8), (8, 128, 4), (16, 128, 8), (4, 512, 8), (2, 512, 4)]:
        for mode in (0, 1):
            fn = words_launch(x, w32, s, y, bn, bw, warps, mode)
            tt = timed(fn, copies)
            err = rel_err(fn, y, ref) if mode == 1 else float("nan")
            rows.append((("raw", "bits")[mode], f"{bn}x{4 * bw} w{warps}", tt, n * k / tt / copy_bw, err))
    for bn, bk, warps in [(8, 1024, 8), (4, 1024, 4), (16, 512, 8)]:
        fn = cvt_launch(x, w8, s, y, bn, bk, warps, 16)
        tt = timed(fn, copies)
        rows.append(("cvt", f"{bn}x{bk} w{warps}", tt, n * k / tt / copy_bw, rel_err(fn, y, ref)))
        fn = cvt_launch(x, w16, s, y, bn, bk, warps, 8)
        tt = timed(fn, copies)
        rows.append(("bf16", f"{bn}x{bk} w{warps}", tt, 2 * n * k / tt / copy_bw, float("nan")))
    print(f"--- {n}x{k} ({copies} copies)")
    return rows


def copy_bandwidth(dev) -> float:
    """Bytes read + written per second by a 1 GiB device copy (float32 words: a byte-wise copy
    does not reach the bandwidth)."""
    src = torch.empty(1 << 28, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / timed(lambda i: dst.copy_(src), 1, reps=10)


def main():
    dev = torch.device("cuda")
    copy_bw = copy_bandwidth(dev)
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    for name, (n, k) in shapes.items():
        print(name)
        for kind, cfg, tt, frac, err in bench_shape(n, k, copy_bw, dev):
            print(f"{kind:5s} {cfg:16s} {tt * 1e6:8.1f} us  {100 * frac:5.1f}% of copy BW  err {err:.2e}")
    if "--sass" in sys.argv:
        n, k = 4096, 14336
        w32 = torch.zeros(n, k // 4, dtype=torch.int32, device=dev)
        x = torch.zeros(k, device=dev, dtype=torch.bfloat16)
        s = torch.ones(n, device=dev)
        y = torch.empty(n, device=dev)
        for mode in (0, 1):
            c = k_words[(n // 8,)](x, w32, s, y, n, k // 4, BLOCK_N=8, BLOCK_W=256, MODE=mode, num_warps=8, num_stages=3)
            print("words mode", mode, opcode_hist(c))
        c = k_cvt[(n // 8,)](x, w32.view(torch.float8_e4m3fn), s, y, n, k, BLOCK_N=8, BLOCK_K=1024, VEC=16,
                             num_warps=8, num_stages=3)
        print("cvt", opcode_hist(c))


if __name__ == "__main__":
    main()
