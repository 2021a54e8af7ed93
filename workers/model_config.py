"""The model's shape, converted once from a Hugging Face `config.json` at the boundary.

`ModelConfig` is frozen: the worker, the model runner and the pools read it, nothing mutates it.
`hf_config` (the transformers config object) is kept only for model construction, where a
family reads its own extra fields (biases, norms, RoPE scaling).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from workers import kv_quant
from workers.parallel import divide, kv_head_placement
from workers.pooling import PoolingConfig, load_pooling_config
from workers.quantization import QuantSpec, quant_spec

logger = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {value}; use float32, bfloat16 or float16")
        return value
    key = value.lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {value!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def _first_attr(cfg: Any, *names: str) -> Any:
    """The first of `names` the HF config sets (families name the same quantity differently)."""
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    raise ValueError(f"config of {type(cfg).__name__} sets none of {names}")


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


@dataclass(frozen=True)
class ModelConfig:
    model_dir: str
    architecture: str  # config.architectures[0], the key of workers.models.registry
    # Attention layers with KV in the pool. Encoder-decoder: 2 per decoder layer (self- and
    # cross-attention); the encoder keeps no KV.
    num_layers: int
    hidden_size: int
    num_heads: int  # attention (query) heads, all ranks together
    num_kv_heads: int  # all ranks together
    head_dim: int
    vocab_size: int
    max_context_len: int  # max_position_embeddings (capped by sentence-transformers' max_seq_length)
    dtype: torch.dtype  # weights and activations (the engine passes float32 on CPU)
    use_mla: bool  # DeepSeek-style latent attention (config has kv_lora_rank)
    is_encoder_decoder: bool
    eos_token_ids: tuple[int, ...]  # config.json + generation_config.json, first seen first
    tie_word_embeddings: bool
    # The transformers config object; read only while building the model.
    hf_config: Any = field(repr=False, compare=False, default=None)
    # An embedding checkpoint (no LM head, e.g. BertModel, or a sentence-transformers
    # modules.json): it serves embeddings only, whatever the engine's is_embedding option says.
    is_embedding_model: bool = False
    # False for bidirectional encoders (BERT): every token attends to every other, so a prompt
    # is computed whole (no chunked prefill) and its K/V are never shared (no prefix cache).
    is_causal: bool = True
    # How hidden states become an embedding (workers.pooling); None: the decoder default.
    pooling: PoolingConfig | None = None
    # Hybrid models (Kimi-Linear, Bailing hybrid): the layers whose config layer type is
    # "linear_attention" keep per-request state (workers.state_pool) instead of KV.
    linear_attn_layers: tuple[int, ...] = ()
    # Embedding sizes a request's `dimensions` may ask for (Matryoshka truncation), from the
    # checkpoint's config.json: `matryoshka_dimensions` (those sizes) or `is_matryoshka: true`
    # (any size). None: the model was not trained for truncation, `dimensions` is refused.
    matryoshka_dimensions: tuple[int, ...] | None = None
    # FP8 weights (`workers/quantization.py`): the checkpoint's format, or --quantization fp8.
    quant: QuantSpec | None = None
    # --kv-cache-dtype: "auto" (the model's dtype) or "fp8_e4m3" (`workers/kv_quant.py`).
    kv_cache_dtype: str = "auto"

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's storage dtype."""
        return kv_quant.kv_dtype(self.kv_cache_dtype, self.dtype)

    def quant_for(self, *modules: str) -> QuantSpec | None:
        """The spec of the linear layer made of the checkpoint modules `modules` (one, or the
        parts a fused layer joins); None: unquantized."""
        if self.quant is None:
            return None
        applies = {self.quant.applies(m) for m in modules}
        if len(applies) > 1:
            raise ValueError(f"{', '.join(modules)}: a fused layer whose parts are not all quantized alike")
        return self.quant if applies.pop() else None

    @classmethod
    def from_pretrained(cls, model_dir: str, dtype: str | torch.dtype | None = None,
                        quantization: str | None = None, kv_cache_dtype: str | None = None) -> ModelConfig:
        """Read `model_dir/config.json` (local files only). Raises ValueError for an
        architecture no model class is registered for, or a quantization it cannot load."""
        from transformers import AutoConfig

        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            raise ValueError(f"{model_dir!r} has no config.json")
        hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        return cls.from_hf_config(hf_config, model_dir, dtype, quantization, kv_cache_dtype)

    @classmethod
    def from_hf_config(
        cls, hf_config: Any, model_dir: str, dtype: str | torch.dtype | None = None, quantization: str | None = None,
        kv_cache_dtype: str | None = None,
    ) -> ModelConfig:
        from workers.models.registry import supported_architectures

        archs = getattr(hf_config, "architectures", None) or []
        if not archs:
            raise ValueError(f"config in {model_dir!r} names no architecture")
        arch = archs[0]
        if arch not in supported_architectures():
            raise ValueError(
                f"unsupported architecture {arch!r} in {model_dir!r}; "
                f"supported: {', '.join(supported_architectures())}"
            )
        quant = quant_spec(hf_config, model_dir, quantization)
        kv_quant.kv_dtype(kv_cache_dtype, torch.float32)  # refuses an unknown --kv-cache-dtype here
        num_heads = int(_first_attr(hf_config, "num_attention_heads", "decoder_attention_heads", "n_head"))
        hidden = int(_first_attr(hf_config, "hidden_size", "d_model", "n_embd"))
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(hf_config, "head_dim", None) or hidden // num_heads

        if dtype is None:
            # transformers >= 4.56 reads config.json's torch_dtype into `dtype`.
            cfg_dtype = getattr(hf_config, "dtype", None)
            resolved = parse_dtype(cfg_dtype) if cfg_dtype is not None else torch.float32
        else:
            resolved = parse_dtype(dtype)

        eos = _as_ids(getattr(hf_config, "eos_token_id", None))
        gen_path = os.path.join(model_dir, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                eos += _as_ids(json.load(f).get("eos_token_id"))

        from workers.models.registry import is_encoder_architecture

        encoder = is_encoder_architecture(arch)
        pooling = load_pooling_config(model_dir, is_encoder=encoder)
        max_context = int(_first_attr(hf_config, "max_position_embeddings", "n_positions"))
        if pooling.max_seq_length is not None:
            max_context = min(max_context, pooling.max_seq_length)
        st_checkpoint = os.path.isfile(os.path.join(model_dir, "modules.json"))

        return cls(
            model_dir=model_dir,
            architecture=arch,
            num_layers=(2 * int(hf_config.decoder_layers) if getattr(hf_config, "is_encoder_decoder", False)
                        else int(_first_attr(hf_config, "num_hidden_layers", "decoder_layers", "n_layer"))),
            hidden_size=hidden,
            num_heads=num_heads,
            num_kv_heads=int(num_kv_heads),
            head_dim=int(head_dim),
            vocab_size=int(hf_config.vocab_size),
            max_context_len=max_context,
            dtype=resolved,
            use_mla=getattr(hf_config, "kv_lora_rank", None) is not None,
            is_encoder_decoder=bool(getattr(hf_config, "is_encoder_decoder", False)),
            eos_token_ids=tuple(dict.fromkeys(eos)),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            hf_config=hf_config,
            is_embedding_model=encoder or st_checkpoint,
            is_causal=not encoder,
            pooling=pooling,
            linear_attn_layers=tuple(
                i for i, t in enumerate(getattr(hf_config, "layer_types", None) or []) if t == "linear_attention"
            ),
            matryoshka_dimensions=_matryoshka(hf_config),
            quant=quant,
            kv_cache_dtype=kv_cache_dtype or "auto",
        )

    # ---- MLA (DeepSeek-V2/V3) head shapes; only meaningful when use_mla ----
    @property
    def kv_lora_rank(self) -> int:
        return int(self.hf_config.kv_lora_rank)

    @property
    def qk_rope_head_dim(self) -> int:
        return int(self.hf_config.qk_rope_head_dim)

    @property
    def qk_nope_head_dim(self) -> int:
        return int(self.hf_config.qk_nope_head_dim)

    @property
    def v_head_dim(self) -> int:
        return int(self.hf_config.v_head_dim)

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head of the MHA form: nope + rope."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def full_attn_layers(self) -> tuple[int, ...]:
        """Layers that keep KV in the KV pool: all of them, but a hybrid model's linear ones."""
        linear = set(self.linear_attn_layers)
        return tuple(i for i in range(self.num_layers) if i not in linear)

    def per_rank_heads(self, tp_size: int) -> int:
        """Query heads on each rank (tp must divide num_heads)."""
        return divide(self.num_heads, tp_size)

    def per_rank_kv_heads(self, tp_size: int) -> int:
        """KV heads each rank holds (the same on every rank): num_kv_heads / tp, or 1 when
        tp > num_kv_heads (each kv head replicated over tp / num_kv_heads ranks)."""
        return kv_head_placement(self.num_kv_heads, tp_size, 0)[1]


class ServingMode(NamedTuple):
    """The engine options a checkpoint forces. The engine (for its scheduler) and every rank
    (for the attention backend's skip decision) derive it from the same inputs, so both
    sides agree without a message."""

    is_embedding: bool  # embedding-only replica: generation requests are refused
    chunked_prefill_size: int  # -1: whole prompts
    disable_radix_cache: bool


def serving_mode(
    mc: ModelConfig, *, is_embedding: bool, chunked_prefill_size: int, disable_radix_cache: bool
) -> ServingMode:
    """An embedding checkpoint is an embedding replica. A bidirectional encoder computes each
    prompt whole (a chunk could not attend to later chunks) and never shares K/V (they depend
    on the whole prompt). An embedding replica whose pooling reads every token needs every
    token's state, so no prefix-cache hit may skip any: the prefix cache is off. A hybrid
    linear-attention model keeps per-request recurrent state that KV pages cannot restore:
    the prefix cache is off (workers.state_pool)."""
    embedding = is_embedding or mc.is_embedding_model
    if not mc.is_causal:
        return ServingMode(embedding, -1, True)
    if mc.is_encoder_decoder:
        # Decoder K/V depend on the encoder input, which a prefix-cache key (decoder tokens)
        # does not hold: no prefix cache (the scheduler never matches such requests either).
        disable_radix_cache = True
    if mc.linear_attn_layers:
        if not disable_radix_cache:
            logger.info("%s: prefix cache off: linear-attention layers keep per-request state that "
                        "cached KV pages cannot restore", mc.architecture)
        disable_radix_cache = True
    needs_all = mc.pooling is not None and mc.pooling.needs_all_tokens
    return ServingMode(embedding, chunked_prefill_size, disable_radix_cache or (embedding and needs_all))


def _matryoshka(hf_config: Any) -> tuple[int, ...] | None:
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return tuple(sorted(int(d) for d in dims))
    return () if getattr(hf_config, "is_matryoshka", False) else None
