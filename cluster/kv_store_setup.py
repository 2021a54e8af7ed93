"""Setting up the shared KV store for a replica: which replicas can share pages (their
identity), the store actor, the CLI options, attaching the scheduler's side
(`cluster.kv_offload.SchedulerKVOffload`) to an engine, and the polled statistics a replica
reports for /metrics.
"""

from __future__ import annotations

import functools
import logging
import threading
import time

from cluster.config import KV_PREFETCH_POLICIES, KV_WRITE_POLICIES, EngineConfig, default_cache_dir
from cluster.kv_offload import MIN_PAGE_TOKENS, STORE_NAME, SchedulerKVOffload
from workers.kv_messages import KVOffloadOptions

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# configuration


@functools.lru_cache(maxsize=8)
def _identity(model: str, dtype: str | None, device: str, page_size: int, tp_size: int) -> tuple | None:
    """(fingerprint, layout, bytes of one store key) of a replica, or None when its KV cannot
    be shared as pages (encoder models, encoder-decoder, hybrid linear attention). Computed
    once per process and replica shape (reads config.json and 1 MiB of each weight file)."""
    from kvstore.keys import model_fingerprint, weights_identity
    from workers.model_config import ModelConfig

    mc = ModelConfig.from_pretrained(model, dtype=dtype or ("float32" if device == "cpu" else None))
    if mc.is_encoder_decoder or mc.linear_attn_layers or not mc.is_causal or mc.is_embedding_model:
        return None
    layout = "mla" if mc.use_mla else "mha"
    fingerprint = model_fingerprint(model, str(mc.dtype), page_size, tp_size, layout, weights_identity(model))
    width = mc.kv_lora_rank + mc.qk_rope_head_dim if mc.use_mla else mc.per_rank_kv_heads(tp_size) * mc.head_dim
    key_bytes = page_size * len(mc.full_attn_layers) * width * mc.dtype.itemsize
    return fingerprint, layout, key_bytes


def replica_identity(config: EngineConfig) -> tuple | None:
    if config.kv_store is None or config.is_embedding or config.disable_radix_cache:
        return None
    if config.page_size < MIN_PAGE_TOKENS:
        return None
    if getattr(config, "speculative_draft_model", None):  # the store holds the target's pages only,
        return None  # and a loaded prefix without the draft's K/V would starve its proposals
    try:
        return _identity(config.model, config.dtype, config.device, config.page_size, config.tp_size)
    except Exception as exc:  # the engine reports a checkpoint it cannot load; the store just stays off
        logger.warning("KV store off: cannot fingerprint %s (%s: %s)", config.model, type(exc).__name__, exc)
        return None


def kv_offload_options(config: EngineConfig) -> KVOffloadOptions | None:
    """What every rank of the replica needs (`RunnerOptions.kv_offload`); None: no store."""
    ident = replica_identity(config)
    if ident is None:
        return None
    return KVOffloadOptions(fingerprint=ident[0], layout=ident[1],
                            host_cache_bytes=int(config.kv_host_cache_gb * 2**30), store_name=STORE_NAME)


def ensure_kv_store(config: EngineConfig, timeout_s: float = 120.0):
    """Start the cluster's store actor for `config` (or find the running one); returns
    (handle, created) or (None, False) when it cannot start (serving then runs without it).
    Call before replicas start, in the namespace the workers will run in."""
    import ray

    from kvstore.store import get_or_create_store, lookup_store

    if config.kv_store is None:
        return None, False
    existing = lookup_store()
    ident = replica_identity(config)
    if ident is None and existing is None:
        logger.info("KV store not started: replicas of %s with --page-size %d do not use one (pages of "
                    "at least %d tokens, a causal model with the prefix cache on)", config.model_name,
                    config.page_size, MIN_PAGE_TOKENS)
        return None, False
    slot = min(max(ident[2] if ident else 64 << 10, 4 << 10), 4 << 20)
    try:
        handle = existing or get_or_create_store(
            config.kv_store, ram_bytes=max(int(config.kv_store_host_gb * 2**30), slot),
            file_bytes=int(config.kv_store_disk_gb * 2**30), slot_bytes=slot)
        ray.get(handle.info.remote(), timeout=timeout_s)
        return handle, existing is None
    except Exception as exc:
        logger.error("KV store under %s did not start (%s: %s): serving without it", config.kv_store,
                     type(exc).__name__, exc)
        return None, False


def add_kv_store_args(p) -> None:
    """The KV store options of `manta serve` / `generate` / `bench`."""
    g = p.add_argument_group("KV store (shared by all replicas; docs/deploy.md section 10)")
    g.add_argument("--kv-store", default=None, metavar="DIR",
                   help="directory of the shared KV store (serve default: <cache dir>/kvstore)")
    g.add_argument("--no-kv-store", action="store_true", help="run without the shared KV store")
    g.add_argument("--kv-store-host-gb", type=float, default=1.0, help="the store's host-RAM tier")
    g.add_argument("--kv-store-disk-gb", type=float, default=16.0, help="the store's file tier")
    g.add_argument("--kv-host-cache-gb", type=float, default=2.0,
                   help="each rank's host tier (pinned on a GPU): pages on their way to and from the store")
    g.add_argument("--kv-write-policy", default="write_back_selective", choices=KV_WRITE_POLICIES,
                   help="when pages are written to the store (cluster/kv_offload.py): write_back_selective "
                        "(default) writes a page when the GPU evicts it, when it proves hot (matched twice) and "
                        "at shutdown; write_through writes every page")
    g.add_argument("--kv-drain-timeout", type=float, default=3.0, dest="kv_drain_timeout_s",
                   help="write_back policies: at shutdown, seconds spent saving the pages still cached (after "
                        "--shutdown-timeout)")
    g.add_argument("--kv-prefetch-policy", default="timeout", choices=KV_PREFETCH_POLICIES)
    g.add_argument("--kv-prefetch-timeout", type=float, default=0.5, dest="kv_prefetch_timeout_s",
                   help="timeout policy: seconds, plus --kv-prefetch-timeout-per-page for each page")
    g.add_argument("--kv-prefetch-timeout-per-page", type=float, default=0.002,
                   dest="kv_prefetch_timeout_per_page_s")


