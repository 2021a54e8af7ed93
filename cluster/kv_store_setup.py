"""Setting up the shared KV store for a cluster: the store actor, the CLI options, and the
polled statistics a replica reports for /metrics. (Which replicas share pages and the engine's
side of the store: `cluster.engine.kv_store_link`.)
"""

from __future__ import annotations

import logging
import threading
import time

from cluster.engine.config import KV_PREFETCH_POLICIES, KV_WRITE_POLICIES, EngineConfig, default_cache_dir
from cluster.engine.kv_store_link import replica_identity, why_no_store
from workers import actor_exit

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# configuration


def ensure_kv_store(config: EngineConfig, timeout_s: float = 120.0):
    """Start the cluster's store actor for `config` (or find the running one); returns
    (handle, created) or (None, False) when it cannot start (serving then runs without it).
    Call before replicas start, in the namespace the workers will run in."""
    import ray

    from kvstore.actor import get_or_create_store, lookup_store

    if config.kv_store is None:
        return None, False
    existing = lookup_store()
    ident = replica_identity(config)
    if ident is None and existing is None:
        logger.info("KV store not started: replicas of %s do not use one: %s", config.model_name,
                    why_no_store(config))
        return None, False
    slot = min(max(ident[2] if ident else 64 << 10, 4 << 10), 4 << 20)
    try:
        handle = existing or get_or_create_store(
            config.kv_store, ram_bytes=max(int(config.kv_store_host_gb * 2**30), slot),
            file_bytes=int(config.kv_store_disk_gb * 2**30), slot_bytes=slot,
            on_start=actor_exit.install)  # Ray's SIGTERM at shutdown never prints a traceback into the driver's log
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
    g.add_argument("--no-kv-host-warm", action="store_false", dest="kv_host_warm",
                   help="start with empty host tiers (default: each rank reads the store's most recent pages of "
                        "this model into its host tier at start, so a restarted replica serves them at once)")
    g.add_argument("--kv-write-policy", default="write_back_selective", choices=KV_WRITE_POLICIES,
                   help="when pages are written to the store (cluster/engine/kv_saves.py): write_back_selective "
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
    g.add_argument("--pd-transfer-timeout", type=float, default=10.0, dest="pd_transfer_timeout_s",
                   help="disaggregated serving: seconds a decode replica waits for a prompt's pages from its "
                        "prefill replica before it computes the rest itself")


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
            "kv_host_cache_gb": args.kv_host_cache_gb, "kv_host_warm": args.kv_host_warm, "kv_write_policy": args.kv_write_policy,
            "kv_prefetch_policy": args.kv_prefetch_policy, "kv_prefetch_timeout_s": args.kv_prefetch_timeout_s,
            "kv_drain_timeout_s": args.kv_drain_timeout_s, "pd_transfer_timeout_s": args.pd_transfer_timeout_s,
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
