"""Decode roofline: bytes a decode step must read (weights + KV) over the measured copy
bandwidth of the device. A step cannot be faster than this; `manta bench latency` prints the
measured step time as a fraction of it."""

from __future__ import annotations

import time

import torch


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 31, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written."""
    if device.type != "cuda":
        n = 1 << 26
        a, b = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
        b.copy_(a)
        t0 = time.perf_counter()
        for _ in range(5):
            b.copy_(a)
        return 2 * n * 5 / (time.perf_counter() - t0)
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize(device)
    seconds = start.elapsed_time(end) / 1e3
    del a, b
    return 2 * nbytes * iters / seconds


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_roofline_ms(model: torch.nn.Module, kv_bytes_per_token: int, batch: int, context: int,
                       bandwidth: float) -> float:
    """Lower bound of one decode step: every weight once plus each request's KV once.
    (Weights of MoE experts that no token selects need not be read; this counts them all.)"""
    return 1e3 * (weight_bytes(model) + batch * context * kv_bytes_per_token) / bandwidth
