"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's Triton kernels.

Inside a CUDA graph each kernel of a batch-1 decode layer is short (2-60 us), and the GPU
spends about a microsecond between two of them draining one grid and starting the next. With
PDL a kernel is launched while its predecessor still runs: it calls `launch_dependents` as it
starts (so its own successor may launch early too), does what needs none of its inputs (a
matrix product issues its first weight loads), and calls `wait` before it touches memory
any earlier kernel writes or reads; `wait` returns once the predecessor has finished and its
writes are visible, so the stream's order is kept for everything after it.

`enabled(device)` is the switch (compute capability 9+, not under Triton's interpreter, and the
kernel options' `pdl`, which `MANTA_PDL=0` turns off for per-kernel profiles); kernels take it
as a constexpr and pass it as their launch's `launch_pdl`.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from attention import kernel_options


@functools.lru_cache(maxsize=8)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" or not kernel_options.current().pdl:
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
