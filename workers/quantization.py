"""Which weights of a checkpoint are FP8, in which format: `QuantSpec`, read from config.json's
`quantization_config` or asked for with `--quantization fp8`.

Formats loaded (issue 25):
- **block** — DeepSeek-V3 style, `{"quant_method": "fp8", "weight_block_size": [bn, bk]}`: each
  linear weight is `float8_e4m3fn` with `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] float32
  (despite the name, the dequantized weight is `weight * weight_scale_inv`), activations
  quantized dynamically per token group of bk.
- **compressed-tensors** FP8 (llm-compressor), `{"quant_method": "compressed-tensors", "format":
  "float-quantized", "config_groups": {..: {"weights": {"type": "float", "num_bits": 8,
  "strategy": "tensor"|"channel"}, "input_activations": {.., "dynamic": true|false}}}}`:
  `weight_scale` per tensor ([] or [1]) or per channel ([N, 1]); static activations add an
  `input_scale` per layer.
- **dynamic** (`--quantization fp8` on a 16/32-bit checkpoint): every linear weight of the
  decoder layers (DeepSeek's routed experts included) is quantized when loaded, one scale per
  output channel.

Inside manta every format is one representation (`workers/layers/fp8.py`): the FP8 weight and a
float32 scale per output row and K block ([N, ceil(K/block_k)]; per tensor and per channel are
block_k = K). Activations: the GPU kernels multiply bf16 activations by the dequantized weight
tiles, or quantize them per token for the FP8 tensor cores (`workers/layers/fp8_gemm.py`); a
checkpoint's static `input_scale` is read and checked but not needed. Embeddings, the LM head,
norms and MoE router gates stay in the model dtype, as in the formats' own exporters.

Anything else (GPTQ, AWQ, int8, FP8 with other strategies, 4-bit) is refused at start with the
config named.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("fp8",)  # --quantization values
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass(frozen=True)
class QuantSpec:
    method: str  # "block" | "compressed-tensors" | "dynamic"
    block: tuple[int, int] | None = None  # block: (bn, bk)
    strategy: str = "channel"  # compressed-tensors weights: "tensor" | "channel"
    static_activations: bool = False
    ignore: tuple[str, ...] = ()  # module names (or "re:" patterns) left unquantized

    @property
    def quantize_at_load(self) -> bool:
        return self.method == "dynamic"

    @property
    def scale_name(self) -> str:
        """The checkpoint's name of a weight's scale tensor."""
        return "weight_scale_inv" if self.method == "block" else "weight_scale"

    def applies(self, module: str) -> bool:
        """Whether the linear layer named `module` (checkpoint name, e.g.
        `model.layers.0.mlp.down_proj`) is FP8. An ignore entry "re:PATTERN" matches from the
        start of the name (compressed-tensors' rule); a plain one is the module itself, a suffix
        of it at a module boundary ("down_proj", "mlp.gate") or a module containing it
        ("model.layers.0"), as transformers reads `modules_to_not_convert`."""
        for pat in self.ignore:
            if pat.startswith("re:"):
                if re.match(pat[3:], module):
                    return False
            elif module == pat or module.endswith("." + pat) or module.startswith(pat + "."):
                return False
        return True

    def describe(self) -> str:
        if self.method == "block":
            return f"fp8 block {self.block[0]}x{self.block[1]}"
        if self.method == "dynamic":
            return "fp8 (quantized at load, per channel)"
        act = "static" if self.static_activations else "dynamic"
        return f"fp8 compressed-tensors ({self.strategy} weights, {act} activations)"


def _as_dict(qc: Any) -> dict:
    return qc if isinstance(qc, dict) else getattr(qc, "to_dict", lambda: vars(qc))()


def _refuse(model_dir: str, qc: dict, why: str) -> ValueError:
    method = qc.get("quant_method") or qc.get("format") or "unknown"
    details = [f"{k} {qc[k]}" for k in ("weight_block_size", "bits", "format", "fmt") if qc.get(k) is not None]
    return ValueError(
        f"{model_dir!r} is a quantized checkpoint manta cannot load (quantization_config: quant_method "
        f"{method!r}{', ' + ', '.join(details) if details else ''}): {why}. Loaded: FP8 block-wise "
        "(quant_method 'fp8' with weight_block_size), compressed-tensors FP8 (float, 8 bits, tensor or "
        "channel weights), and --quantization fp8 on an unquantized checkpoint")


def quant_spec(hf_config: Any, model_dir: str, quantization: str | None = None) -> QuantSpec | None:
    """The checkpoint's FP8 format, or `--quantization` for an unquantized one; None: plain
    weights. Raises ValueError naming an unsupported config."""
    qc = getattr(hf_config, "quantization_config", None)
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization {quantization!r}: supported are {', '.join(QUANTIZATIONS)}")
    if not qc:
        return QuantSpec("dynamic", ignore=("lm_head",)) if quantization == "fp8" else None
    qc = _as_dict(qc)
    method = qc.get("quant_method")
    if method == "fp8":
        spec = _block_spec(qc, model_dir)
    elif method == "compressed-tensors":
        spec = _compressed_tensors_spec(qc, model_dir)
    else:
        raise _refuse(model_dir, qc, "this method is not supported")
    # --quantization fp8 on a checkpoint that is FP8 already: nothing more to do.
    return spec


def _block_spec(qc: dict, model_dir: str) -> QuantSpec:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _refuse(model_dir, qc, f"fmt {qc.get('fmt')!r} (only e4m3)")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse(model_dir, qc, f"activation_scheme {qc.get('activation_scheme')!r} (only dynamic)")
    block = qc.get("weight_block_size")
    if not block or len(block) != 2 or min(block) < 1:
        raise _refuse(model_dir, qc, "FP8 without weight_block_size (per-tensor 'fp8' checkpoints) is not supported")
    if block[1] < 16 or block[1] & (block[1] - 1):
        raise _refuse(model_dir, qc, f"weight_block_size K of {block[1]} (the kernels take powers of two >= 16)")
    ignore = tuple(qc.get("modules_to_not_convert") or ()) + ("lm_head",)
    return QuantSpec("block", block=(int(block[0]), int(block[1])), ignore=ignore)


def _compressed_tensors_spec(qc: dict, model_dir: str) -> QuantSpec:
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _refuse(model_dir, qc, f"compressed-tensors format {fmt!r} (only float-quantized FP8)")
    if qc.get("kv_cache_scheme"):
        logger.info("%s: kv_cache_scheme %s: its per-layer k/v scales are used with --kv-cache-dtype fp8_e4m3 "
                    "(else the KV cache stays in the model's dtype)", model_dir, qc["kv_cache_scheme"])
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise _refuse(model_dir, qc, f"{len(groups)} config groups (one is supported)")
    g = groups[0]
    w, a = g.get("weights") or {}, g.get("input_activations")
    targets = g.get("targets") or []
    if targets != ["Linear"]:
        raise _refuse(model_dir, qc, f"config group targets {targets} (only ['Linear'])")
    if w.get("type") != "float" or w.get("num_bits") != 8 or w.get("strategy") not in ("tensor", "channel") \
            or w.get("dynamic") or w.get("symmetric") is False:
        raise _refuse(model_dir, qc, f"weights {w} (only symmetric static 8-bit float, tensor or channel strategy)")
    static = False
    if a is not None:
        if a.get("type") != "float" or a.get("num_bits") != 8:
            raise _refuse(model_dir, qc, f"input_activations {a} (only 8-bit float)")
        static = not a.get("dynamic", False)
        if static and a.get("strategy") != "tensor":
            raise _refuse(model_dir, qc, f"static input_activations with strategy {a.get('strategy')!r} (only tensor)")
    return QuantSpec("compressed-tensors", strategy=w["strategy"], static_activations=static,
                     ignore=tuple(qc.get("ignore") or ()))
