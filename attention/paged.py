"""Shared machinery of the MHA/GQA backends over the paged cache: metadata, KV write, graph
buffers. Subclasses choose the kernels (`_extend_kernel`, `_decode_kernel`) and nothing else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attention.base import AttentionBackend, AttentionLayer, KVStoreTarget
from attention.graph_buffers import GraphMetadataBuffers
from attention.metadata import AttentionMetadata, build_attention_metadata

if TYPE_CHECKING:
    from workers.forward_batch import ForwardBatch


def should_skip_kv_cache(
    *, is_embedding: bool, chunked_prefill_size: int, disable_radix_cache: bool, use_mla: bool
) -> bool:
    """The one place that decides the embedding fast path: attend over the batch's raw K/V and
    neither write nor read the paged cache. Only safe when nothing will ever read the cache
    again (no chunked prefill continues the request, no radix cache shares it) and never for
    MLA, whose absorbed path always reads its latent cache.

    The backend takes it at construction (`skip_kv_cache`) and `forward_extend` /
    `forward_decode` act on it in one branch each: there is no second, per-forward condition
    (an earlier `not layer.is_causal and kv_pool is None` escape hatch was removed: a missing
    pool is a caller's bug and fails loudly instead of choosing a path)."""
    return is_embedding and chunked_prefill_size == -1 and disable_radix_cache and not use_mla


def cache_scales(layer: AttentionLayer, pool) -> tuple[AttentionLayer, float]:
    """(layer as its kernels see it, factor of their output) for a read of `pool`'s layer: an
    FP8 cache's K scale folds into the softmax scale and its V scale multiplies the output
    (`workers.kv_quant`), so kernels read FP8 as it is stored. (layer, 1.0) otherwise."""
    ks, vs = pool.scales(layer.layer_id)
    if ks != 1.0:
        layer = dataclasses.replace(layer, scaling=layer.scaling * ks)
    return layer, vs


def scale_output(out: torch.Tensor, factor: float) -> torch.Tensor:
    return out if factor == 1.0 else out.mul_(factor)


class PagedAttentionBackend(GraphMetadataBuffers, AttentionBackend):
    """Base for backends over `MHATokenToKVPool`."""

    supports_mla = False

    def __init__(self, page_size: int, skip_kv_cache: bool = False):
        self.page_size = page_size
        self.skip_kv_cache = skip_kv_cache
        self.metadata: AttentionMetadata | None = None
        self.mixed: MixedSplit | None = None
        self._graph_max_bs = 0
        self._static: AttentionMetadata | None = None

    # ---- metadata ----
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self.metadata = build_attention_metadata(forward_batch, self.page_size)
        self.mixed = MixedSplit.of(self.metadata) if forward_batch.forward_mode.is_mixed() else None

    def init_mha_chunk_metadata(self, forward_batch: ForwardBatch) -> None:
        # MHA reads its cached prefix directly from the paged cache: no chunk plan needed.
        return None

    # ---- kernels chosen by subclasses ----
    def _extend_kernel(self, q, k_cache, v_cache, table, q_lens, kv_lens, layer: AttentionLayer, causal):
        raise NotImplementedError

    def _decode_kernel(self, q, k_cache, v_cache, meta: AttentionMetadata, layer: AttentionLayer):
        raise NotImplementedError

    def _ragged_kernel(self, q, k, v, meta: AttentionMetadata, layer: AttentionLayer):
        """Attention of each request over its own raw K/V ([T, Hkv, D], no cache). By default
        the extend kernel over a table that points into the raw rows; backends with a batched
        kernel for it override this."""
        lens = meta.extend_seq_lens_cpu
        return self._extend_kernel(q, k, v, _ragged_table(meta), lens, lens, layer, layer.is_causal)

    # ---- forward ----
    def kv_store_target(self, layer: AttentionLayer, forward_batch: ForwardBatch) -> KVStoreTarget | None:
        # Exactly where `_save` would write: self-attention layers, unless the one skip decision
        # (contract 2) holds; cross-attention K/V come from the encoder and are written here.
        if self.skip_kv_cache or layer.is_cross_attention:
            return None
        pool = forward_batch.kv_pool
        assert pool is not None and forward_batch.out_cache_loc is not None
        return KVStoreTarget(pool, layer.layer_id, forward_batch.out_cache_loc)  # type: ignore[arg-type]

    def _save(self, layer: AttentionLayer, forward_batch: ForwardBatch, k, v) -> None:
        pool = forward_batch.kv_pool
        assert pool is not None
        pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)

    def _cross_attention(self, q, k, v, layer, forward_batch, save_kv_cache):
        meta = self.metadata
        assert meta is not None and meta.encoder_token_table is not None
        pool = forward_batch.kv_pool
        if k is not None and save_kv_cache:
            # The encoder's K/V of this step's new requests: written by the caller-provided
            # locations in extras (see workers.models.bart).
            loc = forward_batch.extras["encoder_out_cache_loc"]
            pool.set_kv_buffer(layer.layer_id, loc, k, v)
        k_cache, v_cache = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        layer, v_scale = cache_scales(layer, pool)
        if forward_batch.forward_mode.is_decode():
            # One query per request over its own encoder_lens[i] keys: the decode kernel, which
            # reads only the page table and lengths (static buffers under graph replay).
            return scale_output(self._decode_kernel(q, k_cache, v_cache, meta.encoder_view(), layer), v_scale)
        q_lens = meta.extend_seq_lens_cpu
        return scale_output(self._extend_kernel(
            q, k_cache, v_cache, meta.encoder_token_table, q_lens, meta.encoder_lens_cpu, layer, False
        ), v_scale)

    def _attend_uncached(self, q, k, v, layer, meta: AttentionMetadata):
        """The embedding fast path: each request's new tokens attend over their own raw K/V.
        Only right when no request has a cached prefix, which `should_skip_kv_cache`
        guarantees (whole prompts, no prefix cache); a violation is a bug, not a fallback."""
        if meta.cache_seqlens_cpu != meta.extend_seq_lens_cpu:
            raise RuntimeError("skip_kv_cache: a request has a cached prefix, which this path cannot read")
        return self._ragged_kernel(q, k, v, meta, layer)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        meta = self.metadata
        assert meta is not None
        if layer.is_cross_attention:
            out = self._cross_attention(q, k, v, layer, forward_batch, save_kv_cache)
        elif self.skip_kv_cache:
            # Contract 2: the one decision skips the write and the read together.
            out = self._attend_uncached(q, k, v, layer, meta)
        else:
            if save_kv_cache:
                self._save(layer, forward_batch, k, v)
            pool = forward_batch.kv_pool
            k_cache, v_cache = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
            layer, v_scale = cache_scales(layer, pool)
            mixed = self.mixed
            if mixed is not None and layer.is_causal:
                # Decodes through the paged decode kernel, prefill pieces through the ragged
                # one: gathering every decode's whole cache for the ragged kernel would cost
                # more than the step's matrix products.
                out = q.new_empty(q.shape[0], layer.num_heads, layer.out_head_dim)
                out[mixed.decode_tokens] = self._decode_kernel(
                    q[mixed.decode_tokens], k_cache, v_cache, mixed.decode_meta, layer
                )
                out[mixed.extend_tokens] = self._extend_kernel(
                    q[mixed.extend_tokens], k_cache, v_cache, mixed.extend_token_table,
                    mixed.extend_q_lens, mixed.extend_kv_lens, layer, True,
                )
            else:
                out = self._extend_kernel(
                    q, k_cache, v_cache, meta.token_table, meta.extend_seq_lens_cpu,
                    meta.cache_seqlens_cpu, layer, layer.is_causal,
                )
            return scale_output(out, v_scale).reshape(q.shape[0], -1)
        return out.reshape(q.shape[0], -1)


    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        meta = self.metadata
        assert meta is not None
        if layer.is_cross_attention:
            return self._cross_attention(q, k, v, layer, forward_batch, save_kv_cache).reshape(q.shape[0], -1)
        if self.skip_kv_cache:
            # A batch of one-token prompts is planned as DECODE; the same decision holds.
            return self._attend_uncached(q, k, v, layer, meta).reshape(q.shape[0], -1)
        if save_kv_cache:
            self._save(layer, forward_batch, k, v)
        pool = forward_batch.kv_pool
        cached, v_scale = cache_scales(layer, pool)
        out = self._decode_kernel(
            q, pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id), meta, cached
        )
        return scale_output(out, v_scale).reshape(q.shape[0], -1)


