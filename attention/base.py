"""The one attention-backend interface.

Every backend and every wrapper implements every hook below with exactly these signatures;
callers call hooks and never probe for them (`hasattr`). `tests/test_backend_conformance.py`
enumerates the abstract methods and fails if a concrete backend misses one or changes its
signature. Capabilities are declared as class attributes and checked once at start-up
(`check_capabilities`), never discovered mid-forward.

Invariants every backend keeps:
- `init_forward_metadata` is called once per step before the first layer, and the metadata
  it builds comes from `attention.metadata.build_attention_metadata` — the same function that
  fills the static buffers for CUDA-graph replay.
- The KV write and the KV read of a forward are decided together, in one branch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from workers.forward_batch import ForwardBatch
    from workers.memory_pool import MHATokenToKVPool


@dataclass(frozen=True)
class AttentionLayer:
    """Static description of one attention layer on this rank (heads are per-rank counts)."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    v_head_dim: int = 0  # 0 means head_dim
    is_causal: bool = True  # False for encoder self-attention
    is_cross_attention: bool = False  # decoder attends to the request's encoder K/V
    logit_cap: float = 0.0
    # MLA only: the latent width; q/k of the absorbed form have kv_lora_rank + rope dims.
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0

    @property
    def out_head_dim(self) -> int:
        return self.v_head_dim or self.head_dim


@dataclass(frozen=True)
class KVStoreTarget:
    """Where a layer may write this forward's K/V itself, fused with the op that produces them
    (RoPE: `workers.layers.rotary.RotaryEmbedding.apply`): layer `layer_id`'s caches of `pool`
    at slots `loc`. Given out by `AttentionBackend.kv_store_target`."""

    pool: MHATokenToKVPool
    layer_id: int
    loc: torch.Tensor


class AttentionBackend(ABC):
    """Attention over the paged KV cache for one model on one rank."""

    # Declared capabilities, checked at start-up by `check_capabilities`.
    name: ClassVar[str] = "abstract"
    supports_mla: ClassVar[bool] = False
    supports_mha: ClassVar[bool] = True
    supports_cuda_graph: ClassVar[bool] = False
    supports_encoder_decoder: ClassVar[bool] = True
    # None means any page size.
    supported_page_sizes: ClassVar[tuple[int, ...] | None] = None

    @classmethod
    def check_capabilities(cls, *, use_mla: bool, page_size: int, cuda_graph: bool) -> None:
        if use_mla and not cls.supports_mla:
            raise ValueError(f"attention backend {cls.name!r} does not support MLA models")
        if not use_mla and not cls.supports_mha:
            raise ValueError(f"attention backend {cls.name!r} only supports MLA models")
        if cls.supported_page_sizes is not None and page_size not in cls.supported_page_sizes:
            raise ValueError(
                f"attention backend {cls.name!r} supports page sizes {cls.supported_page_sizes}, "
                f"not {page_size}"
            )
        if cuda_graph and not cls.supports_cuda_graph:
            raise ValueError(f"attention backend {cls.name!r} does not support CUDA graphs")

    def describe(self) -> str:
        """The backend and the kernels it chose at start-up, as `manta serve` logs them (not a
        hook: backends with a kernel choice say which)."""
        return self.name

    def kv_store_target(self, layer: AttentionLayer, forward_batch: ForwardBatch) -> KVStoreTarget | None:
        """Not a hook: where the caller may write this layer's new K/V itself, fused with their
        RoPE, and then call `forward` with save_kv_cache=False; None (the default): the backend
        writes (or, by its one decision, skips) them itself. A backend gives a target only
        where its own forward would write the same K/V to the same slots."""
        return None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Dispatch on the forward mode. Not a hook: backends implement the two below."""
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    # ---- hooks: every backend and wrapper implements all of them ----

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Build this step's metadata (eager path)."""

    @abstractmethod
    def init_mha_chunk_metadata(self, forward_batch: ForwardBatch) -> None:
        """Plan the chunks in which a cached prefix is read during MHA-style prefill (MLA
        prefill decompresses the latent prefix chunk by chunk). Backends without chunked
        prefix reads make this a no-op, but they still implement it."""

    @abstractmethod
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, metadata_in_graph: bool = False) -> None:
        """Allocate the static buffers that captured graphs read their metadata from.
        `metadata_in_graph`: the capture hook will be called inside the graph capture, so
        that every replay fills the buffers from the graph's static inputs itself (the replay
        hook is then never called)."""

    @abstractmethod
    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, num_tokens: int, forward_batch: ForwardBatch
    ) -> None:
        """Point the metadata at the static buffers for a capture at batch size `bs`."""

    @abstractmethod
    def init_forward_metadata_replay_cuda_graph(self, bs: int, forward_batch: ForwardBatch) -> None:
        """Fill the static buffers for a replay at (padded) batch size `bs`, using the same
        builder as `init_forward_metadata`."""

    @abstractmethod
    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """seq_len given to padded batch entries during capture and replay."""

    @abstractmethod
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Ragged attention of new tokens over prefix + themselves.

        q: [T, num_heads, head_dim]; k: [T, num_kv_heads, head_dim]; v: [T, num_kv_heads, v_dim]
        returns [T, num_heads * v_dim]."""

    @abstractmethod
    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """One new token per request over its cache. Shapes as in `forward_extend` (T = B)."""
