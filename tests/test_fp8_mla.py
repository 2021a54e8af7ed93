"""FP8 DeepSeek checkpoints (MLA + MoE) on the CPU: block-wise (DeepSeek-V3's own layout),
compressed-tensors per-channel and `--quantization fp8`, against transformers loading the same
checkpoint (its own readers of the formats dequantize on the CPU: see tests/test_fp8.py),
prefill and the absorbed decode path; TP=2 equals TP=1. The linear layers and the routed experts hold FP8 weights (the experts' loop
dequantizes each expert it runs on the CPU; the grouped GEMM's FP8 tiles are checked on the GPU
in tests/test_fused_moe.py); so does kv_b_proj, whose FP8 weight also makes the absorbed
projections of decode (`workers.layers.fp8_heads`: dequantized per call on the CPU, one Triton
kernel on the GPU, tests/test_fp8_heads.py)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from tests.fixtures import gloo_rank
from tests.test_engine import PROMPTS, greedy, hf_greedy
from tests.test_fp8 import assert_same_weights, hf_fp8
from tests.test_llama_model import _free_port
from tests.test_mla import Cache, _logits, _prompts, check_prefill_and_decode
from workers.loader import load_model
from workers.make_fp8 import dequantize_checkpoint, quantize_checkpoint
from workers.make_model import make_model
from workers.model_config import ModelConfig
from workers.parallel import TPGroup

BLOCK = (8, 16)  # transformers' block-FP8 reader wants whole blocks (kv_a_proj_with_mqa: 40 rows); K >= 16
VARIANTS = {  # name -> (arch, FP8 format)
    "v2_block": ("deepseek_v2", "fp8-block"),
    "v3_block": ("deepseek_v3", "fp8-block"),
    "v3_channel": ("deepseek_v3", "fp8-channel"),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-mla")
    out = {}
    for name, (arch, kind) in VARIANTS.items():
        d = make_model(root / name, arch, dtype="float32", max_position=128)
        quantize_checkpoint(d, kind, BLOCK)
        dequantize_checkpoint(d, root / f"{name}-deq")
        out[name] = (str(d), str(root / f"{name}-deq"))
    return out


def _load(path: str, tp: TPGroup | None = None, quantization: str | None = None):
    cfg = ModelConfig.from_pretrained(path, "float32", quantization=quantization)
    return cfg, load_model(cfg, tp or TPGroup(), "cpu", torch.float32)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_logits_match_transformers_on_the_same_checkpoint(ckpts, variant):
    path, deq = ckpts[variant]
    cfg, model = _load(path)
    attn = model.model.layers[0].self_attn
    assert attn.o_proj.weight.dtype == torch.float8_e4m3fn and attn.kv_a_proj_with_mqa.weight.dtype == torch.float8_e4m3fn
    moe = model.model.layers[1].mlp
    assert moe.shared_experts.down_proj.weight.dtype == torch.float8_e4m3fn
    assert moe.experts.w13.dtype == moe.experts.w2.dtype == torch.float8_e4m3fn  # with their scales
    assert attn.kv_b_proj.weight.dtype == torch.float8_e4m3fn  # the absorbed projections' too
    check_prefill_and_decode(cfg, model, hf_fp8(path, attn_implementation="eager"), variant)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_transformers_reads_the_deepseek_formats_as_the_dequantized_copies(ckpts, variant):
    """transformers' own readers of the formats give the dequantized copies' weights (which the
    greedy tests hand `hf_greedy`) bit for bit (see tests/test_fp8.py)."""
    assert_same_weights(*ckpts[variant])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_equal_transformers(ckpts, variant):
    path, deq = ckpts[variant]
    engine = Engine(EngineConfig(model=path, page_size=4))
    try:
        for prompt, res in zip(PROMPTS, engine.generate(PROMPTS, greedy())):
            assert res.token_ids == hf_greedy(deq, engine.tokenize(prompt), len(res.token_ids)), prompt
    finally:
        engine.shutdown()


def _tp_worker(rank: int, port: int, paths: list[tuple[str, str | None]], out_dir: str) -> None:
    with gloo_rank(rank, port, 2):
        tp = TPGroup(rank=rank, size=2)
        for i, (path, quantization) in enumerate(paths):
            cfg, model = _load(path, tp, quantization)
            torch.save(_logits(model, Cache(cfg, 32, 3).step(_prompts(cfg.vocab_size))),
                       os.path.join(out_dir, f"logits-{i}-rank{rank}.pt"))


def test_tp2_equals_tp1(ckpts, plain_v3):
    """Block and channel checkpoints, and `--quantization fp8` (whose row-parallel down_proj
    scales, the experts' too, come from whole rows on each rank)."""
    import torch.multiprocessing as mp

    paths = [(ckpts["v3_block"][0], None), (ckpts["v3_channel"][0], None), (plain_v3, "fp8")]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_tp_worker, args=(_free_port(), paths, out), nprocs=2, join=True)
        for i, (path, quantization) in enumerate(paths):
            cfg, model = _load(path, quantization=quantization)
            ref = _logits(model, Cache(cfg, 32, 3).step(_prompts(cfg.vocab_size)))
            got = [torch.load(os.path.join(out, f"logits-{i}-rank{r}.pt")) for r in range(2)]
            assert torch.equal(got[0], got[1])
            assert (got[0] - ref).abs().max().item() < 1e-5, path


