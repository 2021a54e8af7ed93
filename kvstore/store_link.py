"""A KV store actor handle for one client: Ray control calls with timeouts and error counting,
one log line per burst of failures, and a fresh lookup by name when the store actor died (so a
client follows the store Ray restarts). Page bytes never pass here (`kvstore.client`: NIXL)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

FAILED = object()  # a control call that failed (already counted as an error)
WARN_EVERY_S = 10.0  # a failing store is logged once per burst, then this often


@dataclass
class ClientCounters:
    pages_written: int = 0  # pages this client wrote into the store
    pages_present: int = 0  # pages batch_set found already stored (not sent again)
    pages_backup_skipped: int = 0  # MLA pages a rank != 0 did not write
    pages_refused: int = 0  # pages the store had no room for (its RAM full of pages not yet on file)
    pages_read: int = 0  # pages loaded by batch_get / load_pages
    hit_pages: int = 0  # == pages_read; hit_pages / query_pages is the store hit rate
    query_pages: int = 0  # pages asked for by batch_get / load_pages
    bytes_written: int = 0  # client -> store
    bytes_read: int = 0  # store -> client
    errors: int = 0  # failed calls, timeouts, failed transfers, bad checksums
    corrupt: int = 0  # pages whose checksum failed after a read
    stuck_transfers: int = 0  # transfers NIXL could not cancel (their staging area left the pool until they end)
    write_errors: int = 0  # of `errors`, those of writes (batch_set, save_pages)
    read_errors: int = 0  # of `errors`, those of reads (batch_get, load_pages)
    # Where a read's time goes, summed over reads: the store's locate (it reads pages only on
    # file into its RAM first), the NIXL transfer into this client's memory, the checksums.
    read_locate_s: float = 0.0
    read_transfer_s: float = 0.0
    read_verify_s: float = 0.0


class StoreLink:
    """A store actor handle with timeouts, error counting and re-lookup by name."""

    def __init__(self, store, counters: ClientCounters, timeout_s: float, store_name: str,
                 namespace: str | None, retry_interval_s: float):
        self.store = store
        self.counters = counters
        self.timeout_s = timeout_s
        self.store_name = store_name
        self.namespace = namespace
        self.retry_interval_s = retry_interval_s
        self.generation = 0  # bumped whenever the handle changes (the client re-registers)
        self._last_lookup = 0.0
        self._failing = 0  # failed calls since the last success
        self._warned_at = 0.0
        self._tls = threading.local()  # per calling thread: whether its last call's arguments were refused

    def _lookup(self) -> bool:
        now = time.monotonic()
        if now - self._last_lookup < self.retry_interval_s:
            return False
        self._last_lookup = now
        import ray

        try:
            handle = ray.get_actor(self.store_name, namespace=self.namespace)
        except Exception:
            return False
        if self.store is not None and handle._actor_id == self.store._actor_id:
            return False  # the same dead actor
        self.store, self.generation = handle, self.generation + 1
        return True

    @property
    def refused_args(self) -> bool:
        return getattr(self._tls, "refused", False)

    def call(self, method: str, *args):
        """ray.get(store.method(*args)) within timeout_s, or FAILED (counted; `refused_args`
        then says whether the store refused the arguments themselves: a TypeError, e.g. a
        store of an older version)."""
        import ray

        self._tls.refused = False
        for attempt in range(2):
            if self.store is None and not self._lookup():
                break
            try:
                reply = ray.get(getattr(self.store, method).remote(*args), timeout=self.timeout_s)
                self._failing = 0
                return reply
            except ray.exceptions.GetTimeoutError:
                self._warn(f"{method} timed out after {self.timeout_s:.1f}s")
                break
            except ray.exceptions.RayActorError:
                if attempt == 0 and self._lookup():
                    continue  # a new store answers under the name: try it once
                self._warn(f"{method}: the store actor is unavailable")
                break
            except Exception as exc:  # the store refused (bad key) or failed
                self._tls.refused = isinstance(exc, TypeError)
                self._warn(f"{method} failed: {exc}")
                break
        self.counters.errors += 1
        return FAILED

    def _warn(self, msg: str) -> None:
        """Log the first failure of a burst, then one line every WARN_EVERY_S with the count."""
        self._failing += 1
        now = time.monotonic()
        if self._failing == 1 or now - self._warned_at >= WARN_EVERY_S:
            more = f" ({self._failing} failures in a row)" if self._failing > 1 else ""
            logger.warning("kv store: %s%s", msg, more)
            self._warned_at = now

    def send(self, method: str, *args) -> None:
        """Fire and forget (releases): never waits on the store."""
        try:
            if self.store is not None:
                getattr(self.store, method).remote(*args)
        except Exception:
            pass
