"""A rank's host tier warmed at start from the shared store.

When a replica starts again on a store that outlived it (a restart, a redeploy, a crash), its
GPU cache and host tier are empty while the store's file tier still holds the pages of the
prompts it served. Read back on demand, a page costs its request a store lookup, a prefetch
and a requeue (`cluster.engine.kv_offload`), which under load is slower than computing a
1k-token prompt, so the store's judge bypasses the store. Read into the host tier before anyone
asks, that cost is paid before the requests come: the first rank reports the warmed keys with
its next step result, and a request whose prefix is there is admitted at once with a load
from pinned host rows (`cluster.engine.kv_host_admission`).

What is read: the pages of this model and cache layout (the model tag the store keeps with
every page: `kvstore.keys.model_tag`) that the store holds whole for this rank's TP group (an
MHA rank reads its own K/V shards of them; MLA pages are the same for every rank), prompt
pages first, each kind most recently used first: the same list for every rank
(`KVStore.recent`). Up to `WARM_FRACTION` of the tier (the rest stays free for the first
saves). It takes free rows only, so it never evicts a page the replica put there meanwhile,
and puts what it reads at the least recently used end, the most valuable evicted last;
`chunk_pages` a read on
`WARM_THREADS` threads, beside the rank's steps (nothing in a step waits for it); a page the
store no longer has, or that fails its checksum, is skipped. It stops at close, or after
`GIVE_UP` reads in a row brought nothing (the store is down). Counted in the
rank's stats: `offload_warm_pages`, `offload_warm_s` (until the last thread ended) and
`offload_warming` (1 while it runs).

With several TP ranks, each warms its own tier at its own pace, and one may skip a page another
read. So what the first rank reports is agreed (`WarmAgreement`): every step while a warm runs,
the first rank proposes the keys its warm published since, every rank says which of them its
tier holds (min over ranks, on the CPU group), and only those all hold are reported; the rest
are proposed again while any rank still warms, then dropped. A request is never admitted on a
warmed page one rank lacks (its load would come back short: computed again, and the picture
would forget the page for good).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from collections import deque

logger = logging.getLogger(__name__)

WARM_FRACTION = 0.9  # of the host tier's rows that a warm fills at most
WARM_THREADS = 2  # store reads at once (each holds one of the client's staging areas)
GIVE_UP = 3  # reads in a row that brought no page
AGREE_MAX = 512  # warmed keys the first rank proposes per step (TP > 1)
_NO_KEY = (1 << 63) - 1  # what the other ranks put where the first rank's proposals go (a min)


class HostWarm:
    """One warm of one rank's host tier; `threads()` are started by the rank's offload, which
    they hold weakly (a dropped offload ends them) and which joins them at close."""

    def __init__(self, offload_ref, name: str, agreement: WarmAgreement | None = None):
        self._ref = offload_ref
        self.agreement = agreement  # TP > 1: what it publishes is reported once agreed
        self._name = name
        self._chunks: deque[list[str]] = deque()
        self._listed = threading.Event()
        self._lock = threading.Lock()
        self._running = WARM_THREADS
        self._empty_reads = 0
        self.started = time.monotonic()
        self.pages = 0
        self.listed_pages = 0
        self.seconds = 0.0

    @property
    def running(self) -> bool:
        return self._running > 0

    def threads(self) -> list[threading.Thread]:
        return [threading.Thread(target=self._main, args=(i == 0,), name=f"{self._name}-warm{i}", daemon=True)
                for i in range(WARM_THREADS)]

    def _main(self, lister: bool) -> None:
        try:
            if lister:
                try:
                    self._list()
                finally:
                    self._listed.set()
            self._listed.wait()
            while self._read_next():
                pass
        except Exception:
            logger.exception("kv offload: warming the host tier")
        finally:
            self._listed.set()
            with self._lock:
                self._running -= 1
                if self._running == 0:
                    self.seconds = time.monotonic() - self.started
                    if self.pages:
                        logger.info("%s: host tier warmed with %d pages from the KV store in %.1f s",
                                    self._name, self.pages, self.seconds)

    def _list(self) -> None:
        off = self._ref()
        if off is None:
            return
        host = off.host
        limit = int(host.capacity * WARM_FRACTION) - (host.capacity - len(host.free))
        chain = [k for k in off.client.recent(limit) if not host.has(k)] if limit > 0 else []
        n = max(1, off.opts.chunk_pages)
        self._chunks.extend(chain[i : i + n] for i in range(0, len(chain), n))
        self.listed_pages = len(chain)

    def _read_next(self) -> bool:
        """Read one chunk into free rows; False when there is nothing (more) to do."""
        import ray

        off = self._ref()
        if off is None or off._stop or not ray.is_initialized():
            return False
        with self._lock:
            if not self._chunks or self._empty_reads >= GIVE_UP:
                return False
            chunk = self._chunks.popleft()
        host = off.host
        rows = host.take_free(len(chunk))
        if not rows:
            return False  # the tier filled up (the replica's own pages): done
        chunk = chunk[: len(rows)]
        n, held = 0, False
        try:
            n = off.client.read_rows(chunk, [host.data[r] for r in rows], off.key_bytes)
            stuck = off.client.stuck_read()
            if stuck:  # the READ may still write these rows: they come back when it has ended
                off.client.hold(stuck, functools.partial(host.give, rows))
                held = True
        finally:  # (a raise leaves every row free again)
            if not held:
                host.give(rows[n:])
            # At the least recently used end, ahead of the chunks read before it: the list is
            # most valuable first, so the replica's own pages evict the least valuable first.
            host.publish(chunk[:n], rows[:n], oldest=True, log=self.agreement is None)
            if self.agreement is not None:
                self.agreement.published(chunk[:n])
        with self._lock:
            self.pages += n
            self._empty_reads = 0 if n else self._empty_reads + 1
            if n + 1 < len(chunk):  # page n is gone or failed its checksum: go on past it
                self._chunks.appendleft(chunk[n + 1 :])
        return True

    def stats(self) -> dict:
        return {"offload_warm_pages": self.pages, "offload_warm_listed": self.listed_pages,
                "offload_warm_s": self.seconds if not self.running else time.monotonic() - self.started,
                "offload_warming": int(self.running)}


def key_hash(key: str) -> int:
    """A chain key as a non-negative int64 (what a collective carries)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1


