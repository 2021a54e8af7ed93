"""The KDA linear-attention layer of Kimi-Linear and the Bailing hybrid, as transformers
defines them (`KimiLinearDeltaAttention`, `BailingHybridDeltaAttention`); the recurrence and
the short convolution over per-request state run in `attention.linear_attn`.

One layer, H heads of width d (D = H * d):
    q|k|v  = q_proj(x) | k_proj(x) | v_proj(x)            [T, 3D], before the short convolution
    g      = the forget gate (per head and key channel, log decay <= 0), float32:
             Kimi:     -exp(A_log) * softplus(f_b_proj(f_a_proj(x)) + dt_bias)
             Bailing:  kda_lower_bound * sigmoid(exp(A_log) * (f_proj(x) + dt_bias))  (safe gate)
                       or -exp(A_log) * softplus(f_proj(x) + dt_bias)
             (softplus(z) = z above 20, as transformers computes it)
    beta   = sigmoid(b_proj(x))                            [T, H]
    o      = KDA(conv(q|k|v), g, beta)                     the backend, [T, H, d]
    out    = o_proj(rmsnorm(o) * o_norm.weight * sigmoid(gate)), per head, in float32
             gate = g_b_proj(g_a_proj(x)) (Kimi) or g_proj(x) (Bailing)

Tensor parallelism: heads are split. q/k/v, f_b_proj / f_proj, g_b_proj / g_proj and b_proj
are column-parallel by heads, with the conv channels, dt_bias and A_log sliced to the same
heads; the low-rank down projections f_a_proj / g_a_proj are replicated; o_norm is per head
(replicated); o_proj is row-parallel (one all-reduce).

Checkpoint names (after the family's renames, see `workers.models.kimi_linear`) are
transformers': q_proj, k_proj, v_proj (fused here as qkv_proj), q_conv1d, k_conv1d, v_conv1d
([D, 1, K] each, fused here as conv_weight [3 * D / tp, K]), A_log, dt_bias, f_a_proj,
f_b_proj / f_proj, b_proj, g_a_proj, g_b_proj / g_proj, o_norm, o_proj.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from attention.linear_attn import LinearAttentionLayer
from workers.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    TensorSlice,
    check_shape,
    make_param,
)
from workers.parallel import TPGroup, divide, shard_range

if TYPE_CHECKING:
    from workers.forward_batch import ForwardBatch
    from workers.model_config import ModelConfig


@dataclass(frozen=True)
class KDAFamily:
    # "kimi": -exp(A) softplus(f_b(f_a(x)) + dt_bias); "safe": lower_bound * sigmoid(exp(A) (f(x)
    # + dt_bias)); "softplus": -exp(A) softplus(f(x) + dt_bias).
    forget_gate: str
    low_rank_gates: bool  # Kimi: f_a/f_b and g_a/g_b; Bailing: f_proj and g_proj
    lower_bound: float = -5.0
    gate_in_float32: bool = True  # Bailing casts the log decay to the activation dtype


def _softplus(z: torch.Tensor) -> torch.Tensor:
    return torch.where(z > 20.0, z, torch.log(1.0 + torch.exp(z)))


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm with a sigmoid output gate, all in float32 (weight included)."""

    def __init__(self, dim: int, eps: float, device):
        super().__init__()
        self.eps = eps
        self.weight = make_param((dim,), torch.float32, device)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: [..., dim] -> [..., dim] in x's dtype."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return (h * torch.sigmoid(gate.float())).to(x.dtype)


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: ModelConfig, family: KDAFamily, layer_id: int, tp: TPGroup, dtype, device):
        super().__init__()
        hf = config.hf_config
        if getattr(hf, "hidden_act", "silu") not in ("silu", "swish"):
            raise NotImplementedError(f"KDA short-convolution activation {hf.hidden_act!r} (only silu)")
        self.family = family
        self.total_heads = int(hf.linear_num_heads)
        self.head_dim = d = int(hf.linear_head_dim)
        self.kernel = int(hf.linear_conv_kernel_dim)
        self.heads = divide(self.total_heads, tp.size)
        self.dim = self.total_heads * d  # D, all ranks
        self.local = self.heads * d
        self.head_start = tp.rank * self.heads
        self.rows = shard_range(self.dim, tp.rank, tp.size)
        hidden = config.hidden_size
        self.qkv_proj = MergedColumnParallelLinear(hidden, [self.dim] * 3, False, tp, dtype, device)
        # Short-convolution weights and the gate's scalars stay float32 (transformers keeps
        # conv1d, dt_bias and A_log in float32 for the Bailing hybrid).
        self.conv_weight = make_param((3 * self.local, self.kernel), torch.float32, device, self._load_conv, (0, 1, 2))
        self.dt_bias = make_param((self.local,), torch.float32, device, self._load_dt_bias)
        self.A_log = make_param((self.heads,), torch.float32, device, self._load_a_log)
        self.b_proj = ColumnParallelLinear(hidden, self.total_heads, False, tp, dtype, device)
        if family.low_rank_gates:
            self.f_a_proj = ReplicatedLinear(hidden, d, False, dtype, device)
            self.f_b_proj = ColumnParallelLinear(d, self.dim, False, tp, dtype, device)
            self.g_a_proj = ReplicatedLinear(hidden, d, False, dtype, device)
            self.g_b_proj = ColumnParallelLinear(d, self.dim, False, tp, dtype, device)
        else:
            self.f_proj = ColumnParallelLinear(hidden, self.dim, False, tp, dtype, device)
            self.g_proj = ColumnParallelLinear(hidden, self.dim, False, tp, dtype, device)
        self.o_norm = GatedRMSNorm(d, float(hf.rms_norm_eps), device)
        self.o_proj = RowParallelLinear(self.dim, hidden, False, tp, dtype, device)
        self.attn = LinearAttentionLayer(
            layer_id=layer_id,
            num_heads=self.heads,
            num_kv_heads=self.heads,
            head_dim=d,
            scaling=d**-0.5,
            v_head_dim=d,
            conv_kernel=self.kernel,
            conv_weight=self._conv_weight,
        )

    # ---- loading ----
    def _load_conv(self, param: nn.Parameter, src: TensorSlice, shard_id: Any = None) -> None:
        i = int(shard_id)
        check_shape(f"conv1d part {i}", src, [self.dim, 1, self.kernel])
        start, end = self.rows
        with torch.no_grad():
            param.data[i * self.local : (i + 1) * self.local].copy_(src[start:end][:, 0].to(param.dtype))

    def _load_dt_bias(self, param: nn.Parameter, src: TensorSlice, shard_id: Any = None) -> None:
        check_shape("dt_bias", src, [self.dim])
        with torch.no_grad():
            param.data.copy_(src[self.rows[0] : self.rows[1]].to(param.dtype))

    def _load_a_log(self, param: nn.Parameter, src: TensorSlice, shard_id: Any = None) -> None:
        """Kimi stores A_log as [1, 1, H, 1], Bailing as [H]."""
        shape = list(src.get_shape())
        if [n for n in shape if n != 1] != [self.total_heads] and shape != [self.total_heads]:
            raise ValueError(f"A_log: checkpoint tensor has shape {shape}, expected {self.total_heads} heads")
        with torch.no_grad():
            flat = src[:].reshape(-1)
            param.data.copy_(flat[self.head_start : self.head_start + self.heads].to(param.dtype))

    def _conv_weight(self) -> torch.Tensor:
        return self.conv_weight

    # ---- forward ----
    def _forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> log decay [T, H, d]."""
        f = self.family
        t = x.shape[0]
        pre = self.f_b_proj(self.f_a_proj(x)) if f.low_rank_gates else self.f_proj(x)
        z = (pre.float() + self.dt_bias).view(t, self.heads, self.head_dim)
        rate = self.A_log.exp().view(self.heads, 1)
        if f.forget_gate == "safe":
            g = f.lower_bound * torch.sigmoid(rate * z)
        else:
            g = -rate * _softplus(z)
        return g if f.gate_in_float32 else g.to(x.dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        backend = fb.attn_backend
        assert backend is not None
        beta = torch.sigmoid(self.b_proj(x))
        out = backend.forward(self.qkv_proj(x), self._forget_gate(x), beta, self.attn, fb)
        gate = self.g_b_proj(self.g_a_proj(x)) if self.family.low_rank_gates else self.g_proj(x)
        out = self.o_norm(out.view(t, self.heads, self.head_dim), gate.view(t, self.heads, self.head_dim))
        return self.o_proj(out.reshape(t, self.local))


# Checkpoint name (after "self_attn.") -> (parameter name, shard id) where they differ.
_KDA_TARGETS = {
    "q_proj.weight": ("qkv_proj.weight", 0),
    "k_proj.weight": ("qkv_proj.weight", 1),
    "v_proj.weight": ("qkv_proj.weight", 2),
    "q_conv1d.weight": ("conv_weight", 0),
    "k_conv1d.weight": ("conv_weight", 1),
    "v_conv1d.weight": ("conv_weight", 2),
}


def kda_param_target(rest: str) -> tuple[str, Any]:
    """(parameter name under self_attn, shard id) of checkpoint tensor `self_attn.<rest>`."""
    return _KDA_TARGETS.get(rest, (rest, None))
