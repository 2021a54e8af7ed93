"""Moving page bytes between processes, shared by the store client (`kvstore.client`) and the
prefill/decode peer reads (`workers.kv_peer`): one NIXL transfer with a deadline, the checksums
that prove a page arrived whole, and the TP ranks' agreement on how many pages they all hold.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

logger = logging.getLogger(__name__)

_CRC_POOL: ThreadPoolExecutor | None = None
_CRC_POOL_LOCK = threading.Lock()
PARALLEL_CRC_BYTES = 4 << 20  # a batch at least this large is checksummed on several threads


def checksums(views: Sequence[np.ndarray]) -> list[int]:
    """crc32 of each view; a large batch on a few threads at once (zlib releases the GIL for
    large buffers): one core's crc32 (~2 GB/s) was the client's largest cost."""
    if len(views) < 2 or sum(v.nbytes for v in views) < PARALLEL_CRC_BYTES:
        return [zlib.crc32(v) for v in views]
    return list(_crc_pool().map(zlib.crc32, views))


def checksums_started(views: Sequence[np.ndarray]) -> list[Future]:
    """crc32 of each view, started on the checksum threads: the caller goes on (e.g. reads the
    next pages) and takes each `result()` when it needs it."""
    pool = _crc_pool()
    return [pool.submit(zlib.crc32, v) for v in views]


def _crc_pool() -> ThreadPoolExecutor:
    global _CRC_POOL
    if _CRC_POOL is None:
        with _CRC_POOL_LOCK:
            if _CRC_POOL is None:
                _CRC_POOL = ThreadPoolExecutor(max(1, min(4, (os.cpu_count() or 2) // 2)),
                                               thread_name_prefix="kv-crc")
    return _CRC_POOL


_SUM_WEIGHTS: dict[tuple[int, str], object] = {}  # (words, device) -> weights
SUM_SEED = 0x6D616E7461  # every process draws the same weights: a page's sum is the same anywhere
SUM_CHUNK_WORDS = 16 << 20  # words multiplied at once (a 64 MiB temporary)


def page_sums(rows):
    """A checksum of each row of `rows` ([n, bytes] uint8, on any device), as int64 [n] on that
    device, computed there without a copy: the rows' 32-bit words (bytes when the width is not
    a multiple of 4), each times its own fixed odd random weight, mod 2^32 (int32 products
    wrap), summed exactly in int64. Changing any one word changes its product (an odd weight
    is invertible mod 2^32), so the sum; a page overwritten by another request's K/V differs
    everywhere. Integer sums do not depend on the order they are added in, so a GPU and a CPU
    agree on every page. The prefill/decode hand-off (`workers/kv_peer.py`) checks pages in
    GPU memory with it, where a crc32 would first copy them to the host."""
    import torch

    whole = rows.shape[1] % 4 == 0
    words = rows.view(torch.int32) if whole else rows  # (bytes: widened a chunk at a time below)
    key = (words.shape[1], str(rows.device))
    w = _SUM_WEIGHTS.get(key)
    if w is None:
        gen = torch.Generator().manual_seed(SUM_SEED)
        w = torch.randint(0, 2**31, (words.shape[1],), generator=gen, dtype=torch.int64) * 2 + 1  # odd, < 2^32
        w = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32).to(rows.device)  # the same bits as int32
        w = _SUM_WEIGHTS.setdefault(key, w)  # (atomic: threads that raced agree on one)
    step = max(1, SUM_CHUNK_WORDS // max(1, words.shape[1]))  # bounded temporaries
    out = torch.empty(words.shape[0], dtype=torch.int64, device=rows.device)
    for lo in range(0, words.shape[0], step):
        chunk = words[lo : lo + step] if whole else words[lo : lo + step].to(torch.int32)
        torch.sum(chunk * w, dim=1, dtype=torch.int64, out=out[lo : lo + step])
    return out


def agree_on_pages(tp_group, found: int) -> int:
    """The pages every TP rank of a replica loaded: min over ranks (`TPGroup.all_min_int`).

    Each rank loads its own shard (MHA) or its own copy (MLA) and may find fewer pages than a
    peer (eviction between calls, a corrupt page). The replica may use only the prefix every
    rank holds, so all ranks call this with their `batch_get`/`load_pages` count and use the
    result; pages past it are ignored (their slots are overwritten by the prefill)."""
    return tp_group.all_min_int(found)


def make_agent(name: str):
    """A NIXL agent over UCX for transfers that the caller progresses itself (no progress thread:
    it busy-polls a core), safe for several threads at once (STRICT)."""
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                              sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))


def nixl_transfer(agent, op: str, local: list[tuple[int, int, int]], remote: list[tuple[int, int, int]],
                  remote_agent: str, timeout_s: float, mem: str = "DRAM", unreleased: list | None = None) -> str:
    """One NIXL transfer between registered memory here (`local`: (address, bytes, device))
    and `remote_agent`'s (`remote`), READ or WRITE, both in host memory ("DRAM") or both in GPU
    memory ("VRAM", device: the GPU's index in its process): "done" when it completed within `timeout_s`,
    else "failed" — or "stuck" when its handle could not be released (the backend could not
    cancel it: its bytes may still land, so the caller must not reuse the memory yet). A stuck
    transfer's handle is appended to `unreleased`, for `Unreleased` to release once it ends."""
    deadline = time.monotonic() + timeout_s
    handle, state = None, "ERR"
    try:
        handle = agent.initialize_xfer(op, agent.get_xfer_descs(np.array(local, np.uint64), mem),
                                       agent.get_xfer_descs(np.array(remote, np.uint64), mem), remote_agent)
        state = agent.transfer(handle)
        spins = 0
        while state == "PROC" and time.monotonic() < deadline:
            spins += 1
            if spins > 20:
                # Past a few polls, sleep between them: a polling thread holds the GIL,
                # which the rank's step thread needs to launch its forward.
                time.sleep(0.0001)
            state = agent.check_xfer_state(handle)
    except Exception as exc:
        logger.warning("NIXL %s to %s failed: %s", op, remote_agent, exc)
    finally:
        if handle is not None:
            try:
                agent.release_xfer_handle(handle)
            except Exception as exc:
                if state != "DONE":
                    logger.warning("NIXL %s to %s could not be cancelled: %s", op, remote_agent, exc)
                    if unreleased is not None:
                        unreleased.append(handle)
                    return "stuck"
    return "done" if state == "DONE" else "failed"


class Unreleased:
    """Transfers NIXL could not cancel (`nixl_transfer` answered "stuck"), each held with a way
    to give back the memory it may still write: `reap` (called by the owner on its own thread,
    e.g. before its next transfer) releases the handles of those that have ended and then gives
    their memory back, once. Until then the memory stays out of use, so a late write lands where
    nobody reads."""

    def __init__(self) -> None:
        self._held: list[tuple[object, list | None, Callable[[], None]]] = []
        self._lock = threading.Lock()
        self.freed = 0  # transfers whose memory came back

    def add(self, agent, handles: Sequence, free: Callable[[], None]) -> None:
        """Hold a transfer's memory until its `handles` are released; with none known, for good."""
        with self._lock:
            self._held.append((agent, list(handles) or None, free))

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def reap(self) -> int:
        """Release what has ended and give its memory back; the number of transfers given back."""
        with self._lock:
            held, self._held = self._held, []
        keep, done = [], 0
        for agent, handles, free in held:
            if handles is None:  # (no handle to watch: never known to have ended)
                keep.append((agent, handles, free))
                continue
            left = [h for h in handles if not _release_ended(agent, h)]  # (a released handle is never touched again)
            if left:
                keep.append((agent, left, free))
                continue
            try:
                free()
            except Exception:  # kept with no handles left: the next reap tries to give it back again
                logger.exception("giving back the memory of a transfer NIXL could not cancel")
                keep.append((agent, [], free))
                continue
            done += 1
        with self._lock:
            self._held[:0] = keep
            self.freed += done
        return done


def _release_ended(agent, handle) -> bool:
    """Release `handle` if its transfer is no longer in progress; whether it is released."""
    try:
        if agent.check_xfer_state(handle) == "PROC":
            return False
        agent.release_xfer_handle(handle)
        return True
    except Exception:
        return False
