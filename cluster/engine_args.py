"""The engine's command-line flags, shared by `manta generate`, `manta serve` and `manta bench`,
and the `EngineConfig` they make (with the embedded default model when none is given)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from attention.kernel_options import KernelOptions
from cluster.engine.config import ConfigError, EngineConfig, default_cache_dir
from cluster.kv_store_setup import add_kv_store_args, kv_store_config_from_args
from workers.kv_quant import KV_CACHE_DTYPES

DEFAULT_MODEL_ARCH = "llama"


def require_checkpoint(model: str, load_format: str = "auto") -> None:
    """Refuse a model path that is not a checkpoint directory here, or one without weights
    unless they are to be random (`load_format` "dummy"): ConfigError, for the CLI."""
    if not (Path(model) / "config.json").is_file():
        raise ConfigError("model", f"{model} is not a checkpoint directory (it has no config.json)")
    if load_format != "dummy" and not any(Path(model).glob("*.safetensors")):
        raise ConfigError("model", f"{model} has no *.safetensors weights (--load-format dummy serves random "
                                   "weights at its config's shapes)")


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
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: quantize the linear weights of an unquantized checkpoint at load (one scale per "
                        "output channel); FP8 checkpoints (block-wise, compressed-tensors) load as they are")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights at the checkpoint's names and shapes (a directory with its "
                        "config.json and tokenizer is enough: `manta make-model --no-weights`), for benchmarks; "
                        "auto: the checkpoint's weights")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="fp8_e4m3 (or fp8): the KV cache in FP8, one byte per value with a scale per layer (the "
                        "checkpoint's kv_cache_scheme scales, else 1.0): twice the tokens in the same memory; "
                        "auto: the model's dtype")
    p.add_argument("--tp", type=int, default=1, dest="tp_size")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--kv-cache-tokens", type=int, default=None)
    p.add_argument("--mem-fraction", type=float, default=0.85)
    p.add_argument("--gpus-per-rank", type=float, default=1.0,
                   help="share of one GPU per TP rank (0.5: two replicas on one GPU); the KV cache takes "
                        "mem-fraction x this of the GPU's memory")
    p.add_argument("--sm-percent", type=int, default=None,
                   help="under CUDA MPS (an nvidia-cuda-mps-control daemon on the node): the percentage of the "
                        "GPU's SMs each rank's kernels may occupy, so replicas sharing a GPU leave each other room")
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--chunked-prefill-size", type=int, default=2048)
    p.add_argument("--mixed-prefill-tokens", type=int, default=EngineConfig.mixed_prefill_tokens,
                   help="most prompt tokens a step computes while requests are decoding, so that their next "
                        "tokens never wait on a burst of prompts (0: only --max-num-batched-tokens bounds them; default: 1024 "
                        "where prompt pieces run as CUDA graphs, else 0; measured, BENCHMARKS.md)")
    p.add_argument("--itl-target-ms", type=float, default=None,
                   help="time target for a step that computes prompt tokens beside decodes (the gap it puts "
                        "between a stream's tokens): its prompt tokens are what the engine predicts fits, from "
                        "its own measured steps, at most --mixed-prefill-tokens (default: the fixed cap alone)")
    p.add_argument("--ttft-target-ms", type=float, default=None,
                   help="with --itl-target-ms: when the prompts waiting would take the capped steps longer than "
                        "this to compute, their cap grows (up to --mixed-prefill-tokens) until they would "
                        "not, so a burst costs a few longer gaps instead of a growing queue (default: 8 x "
                        "--itl-target-ms)")
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--attention-backend", default="flash", choices=["flash", "reference", "mla"],
                   help="flash: MHA/GQA and MLA models (kernels chosen at start-up); reference: the torch "
                        "reference (MHA/GQA); mla: flash, insisting on an MLA model")
    p.add_argument("--is-embedding", action="store_true")
    p.add_argument("--max-context-len", type=int, default=None)
    p.add_argument("--max-waiting", type=int, default=0,
                   help="requests each replica queues beyond its free running slots before answering 503 "
                        "(0: unbounded)")
    p.add_argument("--step-timeout", dest="step_timeout_s", type=float, default=EngineConfig.step_timeout_s,
                   help="seconds a TP rank may take to answer a step before the replica counts it as hung, "
                        "fails its requests and rebuilds its TP group (0: wait forever)")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--no-pdl", action="store_true",
                   help="launch the decode kernels without programmatic dependent launch (per-kernel profiles; "
                        "also MANTA_PDL=0)")
    p.add_argument("--no-one-row-gemv", action="store_true",
                   help="batch-1 products on the unfused torch ops, not the fused Triton GEMV (a baseline; "
                        "also MANTA_GEMV=0)")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="plan each step after the previous one's tokens are known")
    p.add_argument("--speculative-draft-model", default=None,
                   help="draft model directory (same tokenizer) for speculative decoding")
    p.add_argument("--speculative-num-tokens", type=int, default=4, help="draft tokens proposed per round")
    add_kv_store_args(p)


ENGINE_ARG_NAMES = (
    "tokenizer", "served_model_name", "device", "dtype", "quantization", "load_format", "kv_cache_dtype", "tp_size",
    "page_size",
    "kv_cache_tokens",
    "mem_fraction", "gpus_per_rank", "sm_percent", "max_running_requests", "max_num_batched_tokens", "chunked_prefill_size",
    "mixed_prefill_tokens", "itl_target_ms", "ttft_target_ms", "disable_radix_cache", "attention_backend", "is_embedding", "max_context_len",
    "max_waiting", "step_timeout_s",
    "disable_cuda_graph", "disable_overlap_schedule", "speculative_draft_model", "speculative_num_tokens",
)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    model = args.model or str(default_model_dir())
    env = KernelOptions.from_env()
    kernels = dataclasses.replace(env, pdl=env.pdl and not args.no_pdl,
                                  one_row_gemv=env.one_row_gemv and not args.no_one_row_gemv)
    return EngineConfig(model=model, **{k: getattr(args, k) for k in ENGINE_ARG_NAMES},
                        **kv_store_config_from_args(args), kernels=kernels)
