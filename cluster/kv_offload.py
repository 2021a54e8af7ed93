"""The scheduler's side of the hierarchical KV cache (device pool → rank host tier → shared store).

The scheduler keeps its model (`cluster.scheduler`); this file adds the store through a few
hooks and `StepPlan` orders (`workers.kv_messages`) that the ranks carry out
(`workers.kv_offload`). Pages are named by chain keys (`kvstore.keys`): the key of page i names
the whole prefix through page i, so a page found in the store is the KV of exactly those tokens
of this model (fingerprint: config, weights, dtype, page size, TP layout).

Loading a prefix (when the store has a longer prefix than the radix cache):

1. `set_aside(req)`, when the admission loop reaches a new request: match the radix cache
   (m pages) and lock the match; chain keys of the whole pages of prompt[:-1]; ask the store how
   many pages past m every rank can load (`StoreProbe.count`, all keys of a page for every
   rank). If at least `min_pages`: the request leaves the waiting queue and its keys go out as a
   `KVPrefetch` (ranks read them from the store into their host tier in the background while
   the replica keeps stepping its other requests). Otherwise it is admitted as usual.
2. `orders()`, every step: a prefetching request stops by the stop policy —
   best_effort: at the first step after the prefetch started (take what has arrived);
   wait_complete: when rank 0 reports the prefetch finished (each rank then waits for its own);
   timeout: when finished or at prefetch_timeout_s + per_page_s × pages (grows with the prompt).
   Then pages are allocated (evicting the radix cache's LRU pages if needed) and a `KVLoad`
   copies the host-tier pages into them; the ranks answer n = min over ranks of what they had.
3. `on_result`: the first m + n pages go into the radix cache (locked until admission), the
   other allocated pages are freed, and the request returns to the front of the queue, where
   `_admit` matches the longer prefix and the prefill computes only the rest.

Saving pages (the write policy, when device pages get a copy in the host tier and the store):

- write_through (default): every full page the radix cache takes on `release` (a finished or
  preempted request), in the next plan;
- write_through_selective: a cached page once admissions have matched it `HIT_THRESHOLD` (2)
  times, so pages used once never cost a store write;
- write_back: a page when the radix cache evicts it (the plan that evicts it carries the
  save, which runs before the forward that may overwrite the page).

The store down, slow or full never stops serving: the probe and the ranks' client time out and
count errors, a failed probe pauses probing for `backoff_s`, and a load that finds nothing
admits the request with its radix match only.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from cluster.config import KV_PREFETCH_POLICIES, KV_WRITE_POLICIES, EngineConfig, default_cache_dir
from workers.kv_messages import KVLoad, KVOffloadOptions, KVPrefetch, KVSave

logger = logging.getLogger(__name__)

STORE_NAME = "manta-kvstore"  # kvstore.store.STORE_NAME (not imported: this module stays light)
HIT_THRESHOLD = 2  # write_through_selective: matches before a page is saved
MIN_LOAD_TOKENS = 16  # a store load costs two extra steps: skip shorter ones
# Smaller pages cost more to move than to recompute (one store key, slot and file per page):
# replicas with smaller pages run without the store.
MIN_PAGE_TOKENS = 16
WAIT_COMPLETE_CAP_S = 60.0  # wait_complete still gives up after this long


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
    g.add_argument("--kv-host-cache-gb", type=float, default=0.25, help="each rank's host tier")
    g.add_argument("--kv-write-policy", default="write_through", choices=KV_WRITE_POLICIES)
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
            "kv_prefetch_timeout_per_page_s": args.kv_prefetch_timeout_per_page_s}


# ---------------------------------------------------------------------------------------------
# the scheduler side


@dataclass
class KVOffloadStats:
    query_pages: int = 0  # pages past the radix match looked up in the store
    probe_hit_pages: int = 0  # of those, present for every rank when probed
    hit_pages: int = 0  # pages loaded into the device pool (agreed by all ranks)
    loaded_tokens: int = 0  # hit_pages * page_size: prompt tokens the prefill did not compute
    loads: int = 0  # requests that went through a store load
    saved_pages: int = 0  # pages ordered saved (device -> host tier -> store)
    early_stops: int = 0  # prefetches stopped before they finished (best_effort, timeout)
    probe_skips: int = 0  # requests not probed while probing pauses after a store error


@dataclass(eq=False)
class _Loading:
    req: object
    chain: list[str]
    m: int  # radix pages matched (locked) when set aside
    match_pages: list[int]
    node: object
    s: int  # leading pages every rank's keys were in the store for, when probed (> m)
    started: float
    deadline: float
    executed: bool = False  # the prefetch order has run on the ranks
    finished: bool = False  # rank 0 reported its prefetch done
    pages: list[int] = field(default_factory=list)  # allocated for the KVLoad in flight
    load_step: int = 0  # the step id of the plan carrying that KVLoad


class SchedulerKVOffload:
    """Attached to one `Scheduler` (sets `scheduler.kv_offload`). Every method runs under the
    engine's lock, in the scheduler's thread; the store is asked only by `StoreProbe.count`
    (a bounded Ray call) when a request is set aside."""

    def __init__(self, scheduler, *, fingerprint: str, layout: str, tp_size: int,
                 write_policy: str = "write_through", prefetch_policy: str = "timeout",
                 prefetch_timeout_s: float = 0.5, prefetch_timeout_per_page_s: float = 0.002,
                 store_name: str = STORE_NAME, namespace: str | None = None, probe_timeout_s: float = 2.0,
                 min_pages: int | None = None, backoff_s: float = 5.0, probe=None):
        from kvstore.client import StoreProbe

        if write_policy not in KV_WRITE_POLICIES or prefetch_policy not in KV_PREFETCH_POLICIES:
            raise ValueError(f"bad KV store policy {write_policy!r} / {prefetch_policy!r}")
        self.sched = scheduler
        self.radix = scheduler.radix
        self.allocator = scheduler.allocator
        self.P = scheduler.page_size
        self.fingerprint, self.layout = fingerprint, layout
        self.write_policy, self.prefetch_policy = write_policy, prefetch_policy
        self.timeout_s, self.per_page_s = prefetch_timeout_s, prefetch_timeout_per_page_s
        self.min_pages = min_pages if min_pages is not None else max(1, -(-MIN_LOAD_TOKENS // self.P))
        self.backoff_s = backoff_s
        self.probe = probe or StoreProbe(None, layout, tp_size, timeout_s=probe_timeout_s, store_name=store_name,
                                         namespace=namespace)
        self.store_name, self.namespace = store_name, namespace
        self.tree_keys: dict[int, str] = {}  # page in the radix tree -> its chain key
        self.saved: set[int] = set()  # tree pages already saved (or loaded from the store)
        self.hits: Counter[int] = Counter()  # write_through_selective: admissions that matched a page
        self.pending_saves: list[tuple[int, str]] = []
        self.loading: dict[str, _Loading] = {}
        self.held: dict[str, tuple[object, object]] = {}  # rid -> (req, locked node) until admitted
        self.probed: set[str] = set()
        self.chains: dict[str, list[str]] = {}
        self._prefetch: list[KVPrefetch] = []
        self._skip_until = 0.0
        self.stats = KVOffloadStats()
        self._poller: _StatsPoller | None = None
        scheduler.kv_offload = self
        self.radix.on_evict = self._on_evict  # bookkeeping always; saves only under write_back

    # ---------------- hooks of the scheduler ----------------
    def has_work(self) -> bool:
        return bool(self.loading or self.pending_saves or self._prefetch)

    def held_pages(self) -> list[int]:
        """Pages allocated to loads in flight (neither free, cached nor owned by a request)."""
        return [p for e in self.loading.values() for p in e.pages]

    def set_aside(self, req) -> bool:
        """True: `req` left admission to have its prefix fetched from the store (the caller
        pops it from the waiting queue); it comes back to the front when the load is done."""
        if req.rid in self.probed or req.is_embedding or req.num_preemptions:
            return False
        self.probed.add(req.rid)
        tokens = req.prompt_ids[:-1]  # the last token is always computed: it yields the logits
        n = len(tokens) // self.P
        if n < self.min_pages:
            return False
        match = self.radix.match_prefix(tokens)
        m = len(match.pages)
        if n - m < self.min_pages:
            return False
        now = time.monotonic()
        if now < self._skip_until:
            self.stats.probe_skips += 1
            return False
        chain = self._chain(req, n)
        errors = self.probe.counters.errors
        found = self.probe.count(chain[m:])
        self.stats.query_pages += n - m
        if self.probe.counters.errors > errors:
            self._skip_until = now + self.backoff_s  # the store is down or slow: stop asking for a while
        self.stats.probe_hit_pages += found
        if found < self.min_pages:
            return False
        self.radix.lock(match.node)
        deadline = now + self.timeout_s + self.per_page_s * found
        self.loading[req.rid] = _Loading(req, chain, m, list(match.pages), match.node, m + found, now, deadline)
        self._prefetch.append(KVPrefetch(req.rid, chain[m : m + found]))
        return True

    def admitted(self, req) -> None:
        """`req` was admitted (its radix match is locked by `_admit` now)."""
        held = self.held.pop(req.rid, None)
        if held is not None:
            self.radix.unlock(held[1])
        if self.write_policy == "write_through_selective" and req.kv is not None:
            for p in req.kv.pages[: req.kv.num_cached_pages]:
                self.hits[p] += 1
                if self.hits[p] >= HIT_THRESHOLD and p not in self.saved and p in self.tree_keys:
                    self._save(p, self.tree_keys[p])

    def on_cached(self, req, pages: list[int], num_tokens: int, kept: int, token_ids: list[int]) -> None:
        """`release` put req's full pages into the radix cache; it took pages[kept:n_full].
        token_ids: the request's known tokens (without one still being sampled)."""
        n_full = num_tokens // self.P
        if n_full <= kept:
            return
        chain = self._chain(req, n_full, token_ids=token_ids)
        for i in range(kept, n_full):
            self.tree_keys[pages[i]] = chain[i]
            if self.write_policy == "write_through":
                self._save(pages[i], chain[i])

    def orders(self):
        """This step's KV orders (saves, prefetch starts, loads), or None when there are none
        and no request waits on the store."""
        self._sweep()
        loads: list[KVLoad] = []
        now = time.monotonic()
        for e in list(self.loading.values()):
            if e.pages or not e.executed or not self._should_stop(e, now):
                continue
            load = self._start_load(e, now)
            if load is not None:
                e.load_step = self.sched._step_id + 1  # the plan these orders go into
                loads.append(load)
        saves = [KVSave([p for p, _ in self.pending_saves], [k for _, k in self.pending_saves])]
        saves = saves if self.pending_saves else []
        self.pending_saves = []
        prefetch, self._prefetch = self._prefetch, []
        if not (saves or prefetch or loads or self.loading):
            return None
        return _Orders(saves, prefetch, loads)

    def on_result(self, plan, result) -> None:
        for pre in plan.kv_prefetch:
            e = self.loading.get(pre.rid)
            if e is not None:
                e.executed = True
        for rid in result.kv_prefetched:
            e = self.loading.get(rid)
            if e is not None:
                e.finished = True
        for load in plan.kv_loads:
            e = self.loading.pop(load.rid, None)
            if e is not None:
                self._finish_load(e, min(result.kv_loaded.get(load.rid, 0), len(e.pages)))

    # ---------------- internals ----------------
    def _chain(self, req, n_pages: int, token_ids: list[int] | None = None) -> list[str]:
        """Chain keys of req's first n_pages pages (cached per request, extended as it grows)."""
        from kvstore.keys import chain_keys

        chain = self.chains.get(req.rid, [])
        if len(chain) < n_pages:
            ids = token_ids if token_ids is not None else req.prompt_ids
            start = len(chain) * self.P
            chain = chain + chain_keys(ids[start : n_pages * self.P], self.P, self.fingerprint, self.layout,
                                       parent=chain[-1] if chain else None)
            self.chains[req.rid] = chain
        return chain[:n_pages]

    def _save(self, page: int, key: str) -> None:
        self.saved.add(page)
        self.pending_saves.append((page, key))
        self.stats.saved_pages += 1

    def _on_evict(self, leaf, take: int) -> None:
        """Radix eviction of leaf's last `take` pages: forget them (the page ids come back with
        other tokens); write_back saves them now."""
        for p in leaf.pages[len(leaf.pages) - take :]:
            key = self.tree_keys.pop(p, None)
            self.hits.pop(p, None)
            if self.write_policy == "write_back" and key is not None and p not in self.saved:
                self._save(p, key)
            self.saved.discard(p)

    def _should_stop(self, e: _Loading, now: float) -> bool:
        if self.prefetch_policy == "best_effort":
            return True
        if self.prefetch_policy == "wait_complete":
            return e.finished or now - e.started > WAIT_COMPLETE_CAP_S
        return e.finished or now >= e.deadline

    def _start_load(self, e: _Loading, now: float) -> KVLoad | None:
        want = e.s - e.m
        pages = self.allocator.alloc(want)
        if pages is None:
            self.radix.evict(want - self.allocator.num_free)
            pages = self.allocator.alloc(min(want, self.allocator.num_free))
        if not pages:
            self.loading.pop(e.req.rid)
            self._finish_load(e, 0)
            return None
        e.pages = pages
        if not e.finished:
            self.stats.early_stops += 1
        if self.prefetch_policy == "best_effort":
            wait = 0.0
        elif self.prefetch_policy == "wait_complete":
            wait = max(0.0, e.started + WAIT_COMPLETE_CAP_S - now)
        else:
            wait = max(0.0, e.deadline - now)
        return KVLoad(e.req.rid, pages, e.chain[e.m : e.m + len(pages)], wait)

    def _finish_load(self, e: _Loading, n: int) -> None:
        """The ranks put n pages into e.pages[:n]: cache them, free the rest, requeue req."""
        req, m, P = e.req, e.m, self.P
        node = e.node
        if n > 0 and not req.finished:
            tokens = req.prompt_ids[: (m + n) * P]
            k = self.radix.insert(tokens, e.match_pages + e.pages[:n])
            dup = min(max(k - m, 0), n)  # pages another request cached meanwhile: ours are spare
            for p, key in zip(e.pages[dup:n], e.chain[m + dup : m + n]):
                self.tree_keys[p] = key
                self.saved.add(p)  # it came from the store
            self.allocator.free(e.pages[:dup] + e.pages[n:])
            match = self.radix.match_prefix(tokens)
            self.radix.lock(match.node)
            self.radix.unlock(node)
            node = match.node
            self.stats.hit_pages += n
            self.stats.loaded_tokens += n * P
        else:
            self.allocator.free(e.pages)
        e.pages = []
        self.stats.loads += 1
        if req.finished:
            self.radix.unlock(node)
            return
        self.held[req.rid] = (req, node)
        self.sched.waiting.appendleft(req)

    def _sweep(self) -> None:
        """Forget requests that finished (aborted) while set aside or held. A load still
        holding pages here belongs to a step that failed (its result never came back: a
        successful step's `on_result` ends every load of its plan): it loaded nothing. Under
        overlapped scheduling the newest plan may still be in flight: its loads wait."""
        in_flight_step = self.sched._step_id if self.sched.overlap else None
        for rid, e in list(self.loading.items()):
            if e.pages and e.load_step == in_flight_step:
                continue
            if e.pages:
                del self.loading[rid]
                self._finish_load(e, 0)
            elif e.req.finished:
                del self.loading[rid]
                self.radix.unlock(e.node)
                self.sched._pending_drop.append(rid)  # the ranks cancel its prefetch
        for rid, (req, node) in list(self.held.items()):
            if req.finished:
                del self.held[rid]
                self.radix.unlock(node)
        live = self.sched.requests
        for rid in [r for r in self.probed if r not in live and r not in self.loading]:
            self.probed.discard(rid)
            self.chains.pop(rid, None)

    def close(self) -> None:
        """Stop the stats poller (the engine shuts down)."""
        if self._poller is not None:
            self._poller.stop()

    # ---------------- metrics ----------------
    def report(self, workers) -> dict:
        """Counters for `Replica.stats()` (and so for the router's metrics): the scheduler's,
        every rank's client and host tier (polled in the background), the store's usage."""
        if self._poller is None:
            self._poller = _StatsPoller(workers, self.store_name, self.namespace)
        ranks, store = self._poller.latest()
        probe = self.probe.counters
        return {"layout": self.layout, "write_policy": self.write_policy, "prefetch_policy": self.prefetch_policy,
                **asdict(self.stats), "probe_errors": probe.errors,
                "errors": probe.errors + sum(r.get("errors", 0) for r in ranks),
                "ranks": ranks, "store": store}


