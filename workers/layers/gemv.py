"""One-row linear layers (y = x W^T + b, x of one row: batch-1 decode) on CUDA.

At batch 1 a decoder layer's matrix products read their weights once and are bound by memory
bandwidth; on the H200 cuBLAS's kernels for the smaller matrices of an 8B model (qkv, o_proj)
reach 73-77% of the copy bandwidth, and o_proj/down_proj add a split-K reduction kernel each
(BENCHMARKS.md). `gemv` is a Triton kernel for that case: each program reduces BLOCK_N rows of
W against x over the whole K, no split, float32 accumulation.

`linear` picks, per weight shape and dtype, whichever of cuBLAS (F.linear) and the Triton
kernel is faster, measured once at the first one-row call on the device (never inside a CUDA
graph capture: there, an unmeasured shape takes cuBLAS) and logged. Every other call is
F.linear: more rows, CPU tensors, dtypes other than bf16/fp16.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# (N, K, dtype, has_bias, device index) -> use the Triton kernel
_CHOICE: dict[tuple, bool] = {}
_KERNELS: dict[str, object] = {}


def _kernels():
    """(plain kernel, the same autotuned over launch configurations keyed on N and K)."""
    if not _KERNELS:
        import triton
        import triton.language as tl

        @triton.jit
        def gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn,
                        HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
            rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
            rmask = rows < N
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                cmask = cols < K
                x = tl.load(x_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
                w = tl.load(w_rows + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
                acc += w.to(tl.float32) * x[None, :]
            y = tl.sum(acc, 1)
            if HAS_BIAS:
                y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
            tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)

        configs = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st)
                   for n in (4, 8, 16) for k in (256, 512, 1024) for w in (4, 8) for st in (3, 4)
                   if n * k <= 8192]
        _KERNELS["plain"] = gemv_kernel
        _KERNELS["tuned"] = triton.autotune(configs=configs, key=["N", "K"])(gemv_kernel)
    return _KERNELS["plain"], _KERNELS["tuned"]


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         block: tuple[int, int] | None = None) -> torch.Tensor:
    """x: [1, K] or [K]; weight: [N, K] (rows contiguous); bias: [N] or None -> [1, N].
    block=(BLOCK_N, BLOCK_K) launches that configuration; None: the autotuned one."""
    import triton

    n, k = weight.shape
    x = x.reshape(-1)
    assert x.numel() == k and weight.stride(1) == 1 and x.is_contiguous()
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    plain, tuned = _kernels()
    args = (x, weight, bias if bias is not None else weight, y, n, k, weight.stride(0))
    if block is not None:
        plain[(triton.cdiv(n, block[0]),)](*args, HAS_BIAS=bias is not None, BLOCK_N=block[0], BLOCK_K=block[1])
    else:
        tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, HAS_BIAS=bias is not None)
    return y


def _time(fn, reps: int = 30) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _choose(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: tuple) -> bool:
    cublas = _time(lambda: F.linear(x, weight, bias))
    try:
        triton_ms = _time(lambda: gemv(x, weight, bias))  # autotunes on its first call
    except Exception as e:  # noqa: BLE001 - a Triton failure leaves cuBLAS in place
        logger.warning("one-row linear %s: Triton kernel failed (%s); cuBLAS", key[:2], e)
        return False
    use = triton_ms < cublas
    logger.info("one-row linear N=%d K=%d %s: cuBLAS %.1f us, Triton %.1f us -> %s", key[0], key[1], key[2],
                1e3 * cublas, 1e3 * triton_ms, "Triton" if use else "cuBLAS")
    return use


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with one-row CUDA inputs through the faster of cuBLAS and `gemv`."""
    if (x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and weight.stride(1) == 1 and x.is_contiguous()):
        key = (weight.shape[0], weight.shape[1], x.dtype, bias is not None, x.device.index)
        use = _CHOICE.get(key)
        if use is None:
            if torch.cuda.is_current_stream_capturing():
                return F.linear(x, weight, bias)
            use = _CHOICE[key] = _choose(x, weight, bias, key)
        if use:
            return gemv(x, weight, bias)
    return F.linear(x, weight, bias)
