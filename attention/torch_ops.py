"""Attention kernels in plain torch: the reference every fast kernel is tested against, and
the SDPA-based CPU kernels the FlashAttention backend uses when no GPU kernel applies.

Common semantics (paged): request i has q_lens[i] new queries and kv_lens[i] cached keys
(its slots are token_table[i, :kv_lens[i]]); its queries are the *last* q_lens[i] positions of
its sequence, so under a causal mask query r sees keys 0 .. kv_lens[i] - q_lens[i] + r.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[L, Hkv, D] -> [L, H, D] for GQA/MQA."""
    group = num_heads // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    token_table: torch.Tensor,
    q_lens: list[int],
    kv_lens: list[int],
    scaling: float,
    causal: bool = True,
    logit_cap: float = 0.0,
) -> torch.Tensor:
    """Naive float32 attention, one request at a time.

    q: [sum(q_lens), H, D]; k_cache: [slots, Hkv, D]; v_cache: [slots, Hkv, Dv]
    returns [sum(q_lens), H, Dv] in q's dtype."""
    num_heads = q.shape[1]
    out = q.new_empty(q.shape[0], num_heads, v_cache.shape[-1])
    start = 0
    for i, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        qi = q[start : start + ql].float()
        idx = token_table[i, :kl].long()
        k = _expand_kv(k_cache[idx].float(), num_heads)
        v = _expand_kv(v_cache[idx].float(), num_heads)
        s = torch.einsum("qhd,khd->hqk", qi, k) * scaling
        if logit_cap > 0:
            s = logit_cap * torch.tanh(s / logit_cap)
        if causal:
            q_pos = torch.arange(kl - ql, kl, device=q.device)[:, None]
            k_pos = torch.arange(kl, device=q.device)[None, :]
            s = s.masked_fill(k_pos > q_pos, float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[start : start + ql] = torch.einsum("hqk,khd->qhd", p, v).to(q.dtype)
        start += ql
    return out


def paged_extend_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    token_table: torch.Tensor,
    q_lens: list[int],
    kv_lens: list[int],
    scaling: float,
    causal: bool = True,
) -> torch.Tensor:
    """Ragged prefill through torch SDPA, one call per request (CPU fast path)."""
    num_heads = q.shape[1]
    out = q.new_empty(q.shape[0], num_heads, v_cache.shape[-1])
    start = 0
    for i, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        idx = token_table[i, :kl].long()
        qi = q[start : start + ql].transpose(0, 1).unsqueeze(0)
        k = k_cache[idx].transpose(0, 1).unsqueeze(0).to(q.dtype)
        v = v_cache[idx].transpose(0, 1).unsqueeze(0).to(q.dtype)
        mask = None
        if causal and ql > 1:
            q_pos = torch.arange(kl - ql, kl, device=q.device)[:, None]
            mask = torch.arange(kl, device=q.device)[None, :] <= q_pos
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
        out[start : start + ql] = o[0].transpose(0, 1)
        start += ql
    return out


def paged_decode_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    token_table: torch.Tensor,
    kv_lens: torch.Tensor,
    max_kv_len: int,
    scaling: float,
) -> torch.Tensor:
    """One query per request over its cache, batched with a length mask.

    q: [B, H, D]; kv_lens: [B] (device); returns [B, H, Dv]."""
    idx = token_table[:, :max_kv_len].long()
    k = k_cache[idx].permute(0, 2, 1, 3).to(q.dtype)  # [B, Hkv, L, D]
    v = v_cache[idx].permute(0, 2, 1, 3).to(q.dtype)
    mask = torch.arange(max_kv_len, device=q.device)[None, :] < kv_lens[:, None]
    # Columns past a request's length hold whatever those slots hold (another request's
    # values, or anything): the mask gives them probability 0, but NaN survives both the
    # additive mask and 0 * NaN, so zero K and V there.
    hidden = ~mask[:, None, :, None]
    k, v = k.masked_fill(hidden, 0), v.masked_fill(hidden, 0)
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scaling, enable_gqa=True
    )
    return o.squeeze(2)


def ragged_self_table(cu_seqlens: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """A token table that points each request at its own rows of a ragged [T, ...] tensor, so
    the paged kernels above also attend over raw (uncached) K/V."""
    width = max(lens) if lens else 1
    cols = torch.arange(width, device=cu_seqlens.device)
    return cu_seqlens[:-1, None].long() + cols[None, :]


def ragged_attention_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lens: list[int],
    scaling: float,
    causal: bool,
    max_score_elems: int = 1 << 25,
) -> torch.Tensor:
    """Each request's tokens attend over their own raw K/V (no cache, no prefix): the embedding
    fast path. Requests are sorted by length and padded in groups whose score matrix stays
    under `max_score_elems` elements, one SDPA call per group (a loop per request costs more
    in gathers and calls than the padding wastes).

    q: [T, H, D]; k: [T, Hkv, D]; v: [T, Hkv, Dv]; lens: tokens per request (sum T);
    returns [T, H, Dv]."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    order = sorted(range(len(lens)), key=lambda i: lens[i])
    dev, heads = q.device, q.shape[1]
    i = 0
    while i < len(order):
        j = i + 1  # a group holds at least one request
        while j < len(order) and (j - i + 1) * heads * lens[order[j]] ** 2 <= max_score_elems:
            j += 1
        group = order[i:j]
        longest = lens[group[-1]]
        pos = torch.arange(longest, device=dev)
        glens = torch.tensor([lens[g] for g in group], device=dev)
        valid = pos[None, :] < glens[:, None]  # [G, L]
        rows = torch.tensor([starts[g] for g in group], device=dev)[:, None] + pos[None, :]
        rows = torch.where(valid, rows, torch.zeros_like(rows))  # padding reads row 0, masked out
        qg, kg, vg = (x[rows].transpose(1, 2) for x in (q, k, v))  # [G, heads, L, D]
        mask = valid[:, None, None, :]
        if causal:
            mask = mask & (pos[None, :] <= pos[:, None])[None, None]
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scaling, enable_gqa=True)
        out[rows[valid]] = o.transpose(1, 2)[valid]
        i = j
    return out
