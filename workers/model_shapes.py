"""The model families and real-model shapes `manta make-model` can write.

`ARCHS`: per family, the `transformers` config and model classes, the config keys fixed for the
family, and a function mapping the generic shape arguments (layers, hidden, heads, ...) onto the
config's field names. `PRESETS`: full-size shapes of real models (random weights), for the GPU
benchmarks. Adding a family is one entry in `ARCHS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from workers.make_tokenizer import BOS_ID, EOS_ID, PAD_ID

# ---------------------------------------------------------------------------------------------
# Architectures
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """Generic shape arguments, mapped onto each family's config field names by `ArchSpec.shape`."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    vocab: int = 512
    max_position: int = 512

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _decoder_shape(s: Shape, opts: Mapping[str, Any]) -> dict[str, Any]:
    return dict(
        num_hidden_layers=s.layers,
        hidden_size=s.hidden,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        intermediate_size=s.intermediate,
        vocab_size=s.vocab,
        max_position_embeddings=s.max_position,
    )


def _qwen3_shape(s: Shape, opts: Mapping[str, Any]) -> dict[str, Any]:
    # Qwen3Config.head_dim defaults to 128 whatever the hidden size: always set it.
    return {**_decoder_shape(s, opts), "head_dim": s.head_dim}


def _mla_shape(s: Shape, opts: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSeek MLA: heads are not grouped (kv_heads is ignored); head dims derive from hidden/heads.

    `moe=True`: 4 routed experts (top-2) + 1 shared expert in every layer after the first
    (first_k_dense_replace=1); `moe=False`: every layer is dense.
    """
    d = s.head_dim
    out = dict(
        _decoder_shape(s, opts),
        num_key_value_heads=s.heads,
        kv_lora_rank=max(16, s.hidden // 2),
        qk_nope_head_dim=d,
        qk_rope_head_dim=max(4, d // 2),
        v_head_dim=d,
    )
    if opts["moe"]:
        out.update(
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            first_k_dense_replace=min(1, s.layers - 1),
            moe_intermediate_size=max(8, s.intermediate // 4),
        )
    else:
        out.update(first_k_dense_replace=s.layers, n_routed_experts=4, num_experts_per_tok=2)
    return out


def _hybrid_shape(s: Shape, opts: Mapping[str, Any]) -> dict[str, Any]:
    """Hybrid linear/full attention: MLA dims as `_mla_shape`; layer i is MLA full attention
    when (i + 1) % full_every == 0, else KDA linear attention (heads of width hidden/heads);
    the first layer's MLP is dense, the others MoE (4 routed experts in 2 groups, top-2, plus
    1 shared expert)."""
    d = s.head_dim
    every = opts["full_every"]
    return dict(
        _decoder_shape(s, opts),
        num_key_value_heads=s.heads,
        kv_lora_rank=max(16, s.hidden // 2),
        qk_nope_head_dim=d,
        qk_rope_head_dim=max(4, d // 2),
        v_head_dim=d,
        layer_types=["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(s.layers)],
        mlp_layer_types=["dense" if i == 0 else "sparse" for i in range(s.layers)],
        num_local_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        moe_intermediate_size=max(8, s.intermediate // 4),
    )


def _kimi_linear_shape(s: Shape, opts: Mapping[str, Any]) -> dict[str, Any]:
    return {**_hybrid_shape(s, opts), "linear_num_heads": s.heads, "linear_head_dim": s.head_dim}


def _bailing_hybrid_shape(s: Shape, opts: Mapping[str, Any]) -> dict[str, Any]:
    # BailingHybridConfig: KDA heads = attention heads, of width head_dim (it then resets
    # head_dim to the rope dims).
    return {**_hybrid_shape(s, opts), "head_dim": s.head_dim}


def _seq2seq_shape(s: Shape, opts: Mapping[str, Any]) -> dict[str, Any]:
    """BART family: encoder and decoder of the same shape; MHA (kv_heads is ignored)."""
    return dict(
        d_model=s.hidden,
        encoder_layers=s.layers,
        decoder_layers=s.layers,
        encoder_attention_heads=s.heads,
        decoder_attention_heads=s.heads,
        encoder_ffn_dim=s.intermediate,
        decoder_ffn_dim=s.intermediate,
        vocab_size=s.vocab,
        max_position_embeddings=s.max_position,
    )


# BART conventions on the built-in tokenizer: the decoder starts from </s> and the last token
# allowed by max_new_tokens is forced to </s> (config fields of the family); `generate` also
# forces the first generated token to <s> (bart-large-cnn's forced_bos_token_id), which
# transformers 5 keeps in generation_config.json only. mBART forces a language code there and
# Marian nothing: their tiny checkpoints force no first token.
_SEQ2SEQ_CONFIG = {"decoder_start_token_id": EOS_ID, "forced_eos_token_id": EOS_ID}
GENERATION_EXTRAS: dict[str, dict[str, Any]] = {
    "bart": {**_SEQ2SEQ_CONFIG, "forced_bos_token_id": BOS_ID},
    "mbart": dict(_SEQ2SEQ_CONFIG),
    "marian": {**_SEQ2SEQ_CONFIG, "decoder_start_token_id": PAD_ID},
}


@dataclass(frozen=True)
class ArchSpec:
    """How to build one family.

    config_cls / model_cls: the transformers classes (names resolved lazily from `transformers`).
    shape: maps (Shape, arch options) to config kwargs.
    defaults: config kwargs fixed for this family (overridable by `make_model(**overrides)`).
    options: arch-specific `make_model` keywords that are not config fields (e.g. `moe`), with
      their defaults; `shape` reads them.
    An encoder (bert) or encoder-decoder (bart) entry names its own model class (BertModel,
    BartForConditionalGeneration) and a `shape` function for its config's field names.
    """

    config_cls: str
    model_cls: str
    shape: Callable[[Shape, Mapping[str, Any]], dict[str, Any]] = _decoder_shape
    defaults: Mapping[str, Any] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)

    def classes(self) -> tuple[type, type]:
        import transformers

        return getattr(transformers, self.config_cls), getattr(transformers, self.model_cls)


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec("LlamaConfig", "LlamaForCausalLM", defaults={"rms_norm_eps": 1e-5}),
    # Qwen2 has q/k/v bias (o_proj none) hard-wired in the model; the config has no switch for it.
    "qwen2": ArchSpec("Qwen2Config", "Qwen2ForCausalLM"),
    # Qwen3: per-head RMSNorm on q and k (q_norm/k_norm), no qkv bias, explicit head_dim.
    "qwen3": ArchSpec("Qwen3Config", "Qwen3ForCausalLM", shape=_qwen3_shape),
    # Mistral's config defaults sliding_window=4096 (v0.1); later Mistrals use None (full attention).
    "mistral": ArchSpec("MistralConfig", "MistralForCausalLM", defaults={"sliding_window": None}),
    # DeepSeek-V2-Lite style: no q LoRA, greedy top-k over softmax scores.
    "deepseek_v2": ArchSpec(
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        shape=_mla_shape,
        defaults={"q_lora_rank": None, "topk_method": "greedy", "n_group": 1, "topk_group": 1},
        options={"moe": True},
    ),
    # DeepSeek-V3 style: q LoRA, sigmoid scores + e_score_correction_bias, grouped top-k.
    "deepseek_v3": ArchSpec(
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        shape=_mla_shape,
        defaults={"q_lora_rank": 32, "n_group": 2, "topk_group": 1, "num_mtp_layers": 0},
        options={"moe": True},
    ),
    # Hybrid linear (KDA) / full (MLA) attention. Kimi-Linear: NoPE MLA, low-rank KDA gates.
    "kimi_linear": ArchSpec(
        "KimiLinearConfig", "KimiLinearForCausalLM", shape=_kimi_linear_shape, options={"full_every": 2}
    ),
    # Bailing hybrid (Ling 3): interleaved-RoPE MLA with a per-head output gate, bounded KDA gate.
    "bailing_hybrid": ArchSpec(
        "BailingHybridConfig",
        "BailingHybridForCausalLM",
        shape=_bailing_hybrid_shape,
        defaults={"num_mtp_layers": 0},
        options={"full_every": 2},
    ),
    # Encoder-decoder (served by workers/models/bart.py). BART: post-LN, learned positions
    # (offset 2), layernorm_embedding. mBART: pre-LN with final encoder/decoder layer norms,
    # scaled embeddings, no forced <s>. Marian: post-LN, sinusoidal positions (not saved),
    # scaled embeddings, no layernorm_embedding, decoder starts from <pad>.
    "bart": ArchSpec("BartConfig", "BartForConditionalGeneration", shape=_seq2seq_shape,
                     defaults=dict(_SEQ2SEQ_CONFIG)),
    "mbart": ArchSpec("MBartConfig", "MBartForConditionalGeneration", shape=_seq2seq_shape,
                      defaults={**_SEQ2SEQ_CONFIG, "scale_embedding": True}),
    "marian": ArchSpec("MarianConfig", "MarianMTModel", shape=_seq2seq_shape,
                       defaults={**_SEQ2SEQ_CONFIG, "scale_embedding": True, "decoder_start_token_id": PAD_ID,
                                 "share_encoder_decoder_embeddings": True}),
}


# ---------------------------------------------------------------------------------------------
# Presets: real model shapes with random weights
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    arch: str
    shape: Shape
    rope_theta: float | None = None
    rope_scaling: Mapping[str, Any] | None = None
    overrides: Mapping[str, Any] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)


PRESETS: dict[str, Preset] = {
    "llama-3.1-8b": Preset(
        arch="llama",
        shape=Shape(
            layers=32,
            hidden=4096,
            heads=32,
            kv_heads=8,
            intermediate=14336,
            vocab=128256,
            max_position=131072,
        ),
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        overrides={"rms_norm_eps": 1e-5},
    ),
    "deepseek-v2-lite": Preset(
        arch="deepseek_v2",
        shape=Shape(
            layers=27,
            hidden=2048,
            heads=16,
            kv_heads=16,
            intermediate=10944,
            vocab=102400,
            max_position=163840,
        ),
        rope_theta=10000.0,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        overrides=dict(
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            n_routed_experts=64,
            n_shared_experts=2,
            num_experts_per_tok=6,
            moe_intermediate_size=1408,
            first_k_dense_replace=1,
            topk_method="greedy",
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            rms_norm_eps=1e-6,
        ),
        options={"moe": True},
    ),
}
