"""Page bytes of a KV pool: which tensors one page of a rank is made of, and copies between
the pool and a [n, page_bytes] byte buffer (the client's staging buffer).

A page's bytes are laid out as its store keys (`keys.rank_keys`), each key all layers of the
page's P slots:

- MHA (`MHATokenToKVPool`): `[K | V]`, K as `[layers, P, kv_heads, head_dim]` of this rank's
  heads, V as `[layers, P, kv_heads, v_head_dim]`.
- MLA (`MLATokenToKVPool`): `[latent]` as `[layers, P, 1, kv_lora_rank + qk_rope_head_dim]`.

Pool page p holds slots [p * P, (p + 1) * P). Copies are exact (no dtype conversion); the pool
may live on a GPU, the buffer on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pool_layout(pool) -> str:
    """"mla" for an MLATokenToKVPool, "mha" for an MHATokenToKVPool."""
    return "mla" if pool.use_mla else "mha"


def pool_buffers(pool) -> list[list[torch.Tensor]]:
    """Per store key of a page, the per-layer tensors it is gathered from, [num_slots, ...]."""
    return [pool.kv_buffer] if pool.use_mla else [pool.k_buffer, pool.v_buffer]


def pool_key_bytes(pool) -> list[int]:
    """Bytes of each store key of one page of `pool` (MHA: K, V; MLA: the latent)."""
    return [len(bufs) * pool.page_size * bufs[0][0].numel() * bufs[0].element_size()
            for bufs in pool_buffers(pool)]


def pool_device(pool) -> torch.device:
    return pool_buffers(pool)[0][0].device


def pool_page_bytes(pool) -> int:
    """Bytes of one page of `pool` on this rank: the `page_bytes` a client needs."""
    return sum(pool_key_bytes(pool))


def _views(pool, stage: torch.Tensor) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
    """(per-layer buffers, view of stage [n, layers, P, ...]) per store key of a page.
    stage: [n, page_bytes] uint8 with page_bytes a multiple of 64 (any dtype views fit)."""
    n = stage.shape[0]
    out, off = [], 0
    for bufs, nbytes in zip(pool_buffers(pool), pool_key_bytes(pool)):
        view = stage[:, off : off + nbytes].view(pool.dtype)
        out.append((bufs, view.view(n, len(bufs), pool.page_size, *bufs[0].shape[1:])))
        off += nbytes
    return out


def _slot_index(pool, page_ids: Sequence[int]) -> torch.Tensor:
    P = pool.page_size
    pages = torch.as_tensor(list(page_ids), dtype=torch.long)
    idx = (pages[:, None] * P + torch.arange(P)).reshape(-1)
    device = pool_buffers(pool)[0][0].device
    if device.type == "cuda":  # pinned + non-blocking: a pageable copy would wait for the whole stream
        return idx.pin_memory().to(device, non_blocking=True)
    return idx


def gather_pages(pool, page_ids: Sequence[int], stage: torch.Tensor) -> None:
    """stage[i] = the bytes of pool page page_ids[i]. stage: [len(page_ids), page_bytes].
    With `stage` on the pool's GPU every copy is enqueued on the current stream (nothing waits)."""
    n, idx = len(page_ids), _slot_index(pool, page_ids)
    for bufs, view in _views(pool, stage):
        for layer, buf in enumerate(bufs):
            view[:, layer].copy_(buf[idx].view(n, pool.page_size, *buf.shape[1:]))


def scatter_pages(pool, page_ids: Sequence[int], stage: torch.Tensor) -> None:
    """Pool page page_ids[i] = the bytes in stage[i] (the inverse of gather_pages). With
    `stage` on the pool's GPU every copy is enqueued on the current stream (nothing waits)."""
    n, idx = len(page_ids), _slot_index(pool, page_ids)
    for bufs, view in _views(pool, stage):
        for layer, buf in enumerate(bufs):
            buf[idx] = view[:, layer].reshape(n * pool.page_size, *buf.shape[1:]).to(buf.device)
