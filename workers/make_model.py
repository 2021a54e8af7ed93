"""Tiny (or full-shape) random Hugging Face checkpoints, built offline by `transformers` itself.

Every model family manta serves is tested against the `transformers` implementation on the same
checkpoint, so the checkpoints here are written the way `transformers` writes them: the config class
of the family, the model class built from it, `save_pretrained` for small models. Full-size shapes
(`preset="llama-3.1-8b"`) are built on the `meta` device and written tensor by tensor into
safetensors shards, with the names `save_pretrained` would use (it reverts transformers' in-memory
weight fusions, e.g. MoE experts, to the per-expert checkpoint layout).

Adding a family is one entry in `ARCHS`: the config class, the model class, the config keys that
are fixed for the family, and a function that maps the generic shape arguments (layers, hidden,
heads, ...) onto that config's field names.

The tokenizer is a byte-level BPE trained on a small built-in English corpus, with `<unk>`=0,
`<s>`=1 (prepended on encode), `</s>`=2, `<pad>`=3, `<|im_start|>`=4, `<|im_end|>`=5 and a ChatML
chat template.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

UNK, BOS, EOS, PAD, IM_START, IM_END = "<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD, IM_START, IM_END)  # ids 0..5, in this order
UNK_ID, BOS_ID, EOS_ID, PAD_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))

# Llama-3 style: the template emits bos itself, so render with `tokenize=True` (or encode the
# rendered text with add_special_tokens=False) to get exactly one bos.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Word lists of the templated part of the corpus, separated by "|".
_SUBJECTS = (
    "the cat|a small dog|my neighbour|the old teacher|our team|the engineer|a student|the river|"
    "this machine|the city council|every child|the weather|a quiet musician|the farmer|her brother|"
    "the server|the model|a tired traveller|the library|we|they|you|I|the company|the scientist|"
    "an artist|the captain|the baker"
).split("|")
_VERBS = (
    "walks to|looks at|writes about|builds|remembers|finds|carries|paints|reads|answers|opens|"
    "closes|follows|measures|repairs|explains|visits|watches|cooks|sells|buys|counts|draws|"
    "forgets|sends|learns about|talks about"
).split("|")
_OBJECTS = (
    "the garden|a red apple|the long letter|three books|the bridge|a new house|the mountain road|"
    "the morning news|an old map|the blue door|the market|a question|the kitchen table|"
    "the train station|the final report|a bright star|the broken window|the ocean|a cup of tea|"
    "the evening sky|the answer|a simple program|the summer holiday"
).split("|")
_TAILS = (
    "before breakfast|after the rain|with great care|every Sunday|in the afternoon|without a word|"
    "because it was late|at the end of the day|for the first time|again|near the park|"
    "on Monday morning|while singing|as quickly as possible|last year|in 2024|at 7:30 pm|"
    "twice a week|with two friends|during the storm"
).split("|")
_QUESTIONS = (
    "What is the capital of France?|How many days are there in a week?|Why is the sky blue?|"
    "Can you explain how a computer works?|Where did you put the keys?|Who wrote this story?|"
    "When does the next train leave?|Which way is the museum?|Is it going to rain tomorrow?|"
    "Could you tell me a short joke?|What time is it in Tokyo?|How do plants grow?"
).split("|")
_FIXED_LINES = [
    "Hello, world! This is a test.",
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, there was a little girl who lived in a village near the forest.",
    "It's a beautiful day, isn't it? Let's go outside and play.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 3.14 1,000,000 and 2e-5.",
    "Prices went up by 15% (from $20 to $23) in three months.",
    "Email me at someone@example.com or visit https://example.com/docs?page=2.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    '{"name": "manta", "version": 1, "ok": true}',
    "Café, naïve, résumé, façade, jalapeño, Zürich, São Paulo.",
    "Quotes “like these” and ‘these’ — with dashes – and ellipses…",
    "Tabs\tand  double  spaces, new lines\nand more lines.",
    "User: Hi there!\nAssistant: Hello! How can I help you today?",
    "Please summarise the following paragraph in one sentence.",
    "Translate to French: The house is small but very warm.",
    "Write a poem about the sea, the wind and the stars.",
    "Machine learning models predict the next token from the previous tokens.",
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Water boils at 100 degrees Celsius at sea level.",
    "A B C D E F G H I J K L M N O P Q R S T U V W X Y Z",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z",
    "!?.,;:'\"()[]{}<>/\\|@#$%^&*-_=+~`",
]


def builtin_corpus(lines: int = 600, seed: int = 1234) -> list[str]:
    """A deterministic English-ish corpus: fixed lines plus templated sentences and questions."""
    rng = random.Random(seed)
    out = list(_FIXED_LINES)
    for i in range(lines):
        kind = i % 4
        if kind == 3:
            out.append(rng.choice(_QUESTIONS))
            continue
        subj, verb, obj = rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)
        s = f"{subj[0].upper()}{subj[1:]} {verb} {obj} {rng.choice(_TAILS)}"
        if kind == 1:
            s += f", and then {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        out.append(s + rng.choice([".", ".", ".", "!", "?", "..."]))
    return out


def build_tokenizer(out_dir: str | Path, vocab_size: int) -> Any:
    """Train a byte-level BPE on `builtin_corpus()` and save it as a PreTrainedTokenizerFast.

    The trained vocab has at most `vocab_size` entries (special tokens included; a small corpus may
    stop short of it), so a model whose vocab_size >= `vocab_size` covers every token id.
    Returns the loaded transformers tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size {vocab_size} is below 256 bytes + {len(SPECIAL_TOKENS)} special tokens")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(builtin_corpus(), trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0",
        pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
        special_tokens=[(BOS, BOS_ID)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=[IM_START, IM_END],
        add_bos_token=True,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
        chat_template=CHAT_TEMPLATE,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    _make_tokenizer_files_portable(out)
    return fast


def _make_tokenizer_files_portable(out: Path) -> None:
    """Add what transformers 5 no longer writes but 4.x readers (and other engines) look for.

    transformers 5 saves `tokenizer_class: TokenizersBackend`, the chat template in a separate
    `chat_template.jinja`, `extra_special_tokens`, and no `add_bos_token` / special_tokens_map.json.
    We keep all of that and also write the 4.x spellings; transformers 5 loads either.
    """
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(
        tokenizer_class="PreTrainedTokenizerFast",
        add_bos_token=True,
        add_eos_token=False,
        chat_template=CHAT_TEMPLATE,
        additional_special_tokens=[IM_START, IM_END],
    )
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    special = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "additional_special_tokens": [IM_START, IM_END],
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


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
_GENERATION_EXTRAS: dict[str, dict[str, Any]] = {
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

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_SHARD_BYTES = 2 * 10**9  # as save_pretrained's max_shard_size="2GB"


def default_init_std(hidden: int) -> float:
    """Std of the random weights: 1.6/sqrt(hidden) (0.2 at hidden=64, 0.025 at 4096).

    Large enough that a tiny random model's greedy decoding wanders over many tokens (at the HF
    default of 0.02 the residual stream is the token embedding and greedy decoding falls into a
    2-3 token cycle), small enough that a full-size model stays finite in fp16/bf16.
    """
    return 1.6 / math.sqrt(hidden)


def build_config(
    arch: str,
    *,
    preset: str | Preset | None = None,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    vocab: int | None = None,
    max_position: int | None = None,
    rope_theta: float | None = None,
    rope_scaling: Mapping[str, Any] | None = None,
    tie_word_embeddings: bool = False,
    init_std: float | None = None,
    **overrides: Any,
) -> Any:
    """The transformers config of `arch` (or of `preset`), shape arguments overriding the preset's.

    `overrides` are config fields of the family, or the family's `ArchSpec.options`; anything else
    is an error. `rope_scaling` is the HF dict (`rope_type`, or legacy `type`, plus its parameters)
    and becomes the config's `rope_parameters` together with `rope_theta`.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; supported: {', '.join(ARCHS)}")
    spec = ARCHS[arch]
    p = PRESETS[preset] if isinstance(preset, str) else preset
    if p is None:
        p = Preset(arch=arch, shape=Shape())
    if p.arch != arch:
        raise ValueError(f"preset is for arch {p.arch!r}, not {arch!r}")
    given = dict(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate,
        vocab=vocab,
        max_position=max_position,
    )
    shape = Shape(**{**p.shape.__dict__, **{k: v for k, v in given.items() if v is not None}})
    if shape.hidden % shape.heads or shape.heads % shape.kv_heads:
        raise ValueError(f"bad head layout: {shape}")

    opts = {**spec.options, **p.options}
    for k in list(overrides):
        if k in spec.options:
            opts[k] = overrides.pop(k)
    config_cls, _ = spec.classes()
    known = set(config_cls().to_dict()) | set(getattr(config_cls, "attribute_map", {}))
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown {config_cls.__name__} fields for {arch}: {unknown}")

    theta = rope_theta if rope_theta is not None else (p.rope_theta if p.rope_theta is not None else 10000.0)
    scaling = dict(rope_scaling if rope_scaling is not None else (p.rope_scaling or {}))
    if "type" in scaling:
        scaling["rope_type"] = scaling.pop("type")
    rope = {"rope_type": scaling.pop("rope_type", "default"), **scaling, "rope_theta": float(theta)}

    std = init_std if init_std is not None else default_init_std(shape.hidden)
    kwargs = dict(
        spec.shape(shape, opts),
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters=rope,
        initializer_range=std,
    )
    kwargs.update(spec.defaults)
    kwargs.update(p.overrides)
    kwargs.update(overrides)
    return config_cls(**kwargs)


def _init_value(
    name: str,
    shape: tuple[int, ...],
    std: float,
    gen: torch.Generator,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Random value of one checkpoint tensor (on cpu), chosen by name; drawn on `gen.device`.

    Norm weights are 1 + N(0, 0.1) and biases N(0, std) rather than transformers' ones/zeros, so a
    loader that drops a norm weight or a bias fails the comparison with transformers.
    """
    t = out if out is not None else torch.empty(shape, dtype=dtype)
    # Fill in row blocks so a [128256, 4096] embedding never needs an fp32 copy of itself.
    rows = t.view(t.shape[0], -1) if t.dim() > 1 else t.view(1, -1)
    block = max(1, (1 << 24) // max(1, rows.shape[1]))
    # A LayerNorm's bias is a bias (N(0, std)): 1 + noise would add one shared vector to every
    # normalised state and drown what the input contributes.
    is_norm = len(shape) == 1 and "norm" in name and not name.endswith(".bias")
    s = 0.1 if is_norm else std
    for i in range(0, rows.shape[0], block):
        n = min(block, rows.shape[0] - i)
        chunk = torch.randn((n, rows.shape[1]), generator=gen, device=gen.device, dtype=torch.float32) * s
        if is_norm:
            chunk += 1.0
        rows[i : i + n].copy_(chunk)
    return t


def _reinit_(model: torch.nn.Module, std: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if t.data_ptr() in seen:  # tied weights: initialise once
                continue
            seen.add(t.data_ptr())
            _init_value(name, tuple(t.shape), std, gen, t.dtype, out=t.data)


def checkpoint_tensor_specs(config: Any, arch: str) -> dict[str, tuple[int, ...]]:
    """{name: shape} of every tensor `save_pretrained` would write for `config`, built on `meta`.

    Names are the checkpoint's (transformers reverts its in-memory fusions on save, e.g. MoE
    `experts.gate_up_proj` [E, 2I, H] is written as `experts.{e}.gate_proj.weight` / `up_proj`),
    tied weights appear once.
    """
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    _, model_cls = ARCHS[arch].classes()
    with torch.device("meta"):
        model = model_cls(config)
    sd = remove_tied_weights_from_state_dict(model.state_dict(), model)
    sd = revert_weight_conversion(model, sd)
    return {k: tuple(v.shape) for k, v in sorted(sd.items(), key=lambda kv: _natural_key(kv[0]))}


def _natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """`layers.2` before `layers.10`, so shards follow layer order."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in name.split("."))


def write_random_checkpoint(
    out_dir: str | Path,
    config: Any,
    arch: str,
    *,
    dtype: str = "bfloat16",
    seed: int = 0,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    init_device: str | None = None,
) -> list[Path]:
    """Write random weights for `config` as safetensors shards, one tensor at a time.

    At most one shard (<= max_shard_bytes, unless a single tensor is larger) is in memory. One
    shard is `model.safetensors`; several are `model-0000i-of-0000n.safetensors` plus
    `model.safetensors.index.json`, as `save_pretrained` names them. Returns the shard paths.
    Random numbers are drawn on `init_device` (default: cuda when available, ~10x faster than the
    ~100M values/s of one CPU core), so the same seed gives different weights on cpu and cuda.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tdtype = _DTYPES[dtype]
    elt = torch.empty((), dtype=tdtype).element_size()
    specs = checkpoint_tensor_specs(config, arch)
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in specs.items():
        nbytes = math.prod(shape) * elt
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    n = len(shards)
    files = (
        ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    device = init_device or ("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=device).manual_seed(seed)
    std = float(config.initializer_range)
    for fname, names in zip(files, shards):
        tensors = {k: _init_value(k, specs[k], std, gen, tdtype) for k in names}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        del tensors
    if n > 1:
        total = sum(math.prod(s) * elt for s in specs.values())
        index = {
            "metadata": {"total_size": total},
            "weight_map": {k: f for f, names in zip(files, shards) for k in names},
        }
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [out / f for f in files]


def _write_legacy_config(out: Path) -> None:
    """Rewrite config.json as transformers 4.x checkpoints on the Hub have it.

    transformers 5 writes `rope_parameters` (with `rope_theta` inside) and `dtype`; Hub checkpoints
    (Llama-3.1, DeepSeek-V2, ...) have top-level `rope_theta`, `rope_scaling` (or null) and
    `torch_dtype`. Both load in transformers 5; manta's config conversion must accept both.
    """
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    rope = dict(cfg.pop("rope_parameters", None) or {})
    cfg["rope_theta"] = rope.pop("rope_theta", 10000.0)
    cfg["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def make_model(
    out_dir: str | Path,
    arch: str,
    *,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    vocab: int | None = None,
    max_position: int | None = None,
    dtype: str = "float32",
    seed: int = 0,
    rope_theta: float | None = None,
    rope_scaling: Mapping[str, Any] | None = None,
    tie_word_embeddings: bool = False,
    preset: str | Preset | None = None,
    init_std: float | None = None,
    legacy_config: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    **overrides: Any,
) -> Path:
    """Write a random `arch` checkpoint (config, weights, generation config, tokenizer) to out_dir.

    Shape arguments left None take the preset's value, or the tiny default (2 layers, hidden 64,
    4 heads, 2 kv heads, intermediate 128, vocab 512, max_position 512). Without a preset the model
    is built by transformers (`torch.manual_seed(seed)`, then re-initialised, see `_init_value`)
    and saved with `save_pretrained`; with a preset it is built on `meta` and written shard by
    shard (`write_random_checkpoint`). The model vocab is max(vocab, tokenizer size).
    `legacy_config=True` writes config.json in the transformers 4.x layout (`_write_legacy_config`).
    """
    from transformers import GenerationConfig

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = build_config(
        arch,
        preset=preset,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate,
        vocab=vocab,
        max_position=max_position,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=tie_word_embeddings,
        init_std=init_std,
        **overrides,
    )
    tokenizer = build_tokenizer(out, config.vocab_size)
    config.vocab_size = max(config.vocab_size, len(tokenizer))
    _, model_cls = ARCHS[arch].classes()
    # Encoder-decoder families: the decoder start and forced tokens, where `generate` reads them
    # (the config's own decoder_start/forced_eos fields win when overridden).
    seq2seq = {k: getattr(config, k, v) for k, v in _GENERATION_EXTRAS.get(arch, {}).items()}
    gen_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=[EOS_ID, IM_END_ID], pad_token_id=PAD_ID,
                                  **seq2seq)

    if preset is None:
        torch.manual_seed(seed)
        model = model_cls(config)
        _reinit_(model, float(config.initializer_range), seed)
        model = model.to(_DTYPES[dtype]).eval()
        model.generation_config = gen_config
        model.save_pretrained(str(out), safe_serialization=True)
    else:
        write_random_checkpoint(out, config, arch, dtype=dtype, seed=seed, max_shard_bytes=max_shard_bytes)
        config.architectures = [model_cls.__name__]
        config.dtype = dtype
        config.save_pretrained(str(out))
        gen_config.save_pretrained(str(out))
    if legacy_config:
        _write_legacy_config(out)
    return out


# ---------------------------------------------------------------------------------------------
# CLI: `manta make-model DIR --arch A ...` (wired into cluster/cli.py)
# ---------------------------------------------------------------------------------------------


def add_make_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="output directory (created)")
    parser.add_argument(
        "--arch", choices=sorted(ARCHS), default=None, help="model family (default: the preset's)"
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="a real model's shape with random weights, written shard by shard",
    )
    for flag, help_ in [
        ("--layers", "decoder layers"),
        ("--hidden", "hidden size"),
        ("--heads", "attention heads"),
        ("--kv-heads", "key/value heads"),
        ("--intermediate", "MLP intermediate size"),
        ("--vocab", "vocab size"),
        ("--max-position", "max position embeddings"),
    ]:
        parser.add_argument(flag, type=int, default=None, help=f"{help_} (default: preset's or tiny)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rope-theta", type=float, default=None)
    parser.add_argument(
        "--rope-scaling",
        type=json.loads,
        default=None,
        help='JSON, e.g. \'{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}\'',
    )
    parser.add_argument("--tie-word-embeddings", action="store_true")
    parser.add_argument(
        "--moe",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="deepseek_*: routed experts after the first layer (default) or all dense",
    )
    parser.add_argument(
        "--legacy-config",
        action="store_true",
        help="config.json with rope_theta/rope_scaling/torch_dtype (transformers 4.x layout)",
    )
    parser.add_argument("--force", action="store_true", help="replace DIR if it exists")


def run_make_model(args: argparse.Namespace) -> Path:
    arch = args.arch or (PRESETS[args.preset].arch if args.preset else None)
    if arch is None:
        raise SystemExit("make-model: give --arch or --preset")
    out = Path(args.dir)
    if out.exists() and any(out.iterdir()):
        if not args.force:
            raise SystemExit(f"make-model: {out} exists and is not empty (use --force)")
        shutil.rmtree(out)
    extra = {"moe": args.moe} if args.moe is not None else {}
    path = make_model(
        out,
        arch,
        preset=args.preset,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=args.intermediate,
        vocab=args.vocab,
        max_position=args.max_position,
        dtype=args.dtype,
        seed=args.seed,
        rope_theta=args.rope_theta,
        rope_scaling=args.rope_scaling,
        tie_word_embeddings=args.tie_word_embeddings,
        legacy_config=args.legacy_config,
        **extra,
    )
    print(path)
    return path
