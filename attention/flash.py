"""FlashAttentionBackend: MHA/GQA attention over the paged cache with the fastest kernel the
machine has, chosen once at start-up (see `attention.kernels.select_kernels`) and logged.
On CPU the kernels are torch SDPA; on GPU flash-attn, PyTorch's varlen FlashAttention and
Triton paged decode.
"""

from __future__ import annotations

import logging

from attention.kernels import KernelSet, select_kernels
from attention.paged import PagedAttentionBackend

logger = logging.getLogger(__name__)


class FlashAttentionBackend(PagedAttentionBackend):
    name = "flash_attention"
    supports_cuda_graph = True

    def __init__(self, page_size: int, skip_kv_cache: bool = False, device: str = "cpu"):
        super().__init__(page_size, skip_kv_cache)
        self.kernels: KernelSet = select_kernels(device, page_size)
        logger.info("FlashAttentionBackend kernels: %s", self.kernels.description)

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
