"""The KV cache's storage format: the model's dtype, or FP8 (e4m3) with static scales per layer.

`--kv-cache-dtype fp8_e4m3` stores every K and V element as `x / scale` in float8_e4m3fn
(saturated at +-448), one byte instead of two: the pool holds twice the tokens in the same
memory and a decode step reads half the KV bytes.

Scales are static and per layer (one for K, one for V; MLA's latent cache uses K's): read from
the checkpoint where it has them (compressed-tensors' `kv_cache_scheme` writes
`model.layers.N.self_attn.k_scale` / `v_scale`; older exports name them `k_proj.output_scale` /
`v_proj.output_scale`), else 1.0 as vLLM and SGLang default. Static, not measured at run time:
the shared KV store and prefill/decode transfers hand pages between replicas, so every replica of
a checkpoint must write the same bytes for the same tokens, and a page written by one replica
must mean the same to all (the store's fingerprint names the KV dtype; the scales follow from
the checkpoint it already names).

Reads do not dequantize the cache: kernels load FP8 and widen it to the query's dtype, and the
scales fold into the math around them: q . (s_k k) = s_k (q . k), so K's scale multiplies the
softmax scale; sum_j p_j (s_v v_j) = s_v sum_j p_j v_j, so V's scale multiplies the output
(`attention.paged` and `attention.mla` do both). Writes quantize (`quantize`), in the pool's
write and in the fused RoPE + store kernel.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# --kv-cache-dtype values: "auto" keeps the model's dtype.
KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": FP8, "fp8": FP8}

# Any KV-cache scale tensor (no weight's: models skip them, the loader reads them).
KV_SCALE = re.compile(r"\.[kv]_scale$|\.[kv]_proj\.output_scale$")
# A checkpoint's KV-cache scales: layer index, and which of K or V. compressed-tensors:
# self_attn.k_scale; ModelOpt: self_attn.k_proj.k_scale or self_attn.attn.k_scale; older
# exports: self_attn.k_proj.output_scale.
_SCALE_NAME = re.compile(
    r"layers\.(\d+)\.self_attn\.(?:(?:attn\.|[kv]_proj\.)?([kv])_scale|([kv])_proj\.output_scale)$")


def kv_dtype(kv_cache_dtype: str | None, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's storage dtype for `--kv-cache-dtype`; ValueError naming the flag otherwise."""
    name = kv_cache_dtype or "auto"
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r}: supported are {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name] or model_dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x (any float dtype) -> FP8 values of x / scale, saturated (a cast alone turns values past
    the largest FP8 into NaN on some devices). Computed as x * (1 / scale) in float32, as the
    fused RoPE + store kernel computes it, so every write path stores the same bytes."""
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Stored FP8 -> `dtype` values (what every read of the cache computes with)."""
    y = x.to(dtype)
    return y if scale == 1.0 else y * scale


def roundtrip(x: torch.Tensor, scale: float) -> torch.Tensor:
    """The value a read of `x` gives back after a write to an FP8 cache, in x's dtype."""
    return dequantize(quantize(x, scale), scale, x.dtype)


def checkpoint_kv_scales(names: Iterable[str], read) -> dict[int, dict[str, float]]:
    """{model layer: {"k": scale, "v": scale}} from a checkpoint's KV-cache scale tensors
    (`read(name)` -> the tensor; one value each, per-tensor scales)."""
    scales: dict[int, dict[str, float]] = {}
    for name in names:
        m = _SCALE_NAME.search(name)
        if m is None:
            if KV_SCALE.search(name):  # a KV-cache scale in a layout not read: say so
                logger.warning("%s: a KV-cache scale this loader does not place; that layer keeps 1.0", name)
            continue
        t = read(name).float()
        if t.numel() != 1:
            raise ValueError(f"{name}: a KV-cache scale of {t.numel()} values (only per-tensor scales are supported)")
        value = float(t.reshape(()))
        if not value > 0 or value == float("inf"):
            raise ValueError(f"{name}: KV-cache scale {value} (must be positive and finite)")
        scales.setdefault(int(m.group(1)), {})[m.group(2) or m.group(3)] = value
    return scales


def scales_id(scales: dict[int, dict[str, float]]) -> str:
    """A short digest of a checkpoint's KV-cache scales: pages written under other scales are
    other bytes (the store's fingerprint includes it)."""
    text = ";".join(f"{i}:{s.get('k', 1.0)!r}:{s.get('v', 1.0)!r}" for i, s in sorted(scales.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def pool_scales(checkpoint: dict[int, dict[str, float]] | None, layers: tuple[int, ...],
                use_mla: bool) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(K scales, V scales) per pool layer (`layers`: the model layer of each pool layer). MLA:
    one latent per token, scaled by K's scale (as vLLM reads these checkpoints)."""
    checkpoint = checkpoint or {}
    k = tuple(checkpoint.get(i, {}).get("k", 1.0) for i in layers)
    v = k if use_mla else tuple(checkpoint.get(i, {}).get("v", 1.0) for i in layers)
    return k, v
