"""Linear attention (KDA, "Kimi Delta Attention") over a per-request state pool.

KDA is the linear-attention layer of Kimi-Linear and of the Bailing hybrid (Ling/Ring 3.x) as
transformers defines them. Per head, with key/value width d and a state S in R^{d x d}:

    x_t   = silu(short causal depthwise conv over the pre-conv q|k|v projections)
    q_t   = l2norm(q_t) * d^-1/2,  k_t = l2norm(k_t)      (l2norm(x) = x / sqrt(|x|^2 + 1e-6))
    S     = diag(exp(g_t)) S                          g_t in R^d: per-key-channel log decay <= 0
    S     = S + k_t (beta_t (v_t - S^T k_t))^T        the delta rule, beta_t in (0, 1)
    o_t   = S^T q_t

in float32. transformers runs a chunked (WY) form of the same recurrence for prefill and the
token-by-token form for decode; this backend runs the token-by-token form for every mode (equal
up to float rounding), batched over requests.

Who does what (as in `attention.mla`):
- The **model** owns every projection: q/k/v (pre-convolution), the forget gate g, beta, the
  output gate, the gated RMSNorm and o_proj, and the short-convolution weights (handed over as
  `LinearAttentionLayer.conv_weight`).
- The **backend** owns the state: the convolution state (the last conv_kernel - 1 inputs) and
  the recurrent state of every request, in `workers.state_pool.LinearStatePool` at row
  `req_pool_indices[i]`; the convolution over [state, new inputs], and the recurrence.

Arguments of the hooks for a linear layer (H = this rank's heads, T = new tokens):
- q: [T, 3 * H * d], the pre-convolution projections q | k | v of this rank's heads.
- k: [T, H, d], the log decay g (float32).
- v: [T, H], beta.
- layer.layer_id: the index among the model's linear layers (`HybridLinearAttnBackend` maps
  model layer ids to it), which indexes the state pool.
- save_kv_cache: write the updated states back (False computes the output from the states
  without advancing them).
Returns [T, H * d], the recurrence output before the output gate and norm.

Padding: requests of different lengths are laid out as [B, max_len]; a padded step has g = 0
and beta = 0, which leaves S exactly unchanged (S * 1 + k * 0), so no masking is needed.
Speculative modes (TARGET_VERIFY, DRAFT_EXTEND_V2) would need a rollback of the state past
rejected tokens: they are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from attention.base import AttentionBackend, AttentionLayer

if TYPE_CHECKING:
    from workers.forward_batch import ForwardBatch
    from workers.state_pool import LinearStatePool

L2NORM_EPS = 1e-6


@dataclass(frozen=True)
class LinearAttentionLayer(AttentionLayer):
    """A KDA layer: num_heads = num_kv_heads = this rank's heads, head_dim = key and value
    width, scaling = head_dim^-0.5 (applied to the normalised query); plus the short
    convolution: its kernel size and the model's weights of this rank's channels,
    `conv_weight() -> [3 * H * d, conv_kernel]` (q | k | v channels, as `q` is laid out)."""

    conv_kernel: int = 4
    conv_weight: Callable[[], torch.Tensor] | None = field(default=None, compare=False, repr=False)


@dataclass
class LinearAttnMetadata:
    """Where each new token sits in the padded [B, max_len] layout, built once per step."""

    rows: torch.Tensor  # [B] long: state slot (request row) of each request
    lens: list[int]  # on cpu: new tokens per request this step
    lens_t: torch.Tensor  # [B] long, same values
    max_len: int
    # [T] request and position of each token in the padded layout; None when no request is
    # padded (every request has max_len tokens: decode).
    batch_idx: torch.Tensor | None
    pos_idx: torch.Tensor | None

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [B, max_len, ...] (zeros where a request has fewer tokens)."""
        b = len(self.lens)
        if self.batch_idx is None:
            return x.reshape(b, self.max_len, *x.shape[1:])
        out = x.new_zeros(b, self.max_len, *x.shape[1:])
        out[self.batch_idx, self.pos_idx] = x
        return out

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """[B, max_len, ...] -> [T, ...]."""
        if self.batch_idx is None:
            return y.reshape(-1, *y.shape[2:])
        return y[self.batch_idx, self.pos_idx]


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def kda_recurrence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule with per-channel decay, step by step (all float32).

    q, k: [B, L, H, d] (normalised, q scaled); v: [B, L, H, d]; g: [B, L, H, d] log decay;
    beta: [B, L, H]; state: [B, H, d, d] (keys x values). Returns (o [B, L, H, d], state)."""
    decay = g.exp().unsqueeze(-1)  # [B, L, H, d, 1]
    s = state
    out = []
    for t in range(q.shape[1]):
        k_t = k[:, t]
        s = s * decay[:, t]
        u = (v[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, s)) * beta[:, t, :, None]
        s = s + k_t.unsqueeze(-1) * u.unsqueeze(-2)
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], s))
    return torch.stack(out, dim=1), s


class LinearAttentionBackend(AttentionBackend):
    """KDA over `LinearStatePool` (torch ops, any device)."""

    name = "kda"
    supports_mla = True  # indifferent: it owns no KV layout
    supports_mha = True
    supports_cuda_graph = False
    supports_encoder_decoder = False
    supported_page_sizes = None

    def __init__(self, state_pool: LinearStatePool):
        self.state_pool = state_pool
        self.metadata: LinearAttnMetadata | None = None
        self._graph_max_bs = 0

    # ---- metadata ----
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        mode = fb.forward_mode
        if mode.is_target_verify() or mode.is_draft_extend_v2():
            raise NotImplementedError(
                f"{mode.name} with linear-attention layers needs a rollback of their state past "
                "rejected draft tokens, which is not implemented"
            )
        bs = fb.batch_size
        if mode.is_decode():
            lens = [1] * bs
        else:
            assert fb.extend_seq_lens_cpu is not None
            lens = list(fb.extend_seq_lens_cpu)
        rows = fb.req_pool_indices.long()
        dev = rows.device
        longest = max(lens, default=0)
        batch_idx = pos_idx = None
        if any(n != longest for n in lens):
            host = torch.tensor([i for i, n in enumerate(lens) for _ in range(n)]
                                + [j for n in lens for j in range(n)], dtype=torch.long)
            batch_idx, pos_idx = host.to(dev).split(len(host) // 2)
        self.metadata = LinearAttnMetadata(
            rows=rows,
            lens=lens,
            lens_t=torch.tensor(lens, dtype=torch.long).to(dev),
            max_len=longest,
            batch_idx=batch_idx,
            pos_idx=pos_idx,
        )

    def init_mha_chunk_metadata(self, forward_batch: ForwardBatch) -> None:
        """Nothing to plan: a linear layer reads its prefix as one state, not in chunks."""

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, metadata_in_graph: bool = False) -> None:
        self._graph_max_bs = max_bs

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, num_tokens: int, forward_batch: ForwardBatch
    ) -> None:
        self.init_forward_metadata(forward_batch)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, forward_batch: ForwardBatch) -> None:
        self.init_forward_metadata(forward_batch)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    # ---- forward ----
    def _short_conv(self, x: torch.Tensor, layer: LinearAttentionLayer, conv_state: torch.Tensor,
                    meta: LinearAttnMetadata, save: bool) -> torch.Tensor:
        """silu(causal depthwise conv) of x [T, C] continuing each request's conv state
        [slots, C, K - 1]; writes the last K - 1 inputs back when `save`."""
        assert layer.conv_weight is not None
        weight = layer.conv_weight()  # [C, K]
        channels, kernel = weight.shape
        padded = meta.pad(x).transpose(1, 2)  # [B, C, L]
        seq = torch.cat((conv_state[meta.rows].to(padded.dtype), padded), dim=-1)  # [B, C, K-1+L]
        out = F.conv1d(seq.to(weight.dtype), weight.unsqueeze(1), groups=channels)  # [B, C, L]
        if save and kernel > 1:
            # Request i's last K - 1 inputs are columns lens[i] .. lens[i] + K - 2 of seq.
            cols = meta.lens_t[:, None] + torch.arange(kernel - 1, device=seq.device)
            conv_state[meta.rows] = seq.gather(2, cols[:, None, :].expand(-1, channels, -1)).to(conv_state.dtype)
        return meta.unpad(F.silu(out).to(x.dtype).transpose(1, 2))

    def _forward(self, q, k, v, layer, forward_batch, save_kv_cache):
        meta = self.metadata
        assert meta is not None, "init_forward_metadata was not called"
        assert isinstance(layer, LinearAttentionLayer)
        pool = self.state_pool
        idx = layer.layer_id
        heads, d = layer.num_heads, layer.head_dim
        t = q.shape[0]
        mixed = self._short_conv(q, layer, pool.conv[idx], meta, save_kv_cache)
        q_h, k_h, v_h = mixed.view(t, 3, heads, d).unbind(1)
        o, state = kda_recurrence(
            meta.pad(l2norm(q_h.float()) * layer.scaling),
            meta.pad(l2norm(k_h.float())),
            meta.pad(v_h.float()),
            meta.pad(k.float()),  # g: padded steps get 0 (no decay) ...
            meta.pad(v.float()),  # ... and beta 0 (no update): their state is unchanged
            pool.recurrent[idx][meta.rows],
        )
        if save_kv_cache:
            pool.recurrent[idx][meta.rows] = state
        return meta.unpad(o).to(q.dtype).reshape(t, heads * d)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)
