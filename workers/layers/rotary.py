"""Rotary position embedding, rotate-half (GPT-NeoX) layout as in HF Llama.

Frequencies follow transformers' `modeling_rope_utils` for each scaling type we support
(default, linear, llama3, yarn), so logits match the HF implementation in float32. The HF
config is converted once (`RopeConfig.from_hf`), handling both transformers 5's
`rope_parameters` (rope_theta inside) and the older `rope_scaling` + `rope_theta` fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from workers.layers import fused
from workers.layers.one_row import RopeKV

if TYPE_CHECKING:
    from attention.base import KVStoreTarget

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    head_dim: int
    base: float = 10000.0
    rope_type: str = "default"
    factor: float | None = None
    # Context length the model was pretrained at (llama3, yarn).
    original_max_position: int | None = None
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # yarn
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, hf_config: Any, head_dim: int) -> RopeConfig:
        params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
        params = dict(params or {})
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported RoPE type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
        partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
        if partial not in (None, 1.0):
            raise NotImplementedError(f"partial rotary embeddings (factor {partial}) are not supported")
        base = params.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0
        max_pos = hf_config.max_position_embeddings
        original = (
            getattr(hf_config, "original_max_position_embeddings", None)
            or params.get("original_max_position_embeddings")
            or max_pos
        )
        factor = params.get("factor")
        if rope_type == "yarn" and factor is None:
            factor = max_pos / original
        if rope_type in ("linear", "llama3") and factor is None:
            raise ValueError(f"RoPE type {rope_type!r} needs a factor")
        return cls(
            head_dim=head_dim,
            base=float(base),
            rope_type=rope_type,
            factor=None if factor is None else float(factor),
            original_max_position=int(original),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            attention_factor=params.get("attention_factor"),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
        )


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def _llama3_inv_freq(cfg: RopeConfig) -> torch.Tensor:
    inv_freq = _base_inv_freq(cfg.base, cfg.head_dim)
    assert cfg.factor is not None and cfg.original_max_position is not None
    factor, old_len = cfg.factor, cfg.original_max_position
    low_wavelen = old_len / cfg.low_freq_factor
    high_wavelen = old_len / cfg.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by factor, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor - cfg.low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    assert cfg.factor is not None and cfg.original_max_position is not None
    dim, base, factor = cfg.head_dim, cfg.base, cfg.factor
    if cfg.attention_factor is not None:
        attention_factor = float(cfg.attention_factor)
    elif cfg.mscale and cfg.mscale_all_dim:
        attention_factor = _yarn_mscale(factor, cfg.mscale) / _yarn_mscale(factor, cfg.mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (
            dim * math.log(cfg.original_max_position / (num_rotations * 2 * math.pi)) / (2 * math.log(base))
        )

    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp

    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    inv_freq = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return inv_freq, attention_factor


def compute_inv_freq(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] float32, attention scaling of cos/sin), as transformers does."""
    if cfg.rope_type == "default":
        return _base_inv_freq(cfg.base, cfg.head_dim), 1.0
    if cfg.rope_type == "linear":
        assert cfg.factor is not None
        return _base_inv_freq(cfg.base, cfg.head_dim) / cfg.factor, 1.0
    if cfg.rope_type == "llama3":
        return _llama3_inv_freq(cfg), 1.0
    if cfg.rope_type == "yarn":
        return _yarn_inv_freq(cfg)
    raise ValueError(f"unsupported RoPE type {cfg.rope_type!r}")


class RotaryEmbedding(nn.Module):
    """cos/sin for positions [0, max_position), built once in float32 on `device`."""

    def __init__(self, cfg: RopeConfig, max_position: int, device: torch.device | str):
        super().__init__()
        self.cfg = cfg
        self.max_position = max_position
        inv_freq, scaling = compute_inv_freq(cfg)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # Half-width tables: both halves of a head use the same angles (rotate-half layout).
        self.register_buffer("cos_cache", (freqs.cos() * scaling).to(device), persistent=False)
        self.register_buffer("sin_cache", (freqs.sin() * scaling).to(device), persistent=False)

    def apply(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None,
        store: KVStoreTarget | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T]; q: [T, heads, head_dim]; k: [T, kv_heads, head_dim] -> rotated q, k.

        cos/sin are cast to q's dtype before use, as HF does. With `store` (the attention
        backend's `kv_store_target`), the rotated k and `v` are also written to the store's
        cache slots: on CUDA in one kernel with the rotation (`workers.layers.rope_store`, q
        and k rotated in place), elsewhere by the pool's own write."""
        if store is None:
            return fused.rope(positions, q, k, self.cos_cache, self.sin_cache)
        assert v is not None
        pool, layer = store.pool, store.layer_id
        k_cache, v_cache = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
        if q.is_cuda:
            from workers.layers import rope_store

            if rope_store.can_fuse(q, k, v, k_cache, v_cache, self.cos_cache):
                rope_store.rope_and_store_kv(positions, q, k, v, self.cos_cache, self.sin_cache, store.loc,
                                             k_cache, v_cache, *pool.scales(layer))
                pool.write_count += 1
                return q, k
        q, k = fused.rope(positions, q, k, self.cos_cache, self.sin_cache)
        pool.set_kv_buffer(layer, store.loc, k, v)
        return q, k

    def fused_qkv_target(self, positions: torch.Tensor, store: KVStoreTarget | None, num_q_heads: int,
                         num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> RopeKV | None:
        """What a one-row qkv product needs to rotate q, k and write k, v itself
        (`one_row.RopeKV`): one token on CUDA, caches of the activations' dtype and head size,
        a backend that lets the caller write (`store`). None: `apply` after the product."""
        if store is None or not positions.is_cuda or positions.numel() != 1:
            return None
        pool, layer = store.pool, store.layer_id
        k_cache, v_cache = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
        if not (k_cache.dtype == v_cache.dtype == dtype and k_cache.is_contiguous() and v_cache.is_contiguous()
                and k_cache.shape[1:] == v_cache.shape[1:] == (num_kv_heads, head_dim)
                and self.cos_cache.shape[-1] * 2 == head_dim and self.cos_cache.is_contiguous()
                and store.loc.numel() == 1):
            return None
        pool.write_count += 1
        return RopeKV(positions, store.loc, self.cos_cache, self.sin_cache, k_cache, v_cache, num_q_heads,
                      num_kv_heads, head_dim)
