"""The store's side of its file tier (`kvstore.file_tier.FileTier` holds the files): spilling
a RAM page to its file, reading pages back (for a locate, or staged ahead of one),
write-behind flushing, and rebuilding the index from the files at start. A mixin of
`kvstore.store.KVStore` (below `kvstore.store_ram.StoreRam`, the RAM side, which makes room and
drops bad pages for it); the store owns the index and the lock."""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvstore.file_tier import FileTier, file_bytes
from kvstore.keys import validate_keys
from kvstore.messages import page_checksum
from kvstore.ram_tier import RamTier
from kvstore.removals import RemovalLog

logger = logging.getLogger(__name__)

STAGE_BATCH = 32  # keys per file read of `stage` (a prefetch chunk: 16 MHA pages of one rank)


@dataclass(eq=False)
class Entry:
    size: int
    checksum: int
    writer: str  # client name ("" when rebuilt from disk)
    tag: str = ""  # the writer's model tag (`kvstore.keys.model_tag`; "" unknown): whose page it is
    prompt: bool = False  # it holds prompt tokens (a restarted replica warms these first)
    slots: list[int] | None = None  # RAM copy (sorted slot ids), None when only on file
    on_file: bool = False
    pins: int = 0  # read leases (and file I/O in flight) holding the RAM copy
    loading: bool = False  # its RAM copy is being read from its file (outside the lock)


