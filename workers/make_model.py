"""Tiny (or full-shape) random Hugging Face checkpoints, built offline by `transformers` itself.

Every model family manta serves is tested against the `transformers` implementation on the same
checkpoint, so the checkpoints here are written the way `transformers` writes them: the config class
of the family, the model class built from it, `save_pretrained` for small models. Full-size shapes
(`preset="llama-3.1-8b"`) are built on the `meta` device and written tensor by tensor into
safetensors shards, with the names `save_pretrained` would use (it reverts transformers' in-memory
weight fusions, e.g. MoE experts, to the per-expert checkpoint layout).

Adding a family is one entry in `workers.model_shapes.ARCHS`: the config class, the model class, the config keys that
are fixed for the family, and a function that maps the generic shape arguments (layers, hidden,
heads, ...) onto that config's field names.

The tokenizer (`workers.make_tokenizer`) is a byte-level BPE trained offline on a built-in
corpus, with fixed special-token ids and a ChatML chat template.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from workers.make_tokenizer import BOS_ID, EOS_ID, IM_END_ID, PAD_ID, build_tokenizer
from workers.model_shapes import ARCHS, GENERATION_EXTRAS, PRESETS, Preset, Shape

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
    _, model_cls = ARCHS[arch].classes()
    return tensor_specs_of(config, model_cls)


def tensor_specs_of(config: Any, model_cls: type) -> dict[str, tuple[int, ...]]:
    """`checkpoint_tensor_specs` for a transformers model class (e.g. the one a config's
    `architectures` names)."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

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
    quantization: str | None = None,
    weight_block_size: tuple[int, int] = (128, 128),
    weights: bool = True,
    **overrides: Any,
) -> Path:
    """Write a random `arch` checkpoint (config, weights, generation config, tokenizer) to out_dir.

    Shape arguments left None take the preset's value, or the tiny default (2 layers, hidden 64,
    4 heads, 2 kv heads, intermediate 128, vocab 512, max_position 512). Without a preset the model
    is built by transformers (`torch.manual_seed(seed)`, then re-initialised, see `_init_value`)
    and saved with `save_pretrained`; with a preset it is built on `meta` and written shard by
    shard (`write_random_checkpoint`). The model vocab is max(vocab, tokenizer size).
    `legacy_config=True` writes config.json in the transformers 4.x layout (`_write_legacy_config`).
    `quantization` ("fp8-block", "fp8-channel", "fp8-tensor") rewrites the weights in that FP8
    checkpoint format (`workers/make_fp8.py`; fp8-block in `weight_block_size` blocks).
    `weights=False` writes everything but the weights, for `--load-format dummy`
    (`workers/dummy_weights.py`).
    """
    from transformers import GenerationConfig

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if not weights and quantization is not None:
        raise ValueError("an FP8 checkpoint format is a format of its weights: it needs weights=True")
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
    seq2seq = {k: getattr(config, k, v) for k, v in GENERATION_EXTRAS.get(arch, {}).items()}
    gen_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=[EOS_ID, IM_END_ID], pad_token_id=PAD_ID,
                                  **seq2seq)

    if preset is None and weights:
        torch.manual_seed(seed)
        model = model_cls(config)
        _reinit_(model, float(config.initializer_range), seed)
        model = model.to(_DTYPES[dtype]).eval()
        model.generation_config = gen_config
        model.save_pretrained(str(out), safe_serialization=True)
    else:
        if weights:
            write_random_checkpoint(out, config, arch, dtype=dtype, seed=seed, max_shard_bytes=max_shard_bytes)
        config.architectures = [model_cls.__name__]
        config.dtype = dtype
        config.save_pretrained(str(out))
        gen_config.save_pretrained(str(out))
    if legacy_config:
        _write_legacy_config(out)
    if quantization is not None:
        from workers.make_fp8 import quantize_checkpoint

        quantize_checkpoint(out, quantization, tuple(weight_block_size))
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
    parser.add_argument("--quantization", choices=["fp8-block", "fp8-channel", "fp8-tensor"], default=None,
                        help="write the linear weights in an FP8 checkpoint format: DeepSeek-V3 block-wise "
                             "(128x128 blocks) or compressed-tensors per-channel / per-tensor")
    parser.add_argument("--no-weights", dest="weights", action="store_false",
                        help="config, tokenizer and generation config only: serve it with --load-format dummy")
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
        quantization=args.quantization,
        weights=args.weights,
        **extra,
    )
    print(path)
    return path
