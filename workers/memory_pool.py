"""Device memory of one rank: the request → token-slot table and the KV pools.

Who decides what: the replica's scheduler owns all *bookkeeping* (which request row and which
KV pages are free, see `cluster.engine.kv_allocator`); the worker owns the *tensors* and applies the
scheduler's decisions (`ReqToTokenPool.write`). Page 0 is reserved: padded entries of a batch
(CUDA-graph padding) write their K/V there, so no live page is ever touched by padding.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from workers import kv_quant

if TYPE_CHECKING:
    from workers.model_config import ModelConfig


class ReqToTokenPool:
    """req_to_token[row, i] = KV slot of token i of the request in `row` (int32).

    For page size P, tokens i and i+1 of one request share a page unless (i+1) % P == 0, so
    req_to_token[row, j*P] // P is that request's j-th page (the page table).
    """

    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device | str):
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((max_reqs, max_context_len), dtype=torch.int32, device=device)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.req_to_token[row, start : start + slots.numel()] = slots.to(torch.int32)


class KVPool(ABC):
    """Per-layer KV storage indexed by slot. `num_slots` counts page 0 (reserved).

    `dtype` is the storage dtype: the model's, or FP8 with per-layer scales (`workers.kv_quant`:
    writes quantize, readers fold `scales(layer)` into their math)."""

    use_mla: bool = False

    def __init__(self, num_pages: int, page_size: int, num_layers: int, dtype: torch.dtype, device,
                 k_scales: tuple[float, ...] | None = None, v_scales: tuple[float, ...] | None = None):
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = device
        self.quantized = kv_quant.is_fp8(dtype)
        ones = (1.0,) * num_layers
        self.k_scales = tuple(k_scales) if self.quantized and k_scales else ones
        self.v_scales = tuple(v_scales) if self.quantized and v_scales else ones
        # Counts K/V writes; tests use it to assert that a fast path really skipped the cache.
        self.write_count = 0

    @abstractmethod
    def bytes_per_token(self) -> int:
        """Bytes of KV one token occupies on this rank over all layers."""

    def scales(self, layer_id: int) -> tuple[float, float]:
        """(K scale, V scale) of layer `layer_id`: stored = value / scale (1.0 unless FP8)."""
        return self.k_scales[layer_id], self.v_scales[layer_id]

    def _stored(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """x as this pool stores it: FP8 bytes (viewed as uint8, which every indexing kernel
        takes) or the pool's dtype."""
        if self.quantized:
            return kv_quant.quantize(x, scale).view(torch.uint8)
        return x.to(self.dtype)

    def _raw(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.view(torch.uint8) if self.quantized else buf

    def readback(self, x: torch.Tensor, layer_id: int) -> torch.Tensor:
        """What a read of keys `x` written to layer `layer_id` gives back (x itself unless FP8;
        MLA's latent is scaled as keys): attention over in-batch values that must equal
        attention over the cache."""
        return kv_quant.roundtrip(x, self.k_scales[layer_id]) if self.quantized else x


class MHATokenToKVPool(KVPool):
    """K and V per layer: [num_slots, num_kv_heads, head_dim] (this rank's heads only)."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device,
        v_head_dim: int | None = None,
        k_scales: tuple[float, ...] | None = None,
        v_scales: tuple[float, ...] | None = None,
    ):
        super().__init__(num_pages, page_size, num_layers, dtype, device, k_scales, v_scales)
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        shape = (self.num_slots, num_kv_heads)
        self.k_buffer = [torch.zeros(*shape, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [
            torch.zeros(*shape, self.v_head_dim, dtype=dtype, device=device) for _ in range(num_layers)
        ]

    def bytes_per_token(self) -> int:
        per_layer = self.num_kv_heads * (self.head_dim + self.v_head_dim) * self.dtype.itemsize
        return per_layer * self.num_layers

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k: [T, num_kv_heads, head_dim], v: [T, num_kv_heads, v_head_dim], loc: [T]."""
        ks, vs = self.scales(layer_id)
        self._raw(self.k_buffer[layer_id])[loc] = self._stored(k, ks)
        self._raw(self.v_buffer[layer_id])[loc] = self._stored(v, vs)
        self.write_count += 1


class MLATokenToKVPool(KVPool):
    """One latent per token and layer: [num_slots, 1, kv_lora_rank + qk_rope_head_dim].

    The latent is the same on every TP rank (it is computed before heads are split), so every
    rank holds the full vector and the KV store keeps one copy per page (see kvstore.client).
    """

    use_mla = True

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        dtype: torch.dtype,
        device,
        scales: tuple[float, ...] | None = None,
    ):
        super().__init__(num_pages, page_size, num_layers, dtype, device, scales, scales)
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.latent_dim = kv_lora_rank + qk_rope_head_dim
        self.kv_buffer = [
            torch.zeros(self.num_slots, 1, self.latent_dim, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]

    def bytes_per_token(self) -> int:
        return self.latent_dim * self.dtype.itemsize * self.num_layers

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[layer_id]

    def set_mla_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, kv_latent: torch.Tensor, k_rope: torch.Tensor
    ) -> None:
        """kv_latent: [T, kv_lora_rank] (normalised), k_rope: [T, qk_rope_head_dim] (rotated)."""
        buf, scale = self._raw(self.kv_buffer[layer_id]), self.k_scales[layer_id]
        buf[loc, 0, : self.kv_lora_rank] = self._stored(kv_latent, scale)
        buf[loc, 0, self.kv_lora_rank :] = self._stored(k_rope, scale)
        self.write_count += 1


def kv_bytes_per_token(mc: ModelConfig, tp_size: int) -> int:
    """Bytes of K/V one token takes in this rank's pool of model `mc` (its full-attention layers:
    a hybrid model's linear layers keep no KV), in the KV cache's dtype."""
    layers, item = len(mc.full_attn_layers), mc.kv_dtype.itemsize
    if mc.use_mla:
        return (mc.hf_config.kv_lora_rank + mc.hf_config.qk_rope_head_dim) * item * layers
    return mc.per_rank_kv_heads(tp_size) * 2 * mc.head_dim * item * layers


def make_kv_pool(mc: ModelConfig, tp_size: int, num_pages: int, page_size: int, device,
                 checkpoint_scales: dict[int, dict[str, float]] | None = None) -> KVPool:
    """This rank's KV pool of model `mc`: `num_pages` pages (page 0 reserved) of its
    full-attention layers, in the KV cache's dtype (`mc.kv_dtype`); an FP8 pool takes the
    checkpoint's per-layer scales (`workers.kv_quant`)."""
    layers = mc.full_attn_layers
    k_scales, v_scales = kv_quant.pool_scales(checkpoint_scales, layers, mc.use_mla)
    if mc.use_mla:
        return MLATokenToKVPool(num_pages, page_size, len(layers), mc.hf_config.kv_lora_rank,
                                mc.hf_config.qk_rope_head_dim, mc.kv_dtype, device, k_scales)
    return MHATokenToKVPool(num_pages, page_size, len(layers), mc.per_rank_kv_heads(tp_size), mc.head_dim,
                            mc.kv_dtype, device, k_scales=k_scales, v_scales=v_scales)
