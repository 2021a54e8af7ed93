"""How long a thread of a serving process may hold the GIL while another waits for it.

The serving path crosses threads in each of its processes: in the HTTP server, the event loop
reads a replica's frames while other threads (Ray's, the router's) hold the GIL at times, and
it may be busy writing a step's worth of chunks; in a replica actor, a connection's reader or
writer thread (`cluster/replica_channel.py`) needs the GIL while the engine thread plans and
launches a step; in a rank actor (`workers/worker.py`), the step thread comes back from its
forward while the KV offload's I/O thread or a PD peer's call runs Python. A waiting thread
gets the GIL only
when the holder releases it or when the switch interval runs out: CPython's default, 5 ms,
then lands whole on a request's time to first token at each of those hops. A shorter
interval lets the waiting thread in sooner, at the cost of more switches while threads
contend (each a few microseconds).

`MANTA_GIL_SWITCH_MS` overrides the default (for an A/B; Python's own is 5)."""

from __future__ import annotations

import os
import sys

DEFAULT_MS = 1.0


def apply() -> float:
    """Set this process's switch interval; returns it in milliseconds."""
    ms = float(os.environ.get("MANTA_GIL_SWITCH_MS", DEFAULT_MS))
    if ms <= 0:
        raise ValueError(f"MANTA_GIL_SWITCH_MS must be > 0, got {ms}")
    sys.setswitchinterval(ms / 1000.0)
    return ms
