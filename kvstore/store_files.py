"""The store's side of its file tier (`kvstore.file_tier.FileTier` holds the files): spilling
a RAM page to its file, reading one back, write-behind flushing, and rebuilding the index from
the files at start. A mixin of `kvstore.store.KVStore`, which owns the index and the lock."""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

from kvstore.file_tier import FileTier, file_bytes
from kvstore.messages import page_checksum
from kvstore.ram_tier import RamTier

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Entry:
    size: int
    checksum: int
    writer: str  # client name ("" when rebuilt from disk)
    slots: list[int] | None = None  # RAM copy (sorted slot ids), None when only on file
    on_file: bool = False
    pins: int = 0  # read leases holding the RAM copy


class StoreFiles:
    root: Path
    ram: RamTier
    files: FileTier
    index: dict[str, Entry]
    dirty: OrderedDict[str, None]
    counters: Counter[str]
    _lock: threading.RLock
    _stop: threading.Event

    def _write_file(self, key: str, entry: Entry) -> bool:
        """Copy a RAM page to its file, deleting least recently used files to make room (within
        what the disk allows); False without writing while file writes back off."""
        assert entry.slots is not None
        if not self.files.writable():
            return False
        victims = self.files.victims(file_bytes(entry.size), keep=key)
        if victims is None:
            return False
        for victim in victims:
            dropped = self.index[victim]
            dropped.on_file = False
            self.files.remove(victim)
            self.counters["file_evictions"] += 1
            if dropped.slots is None:
                del self.index[victim]
        if not self.files.write(key, self.ram.regions(entry.slots, entry.size), entry.size, entry.checksum):
            self.counters["errors"] += 1
            self.counters["file_write_errors"] += 1
            return False
        entry.on_file = True
        self.counters["files_written"] += 1
        return True

    def _read_file(self, key: str, entry: Entry, slots: list[int]) -> bool:
        if not self.files.read(key, self.ram.regions(slots, entry.size), entry.size, entry.checksum):
            return False
        if page_checksum(*self.ram.views(slots, entry.size)) != entry.checksum:
            return False
        self.counters["files_read"] += 1
        return True

    def _rebuild(self) -> None:
        """Index the page files under root (a restart on the same directory)."""
        found, broken = self.files.scan()
        self.counters["corrupt"] += broken
        for key, size, crc in found:
            self.index[key] = Entry(size, crc, "", on_file=True)
        self.files.fit_to_disk(warn=True)  # never past the filesystem's reserve
        if self.files.used > self.files.capacity:  # started with a smaller capacity, or a fuller disk
            for victim in self.files.victims(0, keep="") or []:
                self.files.remove(victim)
                del self.index[victim]
        if found:
            logger.info("kv store: %d pages (%.1f MiB) found under %s", len(self.index),
                        self.files.used / 2**20, self.root)

    def _flush_some(self, limit: int) -> int:
        """Write up to `limit` dirty pages to files; stops at the first that cannot be written
        (the disk is full or failing: it and the rest stay dirty, for a later round). Returns
        how many pages left the dirty list."""
        done = 0
        for key in list(self.dirty)[:limit]:
            entry = self.index.get(key)
            if entry is not None and entry.slots is not None and not entry.on_file:
                if not self._write_file(key, entry):
                    break
            self.dirty.pop(key, None)
            done += 1
        return done

    def _flusher(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                while self.dirty and not self._stop.is_set():
                    with self._lock:
                        moved = self._flush_some(16)  # small batches: serving calls wait on the lock
                    if not moved:
                        break  # the disk refuses: try again next round
            except Exception:
                logger.exception("kv store flusher")
