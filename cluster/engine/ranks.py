"""How an engine's config becomes its TP ranks: the options every rank is built with
(`runner_options`, also what a replica hands its Ray rank actors), and the group an engine
without one of its own drives (in-process at TP=1, else one process per rank)."""

from __future__ import annotations

from cluster.engine.config import ConfigError, EngineConfig
from cluster.engine.kv_store_link import kv_offload_options
from workers.group import InProcessWorkerGroup, WorkerGroup
from workers.model_runner import RunnerOptions


def runner_options(config: EngineConfig) -> RunnerOptions:
    """The slice of the engine config every rank needs."""
    return RunnerOptions(
        model=config.model,
        device=config.device,
        dtype=config.dtype,
        quantization=config.quantization,
        kv_cache_dtype=config.kv_cache_dtype,
        page_size=config.page_size,
        kv_cache_tokens=config.kv_cache_tokens,
        mem_fraction=config.mem_fraction,
        gpu_share=config.gpus_per_rank,
        sm_percent=config.sm_percent,
        max_running_requests=config.max_running_requests,
        max_context_len=config.max_context_len,
        attention_backend=config.attention_backend,
        is_embedding=config.is_embedding,
        chunked_prefill_size=config.chunked_prefill_size,
        disable_radix_cache=config.disable_radix_cache,
        disable_cuda_graph=config.disable_cuda_graph,
        seed=config.seed,
        load_format=config.load_format,
        speculative_draft_model=config.speculative_draft_model,
        speculative_num_tokens=config.speculative_num_tokens,
        kv_offload=kv_offload_options(config),
        kernels=config.kernels,
    )


def make_worker_group(config: EngineConfig) -> WorkerGroup:
    if config.sm_percent is not None:  # (CUDA reads it once, as this process started)
        raise ConfigError("sm_percent", "applies to `manta serve`'s Ray rank actors, which start with it; for an "
                          "engine in this process, start the process with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE set")
    if config.tp_size == 1:
        return InProcessWorkerGroup(runner_options(config))
    from workers.mp_group import MultiprocessWorkerGroup

    return MultiprocessWorkerGroup(runner_options(config), config.tp_size)
