"""`manta bench prefill` (issue 26): the FLOPs it counts per prompt token, against a count from
the checkpoint's config by hand (Llama; DeepSeek-V3 with MLA and MoE), the 8B shape's ~14.5
GFLOP at 2,048 tokens that the issue quotes, and a run through the CLI on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cluster.bench.prefill import attention_flops_per_token, bench_prefill, peak_bf16, warmup_prompts
from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from tests.fixtures import tiny_model_dir
from workers.model_config import ModelConfig


def _llama_linear(h: int, inter: int, heads: int, kv: int, hd: int, layers: int) -> float:
    return 2 * layers * (h * (heads + 2 * kv) * hd + heads * hd * h + 3 * h * inter)


def test_llama_counts_match_a_count_from_the_config(tmp_path_factory):
    d = tiny_model_dir(tmp_path_factory, "llama")
    engine = Engine(EngineConfig(model=str(d)))
    try:
        res = bench_prefill(engine, num_prompts=4, input_len=24)
    finally:
        engine.shutdown()
    hf = json.loads((d / "config.json").read_text())
    h, heads, kv, layers = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["num_hidden_layers"]
    hd = hf.get("head_dim") or h // heads
    linear = _llama_linear(h, hf["intermediate_size"], heads, kv, hd, layers)
    attention = layers * 2 * heads * 2 * hd * 25 / 2
    assert res["linear_gflop_per_token"] * 1e9 == pytest.approx(linear)
    assert res["attention_gflop_per_token"] * 1e9 == pytest.approx(attention)
    assert res["prompt_tokens_per_s"] > 0 and res["tflops"] > 0
    assert res["mfu"] is None and res["peak_bf16_tflops"] is None  # no peak for a CPU


def test_the_warm_up_runs_a_full_step_of_the_timed_run():
    """As many warm-up prompts as one step of the timed run holds: 8,192-token steps of
    2,048-token prompts (chunks) take 4; of 1,000-token ones 9; whole 16,384-token prompts (no
    chunking) 2 at least; never more than the run itself."""
    config = EngineConfig(model="m")
    step = (config.max_num_batched_tokens, config.chunked_prefill_size)
    assert step == (8192, 2048)
    assert warmup_prompts(*step, 64, 2048) == 4
    assert warmup_prompts(*step, 64, 8192) == 4  # 2,048-token chunks of each
    assert warmup_prompts(*step, 64, 1000) == 9
    assert warmup_prompts(*step, 5, 1000) == 5
    assert warmup_prompts(8192, -1, 16, 16384) == 2


def test_the_8b_shape_is_14_5_gflop_a_token_at_2048():
    """The issue's figure: linear layers (no embedding, no LM head) + causal attention."""
    linear = _llama_linear(4096, 14336, 32, 8, 128, 32)

    class MC:  # the 8B shape's attention fields
        use_mla, head_dim, num_heads, full_attn_layers = False, 128, 32, tuple(range(32))

    total = linear + attention_flops_per_token(MC, 2048)
    assert total / 1e9 == pytest.approx(14.5, abs=0.05)


def test_deepseek_counts_active_experts_only(tmp_path_factory):
    from cluster.bench.prefill import linear_flops_per_token
    from workers.loader import load_model
    from workers.parallel import TPGroup

    d = tiny_model_dir(tmp_path_factory, "deepseek_v3")
    mc = ModelConfig.from_pretrained(str(d), "float32")
    model = load_model(mc, TPGroup(), "cpu", mc.dtype)
    hf = mc.hf_config
    h, heads, nope, rope, v = hf.hidden_size, hf.num_attention_heads, hf.qk_nope_head_dim, hf.qk_rope_head_dim, \
        hf.v_head_dim
    attn = (h * hf.q_lora_rank + hf.q_lora_rank * heads * (nope + rope) + h * (hf.kv_lora_rank + rope)
            + hf.kv_lora_rank * heads * (nope + v) + heads * v * h)
    dense = 3 * h * hf.intermediate_size
    moe = (hf.n_routed_experts * h  # the router's logits
           + 3 * h * hf.moe_intermediate_size * hf.n_shared_experts
           + 3 * h * hf.moe_intermediate_size * hf.num_experts_per_tok)  # top_k of the routed experts
    layers = hf.num_hidden_layers
    want = 2 * (layers * attn + hf.first_k_dense_replace * dense + (layers - hf.first_k_dense_replace) * moe)
    assert linear_flops_per_token(model) == pytest.approx(want)
    assert attention_flops_per_token(mc, 9) == layers * 2 * heads * ((nope + rope) + v) * 5


def test_peaks_by_device_name():
    assert peak_bf16("NVIDIA H100 80GB HBM3") == peak_bf16("NVIDIA H200") == 989e12
    assert peak_bf16("cpu") is None


def test_the_cli_prints_and_writes_json(tmp_path_factory, tmp_path):
    d = tiny_model_dir(tmp_path_factory, "llama")
    out = tmp_path / "prefill.json"
    run = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "prefill", "--model", str(d),
                          "--num-prompts", "4", "--input-len", "16", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "prompt_tokens_per_s" in run.stdout and "gflop_per_token" in run.stdout
    res = json.loads(out.read_text())["result"]
    assert res["num_prompts"] == 4 and res["input_len"] == 16 and res["prompt_tokens_per_s"] > 0