class StoreFiles:
    root: Path
    ram: RamTier
    files: FileTier
    index: dict[str, Entry]
    removals: RemovalLog
    dirty: OrderedDict[str, None]
    counters: Counter[str]
    _lock: threading.RLock
    _flush_io: threading.Lock  # held by a flush from taking dirty pages until they are written
    _writing: int
    _stop: threading.Event
    _loading_keys: set[str]  # pages whose files a locate is reading outside the lock
    _loaded: threading.Condition  # a read of claimed pages ended
    ram_lru: OrderedDict[str, None]
    clients: dict[str, str]
    _alloc: Callable[[int], list[int] | None]  # (these two: `store_ram.StoreRam`)
    _drop_bad: Callable[[str, Entry], None]

    def _write_file(self, key: str, entry: Entry) -> bool:
        """Copy a RAM page to its file, deleting least recently used files to make room (within
        what the disk allows); False without writing while file writes back off."""
        assert entry.slots is not None
        if not self.files.writable():
            return False
        victims = self.files.victims(file_bytes(entry.size), keep=key, busy=self._loading_keys)
        if victims is None:
            return False
        self._drop_files(victims)
        if not self.files.write(key, self.ram.regions(entry.slots, entry.size), entry.size, entry.checksum,
                                entry.tag, entry.prompt):
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

    def stage(self, client: str, keys: list[str]) -> int:
        """Read the pages of `keys` that are only on file into RAM, ahead of the `locate`s that
        will ask for them: a client's prefetch of a long prefix locates it a chunk at a time,
        and this reads the later chunks while it moves the first. Fire and forget: no lease,
        the pages are plain LRU RAM pages once read, and a locate meanwhile waits for their
        read rather than start its own. Reads `STAGE_BATCH` keys at a time, in order, so the
        first chunks land first, and stops at the first key the store does not have (the rest
        of the prefix is no use without it); returns how many pages it read."""
        validate_keys(keys)
        read = 0
        for i in range(0, len(keys), STAGE_BATCH):
            loading: list[tuple[str, Entry]] = []
            ended = False
            with self._lock:
                if client not in self.clients:
                    return read
                for key in keys[i : i + STAGE_BATCH]:
                    entry = self.index.get(key)
                    if entry is None:
                        ended = True
                        break
                    if entry.slots is not None or not entry.on_file:
                        continue  # in RAM already (or being read)
                    self.files.touch(key)
                    if not self._claim_file_read(key, entry):
                        ended = True  # RAM is full of pinned pages
                        break
                    entry.pins += 1  # its slots stay put until the read ends
                    loading.append((key, entry))
            bad = self._read_claimed(loading)
            with self._lock:
                for key, entry in loading:
                    entry.pins = max(0, entry.pins - 1)
                    if key in bad and self.index.get(key) is entry:
                        self._drop_bad(key, entry)
                self.counters["staged"] += len(loading) - len(bad)
            read += len(loading) - len(bad)
            if ended or bad:
                break
        return read

    def _slots_for_file_page(self, key: str, entry: Entry) -> list[int] | None:
        """Under the lock: RAM slots to read a page only on file into; None when RAM has no
        room, or when the spills that made room evicted this very file."""
        slots = self._alloc(entry.size)
        if slots is not None and (self.index.get(key) is not entry or not entry.on_file):
            self.ram.give(slots)
            slots = None
        return slots

    def _claim_file_read(self, key: str, entry: Entry) -> bool:
        """Under the lock: RAM slots for a page only on file, marked `loading` (a locate that
        wants it meanwhile waits for this read); False when RAM has no room for it."""
        slots = self._slots_for_file_page(key, entry)
        if slots is None:
            return False
        entry.slots, entry.loading = slots, True
        self._loading_keys.add(key)
        return True

    def _read_claimed(self, loading: list[tuple[str, Entry]]) -> set[str]:
        """Read the claimed pages' files into their slots in one batched transfer, outside the
        lock (other calls go on meanwhile), then publish them in RAM; returns the keys whose
        read failed or whose page was deleted meanwhile (the caller frees or deletes those)."""
        if not loading:
            return set()
        requests = [(k, self.ram.regions(e.slots, e.size), e.size, e.checksum) for k, e in loading]
        ok = self.files.read_many(requests)
        with self._lock:
            bad: set[str] = set()
            for (key, entry), good in zip(loading, ok):
                entry.loading = False
                self._loading_keys.discard(key)
                if self.index.get(key) is not entry:  # deleted while it was read
                    self.ram.give(entry.slots)
                    entry.slots = None
                    bad.add(key)
                elif not good:
                    bad.add(key)
                else:
                    self.ram_lru[key] = None
                    self.counters["files_read"] += 1
            self._loaded.notify_all()
        return bad

    def _rebuild(self) -> None:
        """Index the page files under root (a restart on the same directory)."""
        found, broken = self.files.scan()
        self.counters["corrupt"] += broken
        for key, size, crc, tag, prompt in found:
            self.index[key] = Entry(size, crc, "", tag, prompt, on_file=True)
        self.files.fit_to_disk(warn=True)  # never past the filesystem's reserve
        if self.files.used > self.files.capacity:  # started with a smaller capacity, or a fuller disk
            for victim in self.files.victims(0, keep="") or []:
                self.files.remove(victim)
                self._unindex(victim)
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
        """Write-behind: dirty pages to their files, a batch at a time, the file I/O outside
        the lock (the pages pinned meanwhile): a serving call never waits for a flush."""
        while not self._stop.wait(interval):
            try:
                while self.dirty and not self._stop.is_set():
                    with self._flush_io:
                        with self._lock:
                            batch = self._take_dirty(16)
                        if not batch:
                            break  # the disk refuses: try again next round
                        done = [self.files.write_bytes(key, regions, e.size, e.checksum, e.tag, e.prompt)
                                for key, e, regions in batch]
                        with self._lock:
                            self._flushed(batch, done)
            except Exception:
                logger.exception("kv store flusher")

    def _take_dirty(self, limit: int) -> list[tuple[str, Entry, tuple]]:
        """Up to `limit` dirty pages to write now: each pinned, its file's bytes reserved and
        room made (LRU files deleted). Stops at one that cannot fit (it stays dirty)."""
        out: list[tuple[str, Entry, tuple]] = []
        if not self.files.writable():
            return out
        for key in list(self.dirty)[:limit]:
            entry = self.index.get(key)
            if entry is None or entry.slots is None or entry.on_file:
                self.dirty.pop(key, None)
                continue
            victims = self.files.victims(file_bytes(entry.size), keep=key, busy=self._loading_keys)
            if victims is None:
                break
            self._drop_files(victims)
            self.dirty.pop(key, None)
            self.files.used += file_bytes(entry.size)  # reserved until `_flushed`
            entry.pins += 1
            out.append((key, entry, self.ram.regions(entry.slots, entry.size)))
        self._writing += len(out)
        return out

    def _flushed(self, batch: list[tuple[str, Entry, tuple]], done: list[bool]) -> None:
        self._writing -= len(batch)
        for (key, entry, _), ok in zip(batch, done):
            entry.pins = max(0, entry.pins - 1)
            if ok and self.index.get(key) is entry and entry.slots is not None:
                self.files.add(key, entry.size, reserved=True)
                entry.on_file = True
                self.counters["files_written"] += 1
                continue
            self.files.used -= file_bytes(entry.size)
            if ok:  # deleted while its file was written: the file goes too
                self.files.remove(key)
            else:
                self.counters["errors"] += 1
                self.counters["file_write_errors"] += 1
                if self.index.get(key) is entry:
                    self.dirty[key] = None  # a later round tries again

    def _unindex(self, key: str) -> Entry | None:
        """Take `key` out of the index and note its removal for the router (`kvstore.removals`):
        the one place a page leaves the index, so no deletion path can miss the note. The
        page's entry (None if it was not there); freeing its RAM copy and file is the caller's."""
        entry = self.index.pop(key, None)
        if entry is not None:
            self.removals.note(key)
        return entry

    def _drop_files(self, victims: list[str]) -> None:
        """Delete the files of `victims` (LRU evictions); an entry with no RAM copy goes."""
        for victim in victims:
            dropped = self.index[victim]
            dropped.on_file = False
            self.files.remove(victim)
            self.counters["file_evictions"] += 1
            if dropped.slots is None:
                self._unindex(victim)
