"""The cyclic garbage collector and a serving process's long-lived heap.

A full (generation 2) collection walks every container object the process holds: the model's
modules, the tokenizer, torch's and Triton's bookkeeping, what the engine built at start. On
an 8B engine serving 200 streams, two such collections took 350 and 422 ms (one H200,
2026-11-27, BENCHMARKS.md "Steps under a time target"), and every stream and every waiting
request waited on them (the collector holds the GIL). What exists when a process starts
serving lives as long as it serves: `freeze` collects once and moves it out of the collector's
sight (`gc.freeze`), so later collections walk only what serving allocates. Its users: an
engine when it starts serving (`cluster.engine.loop`), a TP rank once its model is loaded and
its graphs captured (`workers.worker.RankWorker`: under `manta serve` the model lives there),
the HTTP server after start-up. Only the first user freezes (a second one would freeze the
first one's live objects, whose cycles would then outlive them uncollected); `thaw` gives the
heap back when the last user stops (an engine shut down in a process that goes on: tests, a
rebuilt replica).
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_users = 0


def freeze() -> None:
    global _users
    with _lock:
        _users += 1
        if _users == 1:
            gc.collect()
            gc.freeze()


def thaw() -> None:
    global _users
    with _lock:
        if _users == 0:
            return
        _users -= 1
        if _users == 0:
            gc.unfreeze()
