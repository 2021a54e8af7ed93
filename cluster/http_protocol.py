"""uvicorn's HTTP protocol, stamping each request with the moment its first bytes arrived.

The server's latencies (TTFT, end to end) count from there: the time a request waits for the
event loop to parse it and route it, behind a burst of others, is the server's, and clients
see it. (The time a new connection waits in the kernel's accept queue before the server reads
anything stays outside: no process can see it.)
"""

from __future__ import annotations

import time

from uvicorn.protocols.http.h11_impl import H11Protocol


class StampedH11Protocol(H11Protocol):
    _arrival: float | None = None

    def data_received(self, data: bytes) -> None:
        if self._arrival is None or self.cycle is None or self.cycle.response_complete:
            self._arrival = time.monotonic()  # the first bytes of a new request on this connection
        super().data_received(data)
        scope = getattr(self, "scope", None)
        if scope is not None:
            scope.setdefault("state", {}).setdefault("arrival", self._arrival)
