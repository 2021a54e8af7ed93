"""Random weights in place of a checkpoint's (`--load-format dummy`): a model directory needs only
its config.json (and a tokenizer), as for vLLM's and SGLang's dummy load format. For benchmarks
and tests of the serving stack at a real model's shapes without writing or reading its weights
(an 8B model's 16 GB: ~50 s to write on the lent GPU machine, and again to read into each rank).

`DummyReader` stands in for `workers.loader.CheckpointReader`: the same tensor names and shapes
a checkpoint of that config has (`workers.make_model.tensor_specs_of`, on the class the config's
`architectures` names), so every model loads through its own `load_weights` (TP sharding, FP8
quantized at load) exactly as from files. Each tensor's values are computed whole on the load
device, element by element from an integer hash of the index and the tensor's name, with the
variance of `make_model`'s draw (norm weights 1 + 0.1 u, the rest initializer_range u, u uniform
with unit variance), then sliced: every rank, TP size, device and restart gets the same model,
so the KV store may share its pages like a checkpoint's (`DUMMY_WEIGHTS_ID`, the weights'
identity in the store's fingerprint).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

DUMMY_WEIGHTS_ID = "dummy-v2"  # what `kvstore.keys.weights_identity` would hash files for
BLOCK = 1 << 24  # elements drawn at once (the hash's int64 working set: 128 MiB)
MASK = 0xFFFFFFFF
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class DummyReader:
    def __init__(self, model_dir: str, device: torch.device | str):
        import transformers
        from transformers import AutoConfig

        from workers.make_model import tensor_specs_of

        self.model_dir = model_dir
        self.config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        if getattr(self.config, "quantization_config", None):
            raise ValueError(f"--load-format dummy: {model_dir!r} declares a quantized checkpoint format; dummy "
                             "weights are unquantized (use --quantization fp8 to quantize them at load)")
        archs = getattr(self.config, "architectures", None) or []
        model_cls = getattr(transformers, archs[0], None) if archs else None
        if model_cls is None:
            raise ValueError(f"--load-format dummy: {model_dir!r}'s config names no transformers model class")
        self.specs = tensor_specs_of(self.config, model_cls)
        dtype = getattr(self.config, "dtype", None) or getattr(self.config, "torch_dtype", None) or "float32"
        self.dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype))
        self.std = float(getattr(self.config, "initializer_range", 0.02))
        self.device = torch.device(device)

    def names(self) -> list[str]:
        return list(self.specs)

    def get_slice(self, name: str) -> DummySlice:
        if name not in self.specs:
            raise KeyError(f"tensor {name!r} is not in a checkpoint of {self.model_dir!r}'s config")
        return DummySlice(self, name)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.get_slice(name)[:]

    def refuse_quantized_tensors(self, fp8: bool = False) -> None:
        """(Nothing to refuse: every tensor is drawn in the config's float dtype.)"""

    def close(self) -> None:
        pass

    def value(self, name: str) -> torch.Tensor:
        """The whole tensor `name`, the same on any device and torch version: element i is a
        hash of (i, the name) spread uniformly with the variance of `make_model`'s draw."""
        shape = self.specs[name]
        out = torch.empty(shape, dtype=self.dtype, device=self.device)
        flat = out.view(-1)
        norm = len(shape) == 1 and "norm" in name and not name.endswith(".bias")  # as make_model's
        scale = (0.1 if norm else self.std) * 3 ** 0.5  # uniform on [-a, a): variance a^2 / 3
        key = zlib.crc32(name.encode())
        for start in range(0, flat.numel(), BLOCK):
            n = min(BLOCK, flat.numel() - start)
            u = _hashed_uniform(start, n, key, self.device) * scale
            flat[start : start + n] = u + 1.0 if norm else u
        return out


class DummySlice:
    """A `TensorSlice` (`workers.layers.linear`) of one dummy tensor."""

    def __init__(self, reader: DummyReader, name: str):
        self.reader, self.name = reader, name

    def get_shape(self) -> list[int]:
        return list(self.reader.specs[self.name])

    def get_dtype(self) -> str:
        return _SAFETENSORS_DTYPES.get(self.reader.dtype, "F32")

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.reader.value(self.name)[index]


def _hashed_uniform(start: int, n: int, key: int, device: torch.device) -> torch.Tensor:
    """Uniform on [-1, 1) for elements start .. start + n of a tensor keyed `key`: an integer hash
    of each index, offset by the key between two mixing passes, so two tensors are unrelated
    orderings rather than shifted copies (every product stays under 2^63, so the values are exact
    on every device; torch's generators are not: CUDA's spreads a draw over a grid the GPU's size
    decides)."""
    h = _mix(torch.arange(start, start + n, dtype=torch.int64, device=device) & MASK)
    h = _mix((h + _mix(torch.tensor(key, dtype=torch.int64)).item()) & MASK)
    return h.to(torch.float32) * (2.0 / 2**32) - 1.0


def _mix(h: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit mixer (two multiply-xorshift rounds) on int64 values under 2^32."""
    for _ in range(2):
        h = h ^ (h >> 16)
        h = (h * 0x45D9F3B) & MASK
    return h ^ (h >> 16)
