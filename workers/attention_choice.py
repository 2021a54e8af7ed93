"""Which attention backend a rank runs: the one `--attention-backend` names, for the checkpoint's
layers (MHA/GQA or MLA) and the serving mode it forces. The target model and the speculative
draft model both ask here."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from attention.base import AttentionBackend
from attention.flash import FlashAttentionBackend
from attention.paged import should_skip_kv_cache
from attention.reference import TorchReferenceBackend
from workers.model_config import ServingMode

if TYPE_CHECKING:
    from workers.model_runner import RunnerOptions

logger = logging.getLogger(__name__)


def make_attention_backend(
    opts: RunnerOptions, use_mla: bool, device: torch.device, mode: ServingMode
) -> AttentionBackend:
    """`mode` is the serving mode the checkpoint forces (`workers.model_config.serving_mode`),
    the same one the engine's scheduler runs under."""
    skip = should_skip_kv_cache(
        is_embedding=mode.is_embedding,
        chunked_prefill_size=mode.chunked_prefill_size,
        disable_radix_cache=mode.disable_radix_cache,
        use_mla=use_mla,
    )
    if mode.is_embedding:
        logger.info("embedding fast path (no KV-cache write or read): %s", skip)
    if opts.attention_backend == "mla" and not use_mla:
        raise ValueError("attention backend 'mla' serves MLA models only; this checkpoint has none")
    backend: AttentionBackend
    if opts.attention_backend == "reference":
        backend = TorchReferenceBackend(opts.page_size, skip_kv_cache=skip)
    else:  # "flash" (or "mla"): MHA/GQA layers, and MLA layers (use_mla) over the latent cache
        backend = FlashAttentionBackend(opts.page_size, skip_kv_cache=skip, device=device.type, use_mla=use_mla)
    backend.check_capabilities(use_mla=use_mla, page_size=opts.page_size, cuda_graph=False)
    return backend
