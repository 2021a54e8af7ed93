"""A wrapper backend for models that mix linear-attention layers with full-attention layers
(Kimi-Linear, Bailing hybrid): every hook of `AttentionBackend` is delegated.

- Metadata hooks (`init_forward_metadata`, `init_mha_chunk_metadata`, the CUDA-graph state,
  capture and replay hooks) go to **both** backends, with the interface's exact arguments.
  `init_mha_chunk_metadata` matters: the full-attention (MLA) layers read a cached prefix in
  chunks during the later pieces of a chunked prefill, and a wrapper that did not forward
  this hook left the chunk plan stale (a real bug: a `hasattr` probe on the wrapper returned
  False and prefill crashed on a size mismatch).
- Forward hooks go to the backend that **owns the layer**: layers in `full_attn_layers` to
  `full_attn_backend`, the others to `linear_attn_backend`.
- `get_cuda_graph_seq_len_fill_value` is the full-attention backend's (the linear backend
  does not read sequence lengths).

Layer ids: each wrapped backend sees dense ids into its own storage. A full-attention layer's
id becomes its index among `full_attn_layers` (the KV pool holds those layers only), a linear
layer's its index among the other layers (the state pool's layer index). The model keeps its
own layer ids; the wrapper maps them (the mapped layer descriptors are built once and cached).

Capabilities are the wrapped backends': `check_capabilities` asks both.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import TYPE_CHECKING

import torch

from attention.base import AttentionBackend, AttentionLayer

if TYPE_CHECKING:
    from workers.forward_batch import ForwardBatch


class HybridLinearAttnBackend(AttentionBackend):
    name = "hybrid_linear"
    # The class-level declarations are the loosest; `check_capabilities` defers to the wrapped
    # backends, and CUDA graphs stay off until both backends support them.
    supports_mla = True
    supports_mha = True
    supports_cuda_graph = False
    supports_encoder_decoder = False
    supported_page_sizes = None

    def __init__(
        self,
        full_attn_backend: AttentionBackend,
        linear_attn_backend: AttentionBackend,
        full_attn_layers: list[int] | tuple[int, ...],
    ):
        self.full_attn_backend = full_attn_backend
        self.linear_attn_backend = linear_attn_backend
        self.full_attn_layers = tuple(sorted(set(full_attn_layers)))
        self._full_index = {layer_id: i for i, layer_id in enumerate(self.full_attn_layers)}
        # model layer id -> (the model's descriptor, the mapped one, the owning backend)
        self._routes: dict[int, tuple[AttentionLayer, AttentionLayer, AttentionBackend]] = {}

    def describe(self) -> str:
        return f"{self.name}: {self.full_attn_backend.describe()} + {self.linear_attn_backend.describe()}"

    def check_capabilities(self, *, use_mla: bool, page_size: int, cuda_graph: bool) -> None:  # type: ignore[override]
        """Checked on the instance: what the wrapper supports is what both backends support."""
        self.full_attn_backend.check_capabilities(use_mla=use_mla, page_size=page_size, cuda_graph=cuda_graph)
        self.linear_attn_backend.check_capabilities(use_mla=use_mla, page_size=page_size, cuda_graph=cuda_graph)

    # ---- routing ----
    def owner(self, layer_id: int) -> AttentionBackend:
        return self.full_attn_backend if layer_id in self._full_index else self.linear_attn_backend

    def storage_index(self, layer_id: int) -> int:
        """The id the owning backend sees: the index into the KV pool or the state pool."""
        if layer_id in self._full_index:
            return self._full_index[layer_id]
        return layer_id - bisect.bisect_left(self.full_attn_layers, layer_id)

    def _route(self, layer: AttentionLayer) -> tuple[AttentionLayer, AttentionBackend]:
        cached = self._routes.get(layer.layer_id)
        if cached is None or cached[0] is not layer:
            mapped = dataclasses.replace(layer, layer_id=self.storage_index(layer.layer_id))
            cached = (layer, mapped, self.owner(layer.layer_id))
            self._routes[layer.layer_id] = cached
        return cached[1], cached[2]

    # ---- metadata hooks: both backends ----
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self.full_attn_backend.init_forward_metadata(forward_batch)
        self.linear_attn_backend.init_forward_metadata(forward_batch)

    def init_mha_chunk_metadata(self, forward_batch: ForwardBatch) -> None:
        self.full_attn_backend.init_mha_chunk_metadata(forward_batch)
        self.linear_attn_backend.init_mha_chunk_metadata(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, metadata_in_graph: bool = False) -> None:
        self.full_attn_backend.init_cuda_graph_state(max_bs, max_num_tokens, metadata_in_graph)
        self.linear_attn_backend.init_cuda_graph_state(max_bs, max_num_tokens, metadata_in_graph)

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, num_tokens: int, forward_batch: ForwardBatch
    ) -> None:
        self.full_attn_backend.init_forward_metadata_capture_cuda_graph(bs, num_tokens, forward_batch)
        self.linear_attn_backend.init_forward_metadata_capture_cuda_graph(bs, num_tokens, forward_batch)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, forward_batch: ForwardBatch) -> None:
        self.full_attn_backend.init_forward_metadata_replay_cuda_graph(bs, forward_batch)
        self.linear_attn_backend.init_forward_metadata_replay_cuda_graph(bs, forward_batch)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.full_attn_backend.get_cuda_graph_seq_len_fill_value()

    # ---- forward hooks: the backend that owns the layer ----
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        mapped, backend = self._route(layer)
        return backend.forward_extend(q, k, v, mapped, forward_batch, save_kv_cache)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        mapped, backend = self._route(layer)
        return backend.forward_decode(q, k, v, mapped, forward_batch, save_kv_cache)
