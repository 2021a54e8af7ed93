"""Multi-head latent attention (DeepSeek-V2/V3) over `MLATokenToKVPool`.

Who does what (the split between the model's attention module and this backend):

- The **model** owns every projection: q (with or without q LoRA), kv_a (latent + k_pe),
  kv_a_layernorm, RoPE on the rope dims, the absorption of q_nope into latent space through
  W_UK and of the latent output through W_UV, o_proj. It also owns the decompression of
  latents into per-head K/V (kv_b_proj), which it hands to the backend as
  `MLAAttentionLayer.expand_kv`.
- The **backend** owns the cache: the write of each new token's cache entry, every read of
  cached latents, the plan of the chunks in which a cached prefix is read
  (`init_mha_chunk_metadata`), and the attention math over them.

Arguments of the hooks for an MLA layer (H = this rank's heads, C = kv_lora_rank,
R = qk_rope_head_dim, N = qk_nope_head_dim, V = v_head_dim):

- k: [T, 1, C + R], the cache entry of each new token: the kv_a_layernorm-ed latent followed by
  the rotated k_pe. Both hooks write it (`set_mla_kv_buffer`) when `save_kv_cache`.
- v: always None (the value is the latent).
- forward_extend (EXTEND / MIXED / TARGET_VERIFY / DRAFT_EXTEND_V2): "MHA-style".
  q: [T, H, N + R] (rope applied). The new tokens' K/V are decompressed with `expand_kv` and
  attended causally; the cached prefix of every request is read from the pool in chunks of at
  most `prefix_chunk_tokens` tokens per request, decompressed chunk by chunk and attended; the
  partial results are merged with their log-sum-exp. Returns [T, H * V].
- forward_decode (DECODE): the absorbed form. q: [B, H, C + R] = [q_nope W_UK, q_pe]; MQA over
  the latent cache with k = [latent, k_pe] and v = latent. Returns [B, H * C]; the model
  projects it through W_UV and o_proj.

The new tokens of an extend attend to their own in-batch entries (the values just written), and
the prefix is read from the cache, so the write and the read of one forward are decided in one
place. MLA never skips the cache (contract 2): the latent layout is what every later step reads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from attention.base import AttentionLayer
from attention.metadata import AttentionMetadata
from attention.mla_ops import merge_attn_states, ragged_attention_lse
from attention.paged import scale_output

if TYPE_CHECKING:
    from workers.forward_batch import ForwardBatch
    from workers.memory_pool import MLATokenToKVPool

logger = logging.getLogger(__name__)

# Prefix tokens per request decompressed at once during an extend: bounds the [tokens, H, N + R]
# buffers of a long cached prefix. Tests pass a small value to exercise several chunks.
DEFAULT_PREFIX_CHUNK_TOKENS = 4096

# latents [n, C + R] -> (k [n, H, N + R], v [n, H, V]) on this rank's heads.
ExpandKV = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class MLAAttentionLayer(AttentionLayer):
    """An MLA layer: head_dim = N + R (q/k of the MHA form), v_head_dim = V, num_kv_heads = 1
    (one latent per token), kv_lora_rank = C, qk_rope_head_dim = R; plus the model's
    decompression of cache entries (kv_b_proj), which the backend calls on every chunk it reads."""

    expand_kv: ExpandKV | None = field(default=None, compare=False, repr=False)


@dataclass
class PrefixChunk:
    """One chunk of the cached prefixes of an extend batch."""

    # [sum(kv_lens)] KV slots of the chunk's tokens, requests concatenated in batch order.
    slots: torch.Tensor
    # Tokens of each request in this chunk (0 once a request's prefix is used up).
    kv_lens: list[int]


@dataclass
class MHAChunkPlan:
    """How the cached prefixes of an extend are read: chunk j holds prefix tokens
    [j * chunk_tokens, (j + 1) * chunk_tokens) of every request (clipped to its prefix)."""

    chunk_tokens: int
    prefix_lens: list[int]  # on cpu: cached tokens before the new ones, per request
    chunks: list[PrefixChunk]


def plan_prefix_chunks(meta: AttentionMetadata, chunk_tokens: int) -> MHAChunkPlan:
    """The chunk plan of an extend batch from its metadata (prefix = cache - extend)."""
    prefix = [c - e for c, e in zip(meta.cache_seqlens_cpu, meta.extend_seq_lens_cpu)]
    longest = max(prefix, default=0)
    chunks = []
    for start in range(0, longest, chunk_tokens):
        lens = [max(0, min(chunk_tokens, p - start)) for p in prefix]
        slots = torch.cat([meta.token_table[i, start : start + n] for i, n in enumerate(lens)])
        chunks.append(PrefixChunk(slots.long(), lens))
    return MHAChunkPlan(chunk_tokens, prefix, chunks)


# The MLA attention math over the latent cache, which the FA backend's MLA mode
# (`attention.flash.FlashAttentionBackend(use_mla=True)`, the one backend serving MLA layers)
# runs: one implementation of the write and of every read.


def _pool(forward_batch: ForwardBatch) -> MLATokenToKVPool:
    pool = forward_batch.kv_pool
    assert pool is not None and pool.use_mla, "MLA layers need an MLATokenToKVPool"
    return pool  # type: ignore[return-value]


def _save(pool: MLATokenToKVPool, layer: AttentionLayer, forward_batch: ForwardBatch, k) -> None:
    entry = k[:, 0]
    c = layer.kv_lora_rank
    pool.set_mla_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, entry[:, :c], entry[:, c:])


def mla_extend(meta: AttentionMetadata | None, plan: MHAChunkPlan | None, q, k, layer, forward_batch,
               save_kv_cache: bool = True) -> torch.Tensor:
    """The MHA-style extend of an MLA layer (module docstring): write the new entries, attend
    the new tokens causally over their own decompressed K/V, then the cached prefix chunk by
    chunk, merging by log-sum-exp. Returns [T, H * V]."""
    assert meta is not None and plan is not None, "init_forward_metadata was not called"
    assert isinstance(layer, MLAAttentionLayer) and layer.expand_kv is not None
    assert q.shape[-1] == layer.head_dim, "extend takes the MHA-form query [T, H, N + R]"
    pool = _pool(forward_batch)
    if save_kv_cache:
        _save(pool, layer, forward_batch, k)
    lens = meta.extend_seq_lens_cpu
    # The new tokens over themselves (causal), from the in-batch entries just written, as a
    # read of the cache would return them (an FP8 cache rounds them: a token attends to the
    # same values whether its keys came in its own chunk or an earlier one).
    k_new, v_new = layer.expand_kv(pool.readback(k[:, 0], layer.layer_id))
    out, lse = ragged_attention_lse(q, k_new, v_new, lens, lens, layer.scaling, causal=True)
    # Then the cached prefix, chunk by chunk: every prefix token precedes every new token.
    cache, scale = pool.get_key_buffer(layer.layer_id), pool.k_scales[layer.layer_id]
    for chunk in plan.chunks:
        k_c, v_c = layer.expand_kv(scale_output(cache[chunk.slots, 0].to(q.dtype), scale))
        out_c, lse_c = ragged_attention_lse(q, k_c, v_c, lens, chunk.kv_lens, layer.scaling, causal=False)
        out, lse = merge_attn_states(out, lse, out_c, lse_c)
    return out.to(q.dtype).reshape(q.shape[0], -1)


def mla_decode(meta: AttentionMetadata | None, kernels, page_size: int, q, k, layer, forward_batch,
               save_kv_cache: bool = True) -> torch.Tensor:
    """The absorbed decode of an MLA layer: write the new entries, MQA over the latent cache
    (graph-safe: reads only the page table and lengths). Returns [B, H * C]."""
    assert meta is not None, "init_forward_metadata was not called"
    c = layer.kv_lora_rank
    assert q.shape[-1] == c + layer.qk_rope_head_dim, "decode takes the absorbed query [B, H, C + R]"
    pool = _pool(forward_batch)
    if save_kv_cache:
        _save(pool, layer, forward_batch, k)
    # An FP8 latent's scale: folded into the softmax scale (keys) and the output (values).
    scale = pool.k_scales[layer.layer_id]
    out = kernels.mla_decode(
        q, pool.get_key_buffer(layer.layer_id), meta.page_table, meta.cache_seqlens_int32, layer.scaling * scale,
        page_size, c,
    )
    return scale_output(out.to(q.dtype), scale).reshape(q.shape[0], -1)