@dataclass
class MixedSplit:
    """A MIXED batch split into its one-token decodes and its prefill pieces, built once per
    step from the step's metadata (index tensors reused by every layer)."""

    decode_tokens: torch.Tensor  # [Bd] token index of each decode's query
    decode_meta: AttentionMetadata  # the decodes' rows of the step's metadata
    extend_tokens: torch.Tensor  # [Te] token indices of the prefill pieces
    extend_token_table: torch.Tensor  # [Be, width]
    extend_q_lens: list[int]
    extend_kv_lens: list[int]

    @classmethod
    def of(cls, meta: AttentionMetadata) -> MixedSplit | None:
        q_lens, kv_lens = meta.extend_seq_lens_cpu, meta.cache_seqlens_cpu
        dec = [i for i, n in enumerate(q_lens) if n == 1 and kv_lens[i] > 1]
        if not dec or len(dec) == len(q_lens):
            return None
        ext = [i for i in range(len(q_lens)) if i not in set(dec)]
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        dev = meta.token_table.device
        ext_rows = torch.tensor(ext, device=dev)
        return cls(
            decode_tokens=torch.tensor([starts[i] for i in dec], device=dev),
            decode_meta=meta.decode_rows(dec),
            extend_tokens=torch.tensor([t for i in ext for t in range(starts[i], starts[i + 1])], device=dev),
            extend_token_table=meta.token_table[ext_rows],
            extend_q_lens=[q_lens[i] for i in ext],
            extend_kv_lens=[kv_lens[i] for i in ext],
        )


def _ragged_table(meta: AttentionMetadata) -> torch.Tensor:
    from attention.torch_ops import ragged_self_table

    return ragged_self_table(meta.cu_seqlens_q, meta.extend_seq_lens_cpu)
