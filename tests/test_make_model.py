"""workers.make_model: tiny random checkpoints that transformers loads, and the preset shard writer."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tests.fixtures import tiny_model_dir
from workers.make_model import (
    ARCHS,
    BOS_ID,
    EOS_ID,
    IM_END_ID,
    PAD_ID,
    Preset,
    Shape,
    add_make_model_args,
    build_config,
    checkpoint_tensor_specs,
    make_model,
    run_make_model,
)

SMALL_ARCHS = ["llama", "qwen2", "qwen3", "mistral", "deepseek_v2", "deepseek_v3"]
TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, tabs\tand\nnew lines  ",
    "Unicode: café naïve Zürich — “quotes” … 日本語 😀",
    "x = f(a, b) ** 2 # comment; {'k': [1, 2]}",
]


def _saved_tensors(d) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                t = st.get_slice(k)
                out[k] = (tuple(t.get_shape()), {"F32": torch.float32, "BF16": torch.bfloat16}[t.get_dtype()])
    return out


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return AutoTokenizer.from_pretrained(tiny_model_dir(tmp_path_factory, "llama"))


def test_arch_table_covers_small_archs():
    assert set(SMALL_ARCHS) <= set(ARCHS)


@pytest.mark.parametrize("arch", SMALL_ARCHS)
def test_tiny_model_loads_and_generates(tmp_path_factory, arch):
    d = tiny_model_dir(tmp_path_factory, arch)
    model, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tok = AutoTokenizer.from_pretrained(d)
    cfg = model.config
    assert cfg.model_type == arch
    assert cfg.vocab_size >= len(tok) and cfg.vocab_size == 512
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    assert cfg.num_hidden_layers == 2 and cfg.hidden_size == 64
    assert model.generation_config.eos_token_id == [EOS_ID, IM_END_ID]

    attn = model.model.layers[0].self_attn
    if arch.startswith("deepseek"):
        assert cfg.num_key_value_heads == cfg.num_attention_heads == 4
        assert cfg.kv_lora_rank == 32 and cfg.qk_nope_head_dim == 16 and cfg.qk_rope_head_dim == 8
        assert cfg.v_head_dim == 16
        if arch == "deepseek_v2":
            assert cfg.q_lora_rank is None and hasattr(attn, "q_proj")
        else:
            assert cfg.q_lora_rank == 32 and hasattr(attn, "q_a_proj")
        names = _saved_tensors(d)
        # transformers fuses experts in memory but writes the per-expert checkpoint layout.
        assert "model.layers.1.mlp.experts.3.gate_proj.weight" in names
        assert "model.layers.1.mlp.experts.gate_up_proj" not in names
        assert "model.layers.0.mlp.gate_proj.weight" in names  # first_k_dense_replace=1
    else:
        assert cfg.num_key_value_heads == 2
        assert attn.k_proj.weight.shape == (2 * 16, 64)
        assert (attn.q_proj.bias is not None) == (arch == "qwen2")
        assert attn.o_proj.bias is None
        if arch == "qwen3":
            assert cfg.head_dim == 16 and attn.q_norm.weight.shape == (16,)
            # norm weights are random around 1, so a loader that skips them is caught
            assert not torch.allclose(attn.q_norm.weight, torch.ones(16))
        if arch == "qwen2":
            assert attn.q_proj.bias.abs().sum() > 0
        if arch == "mistral":
            assert cfg.sliding_window is None

    ids = tok("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    new = out[0, ids.shape[1] :].tolist()
    assert len(new) == 20 and len(set(new)) >= 3, new


def test_tokenizer_round_trip_and_bos(tok):
    for text in TEXTS:
        ids = tok(text).input_ids
        assert ids[0] == BOS_ID and BOS_ID not in ids[1:]
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok.decode(ids[1:]) == text
    assert len(tok("The quick brown fox").input_ids) > 3
    assert tok(TEXTS[0], add_special_tokens=False).input_ids[0] != BOS_ID
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (
        BOS_ID,
        EOS_ID,
        PAD_ID,
        0,
    )


def test_chat_template(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert (
        text
        == "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3
    assert ids.count(IM_END_ID) == 2
    assert tok.apply_chat_template(msgs, tokenize=False).endswith("Hi!<|im_end|>\n")


@pytest.mark.parametrize(
    "scaling",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
        {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    ],
)
@pytest.mark.parametrize("legacy", [False, True])
def test_rope_scaling_passes_through(tmp_path, scaling, legacy):
    d = make_model(tmp_path, "llama", rope_theta=50000.0, rope_scaling=scaling, legacy_config=legacy)
    raw = json.loads((d / "config.json").read_text())
    want = {k if k != "type" else "rope_type": v for k, v in scaling.items()}
    if legacy:
        assert "rope_parameters" not in raw and raw["rope_theta"] == 50000.0 and raw["rope_scaling"] == want
        assert raw["torch_dtype"] == "float32"
    else:
        assert raw["rope_parameters"] == {**want, "rope_theta": 50000.0}
    cfg = AutoConfig.from_pretrained(d)
    assert cfg.rope_parameters == {**want, "rope_theta": 50000.0}
    AutoModelForCausalLM.from_pretrained(d)  # rope init validates the parameters


def test_dtype_tie_and_overrides(tmp_path):
    d = make_model(
        tmp_path / "a",
        "qwen2",
        dtype="bfloat16",
        tie_word_embeddings=True,
        layers=1,
        heads=2,
        kv_heads=1,
        intermediate=96,
        rms_norm_eps=1e-5,
    )
    saved = _saved_tensors(d)
    assert "lm_head.weight" not in saved
    assert {dt for _, dt in saved.values()} == {torch.bfloat16}
    raw = json.loads((d / "config.json").read_text())
    assert raw["dtype"] == "bfloat16" and raw["tie_word_embeddings"] is True
    assert (raw["num_hidden_layers"], raw["num_attention_heads"], raw["num_key_value_heads"]) == (1, 2, 1)
    assert raw["intermediate_size"] == 96 and raw["rms_norm_eps"] == 1e-5
    m = AutoModelForCausalLM.from_pretrained(d)
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()


def test_dense_deepseek_and_bad_options(tmp_path):
    cfg = build_config("deepseek_v2", moe=False, layers=3)
    assert cfg.first_k_dense_replace == 3
    assert not any("experts" in k for k in checkpoint_tensor_specs(cfg, "deepseek_v2"))
    with pytest.raises(ValueError, match="unknown"):
        build_config("llama", no_such_field=1)
    with pytest.raises(ValueError, match="unknown arch"):
        build_config("gpt9")
    with pytest.raises(ValueError, match="preset is for arch"):
        build_config("qwen2", preset="llama-3.1-8b")


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_preset_writer_matches_save_pretrained(tmp_path, arch):
    """The shard writer of big presets, on a tiny fake preset: same names/shapes as save_pretrained."""
    preset = Preset(
        arch=arch,
        shape=Shape(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=600),
        rope_theta=500000.0,
    )
    d = make_model(tmp_path / "sharded", arch, preset=preset, dtype="bfloat16", max_shard_bytes=20_000)
    ref = make_model(
        tmp_path / "ref",
        arch,
        layers=2,
        hidden=64,
        heads=4,
        kv_heads=2,
        intermediate=128,
        vocab=600,
        rope_theta=500000.0,
        dtype="bfloat16",
    )
    got, want = _saved_tensors(d), _saved_tensors(ref)
    assert got == want
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(got) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(math.prod(s) * 2 for s, _ in got.values())
    raw, raw_ref = (json.loads((p / "config.json").read_text()) for p in (d, ref))
    assert raw == raw_ref
    model, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.dtype == torch.bfloat16
    assert torch.isfinite(model(torch.tensor([[1, 7, 9]])).logits).all()


def test_full_size_presets_on_meta():
    cfg = build_config("llama", preset="llama-3.1-8b")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        4096,
        32,
        32,
        8,
    )
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings) == (14336, 128256, 131072)
    assert cfg.rope_parameters["rope_type"] == "llama3" and cfg.rope_parameters["rope_theta"] == 500000.0
    specs = checkpoint_tensor_specs(cfg, "llama")
    assert sum(math.prod(s) for s in specs.values()) == 8_030_261_248
    assert specs["model.layers.31.self_attn.k_proj.weight"] == (1024, 4096)

    cfg = build_config("deepseek_v2", preset="deepseek-v2-lite", layers=3)
    specs = checkpoint_tensor_specs(cfg, "deepseek_v2")
    assert specs["model.layers.0.self_attn.q_proj.weight"] == (16 * 192, 2048)
    assert specs["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (512 + 64, 2048)
    assert specs["model.layers.2.mlp.experts.63.down_proj.weight"] == (2048, 1408)
    assert specs["model.layers.2.mlp.shared_experts.up_proj.weight"] == (2 * 1408, 2048)


def test_cli(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_make_model_args(parser)
    args = parser.parse_args(
        [
            str(tmp_path / "m"),
            "--arch",
            "qwen3",
            "--layers",
            "1",
            "--kv-heads",
            "4",
            "--seed",
            "3",
            "--tie-word-embeddings",
        ]
    )
    path = run_make_model(args)
    assert capsys.readouterr().out.strip() == str(path)
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.num_hidden_layers == 1 and cfg.num_key_value_heads == 4 and cfg.tie_word_embeddings
    with pytest.raises(SystemExit):
        run_make_model(args)  # exists, no --force


def test_fixture_cache_builds_once(tmp_path):
    a = tiny_model_dir(tmp_path, "llama", layers=1)
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert tiny_model_dir(tmp_path, "llama", layers=1) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    b = tiny_model_dir(tmp_path, "llama", layers=1, seed=1)
    assert b != a and (b / "config.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left behind
