"""The torch reference backend: naive float32 attention, the oracle for every fast kernel."""

from __future__ import annotations

from attention.paged import PagedAttentionBackend
from attention.torch_ops import paged_attention_ref


class TorchReferenceBackend(PagedAttentionBackend):
    name = "torch_reference"
    supports_cuda_graph = False

    def _extend_kernel(self, q, k_cache, v_cache, table, q_lens, kv_lens, layer, causal):
        return paged_attention_ref(
            q, k_cache, v_cache, table, q_lens, kv_lens, layer.scaling, causal, layer.logit_cap
        )

    def _decode_kernel(self, q, k_cache, v_cache, meta, layer):
        return paged_attention_ref(
            q,
            k_cache,
            v_cache,
            meta.token_table,
            [1] * q.shape[0],
            meta.cache_seqlens_cpu,
            layer.scaling,
            True,
            layer.logit_cap,
        )
