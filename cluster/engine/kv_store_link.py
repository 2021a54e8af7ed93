"""The engine's side of the shared KV store: which replicas can share pages (their identity:
same checkpoint, dtype, page size, TP size and layout), what every rank needs to reach the
store (`KVOffloadOptions`), and the scheduler's integration (`SchedulerKVOffload`) attached to an
engine. The store actor itself and its CLI options: `cluster.kv_store_setup`.
"""

from __future__ import annotations

import functools
import logging

from cluster.engine.config import EngineConfig
from cluster.engine.kv_offload import MIN_PAGE_TOKENS, SchedulerKVOffload
from kvstore.actor import in_ray_cluster
from kvstore.messages import STORE_NAME
from workers.dummy_weights import DUMMY_WEIGHTS_ID
from workers.kv_messages import KVOffloadOptions

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=8)
def _identity(model: str, dtype: str | None, device: str, page_size: int, tp_size: int,
              quantization: str | None = None, kv_cache_dtype: str = "auto", load_format: str = "auto") -> tuple | None:
    """(fingerprint, layout, bytes of one store key) of a replica, or None when its KV cannot
    be shared as pages (encoder models, encoder-decoder, hybrid linear attention). Computed
    once per process and replica shape (reads config.json, and the weight files the first time
    they are seen: `weights_identity`)."""
    from cluster.engine.config import default_cache_dir
    from kvstore.keys import model_fingerprint, weights_identity
    from workers.model_config import ModelConfig

    mc = ModelConfig.from_pretrained(model, dtype=dtype or ("float32" if device == "cpu" else None),
                                     quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    if mc.is_encoder_decoder or mc.linear_attn_layers or not mc.is_causal or mc.is_embedding_model:
        return None
    layout = "mla" if mc.use_mla else "mha"
    # Weights quantized at load compute other K/V than the checkpoint's own: another fingerprint.
    weights = str(mc.dtype) + (f"+{quantization}" if quantization and mc.quant and mc.quant.quantize_at_load else "")
    dummy = load_format == "dummy"  # random weights, the same on every start (workers/dummy_weights.py)
    if mc.kv_dtype != mc.dtype:  # an FP8 cache: other bytes per page, under the checkpoint's scales
        weights += f"/kv:{str(mc.kv_dtype).removeprefix('torch.')}:{'' if dummy else _kv_scales_id(model)}"
    weights_id = DUMMY_WEIGHTS_ID if dummy else weights_identity(model, cache=default_cache_dir() / "weights-ids.json")
    fingerprint = model_fingerprint(model, weights, page_size, tp_size, layout, weights_id)
    width = mc.kv_lora_rank + mc.qk_rope_head_dim if mc.use_mla else mc.per_rank_kv_heads(tp_size) * mc.head_dim
    key_bytes = page_size * len(mc.full_attn_layers) * width * mc.kv_dtype.itemsize
    return fingerprint, layout, key_bytes


def _kv_scales_id(model: str) -> str:
    """Digest of the checkpoint's KV-cache scales (`workers.kv_quant`): a copy recalibrated with
    other scales has the same weights' identity but writes other FP8 bytes."""
    from workers.kv_quant import checkpoint_kv_scales, scales_id
    from workers.loader import CheckpointReader

    reader = CheckpointReader(model)
    try:
        return scales_id(checkpoint_kv_scales(reader.names(), reader.get_tensor))
    finally:
        reader.close()


def replica_identity(config: EngineConfig) -> tuple | None:
    if config.kv_store is None or config.is_embedding or config.disable_radix_cache:
        return None
    if config.page_size < MIN_PAGE_TOKENS:
        return None
    if getattr(config, "speculative_draft_model", None):  # the store holds the target's pages only,
        return None  # and a loaded prefix without the draft's K/V would starve its proposals
    try:
        return _identity(config.model, config.dtype, config.device, config.page_size, config.tp_size,
                         config.quantization, config.kv_cache_dtype, config.load_format)
    except Exception as exc:  # the engine reports a checkpoint it cannot load; the store just stays off
        logger.warning("KV store off: cannot fingerprint %s (%s: %s)", config.model, type(exc).__name__, exc)
        return None


def why_no_store(config: EngineConfig) -> str:
    """Why replicas of `config` use no store (`replica_identity` is None), in a user's words."""
    if config.is_embedding:
        return "an embedding model keeps no KV pages"
    if config.disable_radix_cache:
        return "--disable-radix-cache (the store extends the prefix cache)"
    if config.page_size < MIN_PAGE_TOKENS:
        return f"--page-size {config.page_size} (the store serves pages of at least {MIN_PAGE_TOKENS} tokens)"
    if getattr(config, "speculative_draft_model", None):
        return "speculative decoding (a loaded prefix would lack the draft model's K/V)"
    return "this model's KV cannot be shared as pages (an encoder, encoder-decoder or hybrid linear attention)"


def kv_offload_options(config: EngineConfig) -> KVOffloadOptions | None:
    """What every rank of the replica needs (`RunnerOptions.kv_offload`); None: no store."""
    ident = replica_identity(config)
    if ident is None:
        return None
    return KVOffloadOptions(fingerprint=ident[0], layout=ident[1],
                            host_cache_bytes=int(config.kv_host_cache_gb * 2**30), store_name=STORE_NAME,
                            warm=config.kv_host_warm, handoff_bytes=int(config.pd_buffer_gb * 2**30),
                            handoff_memory=config.pd_memory)


def kv_host_pages(config: EngineConfig) -> int:
    """Pages one rank's host tier holds (0: no KV store), as `RankKVOffload` sizes it."""
    ident = replica_identity(config)
    if ident is None:
        return 0
    page_bytes = -(-ident[2] * (1 if ident[1] == "mla" else 2) // 64) * 64
    return int(config.kv_host_cache_gb * 2**30) // page_bytes


def attach_kv_offload(engine) -> SchedulerKVOffload | None:
    """The engine's store integration, or None (no --kv-store, a model whose KV is not shared
    as pages, no prefix cache, or no Ray in this process to reach the store)."""
    cfg = engine.config
    if cfg.kv_store is None:
        return None
    ident = replica_identity(cfg)
    if ident is None or engine.serving.disable_radix_cache or engine.serving.is_embedding:
        logger.info("KV store off for %s: its KV is not shared as prefix pages of >= %d tokens",
                    cfg.model_name, MIN_PAGE_TOKENS)
        return None
    if not in_ray_cluster():
        logger.warning("KV store off: this process is not part of a Ray cluster")
        return None
    fingerprint, layout, _ = ident
    off = SchedulerKVOffload(engine.scheduler, fingerprint=fingerprint, layout=layout, tp_size=cfg.tp_size,
                             write_policy=cfg.kv_write_policy, prefetch_policy=cfg.kv_prefetch_policy,
                             prefetch_timeout_s=cfg.kv_prefetch_timeout_s,
                             prefetch_timeout_per_page_s=cfg.kv_prefetch_timeout_per_page_s,
                             host_pages=kv_host_pages(cfg), warm=cfg.kv_host_warm)
    logger.info("KV store on: layout %s, write policy %s, prefetch %s, fingerprint %s", layout,
                cfg.kv_write_policy, cfg.kv_prefetch_policy, fingerprint[:12])
    return off

