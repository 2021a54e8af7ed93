"""The logits error an FP8 KV cache adds to a model: the first-step logits of the same random
prompts with `--kv-cache-dtype auto` and `fp8_e4m3` (each prompt's last position, computed over
the cache its prefill wrote; with `--decode`, the first decode step's, read through the paged
decode kernel), their largest |difference| against the largest |logit|, the mean
relative error, and how often the greedy token agrees; beside it, for scale, the same against
FP8 weights (`--quantization fp8`), a perturbation users already accept. Prints a table and
writes JSON.

    python3 scripts/kv_fp8_error.py MODEL_DIR [--num-prompts 32] [--input-len 1024] [--decode] [--out FILE.json]
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


def first_logits(config, prompts: list[list[int]], decode: bool = False) -> torch.Tensor:
    """[prompts, vocab] float32: the logits of each prompt's last position (the prefill's), or
    with `decode` those of the first decode step, whose query reads the whole cache through the
    paged decode kernel: its input token is forced to the prompt's first (a logit bias), so every
    run decodes the same token whatever its prefill's greedy pick."""
    engine = Engine(config)
    model = engine.workers.runner.model
    try:
        captured: list[torch.Tensor] = []
        original = model.compute_logits
        model.compute_logits = lambda h: (lambda x: captured.append(x.float().cpu()) or x)(original(h))
        rows = []
        for p in prompts:  # one at a time: each step's logits are one prompt's
            captured.clear()
            params = SamplingParams(max_tokens=2 if decode else 1, temperature=0.0, ignore_eos=True,
                                    logit_bias=((p[0], 100.0),) if decode else ())
            out = engine.generate([p], params)[0]
            if decode and out.token_ids[0] != p[0]:
                raise RuntimeError(f"the logit bias did not force token {p[0]} (got {out.token_ids[0]})")
            rows.append(captured[1 if decode else 0][-1])
        return torch.stack(rows)
    finally:
        engine.shutdown()
        del engine, model  # (the capture closure is a cycle through the model: collected below)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the next engine sizes its KV pool from free memory


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--decode", action="store_true",
                   help="the first decode step's logits (the paged decode kernel's error), CUDA graphs off so the "
                        "step's logits can be read")
    p.add_argument("--out", default=None)
    add_engine_args(p)
    args = p.parse_args()
    args.model = args.model_dir
    base = engine_config_from_args(args)
    if args.decode:
        base = dataclasses.replace(base, disable_cuda_graph=True)
    vocab = ModelConfig.from_pretrained(base.model).vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    ref = first_logits(dataclasses.replace(base, kv_cache_dtype="auto"), prompts, args.decode)
    runs = {"fp8_kv": dataclasses.replace(base, kv_cache_dtype="fp8_e4m3")}
    if base.quantization is None:  # for scale: the error FP8 weights (--quantization fp8) add to the same model
        runs["fp8_weights"] = dataclasses.replace(base, kv_cache_dtype="auto", quantization="fp8")
    result = {
        "model": base.model, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "dtype": base.dtype, "quantization": base.quantization, "num_prompts": args.num_prompts,
        "input_len": args.input_len, "decode": args.decode, "date": time.strftime("%Y-%m-%d"),
    }
    print(f"\nlogits against {base.dtype or 'the checkpoint dtype'} with its own KV dtype: {args.num_prompts} x "
          f"{args.input_len} tokens\n" + "-" * 72)
    for name, config in runs.items():
        got = first_logits(config, prompts, args.decode)
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
