"""The store's file tier: one file per store key under a root directory, moved with NIXL POSIX.

Layout: `root/<key[:2]>/<key>.kv` = a 128-byte header (magic, key, page size, crc32 of the page,
the writer's tag, whether it holds prompt tokens) followed by the page bytes. The tag (8 bytes
of the writing replica's model fingerprint, zeros when unknown) and the prompt flag let a
restarted replica find its own model's pages among a shared store's, prompts first
(`KVStore.recent`). A file is written as `<name>.tmp` and renamed, so a reader (or a
store rebuilding its index after a restart) sees a whole page or none. The header's checksum is
the page's: the store verifies it after every read into RAM.

This class keeps the files, their LRU order and their byte count; which entry a file belongs
to, and what happens to it when a file is evicted, is the store's business (`kvstore.store`).
All calls come from the store under its lock, but for the I/O of `write_bytes` and
`read_many`, which the store runs outside it (on page RAM it has pinned) so that one page's
file I/O never holds up another client's call.

The disk is shared: the tier never fills its filesystem past a reserve (5% of its size but no
more than 4 GiB, at least 256 MiB, at most 20%). At start its capacity is clamped to what the
disk has free beyond the reserve (with a warning); while running the free space is read again
at most every second and the capacity shrinks (or grows back, up to the configured cap) with
it, so the LRU eviction makes room inside what the disk allows. A failed write (a full or failing disk)
stops file writes for `backoff_s` and is logged once per burst, not once per page.

One store per directory: a store indexes, evicts and cleans up its root as if it were alone (a
second one would delete the first's files in flight, and each would count only its own). So
the tier holds an exclusive lock on `root/.lock` while it lives (`claim_root`); the kernel
drops it when the process ends, however it ends, so a restarted store gets it back. (A
directory where the lock file cannot be made, a read-only one, is used without it: a store
there deletes nothing.)
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import struct
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from kvstore.keys import is_valid_key, validate_key

logger = logging.getLogger(__name__)

MAGIC = b"MANTAKV1"
HEADER = struct.Struct("<8s96sQI8sB")  # magic, key (ascii, NUL padded), page size, crc32, tag, prompt
HEADER_BYTES = 128
SUFFIX = ".kv"

BLOCK = 4096  # what a file takes on disk is counted in whole blocks


def tag_bytes(tag: str) -> bytes:
    """A writer's tag (16 hex digits, "" when unknown) as the header's 8 bytes."""
    return bytes.fromhex(tag) if tag else bytes(8)


def file_bytes(page_size: int) -> int:
    """Disk space of one page file (header + page, in whole blocks)."""
    return -(-(HEADER_BYTES + page_size) // BLOCK) * BLOCK


LOCK_NAME = ".lock"
LOCK_WAIT_S = 10.0  # how long a store waits for the directory's previous store to go away


class RootInUse(RuntimeError):
    pass


def claim_root(root: Path, wait_s: float | None = None):
    """Hold `root` for this store: an exclusive lock on `root/.lock` (kept in the returned open
    file; None where the file cannot be made), waiting up to `wait_s` for a previous holder that
    is going away (a restart racing its predecessor's exit); raises RootInUse naming the holder."""
    path = root / LOCK_NAME
    try:
        if not path.exists():
            path.touch()
        f = open(path)  # read-only: a filesystem with no file open for writing can be remounted
    except OSError as exc:
        logger.warning("kv store: no lock on %s (%s): another store could share the directory", root, exc)
        return None
    deadline = time.monotonic() + (LOCK_WAIT_S if wait_s is None else wait_s)
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                holder = f.read().strip() or "unknown"
                f.close()
                raise RootInUse(f"the KV store directory {root} is in use by another store (process {holder}): "
                                f"give each cluster its own directory (manta serve --kv-store DIR)") from None
            time.sleep(0.1)
    try:
        path.write_text(f"{os.getpid()} on {os.uname().nodename}\n")
    except OSError:
        pass  # (read-only: the holder goes unnamed)
    return f


RESERVE_MAX = 4 << 30  # the reserve of a big disk (5% of 2 TB would idle 100 GB)


def disk_reserve(total_bytes: int) -> int:
    """Bytes of a filesystem the file tier leaves free."""
    return int(min(max(min(0.05 * total_bytes, RESERVE_MAX), 256 << 20), 0.2 * total_bytes))


class FileTier:
    def __init__(self, root: Path, capacity: int, agent, agent_name: str, fsync: bool = False,
                 backoff_s: float = 5.0, disk_check_s: float = 1.0):
        self.root = root
        self._claim = claim_root(root)  # released by `release` or when the process ends
        self.configured = capacity  # what the operator asked for
        self.capacity = capacity  # what the disk allows now (<= configured)
        self.agent = agent  # the store's NIXL agent, with a POSIX backend
        self.agent_name = agent_name
        self.fsync = fsync
        self.backoff_s, self.disk_check_s = backoff_s, disk_check_s
        self.lru: OrderedDict[str, int] = OrderedDict()  # key -> bytes on disk, oldest first
        self.used = 0
        self.write_errors = 0  # failed page writes (disk full or failing)
        self.skipped_writes = 0  # writes not tried while backing off after a failure
        self._backoff_until = 0.0
        self._checked_at = 0.0
        self._burst = 0  # failures since the last log line

    # ---------------- the disk ----------------
    def fit_to_disk(self, warn: bool = False) -> int:
        """Set the capacity to what the filesystem allows (its free space beyond the reserve,
        plus what this tier already holds), up to the configured cap; returns it."""
        self._checked_at = time.monotonic()
        try:
            du = shutil.disk_usage(self.root)
        except OSError:
            return self.capacity
        allowed = self.used + max(0, du.free - disk_reserve(du.total))
        capacity = min(self.configured, allowed)
        if warn and capacity < self.configured:
            logger.warning("kv store: the file tier under %s is capped at %.2f GiB, not the %.2f GiB asked for: "
                           "its filesystem has %.2f GiB free and keeps %.2f GiB in reserve", self.root,
                           capacity / 2**30, self.configured / 2**30, du.free / 2**30,
                           disk_reserve(du.total) / 2**30)
        self.capacity = capacity
        return capacity

    def release(self) -> None:
        """Let another store have the directory (this one writes no more)."""
        if self._claim is not None:
            self._claim.close()

    def writable(self) -> bool:
        """False while backing off after a failed write (the caller skips the write)."""
        now = time.monotonic()
        if now < self._backoff_until:
            self.skipped_writes += 1
            return False
        if now - self._checked_at >= self.disk_check_s:
            self.fit_to_disk()
        return True

    def _failed_write(self, key: str) -> None:
        self.write_errors += 1
        self._burst += 1
        self._backoff_until = time.monotonic() + self.backoff_s
        if self._burst == 1:
            logger.warning("kv store: writing page %s under %s failed (disk full or failing?); file writes "
                           "pause for %.0f s", key, self.root, self.backoff_s)
        self.fit_to_disk()

    def _wrote(self) -> None:
        if self._burst > 1:
            logger.warning("kv store: file writes work again after %d failures", self._burst)
        self._burst = 0

    def __contains__(self, key: str) -> bool:
        return key in self.lru

    def __len__(self) -> int:
        return len(self.lru)

    def path(self, key: str) -> Path:
        return self.root / key[:2] / (validate_key(key) + SUFFIX)

    def touch(self, key: str) -> None:
        self.lru.move_to_end(key)

    def victims(self, need: int, keep: str, busy: frozenset[str] | set[str] = frozenset()) -> list[str] | None:
        """Least recently used keys to delete so that `need` more bytes fit (never `keep`, nor
        a `busy` one: its file is being read); None when they cannot fit at all."""
        if need > self.capacity:
            return None
        out, free = [], self.capacity - self.used
        for key, nbytes in self.lru.items():
            if free >= need:
                break
            if key != keep and key not in busy:
                out.append(key)
                free += nbytes
        return out if free >= need else None

    def remove(self, key: str) -> None:
        self.used -= self.lru.pop(key, 0)
        try:
            self.path(key).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:  # a failing disk: the file stays, forgotten (a rebuild re-reads it)
            logger.debug("kv store: removing %s: %s", key, exc)

    # ---------------- NIXL POSIX ----------------
    def _transfer(self, op: str, fd: int, regions: Sequence[tuple[int, int]]) -> bool:
        """One transfer between DRAM `regions` (in page order) and the file after its header."""
        reg = self.agent.register_memory([(0, 0, fd, "")], "FILE", backends=["POSIX"])
        handle = None
        try:
            mem, files, off = [], [], HEADER_BYTES
            for addr, n in regions:
                mem.append((addr, n, 0))
                files.append((off, n, fd))
                off += n
            handle = self.agent.initialize_xfer(op, self.agent.get_xfer_descs(mem, "DRAM"),
                                                self.agent.get_xfer_descs(files, "FILE"),
                                                self.agent_name, backends=["POSIX"])
            return self._wait(handle)
        except Exception as exc:  # short reads and I/O errors surface here
            logger.debug("kv store: POSIX %s failed: %s", op, exc)  # the caller logs bursts
            return False
        finally:
            if handle is not None:
                try:
                    self.agent.release_xfer_handle(handle)
                except Exception:
                    pass
            self.agent.deregister_memory(reg, backends=["POSIX"])

    def write(self, key: str, regions: Sequence[tuple[int, int]], size: int, checksum: int, tag: str = "",
              prompt: bool = False) -> bool:
        """Write a page atomically (tmp + rename) and count it; the caller made room (`victims`)."""
        if not self.write_bytes(key, regions, size, checksum, tag, prompt):
            return False
        self.add(key, size)
        return True

    def add(self, key: str, size: int, reserved: bool = False) -> None:
        """Count a page file that `write_bytes` wrote (`reserved`: its bytes already are)."""
        self.lru[key] = file_bytes(size)
        if not reserved:
            self.used += file_bytes(size)

    def write_bytes(self, key: str, regions: Sequence[tuple[int, int]], size: int, checksum: int,
                    tag: str = "", prompt: bool = False) -> bool:
        """The I/O of `write`, without counting the file: safe outside the store's lock (the
        flusher writes there; `add` counts the file under the lock afterwards)."""
        path = self.path(key)
        tmp = path.with_name(path.name + ".tmp")
        ok = False
        try:
            path.parent.mkdir(exist_ok=True)
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                ok = self._transfer("WRITE", fd, regions)
                if ok:
                    header = HEADER.pack(MAGIC, key.encode(), size, checksum, tag_bytes(tag), int(prompt))
                    os.pwrite(fd, header.ljust(HEADER_BYTES, b"\0"), 0)
                    if self.fsync:
                        os.fsync(fd)
            finally:
                os.close(fd)
            if ok:
                os.replace(tmp, path)
        except OSError as exc:  # ENOSPC on the header, the rename or the directory
            logger.debug("kv store: page file %s: %s", path, exc)
            ok = False
        if not ok:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            self._failed_write(key)
            return False
        self._wrote()
        return True

    def read(self, key: str, regions: Sequence[tuple[int, int]], size: int, checksum: int) -> bool:
        """Read a page into DRAM `regions`; False when the file is missing, is not a whole
        page of `key` with this size and checksum, or the read fails. The caller verifies
        the checksum of what landed."""
        try:
            fd = os.open(self.path(key), os.O_RDONLY)
        except OSError:
            return False
        try:
            return self._header(fd, key)[:2] == (size, checksum) and self._transfer("READ", fd, regions)
        finally:
            os.close(fd)

    def read_many(self, items: Sequence[tuple[str, Sequence[tuple[int, int]], int, int]]) -> list[bool]:
        """`read` for several pages (key, DRAM regions, size, crc32) in one NIXL transfer;
        per page, whether it landed. A failed batch is retried page by page, so one bad file
        never costs the others."""
        fds: list[int | None] = []
        try:
            for key, _, size, checksum in items:
                try:
                    fd = os.open(self.path(key), os.O_RDONLY)
                except OSError:
                    fds.append(None)
                    continue
                if self._header(fd, key)[:2] != (size, checksum):
                    os.close(fd)
                    fd = None
                fds.append(fd)
            good = [i for i, fd in enumerate(fds) if fd is not None]
            if good and self._transfer_many("READ", [(fds[i], items[i][1]) for i in good]):
                return [fd is not None for fd in fds]
            return [fd is not None and self._transfer("READ", fd, items[i][1]) for i, fd in enumerate(fds)]
        finally:
            for fd in fds:
                if fd is not None:
                    os.close(fd)

    def _transfer_many(self, op: str, files: Sequence[tuple[int, Sequence[tuple[int, int]]]]) -> bool:
        """One transfer between several files (fd, DRAM regions after the header) and DRAM."""
        reg = self.agent.register_memory([(0, 0, fd, "") for fd, _ in files], "FILE", backends=["POSIX"])
        handle = None
        try:
            mem, descs = [], []
            for fd, regions in files:
                off = HEADER_BYTES
                for addr, n in regions:
                    mem.append((addr, n, 0))
                    descs.append((off, n, fd))
                    off += n
            handle = self.agent.initialize_xfer(op, self.agent.get_xfer_descs(mem, "DRAM"),
                                                self.agent.get_xfer_descs(descs, "FILE"),
                                                self.agent_name, backends=["POSIX"])
            return self._wait(handle)
        except Exception as exc:
            logger.debug("kv store: POSIX %s of %d files failed: %s", op, len(files), exc)
            return False
        finally:
            if handle is not None:
                try:
                    self.agent.release_xfer_handle(handle)
                except Exception:
                    pass
            self.agent.deregister_memory(reg, backends=["POSIX"])

    def _wait(self, handle) -> bool:
        state = self.agent.transfer(handle)
        deadline = time.monotonic() + 30.0
        spins = 0
        while state == "PROC" and time.monotonic() < deadline:
            spins += 1
            if spins > 200:
                time.sleep(0.00005)
            state = self.agent.check_xfer_state(handle)
        return state == "DONE"

    def read_bytes(self, key: str, size: int, checksum: int) -> bytes | None:
        """The page bytes through plain file I/O (control path: verify())."""
        try:
            with open(self.path(key), "rb") as f:
                if self._header(f.fileno(), key)[:2] != (size, checksum):
                    return None
                f.seek(HEADER_BYTES)
                return f.read()
        except OSError:
            return None

    def _header(self, fd: int, key: str) -> tuple[int | None, int | None, str, bool]:
        """(size, crc32, tag, prompt) from a page file's header; (None, None, "", False) when it
        is not a whole page of key."""
        raw = os.pread(fd, HEADER.size, 0)
        bad = None, None, "", False
        if len(raw) != HEADER.size:
            return bad
        magic, hkey, size, crc, tag, prompt = HEADER.unpack(raw)
        if magic != MAGIC or hkey.rstrip(b"\0") != key.encode():
            return bad
        if os.fstat(fd).st_size != HEADER_BYTES + size:
            return bad
        return size, crc, tag.hex() if any(tag) else "", bool(prompt)

    def scan(self) -> tuple[list[tuple[str, int, int, str, bool]], int]:
        """Index the page files under root: ([(key, size, crc, tag, prompt)] oldest first, number of broken
        files deleted). Leftover tmp files are deleted; files that are not ours are left."""
        found, broken = [], 0
        for sub in sorted(self.root.iterdir()):
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for path in sub.iterdir():
                if path.name.endswith(".tmp"):
                    path.unlink(missing_ok=True)
                    continue
                key = path.name.removesuffix(SUFFIX)
                if not path.name.endswith(SUFFIX) or not is_valid_key(key):
                    continue
                meta = None
                try:
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        meta, mtime = self._header(fd, key), os.fstat(fd).st_mtime
                    finally:
                        os.close(fd)
                except OSError:
                    pass
                if meta is None or meta[0] is None:
                    broken += 1
                    path.unlink(missing_ok=True)
                    continue
                found.append((mtime, key, *meta))
        out = []
        for _, key, *meta in sorted(found):
            self.lru[key] = file_bytes(meta[0])
            self.used += file_bytes(meta[0])
            out.append((key, *meta))
        return out, broken
