"""`manta bench prefill`: prompt throughput as model FLOPs utilisation (issue 26).

N random prompts of L tokens, one output token each, through the engine loop (chunked prefill
as configured). FLOPs are counted per prompt token as the issue counts them:
- linear layers: 2 x the weights a token multiplies (every parameter of the decoder layers; of a
  MoE layer's routed experts, top_k / E of them), not the input embedding (a lookup) nor the LM
  head (a prefill computes logits for each prompt's last token only);
- causal attention: per full-attention layer, 2 x heads x (qk_dim + v_dim) per attended
  position (scores, then the weighted sum of values), over (L + 1) / 2 positions on average.
The 8B shape at L = 2,048: ~14.5 GFLOP a token. MFU is the achieved FLOP/s over the GPU's dense
bf16 peak (`PEAK_BF16`, by device name; none on a CPU: FLOP/s only). The count is the same for
FP8 weights: the bf16 peak stays the yardstick, as the issue asks.
"""

from __future__ import annotations

import time

import torch

from cluster.bench.offline import random_prompts
from workers.sampling_params import SamplingParams

# Dense bf16 tensor-core peak FLOP/s by device name (the vendors' SXM figures, without sparsity).
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}


def peak_bf16(device_name: str) -> float | None:
    return next((v for k, v in PEAK_BF16.items() if k in device_name), None)


def linear_flops_per_token(model: torch.nn.Module) -> float:
    """2 x the weights one token multiplies (see the module docstring), of a TP=1 model."""
    from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from workers.models.deepseek_moe import DeepseekMoE

    skip = {id(p) for m in model.modules() if isinstance(m, (ParallelLMHead, VocabParallelEmbedding))
            for p in m.parameters()}
    share: dict[int, float] = {}
    for m in model.modules():
        if isinstance(m, DeepseekMoE):
            for p in m.experts.parameters():
                share[id(p)] = m.gate.top_k / m.gate.num_experts
    total = 0.0
    for name, p in model.named_parameters():
        if id(p) in skip or p.dim() < 2 or name.endswith("_scale"):  # norms, biases, FP8 scales
            continue
        total += p.numel() * share.get(id(p), 1.0)
    return 2 * total


def attention_flops_per_token(mc, input_len: int) -> float:
    """Causal attention of an `input_len`-token prompt, per token on average (all ranks)."""
    qk, v = (mc.qk_head_dim, mc.v_head_dim) if mc.use_mla else (mc.head_dim, mc.head_dim)
    return len(mc.full_attn_layers) * 2 * mc.num_heads * (qk + v) * (input_len + 1) / 2


def warmup_prompts(max_num_batched_tokens: int, chunked_prefill_size: int, num_prompts: int, input_len: int) -> int:
    """Prompts of the untimed first pass: as many as one full step of the timed run holds (at
    least 2, at most the run's own), so the warm-up runs the timed run's full steps (a smaller
    last step may still be new). `chunked_prefill_size`: the one the engine runs (its serving
    mode's: a checkpoint may force -1).
    With 2 (4,096 tokens) before 8,192-token steps, the first FP8 run on a fresh H200 took twice
    as long as the same command again (BENCHMARKS.md, 2026-12-02)."""
    piece = input_len if chunked_prefill_size == -1 else min(input_len, chunked_prefill_size)
    per_step = -(-max_num_batched_tokens // max(piece, 1))
    return max(2, min(per_step, num_prompts))


def bench_prefill(engine, num_prompts: int, input_len: int, seed: int = 0) -> dict:
    """Prompt tokens/s, FLOPs per token, FLOP/s and MFU (None without a known peak)."""
    runner = getattr(engine.workers, "runner", None)
    if runner is None or engine.config.tp_size != 1:
        raise ValueError("bench prefill counts the FLOPs on the engine's own rank: run it with --tp 1")
    mc = engine.model_config
    prompts = random_prompts(num_prompts, input_len, mc.vocab_size, seed)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    warm = warmup_prompts(engine.config.max_num_batched_tokens, engine.serving.chunked_prefill_size, num_prompts,
                          input_len)
    engine.generate(random_prompts(warm, input_len, mc.vocab_size, seed + 1), params)  # warm-up (compiles)
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    tokens = num_prompts * input_len
    linear = linear_flops_per_token(runner.model)
    attention = attention_flops_per_token(mc, input_len)
    flops = (linear + attention) * tokens / dt
    device = torch.cuda.get_device_name() if engine.config.device == "cuda" else "cpu"
    peak = peak_bf16(device)
    return {"num_prompts": num_prompts, "input_len": input_len, "seconds": dt, "prompt_tokens_per_s": tokens / dt,
            "gflop_per_token": (linear + attention) / 1e9, "linear_gflop_per_token": linear / 1e9,
            "attention_gflop_per_token": attention / 1e9, "tflops": flops / 1e12, "device_name": device,
            "peak_bf16_tflops": peak / 1e12 if peak else None, "mfu": flops / peak if peak else None}
