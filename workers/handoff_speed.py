"""Whether a decode rank's hand-off READs move GPU memory as fast as a GPU host should.

NIXL's UCX backend picks its transport itself. Between GPUs it normally finds CUDA IPC (one host)
or GPUDirect RDMA, and a 2,048-token prompt of an 8B model (256 MiB) moves in about a millisecond.
Where it finds neither, it moves GPU memory as active messages over TCP. On one lent H200 host
that was 0.45 GB/s, with no `UCX_TLS` setting that changed it (BENCHMARKS.md, 2026-11-28). The
hand-off then takes longer than the prefill did, so the decode side falls behind and recomputes
most prompts itself. Nothing fails, so without this warning nobody learns why PD is slow there.
Host-memory hand-offs (`--pd-memory host`, CPU replicas) are not judged: TCP is their transport.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

SLOW_GB_S = 2.0  # GPU memory read slower than this: no CUDA IPC or RDMA lane
JUDGED_BYTES = 64 << 20  # reads are judged over at least this many bytes
REPEAT_S = 600.0  # the warning comes again for the same prefill replica after this long


class ReadSpeed:
    """Sums a rank's GPU-memory READs per prefill replica and warns, once per REPEAT_S, when they
    run below SLOW_GB_S. `slow` counts the judgements that found them slow."""

    def __init__(self) -> None:
        self._sums: dict[str, list[float]] = {}  # replica -> [bytes, seconds] since its last judgement
        self._warned: dict[str, float] = {}  # replica -> when it was last warned about
        self.slow = 0

    def add(self, replica: str, mem: str, nbytes: int, seconds: float, now: float) -> str | None:
        """One READ of `nbytes` in `seconds`; returns the warning it logged, if any."""
        if mem != "VRAM" or nbytes <= 0:
            return None
        acc = self._sums.setdefault(replica, [0, 0.0])
        acc[0] += nbytes
        acc[1] += seconds
        if acc[0] < JUDGED_BYTES:
            return None
        gb_s = acc[0] / max(acc[1], 1e-9) / 1e9
        self._sums[replica] = [0, 0.0]
        if gb_s >= SLOW_GB_S:
            return None
        self.slow += 1
        if now - self._warned.get(replica, -REPEAT_S) < REPEAT_S:
            return None
        self._warned[replica] = now
        msg = (f"PD hand-offs from {replica} read GPU memory at {gb_s:.2f} GB/s: NIXL's UCX found no CUDA IPC "
               f"or GPUDirect RDMA lane to its ranks and moves GPU memory over TCP. A 256 MiB prompt (2,048 "
               f"tokens of an 8B model) takes {(256 << 20) / 1e9 / gb_s:.1f} s to move (its prefill takes tens of "
               "ms on a GPU), so under load this decode replica falls behind and computes most prompts itself. "
               "Check the transport with "
               "`python3 scripts/nixl_read_bench.py --device cuda` (docs/deploy.md), or serve with --pd-memory host "
               "(pinned host memory: 3.7 GB/s READs on such a one-GPU host)")
        logger.warning(msg)
        return msg
