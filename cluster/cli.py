"""`manta`: make-model, generate, serve, bench."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from cluster.config import EngineConfig, default_cache_dir
from cluster.kv_store_setup import add_kv_store_args, kv_store_config_from_args

DEFAULT_MODEL_ARCH = "llama"


def default_model_dir() -> Path:
    """The embedded default: a small random Llama built offline into the cache dir (once)."""
    out = default_cache_dir() / "models" / "tiny-llama"
    if not (out / "config.json").exists():
        from workers.make_model import make_model

        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        make_model(tmp, DEFAULT_MODEL_ARCH, layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256,
                   vocab=1024, max_position=2048)
        tmp.rename(out)
    return out


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF-format checkpoint directory (default: a tiny built-in model)")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--tp", type=int, default=1, dest="tp_size")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--kv-cache-tokens", type=int, default=None)
    p.add_argument("--mem-fraction", type=float, default=0.85)
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--chunked-prefill-size", type=int, default=2048)
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--attention-backend", default="flash", choices=["flash", "reference", "mla"],
                   help="flash: MHA/GQA and MLA models (kernels chosen at start-up); reference: the torch "
                        "reference (MHA/GQA); mla: the dedicated MLA backend (MLA models)")
    p.add_argument("--is-embedding", action="store_true")
    p.add_argument("--max-context-len", type=int, default=None)
    p.add_argument("--max-waiting", type=int, default=0)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="plan each step after the previous one's tokens are known")
    p.add_argument("--speculative-draft-model", default=None,
                   help="draft model directory (same tokenizer) for speculative decoding")
    p.add_argument("--speculative-num-tokens", type=int, default=4, help="draft tokens proposed per round")
    add_kv_store_args(p)


ENGINE_ARG_NAMES = (
    "tokenizer", "served_model_name", "device", "dtype", "tp_size", "page_size", "kv_cache_tokens",
    "mem_fraction", "max_running_requests", "max_num_batched_tokens", "chunked_prefill_size",
    "disable_radix_cache", "attention_backend", "is_embedding", "max_context_len", "max_waiting",
    "disable_cuda_graph", "disable_overlap_schedule", "speculative_draft_model", "speculative_num_tokens",
)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    model = args.model or str(default_model_dir())
    return EngineConfig(model=model, **{k: getattr(args, k) for k in ENGINE_ARG_NAMES},
                        **kv_store_config_from_args(args))


def cmd_generate(args: argparse.Namespace) -> int:
    from cluster.engine import Engine
    from workers.sampling_params import SamplingParams

    engine = Engine(engine_config_from_args(args))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.sampling_seed, stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos,
    )
    from cluster.scheduler import RequestRejected
    from workers.sampling_params import SamplingParamsError

    try:
        results = engine.generate(args.prompt, params)
    except (SamplingParamsError, RequestRejected) as exc:
        print(f"manta generate: invalid request: {exc}", file=sys.stderr)
        return 2
    finally:
        engine.shutdown()
    for r in results:
        obj = {"text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason}
        print(json.dumps(obj) if args.json else r.text)
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="manta", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from workers.make_model import add_make_model_args, run_make_model

    mm = sub.add_parser("make-model", help="write a small random HF-format checkpoint")
    add_make_model_args(mm)
    mm.set_defaults(func=run_make_model)

    gen = sub.add_parser("generate", help="generate offline for one or more prompts")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", required=True)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None, dest="sampling_seed", help="sampling seed")
    gen.add_argument("--stop", action="append")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true")
    gen.set_defaults(func=cmd_generate)

    try:
        from cluster.serve_cli import add_serve_parser  # the HTTP server and Ray cluster

        add_serve_parser(sub)
    except ImportError as exc:  # serving needs ray/fastapi; generate does not
        logging.getLogger(__name__).debug("serve unavailable: %s", exc)
    try:
        from cluster.bench import add_bench_parser

        add_bench_parser(sub)
    except ImportError as exc:
        logging.getLogger(__name__).debug("bench unavailable: %s", exc)

    args = parser.parse_args(argv)
    rc = args.func(args)
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
