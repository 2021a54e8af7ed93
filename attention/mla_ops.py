"""MLA attention kernels in plain torch (the CPU path, and the reference GPU kernels are tested
against).

Two ops serve the two forms of MLA attention (see `attention.mla` for who calls what):

- `mla_decode_absorbed`: the absorbed form. Queries live in latent space
  ([kv_lora_rank + qk_rope_head_dim] per head); every head attends over the one shared latent
  per token (MQA), k = [latent, k_pe] and v = latent. Returns the latent-space output.
- `ragged_attention_lse` + `merge_attn_states`: the MHA form of prefill. Attention of ragged
  queries over ragged keys that also returns the log-sum-exp of the scores, so partial results
  over disjoint key sets (the new tokens; each chunk of the cached prefix) merge exactly.

Causal convention (as in `attention.torch_ops`): request i's q_lens[i] queries are the *last*
q_lens[i] positions of its kv_lens[i] keys, so query r sees keys 0 .. kv_lens[i] - q_lens[i] + r.
All math runs in float32; outputs are float32 (callers cast once at the end).
"""

from __future__ import annotations

import torch


def mla_decode_absorbed(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    token_table: torch.Tensor,
    kv_lens: torch.Tensor,
    max_kv_len: int,
    kv_lora_rank: int,
    scaling: float,
) -> torch.Tensor:
    """One latent-space query per request over its cached latents, batched with a length mask.

    q: [B, H, kv_lora_rank + rope]; kv_cache: [slots, 1, kv_lora_rank + rope];
    token_table: [B, >= max_kv_len] slots; kv_lens: [B] (device, every entry >= 1)
    returns [B, H, kv_lora_rank] float32."""
    idx = token_table[:, :max_kv_len].long()
    kv = kv_cache[idx, 0].float()  # [B, L, lora + rope]
    scores = torch.einsum("bhd,bld->bhl", q.float(), kv) * scaling
    valid = torch.arange(max_kv_len, device=q.device)[None, :] < kv_lens[:, None]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhl,blc->bhc", probs, kv[..., :kv_lora_rank])


def ragged_attention_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_lens: list[int],
    kv_lens: list[int],
    scaling: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ragged queries over ragged keys, one request at a time.

    q: [sum(q_lens), H, D]; k: [sum(kv_lens), H, D]; v: [sum(kv_lens), H, Dv]
    returns (out [sum(q_lens), H, Dv] float32, lse [sum(q_lens), H] float32). A request with no
    keys gets out = 0 and lse = -inf, the identity of `merge_attn_states`."""
    num_heads = q.shape[1]
    out = torch.zeros(q.shape[0], num_heads, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[0], num_heads), float("-inf"), dtype=torch.float32, device=q.device)
    qs = ks = 0
    for ql, kl in zip(q_lens, kv_lens):
        if ql and kl:
            qi = q[qs : qs + ql].float()
            s = torch.einsum("qhd,khd->hqk", qi, k[ks : ks + kl].float()) * scaling
            if causal:
                q_pos = torch.arange(kl - ql, kl, device=q.device)[:, None]
                s = s.masked_fill(torch.arange(kl, device=q.device)[None, :] > q_pos, float("-inf"))
            lse_i = torch.logsumexp(s, dim=-1)  # [H, q]
            p = torch.exp(s - lse_i[..., None])
            out[qs : qs + ql] = torch.einsum("hqk,khd->qhd", p, v[ks : ks + kl].float())
            lse[qs : qs + ql] = lse_i.transpose(0, 1)
        qs += ql
        ks += kl
    return out, lse


def merge_attn_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets: softmax over the union equals the
    lse-weighted mix of the parts. out_*: [T, H, Dv], lse_*: [T, H] (float32; -inf = no keys).
    Returns (out, lse) of the union."""
    lse = torch.logaddexp(lse_a, lse_b)
    # Where both parts are empty lse is -inf; use 0 there so the weights are 0, not NaN.
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - safe)[..., None]
    w_b = torch.exp(lse_b - safe)[..., None]
    return out_a * w_a + out_b * w_b, lse
