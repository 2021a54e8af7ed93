"""`manta`: make-model, generate, serve, bench."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from cluster.engine.config import ConfigError
from cluster.engine_args import add_engine_args, engine_config_from_args, require_checkpoint


def cmd_generate(args: argparse.Namespace) -> int:
    from cluster.engine.scheduler import RequestRejected
    from workers.sampling_params import SamplingParams, SamplingParamsError

    config = engine_config_from_args(args)
    require_checkpoint(config.model, config.load_format)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.sampling_seed, stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos,
    )
    try:  # before the model loads: a bad parameter is refused at once
        params.validate()
    except SamplingParamsError as exc:
        print(f"manta generate: invalid request: {exc}", file=sys.stderr)
        return 2
    from cluster.engine.loop import Engine

    engine = Engine(config)
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
        from cluster.bench.command import add_bench_parser

        add_bench_parser(sub)
    except ImportError as exc:
        logging.getLogger(__name__).debug("bench unavailable: %s", exc)

    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
    except ConfigError as exc:  # an option out of range: the usage error argparse would give, no traceback
        flag = next((a.option_strings[0] for a in sub.choices[args.command]._actions
                     if a.dest == exc.field and a.option_strings), exc.field)
        print(f"manta {args.command}: error: {flag}: {exc.msg}", file=sys.stderr)
        return 2
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