@pytest.fixture(scope="module")
def plain_v3(tmp_path_factory):
    """The unquantized checkpoint that v3_channel was made from (the same seed)."""
    return str(make_model(tmp_path_factory.mktemp("fp8-mla-plain") / "plain", "deepseek_v3", dtype="float32",
                          max_position=128))


def test_a_plain_deepseek_quantized_at_load_equals_its_channel_checkpoint(ckpts, plain_v3):
    """`--quantization fp8` quantizes every linear weight per output channel, the routed experts'
    too: the same FP8 weights and scales as the fp8-channel checkpoint of the same weights (whose
    logits are checked against transformers above), so the same logits."""
    cfg = ModelConfig.from_pretrained(plain_v3, "float32", quantization="fp8")
    model = load_model(cfg, TPGroup(), "cpu", torch.float32)
    moe = model.model.layers[1].mlp
    assert model.model.layers[1].self_attn.q_b_proj.weight.dtype == torch.float8_e4m3fn
    assert moe.experts.w13.dtype == moe.experts.w2.dtype == torch.float8_e4m3fn
    _, channel = _load(ckpts["v3_channel"][0])
    stored = channel.model.layers[1].mlp.experts
    for name in ("w13", "w2", "w13_scale", "w2_scale"):  # (FP8 compared bit for bit)
        a, b = getattr(moe.experts, name), getattr(stored, name)
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                                  b.view(torch.uint8) if b.element_size() == 1 else b), name
    ref = _logits(channel, Cache(cfg, 32, 3).step(_prompts(cfg.vocab_size)))
    got = _logits(model, Cache(cfg, 32, 3).step(_prompts(cfg.vocab_size)))
    assert (got - ref).abs().max().item() < 1e-5


def test_quantized_at_load_greedy_tokens_equal_transformers(ckpts, plain_v3):
    """Through the engine with `quantization="fp8"`, against transformers on the dequantized
    weights of the same per-channel quantization."""
    engine = Engine(EngineConfig(model=plain_v3, page_size=4, quantization="fp8"))
    try:
        for prompt, res in zip(PROMPTS, engine.generate(PROMPTS, greedy())):
            assert res.token_ids == hf_greedy(ckpts["v3_channel"][1], engine.tokenize(prompt), len(res.token_ids)), \
                prompt
    finally:
        engine.shutdown()


def test_a_deepseek_checkpoint_that_leaves_down_proj_unquantized(ckpts, tmp_path):
    """compressed-tensors' ignore naming only the dense MLP's and the shared experts' down_proj
    (gate/up stay FP8): the two layers of an MLP follow their own names."""
    from tests.test_fp8 import _unquantize

    path = tmp_path / "m"
    shutil.copytree(ckpts["v3_channel"][0], path)
    _unquantize(path, r"(mlp|shared_experts)\.down_proj")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["ignore"] += ["re:.*mlp\\.down_proj$", "re:.*shared_experts\\.down_proj$"]
    (path / "config.json").write_text(json.dumps(cfg))
    cfg, model = _load(str(path))
    dense, moe = model.model.layers[0].mlp, model.model.layers[1].mlp
    assert dense.down_proj.weight.dtype == torch.float32 and dense.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    assert moe.shared_experts.down_proj.weight.dtype == torch.float32
    assert moe.experts.w2.dtype == torch.float8_e4m3fn  # (experts.N.down_proj is not matched)
    ref = _logits(_load(ckpts["v3_channel"][0])[1], Cache(cfg, 32, 3).step(_prompts(cfg.vocab_size)))
    got = _logits(model, Cache(cfg, 32, 3).step(_prompts(cfg.vocab_size)))
    assert (got - ref).abs().max().item() < 1e-5
