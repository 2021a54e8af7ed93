"""FP8 DeepSeek checkpoints (MLA + MoE) on the CPU: block-wise (DeepSeek-V3's own layout) and
compressed-tensors per-channel, against transformers on the dequantized weights (it cannot run
either format on a CPU: see tests/test_fp8.py), prefill and the absorbed decode path; TP=2
equals TP=1. The linear layers and the routed experts hold FP8 weights (the experts' loop
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
from tests.test_llama_model import _free_port
from tests.test_mla import Cache, _logits, _prompts, check_prefill_and_decode
from workers.loader import load_model
from workers.make_fp8 import dequantize_checkpoint, quantize_checkpoint
from workers.make_model import make_model
from workers.model_config import ModelConfig
from workers.parallel import TPGroup

BLOCK = (16, 16)
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


def _load(path: str, tp: TPGroup | None = None):
    cfg = ModelConfig.from_pretrained(path, "float32")
    return cfg, load_model(cfg, tp or TPGroup(), "cpu", torch.float32)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_logits_match_transformers_on_the_dequantized_weights(ckpts, variant):
    from transformers import AutoModelForCausalLM

    path, deq = ckpts[variant]
    cfg, model = _load(path)
    attn = model.model.layers[0].self_attn
    assert attn.o_proj.weight.dtype == torch.float8_e4m3fn and attn.kv_a_proj_with_mqa.weight.dtype == torch.float8_e4m3fn
    moe = model.model.layers[1].mlp
    assert moe.shared_experts.down_proj.weight.dtype == torch.float8_e4m3fn
    assert moe.experts.w13.dtype == moe.experts.w2.dtype == torch.float8_e4m3fn  # with their scales
    assert attn.kv_b_proj.weight.dtype == torch.float8_e4m3fn  # the absorbed projections' too
    hf = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32, attn_implementation="eager").eval()
    check_prefill_and_decode(cfg, model, hf, variant)


def test_greedy_tokens_equal_transformers(ckpts):
    path, deq = ckpts["v3_block"]
    engine = Engine(EngineConfig(model=path, page_size=4))
    try:
        for prompt, res in zip(PROMPTS, engine.generate(PROMPTS, greedy())):
            assert res.token_ids == hf_greedy(deq, engine.tokenize(prompt), len(res.token_ids)), prompt
    finally:
        engine.shutdown()


def _tp_worker(rank: int, port: int, paths: list[str], out_dir: str) -> None:
    with gloo_rank(rank, port, 2):
        tp = TPGroup(rank=rank, size=2)
        for i, path in enumerate(paths):
            cfg, model = _load(path, tp)
            torch.save(_logits(model, Cache(cfg, 32, 3).step(_prompts(cfg.vocab_size))),
                       os.path.join(out_dir, f"logits-{i}-rank{rank}.pt"))


def test_tp2_equals_tp1(ckpts):
    import torch.multiprocessing as mp

    paths = [ckpts["v3_block"][0], ckpts["v3_channel"][0]]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_tp_worker, args=(_free_port(), paths, out), nprocs=2, join=True)
        for i, path in enumerate(paths):
            cfg, model = _load(path)
            ref = _logits(model, Cache(cfg, 32, 3).step(_prompts(cfg.vocab_size)))
            got = [torch.load(os.path.join(out, f"logits-{i}-rank{r}.pt")) for r in range(2)]
            assert torch.equal(got[0], got[1])
            assert (got[0] - ref).abs().max().item() < 1e-5, path


def test_a_plain_deepseek_quantized_at_load_keeps_experts_dense(tmp_path):
    d = make_model(tmp_path / "plain", "deepseek_v3", dtype="float32", max_position=128)
    cfg = ModelConfig.from_pretrained(str(d), "float32", quantization="fp8")
    model = load_model(cfg, TPGroup(), "cpu", torch.float32)
    assert model.model.layers[1].self_attn.q_b_proj.weight.dtype == torch.float8_e4m3fn
    assert model.model.layers[1].mlp.experts.w13.dtype == torch.float32
    shutil.rmtree(d)


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
