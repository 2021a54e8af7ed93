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
from collections.abc import Sequence
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


def agree_on_pages(tp_group, found: int) -> int:
    """The pages every TP rank of a replica loaded: min over ranks (`TPGroup.all_min_int`).

    Each rank loads its own shard (MHA) or its own copy (MLA) and may find fewer pages than a
    peer (eviction between calls, a corrupt page). The replica may use only the prefix every
    rank holds, so all ranks call this with their `batch_get`/`load_pages` count and use the
    result; pages past it are ignored (their slots are overwritten by the prefill)."""
    return tp_group.all_min_int(found)


def nixl_transfer(agent, op: str, local: list[tuple[int, int, int]], remote: list[tuple[int, int, int]],
                  remote_agent: str, timeout_s: float) -> str:
    """One NIXL transfer between registered host memory here (`local`: (address, bytes, 0))
    and `remote_agent`'s (`remote`), READ or WRITE: "done" when it completed within `timeout_s`,
    else "failed" — or "stuck" when its handle could not be released (the backend could not
    cancel it: its bytes may still land, so the caller must not reuse the memory yet)."""
    deadline = time.monotonic() + timeout_s
    handle, state = None, "ERR"
    try:
        handle = agent.initialize_xfer(op, agent.get_xfer_descs(np.array(local, np.uint64), "DRAM"),
                                       agent.get_xfer_descs(np.array(remote, np.uint64), "DRAM"), remote_agent)
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
                    return "stuck"
    return "done" if state == "DONE" else "failed"
