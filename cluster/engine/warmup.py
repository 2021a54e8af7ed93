"""A replica's warm-up before it takes traffic: the first requests a server answers should not
pay for kernels compiled on first use (Triton JIT, CUDA-graph replays of new batch sizes),
which on a fresh machine costs seconds, and the first MIXED step's tens of milliseconds.

`warm_up` runs the three kinds of step a server sees — a prefill, decodes, and a prefill chunk
joining running decodes (MIXED) — on random prompts, then forgets them: the prefix cache is
flushed (its pages freed; the KV store is detached meanwhile: no lookup, nothing saved) and the
scheduler's counters restart, so the first user request finds the engine as if new.
"""

from __future__ import annotations

import logging
import random
import time

from workers.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def warm_up(engine, prompt_len: int = 512) -> float | None:
    """Warm `engine` (idle, its loop not started); returns the seconds it took, or None when
    the model serves no generation (embeddings, encoder-decoder: nothing to warm this way)."""
    mc = engine.model_config
    if engine.serving.is_embedding or mc.is_encoder_decoder:
        return None
    t0 = time.perf_counter()
    # The KV store stays out of it: no lookups, and no page saved (whatever the write policy).
    sched = engine.scheduler
    store, on_evict = sched.kv_offload, sched.radix.on_evict
    sched.kv_offload = engine.kv_offload = None
    sched.radix.on_evict = None
    try:
        n = _run(engine, prompt_len)
        sched.flush_cache()
    finally:
        sched.kv_offload = engine.kv_offload = store
        sched.radix.on_evict = on_evict
    dt = time.perf_counter() - t0
    logger.info("warm-up: %.2f s (a prefill of %d tokens beside decodes)", dt, n)
    return dt


def _run(engine, prompt_len: int) -> int:
    from cluster.engine.loop import GenerationResult

    mc = engine.model_config
    rng = random.Random(0)
    n = max(2, min(prompt_len, engine.max_context_len - 16))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first, second = GenerationResult(rid=""), GenerationResult(rid="")
    first.rid = engine.add_request([rng.randrange(10, mc.vocab_size - 1) for _ in range(8)], params, first.add)
    while not first.token_ids and engine.has_work():
        engine.step()
    # Its prefill joins the first request's decodes: a MIXED step.
    second.rid = engine.add_request([rng.randrange(10, mc.vocab_size - 1) for _ in range(n)], params, second.add)
    while engine.has_work():
        engine.step()
    if first.error or second.error:
        raise RuntimeError(f"warm-up failed: {first.error or second.error}")
    return n
