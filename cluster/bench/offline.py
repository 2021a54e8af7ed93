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


# `--structured json|regex`: constraints that a model's output does not finish at once (a list of
# objects; words and numbers up to a full stop), without counted repetitions (`{1000,}` or
# `minItems`: each step would meet new grammar states, a cost real schemas do not have). How many
# output tokens were generated under the grammar (before it completed) is reported beside.
BENCH_SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {
    "type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                                     "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}}},
    "required": ["id", "name", "tags"]}}}, "required": ["items"]}
BENCH_REGEX = r"[a-z]+( [a-z]+| [0-9]+|, )*\."


def bench_structured(kind: str) -> StructuredOutput | None:
    if kind == "none":
        return None
    if kind == "json":
        return StructuredOutput.json_schema(BENCH_SCHEMA, "bench")
    return StructuredOutput("regex", BENCH_REGEX, "bench")


def bench_offline(engine: Engine, num_prompts: int, input_len: int, output_len: int, seed: int = 0,
                  structured: StructuredOutput | None = None) -> dict:
    prompts = random_prompts(num_prompts, input_len, engine.model_config.vocab_size, seed)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, structured=structured)
    engine.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    out_tokens = sum(len(r.token_ids) for r in results)
    res = {
        "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
        "seconds": dt, "output_tokens_per_s": out_tokens / dt,
        "total_tokens_per_s": (out_tokens + num_prompts * input_len) / dt,
    }
    if structured is not None:
        res["constrained_token_share"] = _constrained_share(engine, structured, [r.token_ids for r in results])
    return res


def _constrained_share(engine: Engine, structured: StructuredOutput, outputs: list[list[int]]) -> float:
    """The share of output tokens generated while the grammar was still open (after it completes,
    only eos is allowed: a cheap mask)."""
    import torch

    from workers.grammar_masks import GrammarMatchers

    g = GrammarMatchers(engine.config.model, engine.model_config.vocab_size, list(engine.model_config.eos_token_ids),
                        torch.device("cpu"))
    active = 0
    for toks in outputs:
        m = g.start(structured, []).get()
        for t in toks:
            if m.is_stopped() or m.is_error() or not m.consume_token(t):
                break
            active += 1
    return active / max(1, sum(len(t) for t in outputs))
