"""Kernel selection: one decision at start-up, logged, used for the life of the backend.

CPU: torch SDPA and torch references. CUDA:
- extend (ragged prefill): the Triton varlen kernel on Hopper | flash_attn varlen | torch
  varlen_attn | Triton paged prefill (`attention.gpu_prefill.select_prefill`; shapes the varlen
  paths cannot take fall back to the Triton paged kernel inside the call);
- decode: flash_attn_with_kvcache when flash_attn is installed and the page size is a multiple
  of 256, else the Triton split-K paged decode (`attention.triton_decode`);
- mla_decode: the Triton absorbed MLA decode (`attention.triton_mla_decode`).

How a backend calls the paged fields (all graph-safe: no host sync, grid fixed by host values):

    kernels.decode_paged(q, k_cache, v_cache, meta.page_table, meta.cache_seqlens_int32,
                         layer.scaling, page_size, num_splits=None)          # -> [B, H, Dv]
    kernels.mla_decode(q, kv_cache, meta.page_table, meta.cache_seqlens_int32, layer.scaling,
                       page_size, layer.kv_lora_rank, num_splits=None)       # -> [B, H, L]

Under CUDA graphs the page table must be a static buffer of fixed width (max pages per
request), and num_splits is best passed explicitly (None derives it from B, the head count and
that width, so it is also fixed for a given capture). `decode` keeps the token-table signature
of the eager backend and derives the page table itself (token_table[:, ::P] // P).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from attention import kernel_options, torch_ops


def _pages_to_token_table(page_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """[B, pages] page ids -> [B, pages * P] slots (graph-safe; columns past a request's length
    point at whatever page the table holds there, and are masked by the lengths)."""
    if page_size == 1:
        return page_table
    offs = torch.arange(page_size, device=page_table.device, dtype=page_table.dtype)
    return (page_table[:, :, None] * page_size + offs).flatten(1)


def torch_decode_paged(q, k_cache, v_cache, page_table, cache_seqlens, scaling, page_size,
                       num_splits=None, out=None):
    """CPU `decode_paged`: SDPA over the page table expanded to slots (num_splits ignored)."""
    table = _pages_to_token_table(page_table, page_size)
    o = torch_ops.paged_decode_sdpa(q, k_cache, v_cache, table, cache_seqlens, table.shape[1], scaling)
    if out is None:
        return o
    out.copy_(o)
    return out


def torch_mla_decode(q, kv_cache, page_table, cache_seqlens, scaling, page_size, kv_lora_rank,
                     num_splits=None, out=None):
    """CPU absorbed MLA decode in float32: every head attends over the one latent per token,
    k = [latent, k_pe], v = latent. q: [B, H, L + R]; kv_cache: [slots, 1, L + R];
    returns [B, H, L] in q's dtype (num_splits ignored)."""
    table = _pages_to_token_table(page_table, page_size).long()
    kv = kv_cache[table, 0].float()  # [B, T, L + R]
    scores = torch.einsum("bhd,btd->bht", q.float(), kv) * scaling
    valid = torch.arange(table.shape[1], device=q.device)[None, :] < cache_seqlens[:, None]
    probs = torch.softmax(scores.masked_fill(~valid[:, None, :], float("-inf")), dim=-1)
    o = torch.einsum("bht,btc->bhc", probs, kv[..., :kv_lora_rank]).to(q.dtype)
    if out is None:
        return o
    out.copy_(o)
    return out


@dataclass(frozen=True)
class KernelSet:
    """The kernels of one backend. Signatures:

    extend(q, k_cache, v_cache, token_table, q_lens, kv_lens, scaling, causal) -> [T, H, Dv]
    decode(q, k_cache, v_cache, token_table, cache_seqlens_int32, max_seqlen_k, scaling) -> [B, H, Dv]
    reference(q, k_cache, v_cache, token_table, q_lens, kv_lens, scaling, causal, logit_cap)
    decode_paged(q, k_cache, v_cache, page_table, cache_seqlens, scaling, page_size,
                 num_splits=None, out=None) -> [B, H, Dv]
    mla_decode(q, kv_cache, page_table, cache_seqlens, scaling, page_size, kv_lora_rank,
               num_splits=None, out=None) -> [B, H, kv_lora_rank]
    ragged(q, k, v, lens, scaling, causal) -> [T, H, Dv]: each request over its own raw K/V,
               no cache (the embedding fast path); padded SDPA in length-sorted groups
    """

    description: str
    extend: Callable
    decode: Callable
    reference: Callable = torch_ops.paged_attention_ref
    decode_paged: Callable = field(default=torch_decode_paged)
    mla_decode: Callable = field(default=torch_mla_decode)
    ragged: Callable = field(default=torch_ops.ragged_attention_sdpa)


def _decode_from_token_table(decode_paged: Callable, page_size: int) -> Callable:
    """The backend's token-table `decode` signature on top of a paged decode."""

    def decode(q, k_cache, v_cache, token_table, cache_seqlens, max_seqlen_k, scaling):
        from attention.triton_decode import token_table_to_page_table

        page_table = token_table_to_page_table(token_table, page_size)
        return decode_paged(q, k_cache, v_cache, page_table, cache_seqlens, scaling, page_size)

    return decode


def select_kernels(device: str, page_size: int = 1) -> KernelSet:
    """Pick the kernels for `device` ("cpu", "cuda", "cuda:N") once; `description` says what
    was chosen and is logged by the backend. `page_size` decides whether flash-attn's paged
    decode applies (multiples of 256 only) and is bound into the token-table `decode`."""
    if not str(device).startswith("cuda"):
        return KernelSet(
            description="torch-sdpa (cpu)",
            extend=torch_ops.paged_extend_sdpa,
            decode=torch_ops.paged_decode_sdpa,
        )
    return _select_cuda(str(device), page_size, kernel_options.current().triton_prefill)


@functools.lru_cache(maxsize=8)
def _select_cuda(device: str, page_size: int, triton_prefill: bool) -> KernelSet:
    """(`triton_prefill`, the kernel option, is part of the key and what the prefill is chosen by.)"""
    # Imported here: the GPU modules need triton, which CPU-only installs may lack.
    from attention import gpu_prefill
    from attention.triton_decode import paged_decode
    from attention.triton_mla_decode import mla_decode

    prefill_name, extend = gpu_prefill.select_prefill(device, triton_prefill)
    if gpu_prefill.flash_attn_available() and page_size % gpu_prefill.FLASH_ATTN_PAGE_MULTIPLE == 0:
        decode_name, decode_paged = "flash_attn_with_kvcache", gpu_prefill.flash_attn_decode_paged
    else:
        decode_name, decode_paged = "triton split-k", paged_decode
    return KernelSet(
        description=(
            f"cuda: prefill {prefill_name}, decode {decode_name} (page size {page_size}), "
            f"mla decode triton"
        ),
        extend=extend,
        decode=_decode_from_token_table(decode_paged, page_size),
        decode_paged=decode_paged,
        mla_decode=mla_decode,
    )
