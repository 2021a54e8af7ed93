"""The HTTP server's shutdown deadline (`manta serve --shutdown-timeout S`).

On SIGTERM (or SIGINT) the server stops admitting: new requests are answered 503 with
Retry-After while the requests in flight may finish, until S seconds have passed. Then every
request still in flight is ended: a stream with one error event (`server_shutting_down`) and
`[DONE]`, a request still waiting for its answer with a 503. A stream whose client does not
read gets one second to take that event, then its connection is closed. Only then does the
server exit and take the cluster down (replicas, their KV drain, the store, Ray), so every
process is gone shortly after the deadline, however clients behave.
"""

from __future__ import annotations

import asyncio
import logging
import time

logger = logging.getLogger(__name__)


class ServerShuttingDown(Exception):
    """The server is stopping: no new request is admitted, those in flight are ended at the
    deadline."""


class ShutdownGate:
    """Shared by the app's routes and the process that owns the server (one event loop)."""

    def __init__(self) -> None:
        self.closing = False
        self.deadline: float | None = None
        self.inflight = 0  # requests admitted and not yet closed (streams included)
        self._stop: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._timer: asyncio.TimerHandle | None = None

    def _events(self) -> tuple[asyncio.Event, asyncio.Event]:
        if self._stop is None or self._idle is None:  # made on the serving loop, at first use
            self._stop, self._idle = asyncio.Event(), asyncio.Event()
            if self.inflight == 0:
                self._idle.set()
        return self._stop, self._idle

    @property
    def stopped(self) -> asyncio.Event:
        """Set at the deadline: every request still in flight ends now."""
        return self._events()[0]

    def check_open(self) -> None:
        if self.closing:
            raise ServerShuttingDown("the server is shutting down; retry on another instance")

    def enter(self) -> None:
        self.inflight += 1
        self._events()[1].clear()

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight <= 0:
            self._events()[1].set()

    def begin(self, timeout_s: float) -> None:
        """Stop admitting now; end what is in flight `timeout_s` from now (idempotent)."""
        if self.closing:
            return
        self.closing = True
        self.deadline = time.monotonic() + timeout_s
        stop, _ = self._events()
        self._timer = asyncio.get_running_loop().call_later(max(0.0, timeout_s), stop.set)
        logger.info("shutting down: %d request(s) in flight may finish within %.1f s", self.inflight, timeout_s)

    def end_now(self) -> None:
        """Bring the deadline forward to now (a second signal): what is in flight ends at once,
        each stream with its error event, as at the deadline."""
        if not self.closing:
            self.begin(0.0)
            return
        if self._timer is not None:
            self._timer.cancel()
        self.deadline = time.monotonic()
        self._events()[0].set()
        logger.info("shutting down now: ending %d request(s) in flight", self.inflight)

    async def drained(self) -> None:
        """Returns once nothing is in flight, or the deadline has passed (and one more second
        for the streams to take their final event)."""
        stop, idle = self._events()
        idle_wait, stop_wait = asyncio.ensure_future(idle.wait()), asyncio.ensure_future(stop.wait())
        done, pending = await asyncio.wait({idle_wait, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        for t in pending:
            t.cancel()
        if stop_wait in done and not idle.is_set():
            try:
                await asyncio.wait_for(idle.wait(), 1.5)
            except TimeoutError:
                logger.warning("shutting down: %d request(s) did not end in time; closing them", self.inflight)