def kv_store_config_from_args(args) -> dict:
    """EngineConfig fields from the options above. `manta serve` sets `kv_store_embedded`:
    without --kv-store it keeps the store under the cache directory."""
    if getattr(args, "kv_store", None) is None and not hasattr(args, "kv_store_host_gb"):
        return {}  # a parser without the KV store options
    root = args.kv_store
    if args.no_kv_store:
        root = None
    elif root is None and getattr(args, "kv_store_embedded", False):
        root = str(default_cache_dir() / "kvstore")
    return {"kv_store": root, "kv_store_host_gb": args.kv_store_host_gb, "kv_store_disk_gb": args.kv_store_disk_gb,
            "kv_host_cache_gb": args.kv_host_cache_gb, "kv_write_policy": args.kv_write_policy,
            "kv_prefetch_policy": args.kv_prefetch_policy, "kv_prefetch_timeout_s": args.kv_prefetch_timeout_s,
            "kv_drain_timeout_s": args.kv_drain_timeout_s,
            "kv_prefetch_timeout_per_page_s": args.kv_prefetch_timeout_per_page_s}



class _StatsPoller:
    """Fetches every rank's `kv_store_stats` and the store's usage each `interval_s` in a
    daemon thread (never on the caller's thread: a busy rank or a hung store must not stall
    the replica's stats). Stops polling when nobody asked for 30 s."""

    def __init__(self, workers, store_name: str, namespace: str | None, interval_s: float = 1.0):
        self.workers, self.store_name, self.namespace = workers, store_name, namespace
        self.interval_s = interval_s
        self._ranks: list[dict] = []
        self._store: dict | None = None
        self._asked = time.monotonic()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def stop(self) -> None:
        self._asked = float("-inf")
        if self._thread is not None:
            self._thread.join(timeout=5)

    def latest(self) -> tuple[list[dict], dict | None]:
        self._asked = time.monotonic()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="kv-store-stats", daemon=True)
            self._thread.start()
        with self._lock:
            return list(self._ranks), self._store

    def _run(self) -> None:
        import ray

        # Never after ray.shutdown(): a Ray call from here would start a new local instance.
        while time.monotonic() - self._asked < 30 and ray.is_initialized():
            self._poll()
            time.sleep(self.interval_s)

    def _poll(self) -> None:
        ranks = self.workers.kv_store_stats()
        store = _store_usage(self.store_name, self.namespace)
        with self._lock:
            if ranks is not None:
                self._ranks = ranks
            self._store = store


def _store_usage(name: str, namespace: str | None, timeout_s: float = 1.0) -> dict | None:
    import ray

    try:
        st = ray.get(ray.get_actor(name, namespace=namespace).stats.remote(), timeout=timeout_s)
    except Exception:
        return None
    return {"ram_used_bytes": st["ram"]["used_bytes"], "ram_capacity_bytes": st["ram"]["capacity_bytes"],
            "file_used_bytes": st["file"]["used_bytes"], "file_capacity_bytes": st["file"]["capacity_bytes"],
            "file_write_errors": st["file"].get("write_errors", 0), "pages": st["pages"]}


# ---------------------------------------------------------------------------------------------
# wiring


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
    import ray

    if not ray.is_initialized():
        logger.warning("KV store off: this process is not part of a Ray cluster")
        return None
    fingerprint, layout, _ = ident
    off = SchedulerKVOffload(engine.scheduler, fingerprint=fingerprint, layout=layout, tp_size=cfg.tp_size,
                             write_policy=cfg.kv_write_policy, prefetch_policy=cfg.kv_prefetch_policy,
                             prefetch_timeout_s=cfg.kv_prefetch_timeout_s,
                             prefetch_timeout_per_page_s=cfg.kv_prefetch_timeout_per_page_s)
    logger.info("KV store on: layout %s, write policy %s, prefetch %s, fingerprint %s", layout,
                cfg.kv_write_policy, cfg.kv_prefetch_policy, fingerprint[:12])
    return off


def kv_store_stats(engine) -> dict | None:
    """`Replica.stats()["kvstore"]`: None when the replica runs without a store. The
    scheduler's counters, every rank's client and host tier and the store's usage (the last
    two polled in the background: a busy rank or a hung store never stalls the caller)."""
    off = engine.kv_offload
    if off is None:
        return None
    if off.poller is None:
        off.poller = _StatsPoller(engine.workers, off.store_name, off.namespace)
    ranks, store = off.poller.latest()
    counters = off.counters()
    return {**counters, "errors": counters["probe_errors"] + sum(r.get("errors", 0) for r in ranks),
            "ranks": ranks, "store": store}


def close_kv_offload(engine) -> None:
    """Stop the stats poller of the engine's store integration (the engine shuts down)."""
    off = engine.kv_offload
    if off is not None and off.poller is not None:
        off.poller.stop()
