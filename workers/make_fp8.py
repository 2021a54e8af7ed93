"""`manta make-model --quantization fp8-block|fp8-channel|fp8-tensor`: a checkpoint rewritten in
the FP8 formats users download, so tests and benchmarks need no hub.

- fp8-block: DeepSeek-V3's layout — `quantization_config: {quant_method: "fp8", fmt: "e4m3",
  activation_scheme: "dynamic", weight_block_size: [bn, bk]}`, each quantized weight
  `float8_e4m3fn` with `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] float32.
- fp8-channel / fp8-tensor: llm-compressor's compressed-tensors "float-quantized" layout
  (FP8_DYNAMIC: per-channel weights, dynamic per-token activations; or per-tensor weights),
  `weight_scale` [N, 1] / [1] float32, `ignore: ["lm_head"]`.

Quantized: the 2-D `*_proj.weight` tensors of the decoder layers (attention, MLP, experts);
embeddings, norms, MoE router gates and the LM head stay as written. Shards are rewritten one
at a time.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from workers.layers.fp8 import quantize_blocks, quantize_rows

KINDS = ("fp8-block", "fp8-channel", "fp8-tensor")
_LINEAR = re.compile(r"^model\.layers\.\d+\..*_proj(_with_mqa)?\.weight$")


def quantization_config(kind: str, block: tuple[int, int] = (128, 128)) -> dict:
    if kind == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block)}
    strategy = {"fp8-channel": "channel", "fp8-tensor": "tensor"}[kind]
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                  "dynamic": True},
        }},
    }


def _quantize(name: str, w: torch.Tensor, kind: str, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    if kind == "fp8-block":
        q, s = quantize_blocks(w, *block)
        return {name: q, name + "_scale_inv": s}
    if kind == "fp8-channel":
        q, s = quantize_rows(w)
        return {name: q, name + "_scale": s}
    amax = w.abs().amax().to(torch.float32).clamp(min=1e-12)
    s = (amax / 448.0).reshape(1)
    return {name: (w.to(torch.float32) / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), name + "_scale": s}


def quantize_checkpoint(model_dir: str | Path, kind: str, block: tuple[int, int] = (128, 128)) -> None:
    """Rewrite `model_dir`'s safetensors in FP8 format `kind` (in place), and its config."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if kind not in KINDS:
        raise ValueError(f"quantization must be one of {KINDS}, not {kind!r}")
    out = Path(model_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (a benchmark shape's 16 GB: seconds on a GPU)
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    for path in sorted(out.glob("*.safetensors")):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if _LINEAR.match(name) and t.dim() == 2:
                    tensors.update({k: v.cpu() for k, v in _quantize(name, t.to(device), kind, block).items()})
                else:
                    tensors[name] = t
        save_file(tensors, str(path), metadata={"format": "pt"})
        if index is not None:
            for name in tensors:
                index["weight_map"][name] = path.name
    if index is not None:
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = quantization_config(kind, block)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def dequantize_checkpoint(src: str | Path, dst: str | Path, dtype: torch.dtype = torch.float32) -> None:
    """A plain copy of an FP8 checkpoint (weights dequantized, scales and quantization_config
    dropped): what transformers runs as the oracle of FP8 loading on a CPU."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    from workers.layers.fp8 import dequantize

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json"))
    cfg = json.loads((src / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    block = qc.get("weight_block_size")
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            for name in names:
                if name.endswith(("_scale", "_scale_inv", "input_scale")):
                    continue
                t = f.get_tensor(name)
                if t.dtype == torch.float8_e4m3fn:
                    s = f.get_tensor(name + ("_scale_inv" if block else "_scale")).to(torch.float32)
                    if block:
                        s, bk = s.repeat_interleave(block[0], dim=0)[: t.shape[0]], block[1]
                    else:
                        s, bk = s.reshape(-1, 1).expand(t.shape[0], 1), t.shape[1]
                    t = dequantize(t, s, bk)
                tensors[name] = t.to(dtype) if t.is_floating_point() else t
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