class WarmAgreement:
    """Which pages warmed into the host tiers of a TP group every rank holds (the module
    docstring says why). Every rank has one when the ranks warm and there are several, and
    calls `step` once per step, in the same step on every rank, until it says it is done."""

    def __init__(self, tp, host=None):
        self.tp, self.host = tp, host  # host: None on a rank without a store client (holds nothing)
        self.active = tp.size > 1
        self.by_hash: dict[int, str] = {}  # the keys this rank's warm published
        self.unreported: deque[str] = deque()  # the first rank's, not yet agreed
        self._lock = threading.Lock()

    def published(self, keys: list[str]) -> None:
        """The warm put `keys` into this rank's tier (its threads call this)."""
        with self._lock:
            self.by_hash.update((key_hash(k), k) for k in keys)
            if self.tp.is_first:
                self.unreported.extend(keys)

    def step(self, warming: bool) -> list[str]:
        """One round (1 collective, 3 when there is something to agree on): the first rank's
        keys every rank holds now; `warming`: this rank's warm still runs."""
        if not self.active:
            return []
        with self._lock:
            proposed = [self.unreported.popleft() for _ in range(min(AGREE_MAX, len(self.unreported)))]
            left = len(self.unreported)
        n, left, running = (-x for x in self.tp.all_min_ints([-len(proposed), -left, -int(warming)]))
        agreed: list[str] = []
        if n:
            hashes = self.tp.all_min_ints([key_hash(k) for k in proposed] if proposed else [_NO_KEY] * n)
            with self._lock:
                keys = [self.by_hash.get(h) for h in hashes]
            holds = self.tp.all_min_ints([int(k is not None and self.host is not None and self.host.has(k))
                                          for k in keys])
            agreed = [k for k, ok in zip(proposed, holds) if ok]
            if running:  # another rank may still read the rest
                with self._lock:
                    self.unreported.extend(k for k, ok in zip(proposed, holds) if not ok)
        elif not left and not running:  # (the same values on every rank: they stop together)
            self.active = False
            with self._lock:
                self.by_hash.clear()
        return agreed
