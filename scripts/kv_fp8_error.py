"""The logits error an FP8 KV cache adds to a model: the first-step logits of the same random
prompts with `--kv-cache-dtype auto` and `fp8_e4m3` (each prompt's last position, computed over
the cache its prefill wrote; with `--decode`, the first decode step's, read through the paged
decode kernel), their largest |difference| against the largest |logit|, the mean
relative error, and how often the greedy token agrees; beside it, for scale, the same against
FP8 weights (`--quantization fp8`), a perturbation users already accept. Prints a table and
writes JSON. Prompts run one at a time, or with `--together` all in one prefill step and one
decode step: the decode kernel's launch at that batch (at batch 1 it takes the small-batch
launches; serving batches, and `MANTA_FP8_KV_MMA`'s kernel, need 65 or more (request, KV head)
programs: 16 prompts of an 8-KV-head model make 128).

    python3 scripts/kv_fp8_error.py MODEL_DIR [--num-prompts 32] [--input-len 1024] [--decode] [--together]
        [--out FILE.json]
        [engine flags: --device cuda --page-size 16 --mem-fraction 0.6 --quantization fp8 ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import time

import torch

from cluster.engine.loop import Engine
from cluster.engine_args import add_engine_args, engine_config_from_args
from workers.model_config import ModelConfig
from workers.sampling_params import SamplingParams


def first_logits(config, prompts: list[list[int]], decode: bool = False, together: bool = False) -> torch.Tensor:
    """[prompts, vocab] float32: the logits of each prompt's last position (the prefill's), or
    with `decode` those of the first decode step, whose query reads the whole cache through the
    paged decode kernel: its input token is forced to the prompt's first (a logit bias), so every
    run decodes the same token whatever its prefill's greedy pick. `together`: every prompt in
    one prefill step and one decode step (`config` must let a step hold them all)."""
    engine = Engine(config)
    model = engine.workers.runner.model
    try:
        captured: list[torch.Tensor] = []
        original = model.compute_logits
        model.compute_logits = lambda h: (lambda x: captured.append(x.float().cpu()) or x)(original(h))
        params = [SamplingParams(max_tokens=2 if decode else 1, temperature=0.0, ignore_eos=True,
                                 logit_bias=((p[0], 100.0),) if decode else ()) for p in prompts]
        if together:
            plans = _record_plans(engine)
            outs = engine.generate(prompts, params)
            rows = _rows_by_request(plans, captured, [o.rid for o in outs], 1 if decode else 0)
        else:
            rows, outs = [], []
            for p, sp in zip(prompts, params):  # one at a time: each step's logits are one prompt's
                captured.clear()
                outs.append(engine.generate([p], sp)[0])
                rows.append(captured[1 if decode else 0][-1])
        for p, out in zip(prompts, outs):
            if decode and out.token_ids[0] != p[0]:
                raise RuntimeError(f"the logit bias did not force token {p[0]} (got {out.token_ids[0]})")
        return torch.stack(rows)
    finally:
        engine.shutdown()
        del engine, model  # (the capture closure is a cycle through the model: collected below)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the next engine sizes its KV pool from free memory


def _record_plans(engine: Engine) -> list:
    """The step plans the engine hands its workers, in order (one forward, one logits call each)."""
    plans: list = []
    for name in ("launch", "execute"):
        fn = getattr(engine.workers, name)
        setattr(engine.workers, name, lambda plan, *a, _fn=fn, **k: (plans.append(plan), _fn(plan, *a, **k))[1])
    return plans


def _rows_by_request(plans: list, captured: list[torch.Tensor], rids: list[str], nth: int) -> list[torch.Tensor]:
    """Each request's `nth` logits row (0: its prefill's, 1: its first decode step's), from steps
    that ran every request of one kind at once (a MIXED step orders its rows by kind, not by
    plan: refused rather than guessed)."""
    # (IDLE plans run no forward; a prompt chunk that is not its prompt's last samples nothing)
    plans = [plan for plan in plans if any(r.sample for r in plan.reqs)]
    for plan in plans:
        if plan.mode.name == "MIXED" or len(plan.reqs) != len(rids):
            raise RuntimeError(f"a {plan.mode.name} step of {len(plan.reqs)} of the {len(rids)} requests: raise "
                               "--max-num-batched-tokens / --max-running-requests to hold every prompt in one step")
    if len(plans) != len(captured):
        raise RuntimeError(f"{len(plans)} steps but {len(captured)} logits calls")
    seen: dict[str, list[torch.Tensor]] = {}
    for plan, logits in zip(plans, captured):
        sampled = [r.rid for r in plan.reqs if r.sample]
        if logits.shape[0] != len(sampled):
            raise RuntimeError(f"a {plan.mode.name} step of {len(sampled)} sampled rows gave {logits.shape[0]} logits rows")
        for rid, row in zip(sampled, logits):
            seen.setdefault(rid, []).append(row)
    return [seen[rid][nth] for rid in rids]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--decode", action="store_true",
                   help="the first decode step's logits (the paged decode kernel's error), CUDA graphs off so the "
                        "step's logits can be read")
    p.add_argument("--together", action="store_true",
                   help="every prompt in one prefill step and one decode step (the step budget is raised to hold "
                        "them): the decode kernel at that batch, as serving runs it")
    p.add_argument("--out", default=None)
    add_engine_args(p)
    args = p.parse_args()
    args.model = args.model_dir
    base = engine_config_from_args(args)
    if args.decode:
        base = dataclasses.replace(base, disable_cuda_graph=True)
    if args.together:
        base = dataclasses.replace(base, max_num_batched_tokens=max(base.max_num_batched_tokens,
                                                                    args.num_prompts * args.input_len),
                                   chunked_prefill_size=max(base.chunked_prefill_size, args.input_len),
                                   max_running_requests=max(base.max_running_requests, args.num_prompts))
    vocab = ModelConfig.from_pretrained(base.model).vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    ref = first_logits(dataclasses.replace(base, kv_cache_dtype="auto"), prompts, args.decode, args.together)
    runs = {"fp8_kv": dataclasses.replace(base, kv_cache_dtype="fp8_e4m3")}
    if base.quantization is None:  # for scale: the error FP8 weights (--quantization fp8) add to the same model
        runs["fp8_weights"] = dataclasses.replace(base, kv_cache_dtype="auto", quantization="fp8")
    result = {
        "model": base.model, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "dtype": base.dtype, "quantization": base.quantization, "num_prompts": args.num_prompts,
        "input_len": args.input_len, "decode": args.decode, "together": args.together, "date": time.strftime("%Y-%m-%d"),
    }
    print(f"\nlogits against {base.dtype or 'the checkpoint dtype'} with its own KV dtype: {args.num_prompts} x "
          f"{args.input_len} tokens\n" + "-" * 72)
    for name, config in runs.items():
        got = first_logits(config, prompts, args.decode, args.together)
        diff = (got - ref).abs()
        result[name] = {
            "max_abs_error_over_max_logit": diff.max().item() / ref.abs().max().item(),
            "mean_abs_error_over_mean_abs_logit": diff.mean().item() / ref.abs().mean().item(),
            "greedy_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
        }
        for k, v in result[name].items():
            print(f"{name + ' ' + k:<58}{v:>14.4f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
