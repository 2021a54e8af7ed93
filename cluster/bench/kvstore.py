"""`manta bench kvstore`: the shared KV store's data path and what it buys a long prompt.

1. Store bandwidth (`kvstore.bench.bench_store`): batch_set and batch_get of pages the size of
   one store key of the model, client staging <-> the store's RAM tier (NIXL over UCX), and
   get from the file tier after a store restart.
2. Time to first token of a long prompt (max_tokens=1, in-process engine, TP=1), per prompt:
   - cold: nothing cached, the whole prompt is prefilled;
   - store: a fresh engine (empty radix cache and host tier) loads the prefix from the store
     (probe, prefetch into the host tier, load into the device pool) and prefills the rest;
   - host: the first engine again after its radix cache is dropped: the prefix comes from
     its ranks' host tier (no store transfer);
   - radix: the same engine again, prefix in the device pool (the floor).
   Medians over `--num-prompts` distinct prompts (each is new to every tier when cold).
"""

from __future__ import annotations

import statistics
import tempfile
import time

from cluster.engine.config import EngineConfig, default_cache_dir
from cluster.engine.kv_offload import MIN_PAGE_TOKENS
from workers.sampling_params import SamplingParams

BENCH_MODEL = dict(layers=4, hidden=512, heads=8, kv_heads=4, intermediate=1408, vocab=2048, max_position=8192)


def bench_model_dir() -> str:
    """A random Llama big enough that a long prefill costs real time on CPU (built once)."""
    from workers.make_model import make_model

    out = default_cache_dir() / "models" / "bench-kvstore-llama"
    if not (out / "config.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        make_model(tmp, "llama", **BENCH_MODEL)
        tmp.rename(out)
    return str(out)


def _ttft(engine, prompt: list[int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    res = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))[0]
    return time.perf_counter() - t0, res.cached_tokens


def _wait_stored(store, n_keys: int, timeout_s: float = 120.0) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    while ray.get(store.stats.remote())["pages"] < n_keys:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the store did not receive {n_keys} keys in {timeout_s:.0f}s")
        time.sleep(0.02)


def bench_ttft(config: EngineConfig, input_len: int, num_prompts: int, seed: int = 0) -> dict:
    import random

    import ray

    from cluster.engine.loop import Engine
    from cluster.kv_store_setup import ensure_kv_store, kv_store_stats

    # Each prompt's pages must reach the store as soon as the warm engine computed them.
    config = config.replace(kv_write_policy="write_through")
    store, _ = ensure_kv_store(config)
    if store is None:
        raise RuntimeError("the KV store did not start")
    ray.get(store.clear.remote())
    warm, fresh = Engine(config), None
    rng = random.Random(seed)
    vocab = warm.model_config.vocab_size
    prompts = [[rng.randrange(10, vocab - 1) for _ in range(input_len)] for _ in range(num_prompts + 1)]
    rows: dict[str, list[float]] = {"cold": [], "store": [], "host": [], "radix": []}
    cached: dict[str, int] = {}
    try:
        _ttft(warm, prompts[-1])  # warm-up: kernels, the client's first NIXL connection
        fresh = Engine(config)
        _ttft(fresh, prompts[-1])
        per_prompt_keys = (input_len - 1) // config.page_size * 2 * config.tp_size  # MHA: K and V per rank
        stored = ray.get(store.stats.remote())["pages"]
        for p in prompts[:-1]:
            t, _ = _ttft(warm, p)
            rows["cold"].append(t)
            stored += per_prompt_keys
            _wait_stored(store, stored)
            t, cached["store"] = _ttft(fresh, p)
            rows["store"].append(t)
            warm.scheduler.radix.evict(10**9)
            t, cached["host"] = _ttft(warm, p)
            rows["host"].append(t)
            t, cached["radix"] = _ttft(warm, p)
            rows["radix"].append(t)
        stats = kv_store_stats(fresh)
    finally:
        warm.shutdown()
        if fresh is not None:
            fresh.shutdown()
        ray.get(store.shutdown.remote(), timeout=60)  # flush, stop the flusher before the process exits
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {"input_len": input_len, "num_prompts": num_prompts, "page_size": config.page_size,
            "ttft_ms": {k: v * 1e3 for k, v in med.items()},
            "speedup_store_vs_cold": med["cold"] / med["store"], "cached_tokens": cached,
            "store_hit_pages": stats["hit_pages"], "store_errors": stats["errors"]}


def run_bench_kvstore(config: EngineConfig, input_len: int, num_prompts: int, store_pages: int) -> dict:
    """Both parts; `config` gets a page size of at least MIN_PAGE_TOKENS and a store directory."""
    import ray

    from cluster.engine.kv_store_link import replica_identity
    from kvstore.bench import bench_store

    changes: dict = {}
    if config.page_size < MIN_PAGE_TOKENS:
        changes["page_size"] = MIN_PAGE_TOKENS
    if config.kv_store is None:
        changes["kv_store"] = tempfile.mkdtemp(prefix="manta-kvbench-")
    if config.kv_cache_tokens is None:
        changes["kv_cache_tokens"] = max(4 * input_len, 8192)
    config = config.replace(**changes)
    if not ray.is_initialized():
        ray.init(address="local", include_dashboard=False, namespace="manta-bench")
    ident = replica_identity(config)
    if ident is None:
        raise SystemExit(f"{config.model} cannot use the KV store (see cluster/kv_store_setup.py)")
    key_bytes = ident[2]
    out = {"model": config.model, "key_bytes": key_bytes,
           "store": bench_store(num_pages=store_pages, page_bytes=key_bytes, batch_pages=32, repeats=3,
                                print_table=False),
           "ttft": bench_ttft(config, input_len, num_prompts)}
    out["store"].pop("client", None)
    return out
