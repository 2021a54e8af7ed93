"""FlashAttentionBackend: attention over the paged cache with the fastest kernel the machine has,
chosen once at start-up (see `attention.kernels.select_kernels`) and logged. On CPU the kernels
are torch SDPA; on GPU flash-attn, PyTorch's varlen FlashAttention and Triton paged decode.

It serves MHA/GQA layers over `MHATokenToKVPool` and, with `use_mla=True`, the MLA layers of a
DeepSeek-style model over `MLATokenToKVPool`: `set_mla_kv_buffer` on the write side, the latent
cache on the read side (decompressed prefix chunks in an extend, the absorbed Triton/torch
kernel in a decode), by the functions of `attention.mla`: the one backend of MLA layers
(`--attention-backend mla` names it too, and insists on an MLA checkpoint). MLA never takes the
skip-KV-cache fast path (contract 2): its decode always reads the latent cache.
"""

from __future__ import annotations

import logging

from attention.kernels import KernelSet, select_kernels
from attention.mla import DEFAULT_PREFIX_CHUNK_TOKENS, mla_decode, mla_extend, plan_prefix_chunks
from attention.paged import PagedAttentionBackend

logger = logging.getLogger(__name__)


class FlashAttentionBackend(PagedAttentionBackend):
    name = "flash_attention"
    supports_mla = True
    supports_cuda_graph = True

    def __init__(self, page_size: int, skip_kv_cache: bool = False, device: str = "cpu", use_mla: bool = False,
                 prefix_chunk_tokens: int = DEFAULT_PREFIX_CHUNK_TOKENS):
        if use_mla and skip_kv_cache:
            raise ValueError("MLA layers never skip the KV cache: their decode reads the latent cache")
        super().__init__(page_size, skip_kv_cache)
        self.use_mla = use_mla
        self.prefix_chunk_tokens = prefix_chunk_tokens
        self.chunk_plan = None  # MLA: how an extend reads its cached prefix (init_mha_chunk_metadata)
        self.kernels: KernelSet = select_kernels(device, page_size)
        logger.info("FlashAttentionBackend kernels: %s%s", self.kernels.description,
                    f"; MLA layers over the latent cache, prefix chunks of {prefix_chunk_tokens} tokens"
                    if use_mla else "")

    def describe(self) -> str:
        return f"{self.name}{' (MLA)' if self.use_mla else ''}: {self.kernels.description}"

    # ---- metadata (MLA adds the prefix-chunk plan of an extend) ----
    def init_forward_metadata(self, forward_batch) -> None:
        super().init_forward_metadata(forward_batch)
        self.chunk_plan = None
        if self.use_mla:
            self.mixed = None  # an MLA extend treats a MIXED batch's decodes as one-token extends
            if not forward_batch.forward_mode.is_decode():
                self.init_mha_chunk_metadata(forward_batch)

    def init_mha_chunk_metadata(self, forward_batch) -> None:
        if not self.use_mla:
            return None  # MHA reads its cached prefix directly from the paged cache
        assert self.metadata is not None, "init_forward_metadata first"
        self.chunk_plan = plan_prefix_chunks(self.metadata, self.prefix_chunk_tokens)
        return None

    # ---- forward ----
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if self.use_mla:
            return mla_extend(self.metadata, self.chunk_plan, q, k, layer, forward_batch, save_kv_cache)
        return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if self.use_mla:
            return mla_decode(self.metadata, self.kernels, self.page_size, q, k, layer, forward_batch, save_kv_cache)
        return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)

    # ---- MHA kernels ----
    def _extend_kernel(self, q, k_cache, v_cache, table, q_lens, kv_lens, layer, causal):
        if layer.logit_cap > 0:
            return self.kernels.reference(
                q, k_cache, v_cache, table, q_lens, kv_lens, layer.scaling, causal, layer.logit_cap
            )
        return self.kernels.extend(q, k_cache, v_cache, table, q_lens, kv_lens, layer.scaling, causal)

    def _ragged_kernel(self, q, k, v, meta, layer):
        if layer.logit_cap > 0:
            return super()._ragged_kernel(q, k, v, meta, layer)
        return self.kernels.ragged(q, k, v, meta.extend_seq_lens_cpu, layer.scaling, layer.is_causal)

    def _decode_kernel(self, q, k_cache, v_cache, meta, layer):
        if layer.logit_cap > 0:
            return self.kernels.reference(
                q, k_cache, v_cache, meta.token_table, [1] * q.shape[0], meta.cache_seqlens_cpu,
                layer.scaling, True, layer.logit_cap,
            )
        # Graph-safe: reads only the page table and lengths (static buffers under replay).
        return self.kernels.decode_paged(
            q, k_cache, v_cache, meta.page_table, meta.cache_seqlens_int32, layer.scaling, self.page_size
        )
