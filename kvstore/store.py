"""The shared KV store: one named Ray actor per cluster, holding KV pages in two tiers.

Tiers. A host-RAM tier (`ram_tier.RamTier`: one DRAM region registered with the store's NIXL
agent, split into slots) and a file tier (`file_tier.FileTier`: one file per store key under
`root`, header + page, written atomically), each with a byte capacity and LRU eviction. RAM
pages reach the file tier by the flusher thread (write-behind, every `flush_interval_s`) or
when evicted from RAM (spill); the file tier evicts by deleting its least recently used files.
A store started on an existing root rebuilds its index from the file headers. A "page" here is
the bytes of one store key (an MHA page of one rank is two of them, K and V).

Data path. Page bytes never travel through Ray's object store. A client (one per worker rank,
`kvstore.client`) registers its NIXL agent once (`register_client`), then per batch:

- write: `reserve(keys, sizes)` gives DRAM regions; the client NIXL-WRITEs its staging buffer
  into them (UCX) and `commit(lease, keys, checksums)` publishes them. Uncommitted regions of
  the lease are freed by the commit, or when the lease expires.
- read: `locate(keys)` brings the leading present keys into RAM (file pages are read with the
  POSIX backend and their checksum verified), pins them under a lease and returns their
  regions; the client NIXL-READs them, verifies the checksums and `release`s the lease.

Invariants: a key is in at most one of `pending` (reserved, invisible) and `index` (committed);
pinned or pending slots are never evicted or reused; every page carries the crc32 of its bytes
and one that fails a check is deleted and reported missing, never returned. Every public method
runs under one lock (the flusher thread shares the NIXL agent and the index), except for file
I/O: the flusher's writes and `locate`'s reads run outside it on pinned RAM, and the actor serves
calls on several threads, so a read of one page's file never holds up another client's call.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.file_tier import FileTier
from kvstore.keys import recent_pages, validate_key, validate_keys, validate_tag
from kvstore.messages import STORE_NAME, LocateReply, PageLoc, ReserveReply, page_checksum
from kvstore.ram_tier import RamTier
from kvstore.removals import RemovalLog, present_chains
from kvstore.store_files import Entry
from kvstore.store_ram import StoreRam

logger = logging.getLogger(__name__)


@dataclass
class _Lease:
    id: int
    kind: str  # "write" (keys reserved in `pending`) or "read" (pinned entries)
    client: str
    deadline: float
    keys: list[str] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)


class KVStore(StoreRam):
    """Plain class; `kvstore.actor.get_or_create_store` wraps it into the named Ray actor.

    root: directory of the file tier (pages there survive a restart). ram_bytes / file_bytes:
    tier capacities. slot_bytes: RAM allocation unit (a page takes ceil(size / slot_bytes)
    slots; pick about a page). lease_s: how long a reservation or a read pin lives without
    commit/release. flush_interval_s: write-behind period (None: files only on spill, flush()
    or shutdown()). fsync: fsync every page file. verify_writes: re-checksum committed pages
    in the store (costs store CPU; the client verifies every read anyway). prefault: touch the
    RAM tier at start (commits the memory; see RamTier). on_start: called first thing in the
    store's process (the caller's process set-up, e.g. `workers.actor_exit.install`, which this
    layer cannot import).
    """

    def __init__(
        self,
        root: str,
        ram_bytes: int = 256 << 20,
        file_bytes: int = 4 << 30,
        slot_bytes: int = 64 << 10,
        lease_s: float = 10.0,
        flush_interval_s: float | None = 0.5,
        fsync: bool = False,
        verify_writes: bool = False,
        prefault: bool = True,
        on_start: Callable[[], object] | None = None,
    ):
        if on_start is not None:
            on_start()
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.lease_s = lease_s
        self.verify_writes = verify_writes
        self.ram = RamTier(ram_bytes, slot_bytes, prefault)
        self.agent_name = f"{STORE_NAME}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # No NIXL progress thread: it busy-polls a core. `_progress` drives UCX instead, fast
        # only while a lease is open (a client transfer may be in flight); STRICT sync makes the
        # agent safe to call from that thread and the serving thread at once.
        config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                   sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self.agent = nixl_agent(self.agent_name, config)
        # The file tier's reads and writes through POSIX AIO: a batch of page files moves on
        # several I/O threads (~1.6x the default's bandwidth on 126 files of 1 MiB in tmpfs).
        try:
            self.agent.create_backend("POSIX", {"use_posix_aio": "true"})
        except Exception as exc:  # a NIXL build without it
            logger.warning("kv store: NIXL POSIX AIO unavailable (%s); the file tier uses plain POSIX I/O", exc)
            self.agent.create_backend("POSIX")
        # Registered with every backend that takes DRAM: UCX (clients) and POSIX (file tier).
        self.agent.register_memory([(self.ram.base, self.ram.capacity, 0, "")], "DRAM")
        self.index: dict[str, Entry] = {}
        self.removals = RemovalLog()  # pages that left `index`, for the router (kvstore.removals)
        self.pending: dict[str, tuple[int, list[int], int]] = {}  # key -> (lease, slots, size)
        self.ram_lru: OrderedDict[str, None] = OrderedDict()
        self.files = FileTier(self.root, file_bytes, self.agent, self.agent_name, fsync)
        self.dirty: OrderedDict[str, None] = OrderedDict()  # committed, in RAM only, no write begun
        self._writing = 0  # pages the write-behind flusher is writing now (taken off `dirty`)
        self._flush_io = threading.Lock()  # one flush at a time: flush() waits for the batch in flight
        self.leases: dict[int, _Lease] = {}
        self.clients: dict[str, str] = {}  # client name -> its NIXL agent name
        self.client_tags: dict[str, str] = {}  # client name -> the model tag of its pages
        self.counters: Counter[str] = Counter()
        self.writes_by_client: Counter[str] = Counter()
        self._next_lease = 1
        self._registered_at = 0.0
        self._lock = threading.RLock()
        self._loaded = threading.Condition(self._lock)  # a page's file read (outside the lock) ended
        self._loading_keys: set[str] = set()
        self._stop = threading.Event()
        with self._lock:
            self._rebuild()
        threading.Thread(target=self._progress, name="kvstore-progress", daemon=True).start()
        self._write_behind = bool(flush_interval_s)
        if flush_interval_s:
            threading.Thread(target=self._flusher, args=(flush_interval_s,), name="kvstore-flush",
                             daemon=True).start()

    # ---------------- control ----------------
    def register_client(self, name: str, agent_metadata: bytes, tag: str = "") -> tuple[str, bytes]:
        """Learn a client's NIXL agent and its model tag (`kvstore.keys.model_tag`: kept with
        every page it writes, for `recent`); returns (store agent name, store agent metadata)."""
        validate_tag(tag)
        with self._lock:
            self.client_tags[name] = tag
            if name in self.clients:
                try:
                    self.agent.remove_remote_agent(self.clients[name])
                except Exception:
                    pass
            self._registered_at = time.monotonic()
            remote = self.agent.add_remote_agent(agent_metadata)
            self.clients[name] = remote.decode() if isinstance(remote, bytes) else remote
            return self.agent_name, self.agent.get_agent_metadata()

    def info(self) -> dict:
        return {"agent": self.agent_name, "root": str(self.root), "pid": os.getpid(),
                "ram_bytes": self.ram.capacity, "file_bytes": self.files.capacity,
                "slot_bytes": self.ram.slot_bytes, "node_id": _node_id()}

    def exists(self, keys: list[str]) -> list[bool]:
        validate_keys(keys)
        with self._lock:
            found = [k in self.index for k in keys]
            self.counters["queries"] += len(keys)
            self.counters["hits"] += sum(found)
            return found

    def batch_exists_prefix(self, keys: list[str]) -> int:
        """Number of leading keys present (keys, not pages: the caller divides)."""
        validate_keys(keys)
        with self._lock:
            n = 0
            while n < len(keys) and keys[n] in self.index:
                n += 1
            return n

    def stats(self) -> dict:
        with self._lock:
            return {
                "ram": {"used_bytes": self.ram.used, "capacity_bytes": self.ram.capacity,
                        "pages": len(self.ram_lru)},
                "file": {"used_bytes": self.files.used, "capacity_bytes": self.files.capacity,
                         "configured_bytes": self.files.configured, "pages": len(self.files),
                         "write_errors": self.files.write_errors, "skipped_writes": self.files.skipped_writes},
                "pages": len(self.index), "pending": len(self.pending), "leases": len(self.leases),
                "dirty": len(self.dirty) + self._writing, "clients": len(self.clients),
                "counters": dict(self.counters), "writes_by_client": dict(self.writes_by_client),
            }

    def keys(self) -> list[str]:
        with self._lock:
            return list(self.index)

    def removed_since(self, epoch: str | None, seq: int) -> dict:
        """Chain keys of the pages that left the store since `seq`, or a reset listing those
        present (`kvstore.removals`; the listing is built outside the lock)."""
        with self._lock:
            out = self.removals.since(epoch, seq)
            keys = list(self.index) if "reset" in out else None
        if keys is not None:
            out["reset"] = present_chains(keys)
        return out

    def recent(self, tag: str, tp_size: int | None, limit: int) -> list[str]:
        """Chain keys of up to `limit` whole pages written by clients of model tag `tag` (MHA:
        every key of a TP group of `tp_size`; None: MLA pages), prompt pages first, each kind
        most recently used first (RAM, then files): what a restarted replica warms its ranks'
        host tiers with (every rank gets the same list)."""
        validate_tag(tag)
        if not tag or limit <= 0:
            return []
        with self._lock:
            return recent_pages(self.index, (self.ram_lru, self.files.lru), tag, tp_size, limit)

    def clear(self) -> None:
        """Delete every page, in RAM and on disk (pending writes and leases are dropped).
        Counters stay (they are cumulative); writes_by_client restarts. An admin and test
        tool: a file read in flight meanwhile may land in RAM handed out again (a page that
        then fails its checksum at the client, and is deleted)."""
        with self._lock:
            self.writes_by_client.clear()
            for key in list(self.index):
                self._delete(key)
            self.pending.clear()
            self.leases.clear()
            self.ram.reset()

    def flush(self) -> int:
        """Write every RAM-only page to the file tier now, after the write-behind batch in
        flight has landed; returns how many this call wrote."""
        with self._flush_io, self._lock:
            return self._flush_some(len(self.dirty))

    def shutdown(self) -> None:
        self.flush()
        self._stop.set()
        self.files.release()

    # ---------------- write path ----------------
    def reserve(self, client: str, keys: list[str], sizes: list[int]) -> ReserveReply | None:
        """Reserve DRAM for keys not yet stored. None: unknown client (register first)."""
        validate_keys(keys)
        with self._lock:
            if client not in self.clients:
                return None
            self._expire()
            lease = self._new_lease("write", client)
            present: list[bool] = []
            locs: list[PageLoc | None] = []
            for key, size in zip(keys, sizes):
                if key in self.index or key in self.pending:
                    present.append(True)
                    locs.append(None)
                    continue
                present.append(False)
                # A write never waits for a spill while the flusher runs: no clean page to
                # replace, and the write is refused (the store is slower than its writers).
                slots = self._alloc(int(size), spill=not self._write_behind) if 0 < size else None
                if slots is None:
                    self.counters["refused_full"] += 1
                    locs.append(None)
                    continue
                self.pending[key] = (lease.id, slots, int(size))
                lease.keys.append(key)
                locs.append(PageLoc(key, int(size), 0, self.ram.regions(slots, int(size))))
            return ReserveReply(self.agent_name, lease.id, present, locs)

    def commit(self, client: str, lease: int, keys: list[str], checksums: list[int],
               prompt: list[bool] | None = None) -> int:
        """Publish the keys of a write lease whose bytes have landed (`prompt[i]`: keys[i] holds
        prompt tokens); frees the rest of the lease. Returns how many keys were committed."""
        prompt = prompt or [False] * len(keys)
        with self._lock:
            done = 0
            for key, crc, is_prompt in zip(keys, checksums, prompt):
                item = self.pending.get(key)
                if item is None or item[0] != lease:
                    continue
                _, slots, size = self.pending.pop(key)
                if self.verify_writes and page_checksum(*self.ram.views(slots, size)) != crc:
                    self.counters["errors"] += 1
                    self.counters["corrupt"] += 1
                    self.ram.give(slots)
                    continue
                self.index[key] = Entry(size, int(crc), client, self.client_tags.get(client, ""), bool(is_prompt),
                                        slots=slots)
                self.ram_lru[key] = None
                self.dirty[key] = None
                self.counters["pages_written"] += 1
                self.counters["bytes_in"] += size
                self.writes_by_client[client] += 1
                done += 1
            self.release(lease)
            return done

    def put(self, key: str, data: bytes) -> bool:
        """Control-path write (bytes pickled through Ray): for tools and tests, not serving."""
        validate_key(key)
        with self._lock:
            if key in self.index or key in self.pending:
                return True
            slots = self._alloc(len(data)) if data else None
            if slots is None:
                return False
            off = 0
            for view in self.ram.views(slots, len(data)):
                view[:] = memoryview(data)[off : off + len(view)]
                off += len(view)
            self.index[key] = Entry(len(data), page_checksum(data), "put", slots=slots)
            self.ram_lru[key] = None
            self.dirty[key] = None
            self.counters["pages_written"] += 1
            self.counters["bytes_in"] += len(data)
            return True

    # ---------------- read path ----------------
    def locate(self, client: str, keys: list[str]) -> LocateReply | None:
        """Regions of the leading present keys, pinned in RAM until release(lease). Pages only
        on file are read into RAM first, all of them in one batched transfer made outside the
        lock (their slots pinned and marked `loading`: a locate of the same page meanwhile
        waits for that read rather than start its own); their checksums are verified by the
        client that reads them (end to end), which asks `verify` to delete a page that fails."""
        validate_keys(keys)
        with self._lock:
            if client not in self.clients:
                return None
            self._expire()
            lease = self._new_lease("read", client)
            found: list[tuple[str, Entry]] = []
            loading: list[tuple[str, Entry]] = []  # given RAM slots here, to be read from their files
            for key in keys:
                entry = self.index.get(key)
                if entry is None:
                    break
                if entry.on_file:
                    self.files.touch(key)  # before making room: the spill of a RAM page must not evict it
                if entry.slots is None:
                    if not self._claim_file_read(key, entry):  # never evicts what this lease pinned
                        break
                    loading.append((key, entry))
                elif not entry.loading:
                    self.ram_lru.move_to_end(key)
                entry.pins += 1
                lease.entries.append(entry)
                found.append((key, entry))
        bad = self._read_claimed(loading)
        with self._lock:
            # Pages another locate is reading: wait for that read (bounded), under the condition.
            deadline = time.monotonic() + self.lease_s / 2
            while any(e.loading for _, e in found) and time.monotonic() < deadline:
                self._loaded.wait(0.05)
            cut = next((i for i, (k, e) in enumerate(found) if k in bad or e.loading or e.slots is None
                        or self.index.get(k) is not e), len(found))
            for key, entry in found[cut:]:  # the leading pages before the first bad one are served
                entry.pins = max(0, entry.pins - 1)
                lease.entries.remove(entry)
                if key in bad and self.index.get(key) is entry:
                    self._drop_bad(key, entry)
                elif (key, entry) in loading and entry.slots is not None:
                    self.ram_lru[key] = None
            found = found[:cut]
            locs = [PageLoc(k, e.size, e.checksum, self.ram.regions(e.slots, e.size)) for k, e in found]
            self.counters["queries"] += len(keys)
            self.counters["hits"] += len(locs)
            self.counters["pages_read"] += len(locs)
            self.counters["bytes_out"] += sum(loc.size for loc in locs)
            return LocateReply(self.agent_name, lease.id, locs)

    def release(self, lease: int) -> None:
        """End a lease: unpin its read entries, free its uncommitted reservations."""
        with self._lock:
            held = self.leases.pop(lease, None)
            if held is None:
                return
            for entry in held.entries:
                entry.pins = max(0, entry.pins - 1)
            for key in held.keys:
                item = self.pending.get(key)
                if item is not None and item[0] == lease:
                    self.ram.give(self.pending.pop(key)[1])

    def get(self, key: str) -> bytes | None:
        """Control-path read (checksum verified): for tools and tests, not serving."""
        validate_key(key)
        with self._lock:
            entry = self._in_ram(key)
            if entry is None or entry.slots is None:
                return None
            data = b"".join(v.tobytes() for v in self.ram.views(entry.slots, entry.size))
            if page_checksum(data) != entry.checksum:
                self._corrupt(key)
                return None
            return data

    def verify(self, keys: list[str]) -> list[bool]:
        """Check the stored copies of keys (a client saw a bad checksum); deletes bad ones."""
        validate_keys(keys)
        with self._lock:
            out = []
            for key in keys:
                entry = self.index.get(key)
                if entry is None:
                    out.append(False)
                    continue
                if entry.loading:  # being read from its file: the reader's client checks it
                    out.append(True)
                    continue
                if entry.slots is not None:
                    ok = page_checksum(*self.ram.views(entry.slots, entry.size)) == entry.checksum
                else:
                    data = self.files.read_bytes(key, entry.size, entry.checksum)
                    ok = data is not None and page_checksum(data) == entry.checksum
                if not ok:
                    self._corrupt(key)
                out.append(ok)
            return out

    # ---------------- leases and UCX progress ----------------
    def _new_lease(self, kind: str, client: str) -> _Lease:
        lease = _Lease(self._next_lease, kind, client, time.monotonic() + self.lease_s)
        self.leases[lease.id] = lease
        self._next_lease += 1
        return lease

    def _expire(self) -> None:
        now = time.monotonic()
        for lid in [lid for lid, lease in self.leases.items() if lease.deadline < now]:
            self.counters["leases_expired"] += 1
            self.release(lid)

    def _progress(self) -> None:
        """Progress the UCX worker: the target side of a client's transfer (connection set-up,
        and every transfer over a transport that is not one-sided) needs it. ~10 kHz while a
        lease is open, 50 Hz when idle (a few % of a core at most)."""
        while not self._stop.is_set():
            try:
                self.agent.get_new_notifs()
            except Exception:
                logger.exception("kv store: NIXL progress")
            time.sleep(0.0001 if self.leases or self._recent_register() else 0.02)

    def _recent_register(self) -> bool:
        return time.monotonic() - self._registered_at < 2.0


def _node_id() -> str | None:
    """The Ray node this process runs on (None outside Ray)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - informational only
        return None
