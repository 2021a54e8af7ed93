"""Arrival counters for split kernels whose last-arriving program finishes the work.

A kernel that splits one output over several programs (split-K products, split-KV attention)
can reduce in place of a second kernel: each program writes its partial, counts itself in with
an atomic add, and the program that sees the count reach the number of splits combines the
partials and resets the counter to zero. The counters must start at zero, so they are
allocated zeroed once per (device, stream) and every launch leaves them zeroed: a CUDA graph
replays such a launch with no memset. Launches on one stream run one after another (with PDL
each touches the counters only after waiting for its predecessor), so they share the buffer.
"""

from __future__ import annotations

import functools

import torch

COUNTERS = 1 << 16


@functools.cache  # never evicted: captured CUDA graphs keep using the buffer by address
def _buffer(device: torch.device, stream: int) -> torch.Tensor:
    return torch.zeros(COUNTERS, dtype=torch.int32, device=device)


def arrival_counters(device: torch.device, needed: int) -> torch.Tensor:
    """The zeroed int32 counters of the current stream on `device` (at least `needed`)."""
    if needed > COUNTERS:
        raise ValueError(f"{needed} arrival counters requested, {COUNTERS} exist")
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    return _buffer(device, stream)
