"""FP8 checkpoints (issue 25) on the CPU: block-wise (DeepSeek-V3 layout), compressed-tensors
per-channel and per-tensor, and `--quantization fp8` at load, for a Llama-family model.

Oracle: transformers loading the same checkpoint. On a CPU it cannot run FP8 products, so its
readers of the formats (block FP8, and compressed-tensors through that package) dequantize the
weights as they load (`hf_fp8`): the logits tests compare manta with that model, and
`test_transformers_reads_each_format_as_the_dequantized_copy` checks that it has, bit for bit,
the weights of the dequantized copy (`workers.make_fp8.dequantize_checkpoint`), which the
greedy tests hand `hf_greedy` (it loads a plain checkpoint by path). manta's CPU product
computes the same: logits within 1e-4 in float32 and identical greedy tokens. The GPU kernels are checked against the same
dequantized reference in tests/test_fp8_gemm.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from tests.fixtures import gloo_rank
from tests.test_engine import PROMPTS, greedy, hf_greedy
from tests.test_llama_model import ATOL, _copy_with_config, _free_port, _hf_model, _prompts, run_prefill
from workers.layers import fp8
from workers.layers.fp8 import dequantize
from workers.loader import load_model
from workers.make_fp8 import dequantize_checkpoint, quantize_checkpoint
from workers.make_model import make_model
from workers.model_config import ModelConfig
from workers.parallel import TPGroup

KINDS = ("fp8-block", "fp8-channel", "fp8-tensor")
SHAPE = dict(hidden=128, heads=4, kv_heads=2, intermediate=192, layers=2, vocab=513, max_position=64)
BLOCK = (32, 32)  # DeepSeek-V3 uses 128 x 128; the tiny shapes need smaller blocks to have several


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """kind -> (FP8 checkpoint, its dequantized copy); "dynamic" -> (the plain checkpoint, the
    copy quantized per channel as `--quantization fp8` does at load, dequantized)."""
    root = tmp_path_factory.mktemp("fp8")
    plain = make_model(root / "plain", "llama", dtype="float32", **SHAPE)
    out = {}
    for kind in KINDS:
        d = root / kind
        shutil.copytree(plain, d)
        quantize_checkpoint(d, kind, BLOCK)
        dequantize_checkpoint(d, root / f"{kind}-deq")
        out[kind] = (str(d), str(root / f"{kind}-deq"))
    out["dynamic"] = (str(plain), out["fp8-channel"][1])
    return out


def _load(path: str, quantization: str | None = None, tp: TPGroup | None = None):
    cfg = ModelConfig.from_pretrained(path, "float32", quantization=quantization)
    return cfg, load_model(cfg, tp or TPGroup(), "cpu", torch.float32)


def hf_fp8(path: str, **kwargs):
    """transformers' own model of an FP8 checkpoint on the CPU: its reader of the checkpoint's
    format, dequantizing the weights to float32 as they load."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config

    qc = json.loads((Path(path) / "config.json").read_text())["quantization_config"]
    dequant = (CompressedTensorsConfig(dequantize=True) if qc["quant_method"] == "compressed-tensors"
               else FineGrainedFP8Config(dequantize=True, weight_block_size=tuple(qc["weight_block_size"])))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=dequant,
                                                **kwargs).eval()


def assert_same_weights(fp8_path: str, dequantized_path: str) -> None:
    from transformers import AutoModelForCausalLM

    got = dict(hf_fp8(fp8_path).named_parameters())
    want = dict(AutoModelForCausalLM.from_pretrained(dequantized_path, dtype=torch.float32).named_parameters())
    assert sorted(got) == sorted(want)
    for name, p in want.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], p), name


@pytest.mark.parametrize("kind", KINDS)
def test_transformers_reads_each_format_as_the_dequantized_copy(ckpts, kind):
    assert_same_weights(*ckpts[kind])


