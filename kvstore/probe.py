"""The engine's question to the KV store before it schedules a prefill: how many of a prompt's
pages does the store hold? Asked without waiting (`StoreProbe.start` -> `PendingProbe`), so a
slow or dead store never holds a step; a failure reads as no pages."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kvstore.keys import check_layout, keys_per_replica_page, replica_keys, validate_keys
from kvstore.messages import STORE_NAME
from kvstore.store_link import FAILED, ClientCounters, StoreLink

logger = logging.getLogger(__name__)


class PendingProbe:
    """A store lookup in flight (`StoreProbe.start`): `done()` never waits; `pages()` once done."""

    def __init__(self, probe: StoreProbe, future, per_page: int, started: float):
        self.probe, self.future, self.per_page, self.started = probe, future, per_page, started

    def done(self) -> bool:
        return self.future is None or self.future.done()

    def pages(self) -> int:
        """Leading pages every rank can load (0 when the lookup failed: counted as an error)."""
        if self.future is None:
            return 0
        try:
            n = self.future.result(timeout=0)
        except Exception as exc:
            self.probe.failed(exc)
            return 0
        pages = n // self.per_page
        self.probe.counters.hit_pages += pages
        return pages

    def abandon(self, too_slow: bool = False) -> None:
        """Stop waiting for the answer: it is not needed any more (the request was admitted
        otherwise, or ended), or `too_slow` (counted as an error, read as a miss). An answer
        not needed is still read when it comes: a lookup that fails then (a store that died)
        counts as an error, and the dead store is looked up again by name."""
        if self.future is not None and not self.future.done():
            if too_slow:
                self.probe.failed(TimeoutError("store lookup"))
                self.future.cancel()
            else:
                self.future.add_done_callback(self.probe.failed_late)


class StoreProbe:
    """The scheduler's control-only view (no NIXL, no staging): how many leading pages of a
    prefix every rank of a replica can load. Per page it needs all ranks' keys: MHA 2 * tp,
    MLA 1 (`keys.keys_per_replica_page`). `count` waits for the answer; `start` does not (the
    scheduler asks when a request arrives and reads the answer when it admits it)."""

    def __init__(self, store, layout: str, tp_size: int, *, timeout_s: float = 2.0,
                 store_name: str = STORE_NAME, namespace: str | None = None, retry_interval_s: float = 1.0):
        self.layout = check_layout(layout)
        self.tp_size = tp_size
        self.counters = ClientCounters()
        self.link = StoreLink(store, self.counters, timeout_s, store_name, namespace, retry_interval_s)

    def count(self, chain: Sequence[str]) -> int:
        try:
            validate_keys(chain)
        except ValueError:
            self.counters.errors += 1
            return 0
        if not chain:
            return 0
        self.counters.query_pages += len(chain)
        keys = replica_keys(chain, self.layout, self.tp_size)
        n = self.link.call("batch_exists_prefix", keys)
        pages = 0 if n is FAILED else n // keys_per_replica_page(self.layout, self.tp_size)
        self.counters.hit_pages += pages
        return pages

    def start(self, chain: Sequence[str]) -> PendingProbe:
        """Send the lookup of `chain` now, answer later (never waits, never raises)."""
        per_page = keys_per_replica_page(self.layout, self.tp_size)
        now = time.monotonic()
        try:
            validate_keys(chain)
        except ValueError:
            self.counters.errors += 1
            return PendingProbe(self, None, per_page, now)
        self.counters.query_pages += len(chain)
        if not chain or (self.link.store is None and not self.link._lookup()):
            return PendingProbe(self, None, per_page, now)
        try:
            ref = self.link.store.batch_exists_prefix.remote(replica_keys(chain, self.layout, self.tp_size))
            return PendingProbe(self, ref.future(), per_page, now)
        except Exception as exc:
            self.failed(exc)
            return PendingProbe(self, None, per_page, now)

    def failed_late(self, future) -> None:
        """The answer of an abandoned lookup (on the thread that completes it): only a failure counts."""
        if not future.cancelled() and future.exception() is not None:
            self.failed(future.exception())

    def failed(self, exc: BaseException) -> None:
        """A lookup failed: count it; a dead store is looked up again by name next time."""
        import ray

        self.counters.errors += 1
        if isinstance(exc, ray.exceptions.RayActorError):
            self.link.store = None
