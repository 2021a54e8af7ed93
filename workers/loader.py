"""Checkpoint reading and model loading for one rank.

`CheckpointReader` indexes every `*.safetensors` file of a model directory (through
`model.safetensors.index.json` when present) and hands out lazy slices, so each rank reads
only its own shard of a sharded parameter from disk. `load_model` builds the registered class
for the architecture, loads this rank's weights and refuses a model with any parameter (or any
part of a fused parameter) left unloaded.
"""

from __future__ import annotations

import glob
import json
import os
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from torch import nn

from workers import kv_quant
from workers.models.registry import ARCHITECTURES, get_model_class
from workers.parallel import TPGroup

if TYPE_CHECKING:
    from workers.model_config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
# safetensors' names of the dtypes a plain checkpoint stores: float weights, and the int64 /
# bool buffers some keep (BERT's `position_ids`, masks). Quantized weights are F8_*, I8, U8
# (packed 4-bit) or I32 (GPTQ/AWQ packed).
PLAIN_DTYPES = frozenset({"F32", "BF16", "F16", "F64", "I64", "BOOL"})


class CheckpointReader:
    """Lazy access to the tensors of a safetensors checkpoint. File handles are opened on first
    use and kept (safetensors memory-maps them) until `close()`."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self._file_of: dict[str, str] = {}
        self._handles: dict[str, Any] = {}
        index_path = os.path.join(model_dir, INDEX_FILE)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            for name, file in weight_map.items():
                self._file_of[name] = os.path.join(model_dir, file)
        else:
            for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
                for name in self._handle(path).keys():
                    if name in self._file_of:
                        raise ValueError(f"tensor {name!r} appears in two files of {model_dir!r}")
                    self._file_of[name] = path
        if not self._file_of:
            raise ValueError(f"no *.safetensors weights in {model_dir!r}")

    def _handle(self, path: str) -> Any:
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt", device="cpu")
        return self._handles[path]

    def _file(self, name: str) -> str:
        try:
            return self._file_of[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {self.model_dir!r}") from None

    def names(self) -> list[str]:
        return sorted(self._file_of)

    def get_slice(self, name: str) -> Any:
        """safetensors' lazy slice: `.get_shape()`, and `[a:b]` / `[:, a:b]` read only that
        part from disk."""
        return self._handle(self._file(name)).get_slice(name)

    def get_tensor(self, name: str) -> torch.Tensor:
        """The whole tensor (for replicated parameters and tests)."""
        return self._handle(self._file(name)).get_tensor(name)

    def refuse_quantized_tensors(self, fp8: bool = False) -> None:
        """Raise ValueError naming a tensor stored in a quantized type (FP8, int8, packed
        ints): copied into a float parameter without its scales it would load wrong weights
        silently. `fp8`: the config declares an FP8 format (`workers/quantization.py`), whose
        layers load F8_E4M3 weights with their scales. (Other formats a config declares are
        refused earlier, by ModelConfig.)"""
        allowed = PLAIN_DTYPES | {"F8_E4M3"} if fp8 else PLAIN_DTYPES
        for name in self.names():
            dtype = self.get_slice(name).get_dtype()
            if dtype not in allowed:
                raise ValueError(f"tensor {name!r} of {self.model_dir!r} is stored as {dtype}: a quantized "
                                 "checkpoint; manta loads unquantized float32, bfloat16 and float16 weights only")

    def close(self) -> None:
        self._handles.clear()


def expected_shards(model: nn.Module) -> set[tuple[str, Any]]:
    """(parameter name, shard id) pairs a complete load must produce (see workers.layers.linear)."""
    return {(name, sid) for name, p in model.named_parameters() for sid in p.shard_ids}


def check_quantization(model_config: ModelConfig) -> type:
    """The model class, after refusing FP8 weights for one that has no FP8 layers."""
    cls = get_model_class(model_config.architecture)
    if model_config.quant is not None and not getattr(cls, "supports_fp8", False):
        fp8_ones = sorted(a for a, c in ARCHITECTURES.items() if getattr(c, "supports_fp8", False))
        raise ValueError(f"{model_config.architecture} has no FP8 layers yet ({model_config.quant.describe()} in "
                         f"{model_config.model_dir!r}); FP8 loads for {', '.join(fp8_ones)}")
    return cls


def check_tp_split(model_config: ModelConfig, tp_size: int) -> None:
    """Refuse a TP size whose shards would cut the blocks of a block-wise FP8 checkpoint, before
    any rank starts: each rank's model is built on the meta device (no memory, no weights), where
    the layers run their own check (ValueError naming the layer and the column)."""
    quant = model_config.quant
    if tp_size <= 1 or quant is None or quant.method != "block":
        return
    cls = check_quantization(model_config)
    for rank in range(tp_size):
        cls(model_config, TPGroup(rank=rank, size=tp_size), "meta", torch.bfloat16)


def load_model(
    model_config: ModelConfig, tp: TPGroup, device: torch.device | str, dtype: torch.dtype,
    load_format: str = "auto",
) -> nn.Module:
    """Build the model class registered for `model_config.architecture`, load this rank's
    shard of the weights and return it in eval mode. Raises ValueError naming every parameter
    (or fused part) the checkpoint did not provide. `load_format` "dummy": random weights of
    the checkpoint's names and shapes instead of its files (`workers/dummy_weights.py`)."""
    cls = check_quantization(model_config)
    model = cls(model_config, tp, device, dtype)
    if load_format == "dummy":
        from workers.dummy_weights import DummyReader

        reader = DummyReader(model_config.model_dir, device)
    else:
        reader = CheckpointReader(model_config.model_dir)
    try:
        quant = model_config.quant
        reader.refuse_quantized_tensors(fp8=quant is not None and not quant.quantize_at_load)
        with torch.no_grad():
            loaded = model.load_weights(reader)
        # An FP8 KV cache's per-layer scales, where the checkpoint has them (workers/kv_quant.py).
        model.kv_cache_scales = (kv_quant.checkpoint_kv_scales(reader.names(), reader.get_tensor)
                                 if kv_quant.is_fp8(model_config.kv_dtype) else {})
    finally:
        reader.close()
    missing = expected_shards(model) - loaded
    if missing:
        shown = sorted(n if s is None else f"{n}[{s}]" for n, s in missing)
        raise ValueError(f"checkpoint {model_config.model_dir!r} is missing parameters: {', '.join(shown)}")
    return model.eval()