@pytest.mark.parametrize("kind", KINDS + ("dynamic",))
def test_logits_match_transformers_on_the_same_checkpoint(ckpts, kind):
    path, deq = ckpts[kind]
    cfg, model = _load(path, "fp8" if kind == "dynamic" else None)
    assert cfg.quant is not None and cfg.quant.method == {"fp8-block": "block", "dynamic": "dynamic"}.get(
        kind, "compressed-tensors")
    layer = model.model.layers[0]
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert lin.weight.dtype == torch.float8_e4m3fn  # stored as FP8, not widened at load
    assert model.lm_head.weight.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.float32
    # transformers loading the same FP8 checkpoint (dequantized by its own readers); for
    # `--quantization fp8`, the per-channel checkpoint of the same weights
    hf = _hf_model(deq) if kind == "dynamic" else hf_fp8(path)
    logits, _ = run_prefill(model, cfg, 1, _prompts(), page_size=4)
    start = 0
    with torch.no_grad():
        for p in _prompts():
            ref = hf(p[None]).logits[0]
            assert (logits[start : start + p.numel()] - ref).abs().max().item() < ATOL, kind
            start += p.numel()
    # The FP8 weights differ from the plain ones (the check above is not of an unquantized model).
    plain = _hf_model(ckpts["dynamic"][0])
    w = plain.model.layers[0].mlp.down_proj.weight
    got = dequantize(layer.mlp.down_proj.weight, layer.mlp.down_proj.weight_scale, layer.mlp.down_proj.block_k)
    assert 0 < (got - w).abs().max().item() < 0.07 * w.abs().max().item()


@pytest.mark.parametrize("kind", KINDS + ("dynamic",))
def test_greedy_tokens_equal_transformers(ckpts, kind):
    path, deq = ckpts[kind]
    engine = Engine(EngineConfig(model=path, page_size=4, quantization="fp8" if kind == "dynamic" else None))
    try:
        for prompt, res in zip(PROMPTS, engine.generate(PROMPTS, greedy())):
            assert res.token_ids == hf_greedy(deq, engine.tokenize(prompt), len(res.token_ids)), prompt
    finally:
        engine.shutdown()


def _tp_worker(rank: int, port: int, paths: list[tuple[str, str | None]], out_dir: str) -> None:
    with gloo_rank(rank, port, 2):
        tp = TPGroup(rank=rank, size=2)
        for i, (path, quantization) in enumerate(paths):
            cfg, model = _load(path, quantization, tp)
            logits, _ = run_prefill(model, cfg, 2, _prompts(), page_size=4)
            torch.save(logits, os.path.join(out_dir, f"logits-{i}-rank{rank}.pt"))


def test_tp2_equals_tp1(ckpts, tmp_path):
    """Column- and row-parallel shards of FP8 weights and their scales give TP=1's logits: block
    scales cut at block edges, and (48-row blocks, one kv head replicated on both ranks) shards
    and fused q|k|v parts that start inside a block."""
    import torch.multiprocessing as mp

    odd = make_model(tmp_path / "odd", "llama", dtype="float32", **{**SHAPE, "kv_heads": 1})
    quantize_checkpoint(odd, "fp8-block", (48, 32))
    paths = [(ckpts["fp8-block"][0], None), (ckpts["fp8-tensor"][0], None), (ckpts["dynamic"][0], "fp8"),
             (str(odd), None)]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_tp_worker, args=(_free_port(), paths, out), nprocs=2, join=True)
        for i, (path, quantization) in enumerate(paths):
            cfg, model = _load(path, quantization)
            ref, _ = run_prefill(model, cfg, 1, _prompts(), page_size=4)
            got = [torch.load(os.path.join(out, f"logits-{i}-rank{r}.pt")) for r in range(2)]
            assert torch.equal(got[0], got[1])
            assert (got[0] - ref).abs().max().item() < ATOL, path


def test_a_tp_size_that_cuts_a_block_is_refused(tmp_path):
    """intermediate 96 over 2 ranks: down_proj's K splits at column 48, inside a 32-wide block."""
    d = make_model(tmp_path / "m", "llama", dtype="float32", **{**SHAPE, "intermediate": 96})
    quantize_checkpoint(d, "fp8-block", BLOCK)
    cfg = ModelConfig.from_pretrained(str(d), "float32")
    with pytest.raises(ValueError, match="RowParallelLinear: tensor parallelism cuts K at column 48.*32-wide"):
        load_model(cfg, TPGroup(rank=1, size=2), "cpu", torch.float32)  # (building runs no collective)


