"""One rank's side of the hierarchical KV cache: device KV pool → host tier → shared store.

The host tier (`HostTier`) is one host tensor of page rows (pinned when a GPU is present), keyed
by chain key, least recently used first out. It sits between the rank's device pool and the
cluster's store actor (`kvstore.store`, reached through this rank's `kvstore.client`):

- save (`KVSave`, at the start of a step, before the forward): on a GPU the pages are gathered
  and copied down into their pinned host rows on a side stream, after the work already on the
  compute stream (a settled PD hand-off's prompt pages at once: their steps have completed), and this
  step's forward, which may overwrite a saved page, waits for the gather; nothing on the
  step's thread waits or copies bytes. The
  I/O thread waits for the copy's event, publishes the rows and writes them on to the store.
  When the host tier has no free row (every row still on its way to a slow store) the page is
  dropped and counted, never written in the step.
  MLA ranks != 0 keep their host copy and write nothing (the client skips: contract 5).
  A `sync` save (the drain at shutdown, no step running) writes straight to the store.
- prefetch (`KVPrefetch`): the I/O thread reads the request's keys from the store into host
  rows, a chunk at a time, while the rank keeps computing other requests' steps. The host tier
  is registered with the client's NIXL agent, so the store's bytes land in the rows themselves
  (and saves leave from them): no staging copy on either path.
- progress: every step while prefetches run, the ranks agree (min over ranks, on the CPU
  group: nothing waits on the GPU) on each prefetch's pages every rank holds (pinned: nothing
  evicts them before the load) and whether every rank's read has ended; rank 0 reports that
  in the step's result. The ranks' prefetches lag one another (an MLA rank != 0 reads pages it
  never wrote; its first read registers with the store): the scheduler only ever loads what
  all of them hold.
- load (`KVLoad`, in the plan that admits its request): enqueue the copy of those pages up
  from their pinned rows into a device buffer on a load stream, and their scatter into the
  device pages on the compute stream behind it, ahead of the forward that reads them; end the
  prefetch, and agree with the other ranks on the count (min over ranks). Under overlapped
  scheduling the plan is enqueued while the previous step computes, so the PCIe copy (a
  2,048-token prompt of an 8B model: 256 MiB) runs beside that step instead of holding up
  every decode behind it; only the scatter (device to device) is on the compute stream, whose
  order keeps pool pages safe from a step still in flight. Nothing is copied on the step's
  thread: the rows stay pinned until the scatter's event has completed (checked at the next
  step). Every rank runs the same loads in the same order, so the collectives line up; a rank
  that fails locally contributes 0 and never skips one.

Which pages are saved, and when (write-through, selective, write-back), and when a prefetch
stops, is decided by the scheduler (`cluster.engine.kv_offload`); this file only carries out orders.
Failures (store down, full, corrupt page) are misses and counted errors, never exceptions
into the step.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque

import torch

from workers.host_tier import HostTier, runs
from workers.host_warm import WARM_THREADS, HostWarm, WarmAgreement
from workers.kv_messages import KVLoad, KVOffloadOptions, KVPrefetch, KVSave
from workers.kv_offload_io import RankIOThreads, _Prefetch, _Write

logger = logging.getLogger(__name__)


class RankKVOffload(RankIOThreads):
    """Carries out a plan's KV orders on one rank (`run`, called by the model runner at the
    start of `execute`). Owns the host tier, the store client and one I/O thread."""

    def __init__(self, opts: KVOffloadOptions, pool, tp):
        from kvstore.client import KVStoreClient
        from kvstore.pages import pool_device, pool_key_bytes, pool_layout, pool_page_bytes

        if pool_layout(pool) != opts.layout:
            raise ValueError(f"KV store layout {opts.layout!r} for a {pool_layout(pool)!r} pool")
        self.opts = opts
        self.pool = pool
        self.tp = tp
        self.key_bytes = pool_key_bytes(pool)
        self.client = KVStoreClient(None, opts.layout, tp.rank, tp.size, pool_page_bytes(pool), opts.fingerprint,
                                    staging_pages=opts.chunk_pages, timeout_s=opts.timeout_s,
                                    store_name=opts.store_name, namespace=opts.namespace,
                                    # + the reader's, the drain's, the warm's
                                    staging_slots=opts.io_threads + 2 + WARM_THREADS * opts.warm)
        self.page_bytes = self.client.page_bytes
        pages = max(opts.host_cache_bytes // self.page_bytes, opts.chunk_pages)
        self.host = HostTier(pages, self.page_bytes, pin=torch.cuda.is_available(), log_changes=tp.is_first)
        # Pages move straight between the store and the host rows (no staging copy): the
        # client's NIXL agent takes the host tier's memory, or this rank runs without the store.
        if not self.client.register_rows(self.host.data):
            self.client.close()
            raise RuntimeError("the KV store client could not register the host tier with NIXL")
        self._device = pool_device(pool)
        # Prefill/decode hand-offs: rows on the pool's own device (GPU memory on a GPU) under a
        # NIXL agent of their own, read by decode ranks from GPU to GPU (workers/kv_peer.py);
        # none on a mixed replica.
        from workers.handoff_rows import make_handoff_rows
        from workers.kv_peer import READ_CHUNK_PAGES, PeerLeases, PeerReader

        self.handoff = make_handoff_rows(opts.handoff_bytes, self.page_bytes, self._device, opts.handoff_memory,
                                         tp.rank, READ_CHUNK_PAGES, sum(self.key_bytes))
        self.lend = self.handoff.tier if self.handoff is not None else None
        self.leases = PeerLeases(self)  # pages lent to decode replicas (prefill/decode disaggregation)
        self.peer = PeerReader(self, pool, tp)  # pages read from prefill replicas
        # (copy event, rows pinned until it, their tier)
        self._copying: deque[tuple[object, list[int], HostTier]] = deque()
        # On a GPU, pages move between the device pool and the pinned rows by DMA on side
        # streams: saves down on one, loads up on another (a load must not queue behind a save).
        self._gpu_rows = self.host.pinned and self._device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self._device) if self._gpu_rows else None
        self._load_stream = torch.cuda.Stream(self._device) if self._gpu_rows else None
        self.jobs: dict[str, _Prefetch] = {}
        self._reads: deque[_Prefetch] = deque()
        self._writes: deque[_Write] = deque()
        self._handoffs: deque[_Write] = deque()  # host-only saves for decode replicas: any thread, first
        self._progress = False  # a prefetch chunk landed or a prefetch ended since the last step
        self._writing = 0  # saves being written by the I/O threads (their host rows are pinned)
        self._cv = threading.Condition()
        self._stop = False
        self.counters = {"pages_saved_host": 0, "pages_loaded": 0, "loads": 0, "host_hit_pages": 0,
                         "prefetched_pages": 0, "host_full": 0, "write_failures": 0, "errors": 0,
                         "dropped_pages": 0, "drained_pages": 0,
                         # prefetches: seconds queued for an I/O thread, then reading, summed
                         "prefetch_jobs": 0, "prefetch_wait_s": 0.0, "prefetch_read_s": 0.0,
                         "load_s": 0.0, "load_max_s": 0.0}
        # Several requests' prefetches (and saves) move at once: each thread holds one of the
        # client's staging areas for its transfer, and the checksums run outside the GIL. One
        # more thread only reads: a prefetch (a request waits on it) never queues behind saves
        # that took every other thread.
        self._threads = [threading.Thread(target=RankKVOffload._io_main, args=(weakref.ref(self), i == 0),
                                          name=f"kv-offload-r{tp.rank}-{'read' if i == 0 else i}", daemon=True)
                         for i in range(opts.io_threads + 1)]
        # TP > 1: what the ranks warmed is reported once every rank holds it (workers/host_warm.py).
        self.agreement = WarmAgreement(tp, self.host) if opts.warm and tp.size > 1 else None
        self.warm = HostWarm(weakref.ref(self), f"kv-offload-r{tp.rank}", self.agreement) if opts.warm else None
        if self.warm is not None:
            self._threads += self.warm.threads()
        for t in self._threads:
            t.start()
        logger.info("KV store client on rank %d: layout %s, %d-byte pages, host tier %d pages (%.1f MiB)",
                    tp.rank, opts.layout, self.page_bytes, pages, pages * self.page_bytes / 2**20)

    # ---------------- one step ----------------
    def run(self, plan, result) -> None:
        """Saves, then prefetch starts, then loads (see workers.kv_messages for why), as a step
        launches. The prefetches' progress goes in the result when it is completed (`report`)."""
        self._unpin_copied()
        self.leases.sweep()
        for rid in plan.finished_rids:
            job = self.jobs.pop(rid, None)
            if job is not None:
                job.cancel()
        # The loads' rows, pinned before this plan's saves take rows: a save evicts the least
        # recently used rows, often the very prefix a load brings back. A load of pages read
        # from a prefill replica takes them from the hand-off rows.
        tiers = [self._tier_of(ld.rid) for ld in plan.kv_loads]
        held = [t.leading(ld.keys[: len(ld.page_ids)]) for t, ld in zip(tiers, plan.kv_loads)]
        # Settled saves first: on the in-order copy stream, one behind a save that waits for the
        # step in flight would wait for it too.
        for save in sorted(plan.kv_saves, key=lambda s: not s.settled):
            self._save(save)
        for pre in plan.kv_prefetch:
            self._start_prefetch(pre)
        if plan.kv_loads:
            t0 = time.monotonic()
            for load, rows, tier in zip(plan.kv_loads, held, tiers):
                result.kv_loaded[load.rid] = self._load(load, rows, tier)
            spent = time.monotonic() - t0
            self.counters["load_s"] += spent  # on the step's thread: launches only, never a wait
            self.counters["load_max_s"] = max(self.counters["load_max_s"], spent)
        with self._cv:
            if not plan.reqs and not plan.kv_loads and not self._progress and any(
                    not j.done.is_set() for j in self.jobs.values()):
                # Nothing to compute and the scheduler waits on a prefetch: give it a moment
                # rather than answer at once (the engine loop would spin on empty steps).
                self._cv.wait(self.opts.idle_wait_s)
            self._progress = False

    def report(self, result) -> None:
        """The prefetches' progress (and the host tier's changes) into `result`, as the step's
        result is completed: on every rank at the same point (the model runner's), after the
        next step's `run` when steps overlap. Sampled here rather than at launch, the scheduler
        learns that a prefetch (a PD hand-off's read) has landed a step sooner."""
        jobs = list(self.jobs.values())
        progress = report_progress(self.tp, [j.ready for j in jobs], [j.done.is_set() for j in jobs])
        # (read before the agreement and the changes: a warm that has ended has published all it will)
        warming = self.warm is not None and self.warm.running
        agreed = self.agreement.step(warming) if self.agreement is not None else []
        if self.tp.is_first:
            result.kv_prefetched = dict(zip([j.rid for j in jobs], progress))
            result.kv_host_warming = warming or (self.agreement is not None and self.agreement.active)
            ready, result.kv_host_evicted = self.host.take_changes()
            result.kv_host_ready = ready + [k for k in agreed if self.host.has(k)]

    def _tier_of(self, rid: str) -> HostTier:
        job = self.jobs.get(rid)
        return job.tier if job is not None else self.host

    def _save(self, save: KVSave) -> None:
        from kvstore.pages import gather_pages

        if save.sync:
            self._save_now(save)
            return
        tier = self.host if save.store else self.lend  # a hand-off: the rows decode ranks read
        if tier is None:  # (no hand-off rows: the decode replica computes the prompt)
            self.counters["dropped_pages"] += len(save.page_ids)
            return
        ahead = [not tier.has(k) for k in save.keys]
        todo = [(p, k) for p, k, a in zip(save.page_ids, save.keys, ahead) if a]
        prompt = sum(ahead[: save.prompt])  # the leading pages that hold prompt tokens
        rows = tier.take(len(todo))
        if len(rows) < len(todo):
            # Every host row is still on its way to the store (it is slow or down): drop the
            # rest rather than make the step wait for it.
            self.counters["dropped_pages"] += len(todo) - len(rows)
            self.counters["host_full"] += 1
            todo = todo[: len(rows)]
        if not todo:
            return
        pages = [p for p, _ in todo]
        if not save.store:  # a decode rank may ask for these before they are published
            self.leases.expect([k for _, k in todo])
        try:
            if self._gpu_rows:
                done, sums = self._copy_out(pages, rows, tier, final=save.settled,
                                            sums=not save.store and tier.data.is_cuda)
                write = _Write([k for _, k in todo], rows, None, done, save.store, prompt, sums)
            else:  # on the CPU: gathered now, put into its rows by the I/O thread
                stage = torch.empty((len(pages), self.page_bytes), dtype=torch.uint8)
                gather_pages(self.pool, pages, stage)
                write = _Write([k for _, k in todo], rows, stage, store=save.store, prompt=prompt)
        except Exception:
            logger.exception("kv offload: copying %d pages out of the device pool failed", len(todo))
            self.counters["errors"] += 1
            tier.give(rows)
            if not save.store:
                self.leases.arrived([k for _, k in todo])
            return
        self.counters["pages_saved_host"] += len(todo)
        with self._cv:
            # A hand-off goes first (a decode replica waits on it; it never touches the store),
            # in the order they came.
            (self._writes if write.store else self._handoffs).append(write)
            self._cv.notify_all()

    def _copy_out(self, page_ids: list[int], rows: list[int], tier: HostTier, final: bool = False,
                  sums: bool = False):
        """Device pages into rows of `tier` (the pinned host tier, or the hand-off rows in
        device memory) with nothing on the step's thread but launches: the pages are gathered
        into a device buffer and copied to their rows on a side stream, and this plan's forward
        (which may overwrite a saved page) waits on the compute stream for the gather. Returns
        an event that completes when the bytes are in the rows, and (`sums`: a hand-off) the
        gathered pages' checksums (`kvstore.transfer.page_sums`), copied to the host beside them.

        Where the gather starts: a page the radix cache took on a release may hold K/V that a
        step in flight is still writing (the last known token's under overlapped scheduling; an
        aborted prefill's piece), so by default the gather waits for everything enqueued on the
        compute stream. A `final` save (`KVSave.settled`: a PD hand-off of a prefill that ended
        on its sampled token, every plan that wrote its pages read back) is gathered at once,
        beside the step in flight: waiting for it, a prefill replica sharing an H200 made each
        hand-off's `locate` wait 42-47 ms (268 MB for a 2,048-token 8B prompt, behind the next
        ~125 ms prefill step; 2026-11-28)."""
        from kvstore.pages import gather_pages
        from kvstore.transfer import page_sums

        compute = torch.cuda.current_stream(self._device)
        if not final:
            queued = torch.cuda.Event()
            queued.record(compute)
        host_sums = None
        with torch.cuda.stream(self._copy_stream):
            if not final:
                self._copy_stream.wait_event(queued)
            dev = torch.empty((len(page_ids), self.page_bytes), dtype=torch.uint8, device=self._device)
            gather_pages(self.pool, page_ids, dev)
            gathered = torch.cuda.Event()
            gathered.record(self._copy_stream)
            for i, j in runs(rows):
                tier.data[rows[i] : rows[i] + j - i].copy_(dev[i:j], non_blocking=True)
            if sums:
                used = sum(self.key_bytes)
                host_sums = torch.empty(len(page_ids), dtype=torch.int64, pin_memory=True)
                host_sums.copy_(page_sums(dev[:, :used]), non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        compute.wait_event(gathered)  # the forward after this may reuse a saved page
        return done, host_sums

    def _save_now(self, save: KVSave) -> None:
        """Write pages straight from the device pool to the store (the drain: no step runs)."""
        n = len(save.page_ids)
        if n and self.client.save_pages(self.pool, save.page_ids, save.keys, save.prompt, wait_s=save.wait_s):
            self.counters["drained_pages"] += n
        elif n:
            self.counters["write_failures"] += 1

    def _start_prefetch(self, pre: KVPrefetch) -> None:
        old = self.jobs.pop(pre.rid, None)
        if old is not None:
            old.cancel()
        # (a read from a prefill replica without hand-off rows here reads nothing: `PeerReader.fetch`)
        tier = self.lend if pre.source is not None and self.lend is not None else self.host
        job = _Prefetch(pre.rid, list(pre.keys), tier, pre.source)
        self.jobs[pre.rid] = job
        with self._cv:
            self._reads.append(job)
            self._cv.notify_all()

    def _load(self, load: KVLoad, rows: list[int], tier: HostTier) -> int:
        """Copy `load`'s pages from their rows (`rows`: the leading ones `tier` holds, pinned
        by `run`; unpinned here once copied) into its device pages; the count every rank loaded."""
        from kvstore.pages import scatter_pages
        from kvstore.transfer import agree_on_pages

        n_local = 0
        try:
            n_local = len(rows)
            if rows and self._gpu_rows:
                self._copy_in(load.page_ids[:n_local], rows, tier)
                rows = []  # pinned until their copy has run (`_unpin_copied`)
            elif rows:
                scatter_pages(self.pool, load.page_ids[:n_local],
                              torch.index_select(tier.data, 0, torch.tensor(rows)))
        except Exception:
            logger.exception("kv offload: loading %d pages failed", len(load.page_ids))
            self.counters["errors"] += 1
            n_local = 0
        finally:
            tier.unpin(rows)
        n = agree_on_pages(self.tp, n_local)  # every rank reaches this, whatever happened above
        job = self.jobs.pop(load.rid, None)
        if job is not None:
            job.cancel()  # the I/O thread stops after its current chunk
        else:  # admitted on what the host tier holds (no prefetch): every page a host hit
            self.counters["host_hit_pages"] += n
        if load.page_ids:
            self.counters["loads"] += 1
            self.counters["pages_loaded"] += n
        return n

    def _copy_in(self, page_ids: list[int], rows: list[int], tier: HostTier) -> None:
        """Enqueue the copy of pinned host rows into a device buffer on the load stream (DMA
        straight from the rows, each run of adjacent rows in one copy), and the buffer's scatter
        into device pages on the current stream once it has landed; the rows stay pinned until
        the scatter's event completes. Rows in device memory (the hand-off rows) are scattered
        from where they are."""
        from kvstore.pages import scatter_pages

        compute = torch.cuda.current_stream(self._device)
        if tier.data.is_cuda:
            spans = list(runs(rows))
            if len(spans) <= 4:  # straight from runs of adjacent rows: no copy of them all
                for i, j in spans:
                    scatter_pages(self.pool, page_ids[i:j], tier.data[rows[i] : rows[i] + j - i])
            else:  # (a pinned index: a pageable copy would wait for the step in flight)
                idx = torch.tensor(rows).pin_memory().to(self._device, non_blocking=True)
                scatter_pages(self.pool, page_ids, tier.data.index_select(0, idx))
            done = torch.cuda.Event()
            done.record(compute)
            self._copying.append((done, rows, tier))
            return
        with torch.cuda.stream(self._load_stream):
            dev = torch.empty((len(rows), self.page_bytes), dtype=torch.uint8, device=self._device)
            for i, j in runs(rows):
                dev[i:j].copy_(tier.data[rows[i] : rows[i] + j - i], non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(self._load_stream)
        compute.wait_event(landed)
        dev.record_stream(compute)  # (allocated on the load stream) not reused before the scatter read it
        scatter_pages(self.pool, page_ids, dev)
        done = torch.cuda.Event()
        done.record(compute)
        self._copying.append((done, rows, tier))

    def _unpin_copied(self, wait: bool = False) -> None:
        """Unpin the rows whose copies into the device have run (all of them: `wait`)."""
        while self._copying and (wait or self._copying[0][0].query()):
            done, rows, tier = self._copying.popleft()
            if wait:
                done.synchronize()
            tier.unpin(rows)

    # ---------------- metrics, shutdown ----------------
    def stats(self) -> dict:
        """The client's counters (pages/bytes to and from the store, errors) and the host tier's."""
        st = self.client.stats()
        st["errors"] += self.counters["errors"]
        st.update({f"offload_{k}": v for k, v in self.counters.items() if k != "errors"})
        st.update(self.peer.counters, **self.leases.counters)
        st["pd_peer_agents"] = dict(self.peer.agents)  # prefill rank actor -> the NIXL agent added for it
        if self.warm is not None:
            st.update(self.warm.stats())
        for name, tier in (("host", self.host), ("handoff", self.lend)):
            if tier is None:
                continue
            st[name] = {"used_bytes": tier.used_bytes, "capacity_bytes": tier.capacity * self.page_bytes,
                        "pages": len(tier.ready), "evictions": tier.evictions, "pinned_rows": len(tier.pins),
                        "device": str(tier.data.device)}
        if self.handoff is not None and "handoff" in st:
            st["handoff"]["agent"] = self.handoff.name  # the NIXL agent decode ranks read these rows through
        return st

    def close(self) -> None:
        """Stop the I/O thread (after the store call it may be in: bounded by the client's
        timeouts) and release the client's NIXL agent. Idempotent."""
        for job in list(self.jobs.values()):
            job.cancel()
        self._unpin_copied(wait=True)
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=30)
        self.client.close()
        if self.handoff is not None:
            self.handoff.close()


class NullKVOffload:
    """A rank whose offload could not start: it loads nothing but still takes part in every
    agreement (its peers wait on the collectives), so the replica just misses: it follows the
    prefetches the plans start and end as a rank that holds none of their pages."""

    def __init__(self, tp, warm: bool = False):
        self.tp = tp
        self.jobs: dict[str, None] = {}
        self.agreement = WarmAgreement(tp) if warm and tp.size > 1 else None  # (holds nothing)

    def run(self, plan, result) -> None:
        from kvstore.transfer import agree_on_pages

        for rid in plan.finished_rids:
            self.jobs.pop(rid, None)
        for pre in plan.kv_prefetch:
            self.jobs.pop(pre.rid, None)
            self.jobs[pre.rid] = None
        for load in plan.kv_loads:
            result.kv_loaded[load.rid] = agree_on_pages(self.tp, 0)
            self.jobs.pop(load.rid, None)

    def report(self, result) -> None:
        progress = report_progress(self.tp, [0] * len(self.jobs), [True] * len(self.jobs))
        if self.agreement is not None:
            self.agreement.step(False)
        if self.tp.is_first:
            result.kv_prefetched = dict(zip(self.jobs, progress))

    def stats(self) -> dict:
        return {"tp_rank": self.tp.rank, "errors": 1, "connected": False}

    def close(self) -> None:
        pass


def report_progress(tp, ready: list[int], ended: list[bool]) -> list[tuple[int, bool]]:
    """Per prefetch (the same ones, in the same order, on every rank): the pages every rank
    holds and whether every rank's read has ended — one collective on the CPU group."""
    if not ready:
        return []
    agreed = tp.all_min_ints(list(ready) + [int(e) for e in ended])
    n = len(ready)
    return [(agreed[i], bool(agreed[n + i])) for i in range(n)]


def make_rank_offload(opts: KVOffloadOptions | None, pool, tp) -> RankKVOffload | NullKVOffload | None:
    """The rank's offload; None when the replica runs without a KV store."""
    if opts is None:
        return None
    try:
        return RankKVOffload(opts, pool, tp)
    except Exception:
        logger.exception("KV store off on rank %d: its loads count 0 pages", tp.rank)
        return NullKVOffload(tp, opts.warm)