class _Orders:
    """A step's KV orders; truthy even when empty while a request waits on the store (the
    step then gives the ranks a chance to report prefetch progress)."""

    def __init__(self, saves, prefetch, loads):
        self.saves, self.prefetch, self.loads = saves, prefetch, loads

    def apply(self, plan) -> None:
        plan.kv_saves, plan.kv_prefetch, plan.kv_loads = self.saves, self.prefetch, self.loads


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
        ranks = _rank_stats(self.workers)
        store = _store_usage(self.store_name, self.namespace)
        with self._lock:
            if ranks is not None:
                self._ranks = ranks
            self._store = store


def _rank_stats(workers, timeout_s: float = 1.0) -> list[dict] | None:
    actors = getattr(workers, "workers", None)
    if actors:  # RayWorkerGroup: each rank actor answers on its second thread
        import ray

        try:
            return [s for s in ray.get([w.kv_store_stats.remote() for w in actors], timeout=timeout_s) if s]
        except Exception:
            return None
    runner = getattr(workers, "runner", None)  # InProcessWorkerGroup
    off = getattr(runner, "kv_offload", None)
    return [off.stats()] if off is not None else []


def _store_usage(name: str, namespace: str | None, timeout_s: float = 1.0) -> dict | None:
    import ray

    try:
        st = ray.get(ray.get_actor(name, namespace=namespace).stats.remote(), timeout=timeout_s)
    except Exception:
        return None
    return {"ram_used_bytes": st["ram"]["used_bytes"], "ram_capacity_bytes": st["ram"]["capacity_bytes"],
            "file_used_bytes": st["file"]["used_bytes"], "file_capacity_bytes": st["file"]["capacity_bytes"],
            "pages": st["pages"]}


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
    """`Replica.stats()["kvstore"]`: None when the replica runs without a store."""
    off = getattr(engine, "kv_offload", None)
    return off.report(engine.workers) if off is not None else None
