"""One frozen configuration tree for an engine (a replica), validated at start-up.

Options come from the CLI or from code; unknown options are errors (`EngineConfig.from_dict`).
External configs (the checkpoint's config.json) are converted once, in
`workers.model_config.ModelConfig`, and never mutated afterwards.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from attention.kernel_options import KernelOptions

ATTENTION_BACKENDS = ("flash", "reference", "mla")  # mla: flash, checked to be an MLA model
KV_WRITE_POLICIES = ("write_back_selective", "write_back", "write_through_selective", "write_through")  # cluster/engine/kv_saves.py
LOAD_FORMATS = ("auto", "dummy")  # workers/loader.py: the checkpoint's weights, or random ones at its shapes
KV_PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
PD_MEMORIES = ("gpu", "host")  # where a rank keeps PD hand-off pages (workers/handoff_rows.py)


class ConfigError(ValueError):
    """An option out of its range: `field` names the option (an EngineConfig or ClusterOptions
    field, the `dest` of its command-line flag)."""

    def __init__(self, field: str, msg: str):
        super().__init__(f"invalid option {field}: {msg}")
        self.field, self.msg = field, msg


def default_cache_dir() -> Path:
    return Path(os.environ.get("MANTA_CACHE_DIR", Path.home() / ".cache" / "manta"))


@dataclass(frozen=True)
class EngineConfig:
    model: str
    tokenizer: str | None = None  # defaults to the model directory
    served_model_name: str | None = None
    device: str = "cpu"  # "cpu" or "cuda"
    dtype: str | None = None  # None: float32 on cpu, the checkpoint's dtype on cuda
    # "fp8": quantize an unquantized checkpoint's linear weights at load (workers/quantization.py);
    # an FP8 checkpoint needs nothing (its config says so).
    quantization: str | None = None
    # "fp8_e4m3": the KV cache in FP8 with per-layer scales (workers/kv_quant.py); "auto": the
    # model's dtype.
    kv_cache_dtype: str = "auto"
    tp_size: int = 1
    page_size: int = 1
    # KV capacity in tokens. None: sized from memory (cpu: 65536 tokens; cuda: mem_fraction).
    kv_cache_tokens: int | None = None
    mem_fraction: float = 0.85
    # The share of one GPU each TP rank takes (Ray's fractional GPU resource): 0.5 puts two
    # replicas' ranks on one GPU (small models, tests). The rank's KV pool is then sized from
    # mem_fraction x gpus_per_rank of the GPU's memory, so replicas sharing it never overcommit.
    gpus_per_rank: float = 1.0
    # Under CUDA MPS, the percentage of the GPU's SMs each rank's kernels may occupy
    # (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE in its environment): replicas sharing a GPU then cannot
    # fill it while the other's kernels wait. Set in `manta serve`'s Ray rank actors as they start;
    # without an MPS daemon it does nothing. None: all of them.
    sm_percent: int | None = None
    max_running_requests: int = 256
    # Tokens computed per step over all requests (decodes + prefill chunks).
    max_num_batched_tokens: int = 8192
    # Longest prefill piece per request per step; -1 disables chunking (whole prompt at once).
    chunked_prefill_size: int = 2048
    # Most prompt tokens a step computes while requests are decoding (stall-free mixing:
    # cluster/engine/scheduler.py); 0: only max_num_batched_tokens bounds them; None: `prefill_cap`.
    mixed_prefill_tokens: int | None = None
    # A time target for steps that compute prompt tokens beside decodes (the gap they put between a
    # stream's tokens): their prompt tokens are what is predicted to fit, at most the cap above
    # (cluster/engine/step_budget.py). None: the cap alone.
    itl_target_ms: float | None = None
    # With itl_target_ms: when the prompt tokens waiting would take capped steps longer than this
    # to compute, the cap grows until they would not. None: 8 x itl_target_ms.
    ttft_target_ms: float | None = None
    disable_radix_cache: bool = False
    attention_backend: str = "flash"
    is_embedding: bool = False
    # Largest context a request may reach (prompt + output); None: the model's limit.
    max_context_len: int | None = None
    # Waiting requests beyond this are refused (overload); 0: unbounded.
    max_waiting: int = 0
    # A step no rank has answered for this long means a hung rank (a stopped process, a stuck
    # collective, a wedged GPU): the replica fails its requests and rebuilds its TP group, as
    # when a rank dies (workers/step_channel.py). 0: wait forever. Longer than any step takes,
    # a first one that compiles kernels included.
    step_timeout_s: float = 120.0
    disable_cuda_graph: bool = False
    # Plan step k+1 while step k runs (cluster/engine/scheduler.py); on where the workers allow it.
    disable_overlap_schedule: bool = False
    seed: int = 0
    # "dummy": random weights at the checkpoint's names and shapes, no weight files needed
    # (workers/dummy_weights.py: benchmarks at a real model's shapes); "auto": the checkpoint's.
    load_format: str = "auto"
    # Speculative decoding: a draft model (same tokenizer) proposes this many tokens per round;
    # the target verifies them in one forward (cluster/engine/spec_scheduler.py, workers/spec_runner.py).
    speculative_draft_model: str | None = None
    speculative_num_tokens: int = 4
    # The shared KV store (cluster/engine/kv_offload.py): its directory (None: off; `manta serve`
    # defaults to <cache dir>/kvstore), its host-RAM and disk caps, each rank's host tier, when
    # device pages are saved, and when a prefetch stops (timeout: base + per page).
    kv_store: str | None = None
    kv_store_host_gb: float = 1.0
    kv_store_disk_gb: float = 16.0
    kv_host_cache_gb: float = 2.0
    kv_host_warm: bool = True  # at start, fill the host tiers with the store's recent pages of this model
    kv_write_policy: str = "write_back_selective"
    kv_prefetch_policy: str = "timeout"
    kv_prefetch_timeout_s: float = 0.5
    kv_prefetch_timeout_per_page_s: float = 0.002
    # write_back policies: seconds spent at shutdown saving the pages still cached.
    kv_drain_timeout_s: float = 3.0
    # Prefill/decode disaggregation (cluster/engine/kv_handoff.py): how long a decode replica
    # waits for a prompt's pages from its prefill replica before it computes the rest itself.
    pd_transfer_timeout_s: float = 10.0
    # Each rank's hand-off rows (workers/handoff_rows.py), on its GPU ("gpu", beside the pool:
    # out of --mem-fraction, before the pool) or in pinned host memory ("host"): a prefill rank's pages
    # lent to decode replicas, a decode rank's pages read from prefill replicas until loaded.
    # 0: none (an engine of no disaggregated deployment); `cluster.launch.ClusterOptions.engine_for`
    # sets them for the replicas that take part in hand-offs (`manta serve --pd-buffer-gb`).
    pd_buffer_gb: float = 0.0
    pd_memory: str = "gpu"
    # The kernels' options (attention/kernel_options.py): read from this process's environment
    # once, when the config is made, and installed on every rank.
    kernels: KernelOptions = dataclasses.field(default_factory=KernelOptions.from_env)

    def __post_init__(self) -> None:
        def bad(field: str, msg: str) -> None:
            raise ConfigError(field, msg)

        if self.tp_size < 1:
            bad("tp_size", "must be >= 1")
        if self.page_size < 1:
            bad("page_size", "must be >= 1")
        if self.device not in ("cpu", "cuda"):
            bad("device", f"must be cpu or cuda, not {self.device!r}")
        if self.load_format not in LOAD_FORMATS:
            bad("load_format", f"must be one of {LOAD_FORMATS}, not {self.load_format!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            bad("attention_backend", f"must be one of {ATTENTION_BACKENDS}")
        if self.chunked_prefill_size != -1 and self.chunked_prefill_size < 1:
            bad("chunked_prefill_size", "must be -1 (off) or >= 1")
        if self.max_num_batched_tokens < 1:
            bad("max_num_batched_tokens", "must be >= 1")
        if self.mixed_prefill_tokens is not None and self.mixed_prefill_tokens < 0:
            bad("mixed_prefill_tokens", "must be >= 0 (0: no cap beside decodes)")
        if self.itl_target_ms is not None and self.itl_target_ms <= 0:
            bad("itl_target_ms", "must be > 0 (or unset: the fixed cap on prompt tokens beside decodes)")
        if self.ttft_target_ms is not None and (self.itl_target_ms is None or self.ttft_target_ms <= 0):
            bad("ttft_target_ms", "must be > 0, and goes with itl_target_ms (it bounds what the ITL target may "
                "cost first tokens)")
        if self.itl_target_ms is not None and self.chunked_prefill_size == -1:
            bad("itl_target_ms", "needs chunked prefill (a whole prompt cannot be cut to fit a step's time)")
        if self.itl_target_ms is not None and self.speculative_draft_model is not None:
            bad("itl_target_ms", "is not supported with speculative decoding (a verify step's time is not modelled)")
        if self.max_running_requests < 1:
            bad("max_running_requests", "must be >= 1")
        if self.max_waiting < 0:
            bad("max_waiting", "must be >= 0 (0: unbounded)")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 2 * self.page_size:
            bad("kv_cache_tokens", "must hold at least two pages")
        if not 0.0 < self.mem_fraction <= 1.0:
            bad("mem_fraction", "must be in (0, 1]")
        if not 0.0 < self.gpus_per_rank <= 1.0:
            bad("gpus_per_rank", "must be in (0, 1] (a share of one GPU)")
        if self.sm_percent is not None and not 1 <= self.sm_percent <= 100:
            bad("sm_percent", "must be in [1, 100] (a percentage of the GPU's SMs)")
        if self.speculative_num_tokens < 1:
            bad("speculative_num_tokens", "must be >= 1")
        if self.speculative_draft_model is not None and self.is_embedding:
            bad("speculative_draft_model", "speculative decoding serves generation, not embeddings")
        if self.kv_write_policy not in KV_WRITE_POLICIES:
            bad("kv_write_policy", f"must be one of {KV_WRITE_POLICIES}")
        if self.kv_prefetch_policy not in KV_PREFETCH_POLICIES:
            bad("kv_prefetch_policy", f"must be one of {KV_PREFETCH_POLICIES}")
        for name in ("kv_store_host_gb", "kv_store_disk_gb", "kv_host_cache_gb"):
            if getattr(self, name) <= 0:
                bad(name, "must be > 0")
        if self.pd_buffer_gb < 0:
            bad("pd_buffer_gb", "must be >= 0")
        if self.pd_memory not in PD_MEMORIES:
            bad("pd_memory", f"must be one of {PD_MEMORIES}")
        if self.pd_transfer_timeout_s <= 0:
            bad("pd_transfer_timeout_s", "must be > 0")
        if self.kv_prefetch_timeout_s < 0 or self.kv_prefetch_timeout_per_page_s < 0:
            bad("kv_prefetch_timeout_s", "must be >= 0")
        if self.kv_drain_timeout_s < 0:
            bad("kv_drain_timeout_s", "must be >= 0")

    @classmethod
    def from_dict(cls, options: dict) -> EngineConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown engine options: {', '.join(unknown)}")
        return cls(**options)

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name

    @property
    def prefill_cap(self) -> int:
        """The prompt tokens a step may compute beside decodes (`mixed_prefill_tokens`; 0: no
        cap). By default 1,024 where prompt pieces run as CUDA graphs (CUDA, graphs and the
        `prompt_graphs` kernel option on), measured: on the serve workload it took the p99 gap
        between tokens from 68 to 47 ms on an H200 for 1.3% of the throughput; 768 gave 40 ms but
        a TTFT p99 of 350 ms, as each 1,024-token prompt then takes two steps (BENCHMARKS.md,
        "Prompt pieces as piecewise CUDA graphs"). Elsewhere none: an eager prompt piece costs its
        host time again in every capped step (7% of the throughput on an H100 at 1,024)."""
        if self.mixed_prefill_tokens is not None:
            return self.mixed_prefill_tokens
        return 1024 if self.prompt_graphs else 0

    @property
    def prompt_graphs(self) -> bool:
        """Prompt pieces run as CUDA graphs per token-count bucket (`workers/prompt_graphs.py`)."""
        return self.device == "cuda" and not self.disable_cuda_graph and self.kernels.prompt_graphs
