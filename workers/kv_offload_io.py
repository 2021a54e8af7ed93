"""A rank's KV I/O threads (a mixin of `workers.kv_offload.RankKVOffload`, which owns the
host tier, the store client and the queues): each takes the next order off the queues, reads
first (a request waits on a prefetch; one thread only reads), and carries it out beside the
rank's steps: a save's bytes landed in their host rows and written on to the store, or a
prefetch's pages read from the store (or a prefill replica) into pinned host rows, a chunk at
a time, while the store stages the later chunks' files.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from workers.host_tier import HostTier
from workers.kv_messages import KVOffloadOptions

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Write:
    """Pages on their way to the store: on the CPU their bytes in `stage`, put into rows `rows`
    (of the host tier; a hand-off's: of the hand-off rows, `RankIOThreads._rows_for`; taken,
    invisible until published) by the I/O thread; on a GPU copied into the
    rows themselves, landed once `event` completes. Then written (or, a hand-off to a decode
    replica, published in the rank's hand-off rows with their checksums: `sums`, taken on the
    GPU beside the copy, or computed by the I/O thread)."""

    keys: list[str]
    rows: list[int]
    stage: torch.Tensor | None
    event: object = None
    store: bool = True  # False: a hand-off to a decode replica (its rows are the hand-off rows)
    prompt: int = 0  # the leading keys that hold prompt tokens
    sums: torch.Tensor | None = None


@dataclass(eq=False)
class _Prefetch:
    """One request's prefetch. The rows of keys[:ready] stay pinned in `tier` (the host tier; a
    read from a prefill replica: the hand-off rows) until the load has copied them (or the
    prefetch is cancelled): the next chunk's reads never evict the chunks before it, so a
    prefix longer than the tier stops at its capacity."""

    rid: str
    keys: list[str]
    tier: HostTier
    source: object = None  # a KVSource: read from a prefill replica's ranks (workers/kv_peer.py)
    ready: int = 0  # leading keys in the tier so far
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    rows: list[int] = field(default_factory=list)  # pinned rows of keys[:ready]
    lock: threading.Lock = field(default_factory=threading.Lock)
    queued_at: float = field(default_factory=time.monotonic)

    def add(self, rows: list[int]) -> bool:
        """Record pinned rows of the next keys; False (rows unpinned) once cancelled."""
        with self.lock:
            if not self.cancelled:
                self.rows += rows
                self.ready += len(rows)
                return True
        self.tier.unpin(rows)
        return False

    def cancel(self) -> None:
        """Stop the I/O thread after its current chunk and unpin what it fetched."""
        with self.lock:
            self.cancelled = True
            rows, self.rows = self.rows, []
        self.tier.unpin(rows)



class RankIOThreads:
    opts: KVOffloadOptions
    host: HostTier
    lend: HostTier | None  # the hand-off rows (workers/handoff_rows.py)
    client: object  # kvstore.client.KVStoreClient
    key_bytes: list[int]
    leases: object  # workers.kv_peer.PeerLeases
    peer: object  # workers.kv_peer.PeerReader
    counters: dict
    _reads: deque
    _writes: deque
    _handoffs: deque
    _writing: int
    _progress: bool
    _stop: bool
    _cv: threading.Condition

    @staticmethod
    def _io_main(ref, reader: bool) -> None:
        """An I/O thread. It holds the offload only weakly between rounds, so an engine that is
        dropped (its pool, host tier and client with it) ends the thread too."""
        while True:
            offload = ref()
            if offload is None or not offload._io_round(reader):
                return
            del offload

    def _io_round(self, reader: bool = False) -> bool:
        """One read or write (reads first: a request waits on them; the reader thread only
        reads); False at shutdown. Runs on each of the I/O threads."""
        with self._cv:
            if not self._stop and not self._reads and not self._handoffs and (reader or not self._writes):
                self._cv.wait(1.0)
            if self._stop:
                return False
            job = self._reads.popleft() if self._reads else None
            write = None
            if job is None:
                write = self._handoffs.popleft() if self._handoffs else \
                    self._writes.popleft() if self._writes and not reader else None
            self._writing += write is not None
        import ray

        if not ray.is_initialized():  # shut down under us: a store call would start a new Ray
            if job is not None:
                job.cancelled = True  # ends at once (done is still set below)
            if write is not None:
                self._rows_for(write).give(write.rows)
                write = None
        try:
            if job is not None:
                self._prefetch(job)
            elif write is not None:
                self._write(write)
        except Exception:
            logger.exception("kv offload I/O")
            self.counters["errors"] += 1
        finally:
            if write is not None:
                with self._cv:
                    self._writing -= 1
                    self._cv.notify_all()  # its rows are free to take
            if job is not None:
                job.done.set()
                self._note_progress()
        return True

    def _rows_for(self, w: _Write) -> HostTier:
        return self.host if w.store else self.lend

    def _write(self, w: _Write) -> None:
        """Land a save's bytes in its rows, publish them, write them to the store."""
        tier = self._rows_for(w)
        try:
            if w.event is not None:
                w.event.synchronize()
            if w.stage is not None:  # on a GPU the bytes were copied into the rows themselves
                tier.data[torch.tensor(w.rows)] = w.stage
        except Exception:
            tier.give(w.rows)
            if not w.store:
                self.leases.arrived(w.keys)
            raise
        if not w.store:  # checksummed (now, or on the GPU beside the copy): off the decode rank's path
            self.leases.publish_checksummed(w.keys, w.rows, None if w.sums is None else w.sums.tolist())
            return
        held = self.host.publish(w.keys, w.rows, pin=True)  # pinned until the store write is done
        try:
            self._count_write(self.client.write_rows, w.keys, [self.host.data[r] for r in held], self.key_bytes,
                              w.prompt)
        finally:
            self.host.unpin(held)

    def _count_write(self, write, *args) -> None:
        """A store write; a failure (store down or failing: those pages just miss later) counts
        once as an error, whether or not the client counted it itself; pages the store refused
        (no room in its RAM for now) are counted by the client as refused, not as errors."""
        before = (self.client.counters.errors, self.client.counters.pages_refused)
        if not write(*args):
            self.counters["write_failures"] += 1
            if (self.client.counters.errors, self.client.counters.pages_refused) == before:
                self.counters["errors"] += 1  # (a refusal is counted as a dropped page, not an error)

    def _take_rows(self, n: int, job: _Prefetch, wait_s: float = 1.0) -> list[int]:
        """Rows of the job's tier for a prefetch chunk; while none is free but saves are being
        written (their rows come free when done), wait for them rather than give up, a bounded
        while. Hand-off rows come free as the step thread's loads complete: those are waited for
        the same bounded while."""
        deadline = time.monotonic() + wait_s
        while True:
            rows = job.tier.take(n)
            if rows or job.cancelled:
                return rows
            with self._cv:
                if (job.tier is self.host and not self._writing) or time.monotonic() > deadline:
                    return []
                self._cv.wait(0.01)

    def _prefetch(self, job: _Prefetch) -> None:
        start = time.monotonic()
        self.counters["prefetch_jobs"] += 1
        self.counters["prefetch_wait_s"] += start - job.queued_at
        try:
            self._prefetch_pages(job)
        finally:
            self.counters["prefetch_read_s"] += time.monotonic() - start

    def _prefetch_pages(self, job: _Prefetch) -> None:
        if job.source is not None:
            self.peer.fetch(job, job.source)
            return
        keys = job.keys
        if len(keys) - job.ready > self.opts.chunk_pages:  # the store reads the later chunks' files meanwhile
            self.client.stage(keys[job.ready + self.opts.chunk_pages :])
        while job.ready < len(keys) and not job.cancelled:
            row = self.host.pin_ready(keys[job.ready])
            if row is not None:
                self.counters["host_hit_pages"] += 1
                if not job.add([row]):
                    return
                continue
            chunk = keys[job.ready : job.ready + self.opts.chunk_pages]
            rows = self._take_rows(len(chunk), job)
            if not rows:  # every row is pinned: the prefix is longer than the host tier
                self.counters["host_full"] += 1
                return
            chunk = chunk[: len(rows)]
            n = self.client.read_rows(chunk, [self.host.data[r] for r in rows], self.key_bytes)
            stuck = self.client.stuck_read()
            if stuck:  # the READ may still write these rows: they come back when it has ended
                self.client.hold(stuck, functools.partial(self.host.give, rows))
            else:
                self.host.give(rows[n:])
            self.counters["prefetched_pages"] += n
            if not job.add(self.host.publish(chunk[:n], rows[:n], pin=True)):
                return
            self._note_progress()
            if n < len(chunk):
                return  # the store has no more of this prefix (or failed): a miss from here

    def _note_progress(self) -> None:
        with self._cv:
            self._progress = True
            self._cv.notify_all()