def test_static_activation_scales_load(ckpts, tmp_path):
    """A compressed-tensors checkpoint with static per-tensor activation scales: `input_scale`
    of q, k and v is one per fused layer (the largest), and the output is unchanged (the
    products do not need it)."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "static"
    shutil.copytree(ckpts["fp8-channel"][0], path)
    (f,) = path.glob("*.safetensors")
    tensors = load_file(f)
    for name in [n for n in tensors if n.endswith("_proj.weight_scale")]:
        tensors[name.replace("weight_scale", "input_scale")] = torch.tensor([0.01 + 0.001 * len(name)])
    save_file(tensors, f)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    (path / "config.json").write_text(json.dumps(cfg))
    mc, model = _load(str(path))
    assert mc.quant.static_activations
    qkv = model.model.layers[0].self_attn.qkv_proj
    names = [f"model.layers.0.self_attn.{p}_proj.input_scale" for p in "qkv"]
    assert qkv.input_scale.item() == pytest.approx(max(tensors[n].item() for n in names))
    ref, _ = run_prefill(_load(ckpts["fp8-channel"][0])[1], mc, 1, _prompts(), page_size=4)
    got, _ = run_prefill(model, mc, 1, _prompts(), page_size=4)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("qc, named", [
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "quant_method 'fp8'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "activation_scheme"),
    ({"quant_method": "fp8", "weight_block_size": [128, 96]}, "weight_block_size K of 96"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}, "'pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}}, "'int'"),
    ({"quant_method": "gptq", "bits": 4}, "'gptq', bits 4"),
    ({"quant_method": "awq", "bits": 4}, "'awq', bits 4"),
])
def test_unsupported_quantization_is_refused_by_name(ckpts, tmp_path, qc, named):
    q = _copy_with_config(ckpts["dynamic"][0], tmp_path / "q", quantization_config=qc)
    with pytest.raises(ValueError, match=re.escape(named) + ".*Loaded: FP8 block-wise"):
        ModelConfig.from_pretrained(q)


def test_make_model_cli_writes_a_checkpoint_transformers_and_manta_read_alike(tmp_path):
    """`manta make-model --quantization fp8-tensor`: transformers reads what it wrote, and manta's
    logits on it are transformers' (the command line's path: arguments, shards, config)."""
    import argparse

    from workers.make_model import add_make_model_args, run_make_model

    parser = argparse.ArgumentParser()
    add_make_model_args(parser)
    path = str(run_make_model(parser.parse_args([str(tmp_path / "m"), "--arch", "llama", "--layers", "2",
                                                 "--dtype", "float32", "--quantization", "fp8-tensor"])))
    cfg, model = _load(path)
    assert cfg.quant.method == "compressed-tensors" and cfg.quant.strategy == "tensor"
    assert model.model.layers[1].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    hf = hf_fp8(path)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 11)]
    logits, _ = run_prefill(model, cfg, 1, prompts, page_size=4)
    start = 0
    with torch.no_grad():
        for p in prompts:
            assert (logits[start : start + p.numel()] - hf(p[None]).logits[0]).abs().max().item() < ATOL
            start += p.numel()


def test_fp8_config_on_plain_weights_and_fp8_on_a_model_without_fp8_layers_are_refused(ckpts, tmp_path):
    from workers.make_fp8 import quantization_config

    q = _copy_with_config(ckpts["dynamic"][0], tmp_path / "q", quantization_config=quantization_config("fp8-channel"))
    with pytest.raises(ValueError, match="quantization_config says FP8, but this weight is stored as torch.float32"):
        _load(q)
    with pytest.raises(ValueError, match="--quantization 'int4'"):
        ModelConfig.from_pretrained(ckpts["dynamic"][0], quantization="int4")
    bart = make_model(tmp_path / "bart", "bart", dtype="float32")
    with pytest.raises(ValueError) as err:
        _load(bart, quantization="fp8")
    assert str(err.value).startswith("BartForConditionalGeneration has no FP8 layers yet (fp8 (quantized at load")
    assert "FP8 loads for DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, LlamaForCausalLM" in str(err.value)


def _unquantize(path, names: str) -> None:
    """Store the weights whose names match `names` dequantized (float32) and drop their scales,
    as a checkpoint that leaves those layers unquantized does."""
    from safetensors.torch import load_file, save_file

    (f,) = path.glob("*.safetensors")
    tensors = load_file(f)
    cfg = json.loads((path / "config.json").read_text())["quantization_config"]
    block = cfg.get("weight_block_size")
    for name in [n for n in tensors if re.search(names, n) and n.endswith(".weight")]:
        w = tensors[name]
        s = tensors.pop(name + ("_scale_inv" if block else "_scale")).float()
        if block:
            s, bk = s.repeat_interleave(block[0], 0)[: w.shape[0]], block[1]
        else:
            s, bk = s.reshape(-1, 1).expand(w.shape[0], 1), w.shape[1]
        tensors[name] = dequantize(w, s, bk)
    save_file(tensors, f)


@pytest.mark.parametrize("kind, ignore", [
    ("fp8-channel", {"ignore": ["lm_head", "re:.*mlp\\.down_proj"]}),  # compressed-tensors: re.match
    ("fp8-block", {"modules_to_not_convert": ["down_proj"]}),  # transformers: a module-name suffix
])
def test_layers_a_checkpoint_leaves_unquantized(ckpts, tmp_path, kind, ignore):
    path = tmp_path / "m"
    shutil.copytree(ckpts[kind][0], path)
    _unquantize(path, r"mlp\.down_proj")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"].update(ignore)
    (path / "config.json").write_text(json.dumps(cfg))
    mc, model = _load(str(path))
    layer = model.model.layers[1]
    assert layer.mlp.down_proj.weight.dtype == torch.float32 and layer.mlp.gate_up_proj.weight.dtype == fp8.FP8
    ref, _ = run_prefill(_load(ckpts[kind][0])[1], mc, 1, _prompts(), page_size=4)
    got, _ = run_prefill(model, mc, 1, _prompts(), page_size=4)
    assert (got - ref).abs().max().item() < ATOL  # the same weights, stored plainly


def test_kv_cache_scales_are_skipped(ckpts, tmp_path):
    """An llm-compressor export with an FP8 KV-cache scheme: its k/v scales are not used (the KV
    cache stays in the model's dtype), the model loads and computes the same."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "kv"
    shutil.copytree(ckpts["fp8-channel"][0], path)
    (f,) = path.glob("*.safetensors")
    tensors = load_file(f)
    for i in range(SHAPE["layers"]):
        for kv in "kv":
            tensors[f"model.layers.{i}.self_attn.{kv}_scale"] = torch.tensor(0.05)
    save_file(tensors, f)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                     "dynamic": False, "symmetric": True}
    (path / "config.json").write_text(json.dumps(cfg))
    mc, model = _load(str(path))
    ref, _ = run_prefill(_load(ckpts["fp8-channel"][0])[1], mc, 1, _prompts(), page_size=4)
    got, _ = run_prefill(model, mc, 1, _prompts(), page_size=4)
    assert torch.equal(got, ref)


