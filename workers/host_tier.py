"""A rank's host tier: page rows in one host tensor (pinned when a GPU is present), keyed by
the pages' chain keys, least recently used first out. It sits between the rank's device pool
and the cluster's KV store; `workers.kv_offload` moves pages through it (and registers its
memory with the store client's NIXL agent, so the store reads and writes the rows themselves).
The same structure on the pool's own device holds the pages of prefill/decode hand-offs
(`RankKVOffload.lend`: GPU memory on a GPU, read over NIXL GPU to GPU).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch


def runs(rows: list[int]):
    """(i, j) spans of `rows` whose rows are adjacent (rows[i:j] == range(rows[i], rows[i] + j - i))."""
    i = 0
    while i < len(rows):
        j = i + 1
        while j < len(rows) and rows[j] == rows[j - 1] + 1:
            j += 1
        yield i, j
        i = j


class HostTier:
    """Page rows of one rank keyed by chain key: data [capacity, page_bytes] uint8.

    A row is `ready` (holds its key's bytes; evictable, LRU order) or taken (being filled by a
    prefetch or a save: invisible to lookups) or free. Rows being written to the store are
    pinned: eviction skips them. Every method takes `lock`; the bytes of a row are read or
    written outside it only while the row is taken or pinned."""

    def __init__(self, capacity_pages: int, page_bytes: int, pin: bool, log_changes: bool = False,
                 device: torch.device | None = None):
        self.page_bytes = page_bytes
        # key -> whether it is ready now, for the keys published or evicted since the last
        # `take_changes` (`log_changes`: the rank that tells the scheduler what its tier holds).
        self.changes: dict[str, bool] | None = {} if log_changes else None
        on_gpu = device is not None and device.type == "cuda"
        self.pinned = pin and not on_gpu
        self.data = torch.empty((capacity_pages, page_bytes), dtype=torch.uint8, device=device,
                                pin_memory=self.pinned)
        self.ready: OrderedDict[str, int] = OrderedDict()
        self.pins: dict[int, int] = {}
        self.free = list(range(capacity_pages - 1, -1, -1))
        self.lock = threading.Lock()
        self.evictions = 0

    @property
    def capacity(self) -> int:
        return self.data.shape[0]

    @property
    def used_bytes(self) -> int:
        return (self.capacity - len(self.free)) * self.page_bytes

    def leading(self, keys: list[str]) -> list[int]:
        """Rows of the leading keys that are ready (refreshed as most recently used), pinned:
        `unpin` them once their bytes are copied."""
        rows: list[int] = []
        with self.lock:
            for key in keys:
                row = self.ready.get(key)
                if row is None:
                    break
                self.ready.move_to_end(key)
                self.pins[row] = self.pins.get(row, 0) + 1
                rows.append(row)
        return rows

    def has(self, key: str) -> bool:
        with self.lock:
            return key in self.ready

    def take(self, n: int) -> list[int]:
        """Up to n rows (free ones first, then the least recently used unpinned ready ones)."""
        with self.lock:
            rows = [self.free.pop() for _ in range(min(n, len(self.free)))]
            if len(rows) < n:
                for key in list(self.ready):
                    row = self.ready[key]
                    if self.pins.get(row):
                        continue
                    del self.ready[key]
                    self.evictions += 1
                    if self.changes is not None:
                        self.changes[key] = False
                    rows.append(row)
                    if len(rows) == n:
                        break
            return rows

    def take_free(self, n: int) -> list[int]:
        """Up to n free rows (never an eviction)."""
        with self.lock:
            return [self.free.pop() for _ in range(min(n, len(self.free)))]

    def publish(self, keys: list[str], rows: list[int], pin: bool = False, oldest: bool = False,
                log: bool = True) -> list[int]:
        """Rows now hold keys; a key already ready keeps its row and the new one is freed.
        Returns the rows that hold the keys (pinned when `pin`). `oldest`: new keys go to the
        least recently used end, each before the one published before it (the first key
        given is evicted last of them). `log`: among the changes (`take_changes`); without,
        the caller reports them itself (an eviction is logged either way)."""
        held = []
        with self.lock:
            for key, row in zip(keys, rows):
                if key in self.ready:
                    self.free.append(row)
                    row = self.ready[key]
                else:
                    self.ready[key] = row
                    if oldest:
                        self.ready.move_to_end(key, last=False)
                    if self.changes is not None and log:
                        self.changes[key] = True
                if pin:
                    self.pins[row] = self.pins.get(row, 0) + 1
                held.append(row)
        return held

    def pin_ready(self, key: str) -> int | None:
        """The row of a ready key, pinned (None when the key is not ready)."""
        with self.lock:
            row = self.ready.get(key)
            if row is not None:
                self.ready.move_to_end(key)
                self.pins[row] = self.pins.get(row, 0) + 1
            return row

    def take_changes(self) -> tuple[list[str], list[str]]:
        """(keys ready now, keys evicted) among those published or evicted since the last
        call. Empty unless `log_changes`."""
        with self.lock:
            if not self.changes:
                return [], []
            changes, self.changes = self.changes, {}
        return [k for k, ready in changes.items() if ready], [k for k, ready in changes.items() if not ready]

    def give(self, rows: list[int]) -> None:
        with self.lock:
            self.free.extend(rows)

    def unpin(self, rows: list[int]) -> None:
        with self.lock:
            for row in rows:
                left = self.pins.get(row, 0) - 1
                if left > 0:
                    self.pins[row] = left
                else:
                    self.pins.pop(row, None)
