"""The offline workload every engine benchmark shares: N random prompts of fixed input and output
lengths (ignore_eos) through the engine loop; output and total tokens/s."""

from __future__ import annotations

import time

from cluster.engine.loop import Engine
from workers.sampling_params import SamplingParams
from workers.structured_output import StructuredOutput


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 1) for _ in range(length)] for _ in range(n)]


# `--structured json`: a schema that stays open for any output length (an unbounded array of
# objects), so every step of every request is constrained.
BENCH_SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {
    "type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string"}},
    "required": ["id", "name"]}}}, "required": ["items"]}


def bench_structured(kind: str) -> StructuredOutput | None:
    if kind == "none":
        return None
    if kind == "json":
        return StructuredOutput.json_schema(BENCH_SCHEMA, "bench")
    return StructuredOutput("regex", r"([a-z]+ [0-9]+, )*", "bench")


def bench_offline(engine: Engine, num_prompts: int, input_len: int, output_len: int, seed: int = 0,
                  structured: StructuredOutput | None = None) -> dict:
    prompts = random_prompts(num_prompts, input_len, engine.model_config.vocab_size, seed)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, structured=structured)
    engine.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    out_tokens = sum(len(r.token_ids) for r in results)
    return {
        "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
        "seconds": dt, "output_tokens_per_s": out_tokens / dt,
        "total_tokens_per_s": (out_tokens + num_prompts * input_len) / dt,
    }