def test_one_row_entry_points_take_fp8_weights_with_row_scales():
    """The batch-1 entry points (`workers.layers.one_row`) off the kernel (CPU) on an FP8 weight
    with per-row scales (`fp8.row_scale`): the unfused ops on the dequantized weight."""
    from workers.layers import fused, one_row

    g = torch.Generator().manual_seed(4)
    q, s = fp8.quantize_rows(torch.randn(16, 24, generator=g))
    q2, s2 = fp8.quantize_rows(torch.randn(10, 16, generator=g))
    wd, wd2 = dequantize(q, s, 24), dequantize(q2, s2, 16)
    x, res, b = torch.randn(1, 48, generator=g), torch.randn(1, 16, generator=g), torch.randn(16, generator=g)
    nw = torch.rand(24, generator=g) + 0.5
    torch.testing.assert_close(one_row.linear(x[:, :24], q, b, scale=s), torch.nn.functional.linear(x[:, :24], wd, b))
    torch.testing.assert_close(one_row.silu_mul_linear(x, q, b, scale=s),
                               torch.nn.functional.linear(fused._silu_and_mul(x), wd, b))
    y, summed = one_row.add_rms_norm_linear(x[:, :24], x[:, 24:], nw, 1e-6, q, None, scale=s)
    h, want_s = fused._add_rms_norm(x[:, :24], x[:, 24:], nw, 1e-6)
    torch.testing.assert_close(y, torch.nn.functional.linear(h, wd))
    torch.testing.assert_close(summed, want_s)
    row = one_row.linear_add(x, q, None, res, silu_mul=True, scale=s)
    torch.testing.assert_close(row.row, res + torch.nn.functional.linear(fused._silu_and_mul(x), wd))
    torch.testing.assert_close(one_row.norm_linear(row, nw[:16], 1e-6, q2, None, scale=s2),
                               torch.nn.functional.linear(fused._rms_norm(row.row, nw[:16], 1e-6), wd2))


def test_row_scale_is_per_row_scales_only(ckpts):
    """`fp8.row_scale`: the per-row scales of per-channel / per-tensor / at-load layers (the one-row
    kernels take them), None for block-wise and unquantized layers."""
    for kind, per_row in [("fp8-channel", True), ("fp8-tensor", True), ("fp8-block", False), ("dynamic", True)]:
        _, model = _load(ckpts[kind][0], "fp8" if kind == "dynamic" else None)
        qkv = model.model.layers[0].self_attn.qkv_proj
        scale = fp8.row_scale(qkv)
        assert (scale is not None) == per_row
        if per_row:
            assert scale is qkv.weight_scale and scale.shape == (qkv.weight.shape[0], 1)
    _, plain = _load(ckpts["dynamic"][0])
    assert fp8.row_scale(plain.model.layers[0].self_attn.qkv_proj) is None
