"""A loopback port for a `manta serve` that a benchmark or a test starts."""

from __future__ import annotations

import random
import socket


def free_port() -> int:
    """A free port below Linux's ephemeral range (32768-60999) and above Ray's worker ports
    (10002-19999): a port the kernel hands out for bind(0) may be taken by one of the Ray
    processes the server starts before it binds its own (seen in CI: "address already in use")."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32767")
