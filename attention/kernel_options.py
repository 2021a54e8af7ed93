"""The kernel options of a rank: one frozen object, built once, logged at start-up.

The engine builds it with its config (`KernelOptions.from_env`, overridden by `manta serve`'s
`--no-pdl` / `--no-one-row-gemv`), passes it to every rank in `RunnerOptions.kernels`, and each
rank installs it (`install`) before it loads its model; the kernels read `current()`. So the
options of a replica are those of the process that started it, the same on every node, and no
kernel reads the environment at a time of its own choosing.

What is left to choose is what a user or a benchmark needs:
- `one_row_gemv` (`MANTA_GEMV=0` turns it off): batch-1 products through the Triton GEMV with
  its fused prologues and epilogues (`workers.layers.gemv`); off, the unfused torch ops (the
  baseline a benchmark compares against).
- `pdl` (`MANTA_PDL=0`): programmatic dependent launch of the decode kernels
  (`attention.pdl`); off for per-kernel times in a profile.
- `mixed_split` (`MANTA_MIXED_SPLIT=0`): a MIXED step runs its decode rows through their CUDA
  graph and its prompt pieces as a second, eager forward (`workers.pipeline`); off, the whole
  step runs as one eager forward (the baseline).
- `prompt_graphs` (`MANTA_PROMPT_GRAPHS=0`): prompt batches of up to the chunk size run as
  CUDA graphs of the layers between attention calls, per token-count bucket
  (`workers.prompt_graphs`); off, eagerly (the baseline).
- `gemv_configs` (`MANTA_GEMV_CONFIGS="NxK:block_n,block_k,split_k,num_warps[,vec[,prefetch]];..."`): launches to
  try for given product shapes (tuning).
- `decode_zero_bias` (`MANTA_ZERO_BIAS=0`): the 16-bit products of decode batches for which cuBLASLt's
  heuristic picks a faster kernel, through its bias epilogue with a zero bias (`workers.layers.lt_bias`
  says which); off, plain `F.linear`.
- `triton_prefill` (`MANTA_TRITON_PREFILL=0`): prompt attention of head dim 128 on a Hopper GPU
  through the Triton varlen kernel (`attention.triton_varlen`); off, ATen's FlashAttention (or
  flash-attn's where installed), as for other head dims and on other GPUs.
- `fp8_rows` (`MANTA_FP8_ROWS=0`): the RMSNorms and SiLU·up before per-channel FP8 products of
  W8A8 size write their rows quantized per token (`workers.layers.quant_rows`); off, a 16-bit
  row that the product's own quantization kernel reads (the baseline).
- `fp8_kv_words` (`MANTA_FP8_KV_WORDS=0`): the paged decode of small batches loads an FP8 KV
  cache as 16-bit words and widens each to two float16 values in registers
  (`attention.triton_decode.widens_words`); off, it loads e4m3 elements and converts them where
  Triton places the conversion, as larger batches always do (the baseline).
- `fp8_tma` (`MANTA_FP8_TMA=0`): per-channel FP8 products of decode batches on a Hopper GPU
  through the TMA-fed Triton kernel (`workers.layers.fp8_tma`) where `fp8_tma.launch` has a
  launch for the shape; off, W8A16 tiles below A8_MIN_M rows and cuBLAS's row-wise product (or
  the pointer-load W8A8 kernel) from there (the baseline). The step A/B on an H200
  (`gpu_bench.sh fp8tmaab`, BENCHMARKS.md, 2026-12-06): batch 16 5.15 -> 3.55 ms, batch 64
  5.19 -> 4.80, batch 128 6.58 -> 6.17.
- `fp8_kv_mma` (`MANTA_FP8_KV_MMA=1` turns it on; off by default): the paged decode over an FP8
  cache on a Hopper GPU puts the keys on the MMA's M side and multiplies them as e4m3 against
  queries quantized per head (`attention.triton_decode_mma`), instead of widening every cached
  element to float16 (the baseline). Compiled for sm_90 it issues 19% fewer instructions a block
  than the element loads of serve batches and takes 116 registers against 255, yet on an H100
  (`gpu_bench.sh kvmma`, BENCHMARKS.md, 2026-12-07) it was 3-5% slower than the shipped loads
  at batches 16-256 alone and 0.5-1.9% slower on the FP8 step at batches 16-128: off. There the
  shipped loads were already at 77-87% of the copy bandwidth; an H200 (40% more bandwidth, the
  same SMs) is where fewer instructions could still pay, and its A/B is not run yet.
Switches whose A/B is settled in BENCHMARKS.md kept no old path (GEMV_AHEAD, GEMV_ADD,
GEMV_ROPE, DECODE_EARLY, DECODE_SPECIALIZE, DECODE_PREP).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)

GemvLaunch = tuple[int, ...]  # block_n, block_k, split_k, num_warps[, vec[, prefetch 0 or 1]]


@dataclass(frozen=True)
class KernelOptions:
    one_row_gemv: bool = True
    pdl: bool = True
    mixed_split: bool = True
    prompt_graphs: bool = True
    gemv_configs: tuple[tuple[str, GemvLaunch], ...] = ()  # ("NxK", launch)
    decode_zero_bias: bool = True
    triton_prefill: bool = True
    fp8_rows: bool = True
    fp8_kv_words: bool = True
    fp8_tma: bool = True
    fp8_kv_mma: bool = False  # opt-in: slower on an H100 (above)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> KernelOptions:
        return cls(one_row_gemv=environ.get("MANTA_GEMV") != "0", pdl=environ.get("MANTA_PDL") != "0",
                   mixed_split=environ.get("MANTA_MIXED_SPLIT") != "0",
                   prompt_graphs=environ.get("MANTA_PROMPT_GRAPHS") != "0",
                   gemv_configs=parse_gemv_configs(environ.get("MANTA_GEMV_CONFIGS", "")),
                   decode_zero_bias=environ.get("MANTA_ZERO_BIAS") != "0",
                   triton_prefill=environ.get("MANTA_TRITON_PREFILL") != "0",
                   fp8_rows=environ.get("MANTA_FP8_ROWS") != "0",
                   fp8_kv_words=environ.get("MANTA_FP8_KV_WORDS") != "0",
                   fp8_tma=environ.get("MANTA_FP8_TMA") != "0",
                   fp8_kv_mma=environ.get("MANTA_FP8_KV_MMA") == "1")

    def gemv_launch(self, n: int, k: int) -> GemvLaunch | None:
        shape = f"{n}x{k}"
        return next((launch for s, launch in self.gemv_configs if s == shape), None)

    def describe(self) -> str:
        parts = [f"one-row GEMV {'on' if self.one_row_gemv else 'off'}", f"PDL {'on' if self.pdl else 'off'}",
                 f"MIXED split {'on' if self.mixed_split else 'off'}",
                 f"prompt graphs {'on' if self.prompt_graphs else 'off'}",
                 f"decode zero bias {'on' if self.decode_zero_bias else 'off'}",
                 f"Triton prefill {'on' if self.triton_prefill else 'off'}",
                 f"FP8 rows {'on' if self.fp8_rows else 'off'}",
                 f"FP8 KV words {'on' if self.fp8_kv_words else 'off'}",
                 f"FP8 TMA {'on' if self.fp8_tma else 'off'}", f"FP8 KV MMA {'on' if self.fp8_kv_mma else 'off'}"]
        if self.gemv_configs:
            parts.append("GEMV launches " + "; ".join(f"{s}:{','.join(map(str, c))}" for s, c in self.gemv_configs))
        return ", ".join(parts)


def parse_gemv_configs(text: str) -> tuple[tuple[str, GemvLaunch], ...]:
    out = []
    for item in filter(None, text.split(";")):
        shape, _, launch = item.partition(":")
        values = launch.split(",")
        n, x, k = shape.partition("x")
        if (not (x and n.isdigit() and k.isdigit()) or len(values) not in (4, 5, 6) or not all(v.isdigit() for v in values)
                or len(values) == 6 and values[5] not in ("0", "1")):
            raise ValueError(f"MANTA_GEMV_CONFIGS item {item!r}: want NxK:block_n,block_k,split_k,num_warps[,vec[,prefetch]]")
        out.append((shape, tuple(int(v) for v in values)))
    return tuple(out)


_current = KernelOptions()


def install(options: KernelOptions) -> None:
    """This process's kernels use `options` from now on (a rank, before it loads its model)."""
    global _current
    if options != _current:
        logger.info("kernel options: %s", options.describe())
    _current = options


def current() -> KernelOptions:
    return _current
