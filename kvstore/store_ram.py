"""The store's side of its RAM tier (`kvstore.ram_tier.RamTier` holds the slots): making room
for a page (LRU eviction, spilling a RAM-only page to its file first), bringing a file page back
into RAM for a control-path read, and deleting a page from every tier. A mixin of
`kvstore.store.KVStore`, which owns the index and the lock; every method runs under it."""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict

from kvstore.file_tier import FileTier
from kvstore.ram_tier import RamTier
from kvstore.removals import RemovalLog
from kvstore.store_files import Entry, StoreFiles

logger = logging.getLogger(__name__)


class StoreRam(StoreFiles):
    ram: RamTier
    files: FileTier
    index: dict[str, Entry]
    removals: RemovalLog
    dirty: OrderedDict[str, None]
    ram_lru: OrderedDict[str, None]
    counters: Counter[str]

    def _alloc(self, size: int, spill: bool = True) -> list[int] | None:
        """Slots for `size` bytes, evicting unpinned RAM pages, LRU first: pages on file
        already (they leave at no cost), then — `spill`, or while the file tier refuses writes
        (their pages are dropped then, as before) — dirty ones, written to files first under the
        lock (the flusher writes them outside it, ahead of need)."""
        n = self.ram.slots_for(size)
        if n > self.ram.num_slots:
            return None
        while self.ram.num_free < n:
            victim = next((k for k in self.ram_lru if self.index[k].pins == 0 and self.index[k].on_file), None)
            if victim is None and (spill or not self.files.writable()):
                victim = next((k for k in self.ram_lru if self.index[k].pins == 0), None)
            if victim is None:
                return None
            self._evict_ram(victim)
        return self.ram.take(n)

    def _evict_ram(self, key: str) -> None:
        entry = self.index[key]
        if not entry.on_file:
            self.dirty.pop(key, None)
            if self._write_file(key, entry):
                self.counters["spills"] += 1
            else:
                self.counters["ram_dropped"] += 1
        self.counters["ram_evictions"] += 1
        assert entry.slots is not None
        self.ram.give(entry.slots)
        entry.slots = None
        self.ram_lru.pop(key, None)
        if not entry.on_file:
            self._unindex(key)

    def _in_ram(self, key: str) -> Entry | None:
        """The entry with a RAM copy (read from its file if needed), or None (missing, no room,
        or its file failed its checks and was deleted)."""
        entry = self.index.get(key)
        if entry is None or entry.loading:
            return None
        if entry.slots is None:
            self.files.touch(key)
            slots = self._slots_for_file_page(key, entry)
            if slots is None:
                return None
            if not self._read_file(key, entry, slots):
                self.ram.give(slots)
                self._corrupt(key)
                return None
            entry.slots = slots
            self.ram_lru[key] = None
        else:
            self.ram_lru.move_to_end(key)
        if entry.on_file:
            self.files.touch(key)
        return entry

    def _delete(self, key: str) -> None:
        entry = self._unindex(key)
        if entry is None:
            return
        if entry.slots is not None and not entry.loading:  # (a loading page's reader frees them)
            self.ram.give(entry.slots)
            entry.slots = None
        self.ram_lru.pop(key, None)
        self.dirty.pop(key, None)
        if entry.on_file:
            entry.on_file = False
            self.files.remove(key)

    def _drop_bad(self, key: str, entry: Entry) -> None:
        """A page whose file failed its read: free its RAM copy and delete it."""
        self.ram.give(entry.slots)
        entry.slots = None
        self._corrupt(key)

    def _corrupt(self, key: str) -> None:
        logger.warning("kv store: page %s failed its checks; deleted", key)
        self.counters["corrupt"] += 1
        self.counters["errors"] += 1
        self._delete(key)
