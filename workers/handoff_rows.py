"""A rank's hand-off rows: where prefill/decode disaggregation keeps KV pages on their way
from a prefill rank to a decode rank (`workers/kv_peer.py` moves them).

The rows are a `HostTier` (chain key -> row, LRU) on the rank's KV pool device: GPU memory on a
GPU, so a hand-off never crosses host memory (gathered from the pool on the device, READ over
NIXL from GPU memory to GPU memory, scattered into the decode pool on the device); host memory
on CPUs, or with `--pd-memory host` (NIXL over a network without GPUDirect RDMA is faster from
host memory). They are registered with a NIXL agent of their own: the store client's agent
carries only host memory, so the KV store (a CPU actor that loads every client's metadata)
never sees GPU memory.

Checksums follow the memory: in GPU memory `kvstore.transfer.page_sums` (a weighted word sum,
computed on the device, on a stream of the calling thread's own: never behind the step that
runs on the default stream); in host memory zlib's crc32 on the checksum threads (~3x torch's
sum on a CPU: BENCHMARKS.md). Both sides of a hand-off must keep its pages in one kind of
memory (`same_memory`), so they agree on the kind of checksum.

Only prefill and decode replicas have them, and mixed ones beside prefill replicas
(`cluster.launch.ClusterOptions.engine_for`; elsewhere `KVOffloadOptions.handoff_bytes` is 0).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid

import torch

from workers.host_tier import HostTier

logger = logging.getLogger(__name__)

SUM_ROWS = 8  # rows checksummed at once


class HandoffRows:
    """The rows (`tier`), the NIXL agent that lends or reads them (`agent`, named `name`)."""

    def __init__(self, capacity_pages: int, page_bytes: int, device: torch.device, memory: str, rank: int,
                 width: int):
        from kvstore.transfer import make_agent

        on_gpu = device.type == "cuda" and memory == "gpu"
        self.name = f"manta-pd-r{rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.agent = make_agent(self.name)
        self.tier = HostTier(capacity_pages, page_bytes, pin=device.type == "cuda",
                             device=device if on_gpu else None)
        self._tls = threading.local()
        self.closed = False
        try:
            self._reg = self.agent.register_memory(self.tier.data)
        except Exception:
            if not on_gpu:
                raise
            # NIXL without GPU memory (a UCX built without CUDA): through the host, and only with
            # ranks that do the same.
            logger.warning("rank %d: NIXL cannot register GPU memory; PD hand-offs go through host memory", rank)
            self.tier = HostTier(capacity_pages, page_bytes, pin=True)
            self._reg = self.agent.register_memory(self.tier.data)
        if self.tier.data.is_cuda:  # the sums' weights (for `width` bytes) on the device now, not in a hand-off's copy
            self.sums_now([0], width)

    @property
    def mem(self) -> str:
        return mem_of(self.tier.data)

    @property
    def dev(self) -> int:
        return dev_of(self.tier.data)

    def stream(self):
        """The calling thread's CUDA stream for work on the rows (None in host memory)."""
        data = self.tier.data
        if not data.is_cuda:
            return None
        s = getattr(self._tls, "stream", None)
        if s is None:
            torch.cuda.set_device(data.device)  # (a thread's first CUDA call: the rows' device)
            # High priority: from another pool than the copy and load streams (a save's copy
            # stream waits for the step in flight), and ahead of the step's kernels.
            s = self._tls.stream = torch.cuda.Stream(data.device, priority=-1)
        return s

    def on_stream(self):
        """Context: the calling thread's stream current (nothing in host memory)."""
        s = self.stream()
        return torch.cuda.stream(s) if s is not None else contextlib.nullcontext()

    def sums_now(self, rows: list[int], width: int) -> list[int]:
        """Checksums of `rows` (their first `width` bytes), computed and read back now."""
        if not rows:
            return []
        with self.on_stream():
            return results(row_sums(self.tier.data, rows, width))

    def close(self) -> None:
        self.closed = True
        try:
            self.agent.deregister_memory(self._reg)
        except Exception:
            pass


def make_handoff_rows(handoff_bytes: int, page_bytes: int, device: torch.device, memory: str,
                      rank: int, min_pages: int, width: int) -> HandoffRows | None:
    """A rank's hand-off rows (pages of `width` used bytes); None without them (a mixed replica)
    or when NIXL cannot make them."""
    if handoff_bytes <= 0:
        return None
    try:
        return HandoffRows(max(handoff_bytes // page_bytes, min_pages), page_bytes, device, memory, rank, width)
    except Exception:
        logger.exception("rank %d: no hand-off rows; prefill/decode hand-offs are recomputed", rank)
        return None


def row_sums(data: torch.Tensor, rows: list[int], width: int) -> list:
    """Start the checksums of `rows` of `data` (their first `width` bytes), SUM_ROWS rows at a
    time (bounded temporaries): in GPU memory `page_sums`, enqueued on the current stream (int64
    tensors); in host memory their crc32s on the checksum threads (futures). `results` reads
    them, on the same stream."""
    from kvstore.transfer import checksums_started, page_sums

    if not data.is_cuda:
        return [checksums_started([data[r, :width].numpy() for r in rows])]
    started = []
    for i in range(0, len(rows), SUM_ROWS):
        idx = torch.tensor(rows[i : i + SUM_ROWS]).pin_memory().to(data.device, non_blocking=True)
        started.append(page_sums(data[idx, :width]))
    return started


def results(started: list) -> list[int]:
    """The checksums `row_sums` started, in order (call on the stream they were started on)."""
    out: list[int] = []
    for s in started:
        out += s.tolist() if isinstance(s, torch.Tensor) else [f.result() for f in s]
    return out


def mem_of(t: torch.Tensor) -> str:
    """The NIXL memory type of a tensor's memory."""
    return "VRAM" if t.is_cuda else "DRAM"


def dev_of(t: torch.Tensor) -> int:
    """The device id of a NIXL descriptor of a tensor's memory (0 for host memory)."""
    return t.device.index if t.is_cuda else 0


def same_memory(reply: dict, data: torch.Tensor) -> None:
    """A READ moves pages between memories of one kind: GPU rows and host rows do not mix (each
    side's checksum follows its memory)."""
    if reply.get("mem", "DRAM") != mem_of(data):
        raise ValueError(f"the prefill rank's pages are in {reply.get('mem', 'DRAM')}, this rank's in "
                         f"{mem_of(data)}: run both sides with the same --pd-memory")
