"""A decode rank's judgement of its hand-off READs (workers/handoff_speed.py): GPU memory moved at
TCP's pace is said once per prefill replica, naming the rate and how to check the transport; host
memory, fast reads and too few bytes to judge are not."""

from __future__ import annotations

import logging

from workers.handoff_speed import JUDGED_BYTES, REPEAT_S, ReadSpeed

MIB = 1 << 20


def test_gpu_memory_at_tcp_pace_is_said_once_per_replica(caplog):
    speed = ReadSpeed()
    caplog.set_level(logging.WARNING, logger="workers.handoff_speed")
    # the lent H200 host of 2026-11-28 (BENCHMARKS.md): 256 MiB in 0.6 s
    msg = speed.add("replica-0", "VRAM", 256 * MIB, 0.6, now=100.0)
    assert msg is not None and "replica-0" in msg and "0.45 GB/s" in msg
    assert "nixl_read_bench.py --device cuda" in msg and "--pd-memory host" in msg
    assert [r.getMessage() for r in caplog.records] == [msg]
    assert speed.slow == 1
    # slow again within REPEAT_S: counted, not said again
    assert speed.add("replica-0", "VRAM", 256 * MIB, 0.6, now=200.0) is None
    assert speed.slow == 2 and len(caplog.records) == 1
    # another prefill replica is its own case
    assert speed.add("replica-3", "VRAM", 128 * MIB, 0.3, now=200.0) is not None
    # and after REPEAT_S the first is said again
    assert speed.add("replica-0", "VRAM", 256 * MIB, 0.6, now=100.0 + REPEAT_S) is not None
    assert speed.slow == 4 and len(caplog.records) == 3


def test_fast_reads_host_memory_and_small_reads_are_not_judged_slow(caplog):
    speed = ReadSpeed()
    caplog.set_level(logging.WARNING, logger="workers.handoff_speed")
    assert speed.add("replica-0", "VRAM", 256 * MIB, 0.0008, now=1.0) is None  # CUDA IPC: ~300 GB/s
    assert speed.add("replica-0", "DRAM", 256 * MIB, 0.6, now=1.0) is None  # host memory: TCP is its transport
    # a slow read under JUDGED_BYTES waits for more bytes; the sum decides
    half = JUDGED_BYTES // 2
    assert speed.add("replica-1", "VRAM", half, 0.5, now=1.0) is None
    assert speed.add("replica-1", "VRAM", half, 0.5, now=2.0) is not None  # 64 MiB in 1 s
    # a fast read after slow ones is judged on the sum since the last judgement only
    assert speed.add("replica-2", "VRAM", JUDGED_BYTES, 0.001, now=3.0) is None
    assert speed.slow == 1 and len(caplog.records) == 1
