"""`manta bench`: the project's benchmarks. Each prints a table and writes JSON.

- offline:  N prompts of fixed input/output lengths (ignore_eos) through the engine loop;
            output tokens/s and total tokens/s.
- latency:  decode step time at batch 1 and batch B.
- prefill:  prompt tokens/s as model FLOPs utilisation against the GPU's dense bf16 peak:
            cluster/bench/prefill.py.
- serve:    Poisson arrivals against a server (or the in-process engine): TTFT/TPOT/ITL.
- overhead: per-step cost of driving the TP group (in-process vs Ray actors), i.e. the
            driver's step time minus the worker's own compute time.
- spec:     offline tokens/s without and with speculative decoding (a draft that agrees, one
            that does not): cluster/bench/spec.py.
- kvstore:  the shared KV store's set/get bandwidth and the TTFT of a long prompt cold vs
            loaded from the store (and from the host tier, the radix cache): cluster/bench/kvstore.py.
- embed:    embeddings/s of the engine beside sentence-transformers on the same texts, model
            and machine (when the checkpoint is a sentence-transformers one), with their
            agreement (min cosine).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

from cluster.bench.offline import bench_offline, bench_structured, random_prompts
from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from workers.sampling_params import SamplingParams


def _print_table(title: str, rows: list[tuple[str, object]]) -> None:
    width = max(len(k) for k, _ in rows)
    print(f"\n{title}")
    print("-" * (width + 24))
    for k, v in rows:
        if isinstance(v, float):
            print(f"{k:<{width}}  {v:>20.3f}")
        else:
            print(f"{k:<{width}}  {v if isinstance(v, int | str) else json.dumps(v):>20}")


def _write(path: str | None, payload: dict) -> None:
    payload = {"date": date.today().isoformat(), "host": platform.node(), **payload}
    if path:
        Path(path).write_text(json.dumps(payload, indent=2))
        print(f"\nwrote {path}")


def _decode_step_times(engine: Engine, batch: int, input_len: int, steps: int) -> tuple[list[float], list[float]]:
    """Per pure-decode step at a fixed batch size: the wall time between the completions of
    consecutive steps (the engine's whole loop: planning, forward, sampling, detokenizing; with
    overlapped scheduling the steps overlap, so this is the rate they complete at) and the
    worker's own time for the step. The first prompts decode beside the later ones' chunks: with
    only `steps` tokens a large batch's first requests would finish before its last are
    prefilled, and no step would hold the whole batch. So each may also generate a token per 16
    prompt tokens of the batch (within the context), and all are aborted once `steps` + 3
    whole-batch steps are seen."""
    prompts = random_prompts(batch, input_len, engine.model_config.vocab_size, 1)
    extra = -(-batch * input_len // 16)
    params = SamplingParams(max_tokens=max(steps + 1, min(steps + 1 + extra, engine.max_context_len - input_len - 1)),
                            temperature=0.0, ignore_eos=True)
    stamps: list[tuple[float, float]] = []
    original = engine.scheduler.process_result

    def timed(plan, result):
        if plan.mode.is_decode() and len(plan.reqs) == batch:
            stamps.append((time.perf_counter(), result.compute_s))
        return original(plan, result)

    engine.scheduler.process_result = timed
    try:
        rids = [engine.add_request(p, params, lambda out: None) for p in prompts]
        while engine.has_work():
            engine.step()
            if len(stamps) >= steps + 3:
                for rid in rids:
                    engine.abort(rid)
    finally:
        engine.scheduler.process_result = original
    walls = [t1 - t0 for (t0, _), (t1, _) in zip(stamps, stamps[1:])]
    computes = [c for _, c in stamps[1:]]
    if len(walls) <= 2:
        raise RuntimeError(f"bench latency: no run of whole-batch decode steps at batch {batch}: the requests "
                           "ended first (is the KV cache large enough for the whole batch?)")
    return walls[2:], computes[2:]  # drop warm-up steps


def bench_latency(engine: Engine, batches: list[int], input_len: int, steps: int) -> dict:
    """Decode step time per batch size, beside the roofline (in-process worker groups only)."""
    from workers.group import InProcessWorkerGroup
    from workers.roofline import decode_roofline_ms, measure_copy_bandwidth

    runner = engine.workers.runner if isinstance(engine.workers, InProcessWorkerGroup) else None
    bandwidth = measure_copy_bandwidth(runner.device) if runner is not None else None
    rows: dict = {"copy_bandwidth_GBps": bandwidth / 1e9 if bandwidth else None}
    for b in batches:
        walls, computes = _decode_step_times(engine, b, input_len, steps)
        row = {"step_ms_mean": 1e3 * statistics.mean(walls),
               "step_ms_p50": 1e3 * statistics.median(walls),
               "compute_ms_mean": 1e3 * statistics.mean(computes)}
        if runner is not None:
            context = input_len + steps // 2
            roof = decode_roofline_ms(runner.model, runner.kv_pool.bytes_per_token(), b, context, bandwidth)
            row["roofline_ms"] = roof
            row["fraction_of_roofline"] = roof / row["step_ms_p50"]
        rows[str(b)] = row
    return rows


def bench_overhead(config: EngineConfig, batch: int, input_len: int, steps: int, cpus_per_rank: float) -> dict:
    """Decode step through the in-process group and through Ray rank actors, one step at a
    time (step = worker compute + the overhead of driving the group), and through the actors
    overlapped (step only: planning and the round trip hide behind the ranks' compute)."""
    import ray

    from cluster.engine.ranks import runner_options
    from workers.ray_group import RayWorkerGroup

    serial = dataclasses.replace(config, disable_overlap_schedule=True)
    out = {}
    if config.tp_size == 1:
        walls, computes = _decode_step_times(Engine(serial), batch, input_len, steps)
        out["in_process"] = _overhead_row(walls, computes)
    ray.init(address="local", num_cpus=max(4, config.tp_size), include_dashboard=False, ignore_reinit_error=True)
    group = RayWorkerGroup(runner_options(config), config.tp_size, cpus_per_rank=cpus_per_rank, name="bench")
    try:
        walls, computes = _decode_step_times(Engine(serial, workers=group), batch, input_len, steps)
        out["ray_actors"] = _overhead_row(walls, computes)
        walls, _ = _decode_step_times(Engine(dataclasses.replace(config, disable_overlap_schedule=False),
                                             workers=group), batch, input_len, steps)
        out["ray_actors_overlapped"] = {"step_ms": 1e3 * statistics.mean(walls)}
    finally:
        group.shutdown()
        ray.shutdown()
    return out


def _overhead_row(walls: list[float], computes: list[float]) -> dict:
    over = [w - c for w, c in zip(walls, computes)]
    return {"step_ms": 1e3 * statistics.mean(walls), "worker_compute_ms": 1e3 * statistics.mean(computes),
            "overhead_ms": 1e3 * statistics.mean(over),
            "overhead_pct": 100 * statistics.mean(over) / statistics.mean(walls)}


def _random_texts(n: int, words: int, seed: int) -> list[str]:
    """n texts of about `words` words each (between half and 1.5x), drawn from a fixed list."""
    import random

    vocab = ("the of and to in is was for on with as by at from it an be this that which or are "
             "model server request token batch cache memory time data system user answer question "
             "river mountain city music science history weather travel game light water").split()
    rng = random.Random(seed)
    return [" ".join(rng.choice(vocab) for _ in range(rng.randint(max(1, words // 2), max(1, 3 * words // 2))))
            for _ in range(n)]


def bench_embed(config: EngineConfig, num_prompts: int, words: int, st_batch_size: int, repeats: int = 5) -> dict:
    """The same texts through the engine (offline loop) and, for a sentence-transformers
    checkpoint, through its `encode` (same device, same threads). Runs alternate between the
    two, so both see the same machine load; each reports its best run."""
    import os

    import torch

    engine = Engine(config)
    limit = engine.max_context_len
    texts = _random_texts(num_prompts, words, 0)
    texts = [t if len(engine.tokenize(t)) <= limit else " ".join(t.split()[: limit // 2]) for t in texts]
    tokens = sum(len(engine.tokenize(t)) for t in texts)
    st = None
    if os.path.isfile(os.path.join(config.model, "modules.json")):
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(config.model, device=config.device)
        st.encode(texts[:8], batch_size=st_batch_size)
    engine.embed(texts[:8])  # warm-up
    times: dict[str, list[float]] = {"manta": [], "sentence_transformers": []}
    vectors = ref = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        vectors = torch.tensor([r.embedding for r in engine.embed(texts)])
        times["manta"].append(time.perf_counter() - t0)
        if st is not None:
            t0 = time.perf_counter()
            ref = st.encode(texts, batch_size=st_batch_size, convert_to_tensor=True, show_progress_bar=False)
            times["sentence_transformers"].append(time.perf_counter() - t0)
    engine.shutdown()
    out: dict = {"num_texts": num_prompts, "tokens": tokens, "torch_threads": torch.get_num_threads()}
    for name, ts in times.items():
        if ts:
            best = min(ts)
            out[name] = {"seconds_best": best, "seconds_median": statistics.median(ts),
                         "embeddings_per_s": num_prompts / best, "tokens_per_s": tokens / best}
    if st is not None:
        out["sentence_transformers"]["batch_size"] = st_batch_size
        out["speedup"] = out["manta"]["embeddings_per_s"] / out["sentence_transformers"]["embeddings_per_s"]
        out["min_cosine"] = float(torch.nn.functional.cosine_similarity(vectors, ref.cpu().float()).min())
    return out


def cmd_bench(args: argparse.Namespace) -> int:
    from cluster.engine_args import engine_config_from_args

    config = engine_config_from_args(args)
    payload: dict = {"mode": args.mode, "model": config.model, "device": config.device, "tp": config.tp_size}
    if args.mode == "offline":
        engine = Engine(config)
        if args.structured != "none":  # one untimed pass first: later runs must not pay warm-up costs
            bench_offline(engine, args.num_prompts, args.input_len, args.output_len)
        res = {"manta": bench_offline(engine, args.num_prompts, args.input_len, args.output_len)}
        if args.structured != "none":  # the same workload under a grammar, between two free runs (A/B/A)
            constrained = bench_offline(engine, args.num_prompts, args.input_len, args.output_len,
                                        structured=bench_structured(args.structured))
            again = bench_offline(engine, args.num_prompts, args.input_len, args.output_len)
            res[f"manta_{args.structured}"], res["manta_again"] = constrained, again
            free = (res["manta"]["output_tokens_per_s"] + again["output_tokens_per_s"]) / 2
            res["structured_cost"] = 1 - constrained["output_tokens_per_s"] / free
        if args.compare_transformers:
            import gc

            import torch

            from cluster.bench.serve import run_transformers_offline

            engine.shutdown()
            del engine
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            prompts = random_prompts(args.num_prompts, args.input_len, 1000, 0)
            try:
                res["transformers"] = run_transformers_offline(config.model, prompts, args.output_len,
                                                               config.device, config.dtype)
                res["speedup"] = (res["manta"]["output_tokens_per_s"]
                                  / res["transformers"]["output_tokens_per_s"])
            except Exception as exc:  # the baseline's API moves between transformers releases
                res["transformers_error"] = f"{type(exc).__name__}: {exc}"
                print(f"transformers baseline failed: {res['transformers_error']}")
        else:
            engine.shutdown()
        payload["result"] = res
        _print_table(f"offline: {args.num_prompts} x ({args.input_len} in, {args.output_len} out)",
                     [(f"{g} {k}", v) for g, row in res.items() if isinstance(row, dict) for k, v in row.items()]
                     + ([("speedup vs transformers", res["speedup"])] if "speedup" in res else [])
                     + ([("structured output cost", res["structured_cost"])] if "structured_cost" in res else [])
                     + [(f"{g} tokens under the grammar", row["constrained_token_share"]) for g, row in res.items()
                        if isinstance(row, dict) and "constrained_token_share" in row])
    elif args.mode == "serve":
        import asyncio

        from cluster.bench.serve import BenchFailed, run_http, run_in_process

        if args.url:
            from transformers import AutoConfig

            vocab = AutoConfig.from_pretrained(config.model).vocab_size
            prompts = random_prompts(args.num_prompts, args.input_len, vocab, 0)
            warmup = random_prompts(2, args.input_len, vocab, 1)  # as the in-process run warms its engine
            try:
                res = asyncio.run(run_http(args.url, config.model_name, prompts, args.output_len, args.request_rate,
                                           warmup=warmup, server_pid=args.server_pid))
            except BenchFailed as exc:
                print(f"manta bench serve: error: {exc}", file=sys.stderr)
                return 1
        else:
            engine = Engine(config)
            prompts = random_prompts(args.num_prompts, args.input_len, engine.model_config.vocab_size, 0)
            bench_offline(engine, 2, args.input_len, 4)  # warm-up
            res = asyncio.run(run_in_process(engine, prompts, args.output_len, args.request_rate))
            engine.shutdown()
        payload["result"] = res
        _print_table(f"serve: {args.num_prompts} x ({args.input_len} in, {args.output_len} out) at "
                     f"{args.request_rate} req/s ({'HTTP ' + args.url if args.url else 'in-process engine'})",
                     [(k, v) for k, v in res.items() if k not in ("steps", "replica_steps", "replica_step_budget")]
                     + [(f"{k}: steps / mean ms / p99 ms / s",
                          f"{v['steps']} / {v['mean_ms']:.2f} / {v['p99_ms']:.2f} / {v['total_s']:.2f}")
                        for k, v in res.get("steps", {}).items()]
                     + [(f"{name} {mode}: steps / mean ms / p50, p99 under ms / > 40 ms",
                         f"{v['steps']} / {v['mean_ms']:.2f} / {v['p50_ms_under']:g}, {v['p99_ms_under']:g} / {v['over_40ms']}")
                        for name, modes in res.get("replica_steps", {}).items() for mode, v in modes.items()]
                     + [(f"{name} {mode}: slowest steps over 40 ms, ms (requests, input tokens)",
                         ", ".join(f"{x['ms']:.0f} ({x['reqs']}, {x['tokens']})" for x in v["slow"][:6]))
                        for name, modes in res.get("replica_steps", {}).items() for mode, v in modes.items()
                        if v.get("slow")]
                     + [(f"{name} step budget: capped / relaxed steps", f"{b.get('capped_steps')} / {b.get('relaxed_steps')}")
                        for name, b in res.get("replica_step_budget", {}).items()])
    elif args.mode == "latency":
        engine = Engine(config)
        res = bench_latency(engine, args.batch, args.input_len, args.steps)
        engine.shutdown()
        payload["result"] = res
        _print_table("decode step latency (ms)",
                     [(f"batch {b} {k}", v) for b, row in res.items() if isinstance(row, dict)
                      for k, v in row.items()] + [("copy bandwidth GB/s", res["copy_bandwidth_GBps"] or 0.0)])
    elif args.mode == "prefill":  # prompt throughput as model FLOPs utilisation: cluster/bench/prefill.py
        from cluster.bench.prefill import bench_prefill

        engine = Engine(config)
        res = bench_prefill(engine, args.num_prompts, args.input_len)
        engine.shutdown()
        payload["result"] = res
        _print_table(f"prefill: {args.num_prompts} x {args.input_len} tokens on {res['device_name']}",
                     [(k, v) for k, v in res.items() if k not in ("device_name",) and v is not None])
    elif args.mode == "embed":
        res = bench_embed(config, args.num_prompts, args.input_len, args.st_batch_size)
        payload["result"] = res
        _print_table(f"embed: {args.num_prompts} texts of ~{args.input_len} words ({res['tokens']} tokens), "
                     f"{res['torch_threads']} torch threads",
                     [(f"{g} {k}", v) for g, row in res.items() if isinstance(row, dict) for k, v in row.items()]
                     + [(k, res[k]) for k in ("speedup", "min_cosine") if k in res])
    elif args.mode == "overhead":
        res = bench_overhead(config, args.batch[-1], args.input_len, args.steps, args.cpus_per_rank)
        payload["result"] = res
        _print_table(f"per-step overhead at batch {args.batch[-1]} (ms)",
                     [(f"{g} {k}", v) for g, row in res.items() for k, v in row.items()])
    elif args.mode == "spec":
        from cluster.bench.spec import bench_spec

        res = bench_spec(config, args.batch, args.input_len, args.output_len, args.identity_tail_layers,
                         identity_tail_only=args.identity_tail_only)
        payload["result"] = res
        _print_table(f"speculative decoding, K={res['num_draft_tokens']}: batch {args.batch} x "
                     f"({args.input_len} in, {args.output_len} out), greedy",
                     [(f"{g} {b} {k}", v) for g, rows in res.items() if isinstance(rows, dict)
                      for b, row in rows.items() for k, v in row.items()])
    elif args.mode == "soak":
        from cluster.bench.soak import bench_soak

        payload["result"] = bench_soak(args)
    elif args.mode == "kvstore":  # store bandwidth + TTFT cold vs from the store: cluster/bench/kvstore.py
        from cluster.bench.kvstore import bench_model_dir, run_bench_kvstore

        if args.model is None:
            config = config.replace(model=bench_model_dir(), tokenizer=None)
            payload["model"] = config.model
        res = run_bench_kvstore(config, args.input_len, args.num_prompts, store_pages=256)
        payload["result"] = res
        _print_table(f"kvstore: {res['model']}, {args.input_len}-token prompts, key {res['key_bytes']} B",
                     [(f"store {k}", v) for k, v in res["store"].items() if k.endswith("MBps")]
                     + [(f"ttft_ms {k}", v) for k, v in res["ttft"]["ttft_ms"].items()]
                     + [("speedup store vs cold", res["ttft"]["speedup_store_vs_cold"])])
    elif args.mode == "routing":  # the router's policies on multi-turn conversations: cluster/bench/routing.py
        from cluster.bench.routing import Workload, bench_routing

        work = Workload(conversations=args.conversations, turns=args.turns, system_prompts=args.system_prompts,
                        system_len=args.system_len, user_len=args.user_len, output_len=args.output_len,
                        concurrency=args.concurrency)
        res = bench_routing(config, args.replicas, args.policies.split(","), work,
                            tree_max_tokens=args.tree_max_tokens)
        payload["result"] = {"workload": dataclasses.asdict(work), "policies": res}
        _print_table(f"routing: {args.replicas} replicas, {work.conversations} conversations x {work.turns} turns, "
                     f"{work.system_prompts} system prompts of {work.system_len} tokens",
                     [(f"{p} {k}", v) for p, row in res.items() for k, v in row.items()
                      if k in ("requests", "errors", "hit_rate", "local_hit_rate", "gpu_hit_rate", "host_hit_rate",
                               "store_hit_rate", "ttft_ms_p50", "ttft_ms_p90")])
    _write(args.out, payload)
    return 0


def add_bench_parser(sub) -> None:
    from cluster.engine_args import add_engine_args

    p = sub.add_parser("bench", help="benchmarks: offline throughput, decode latency, Ray overhead")
    p.add_argument("mode", choices=["offline", "latency", "prefill", "overhead", "serve", "embed", "spec", "soak",
                                    "kvstore",
                                    "routing"])
    add_engine_args(p)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--cpus-per-rank", type=float, default=1.0)
    p.add_argument("--out", default=None, help="write JSON here")
    p.add_argument("--compare-transformers", action="store_true",
                   help="offline: run the same workload through transformers' generate_batch")
    p.add_argument("--structured", default="none", choices=["none", "json", "regex"],
                   help="offline: also run the workload with every request under a JSON schema or a regex")
    p.add_argument("--request-rate", type=float, default=16.0, help="serve: Poisson arrivals per second")
    p.add_argument("--url", default=None, help="serve: a running server (else the in-process engine)")
    p.add_argument("--st-batch-size", type=int, default=64, help="embed: sentence-transformers' batch size")
    p.add_argument("--identity-tail-layers", type=int, default=0,
                   help="spec: also a target whose layers from M on are identities, drafted by its first M")
    p.add_argument("--identity-tail-only", action="store_true",
                   help="spec: run only the identity-tail pair (skip baseline, agree and disagree: on a GPU each "
                        "loads another copy of the model)")
    p.add_argument("--replicas", type=int, default=2, help="routing: replicas of each policy's cluster")
    p.add_argument("--policies", default="round_robin,tree,events",
                   help="routing: comma-separated, of round_robin, tree (cache_aware on the router's memory), "
                        "events (cache_aware on the replicas' KV events)")
    p.add_argument("--conversations", type=int, default=32, help="routing: conversations")
    p.add_argument("--turns", type=int, default=6, help="routing: turns per conversation")
    p.add_argument("--system-prompts", type=int, default=4, help="routing: system prompts the conversations share")
    p.add_argument("--system-len", type=int, default=256, help="routing: tokens per system prompt")
    p.add_argument("--user-len", type=int, default=32, help="routing: tokens per user message")
    p.add_argument("--tree-max-tokens", type=int, default=None,
                   help="routing: the router's memory of what it sent where, tokens per replica (default 200,000)")
    from cluster.bench.soak import add_soak_args

    add_soak_args(p)
    p.set_defaults(func=cmd_bench)
