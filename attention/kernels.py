"""Kernel selection: one decision at start-up, logged, used for the life of the backend."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from attention import torch_ops


@dataclass(frozen=True)
class KernelSet:
    description: str
    extend: Callable
    decode: Callable
    reference: Callable = torch_ops.paged_attention_ref


def select_kernels(device: str) -> KernelSet:
    """CPU: torch SDPA. GPU kernels are added by the GPU work (flash_attn / varlen / Triton)."""
    return KernelSet(
        description="torch-sdpa (cpu)",
        extend=torch_ops.paged_extend_sdpa,
        decode=torch_ops.paged_decode_sdpa,
    )
