"""Per-request deadlines of the HTTP server (`manta serve --request-timeout S`).

The server stamps each request with a deadline when it arrives (`request.state.deadline`, a
`time.monotonic()` value, or None for no limit). Admission, collecting a non-streaming answer
and every chunk of a stream are awaited `within` it. Past it, `RequestTimedOut` is raised (the
server answers 504, or sends one error event on a stream that has started) and the request's
`FanOut` is closed, which aborts it on its replica and frees its KV pages at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


class RequestTimedOut(Exception):
    """The request ran past the server's per-request timeout."""

    def __init__(self, timeout_s: float):
        super().__init__(f"the request did not finish within the server's timeout of {timeout_s:g} s "
                         "and was aborted")
        self.timeout_s = timeout_s


def stamp(state: Any, timeout_s: float | None) -> None:
    """Give a request (its Starlette `request.state`) a deadline `timeout_s` from now."""
    state.deadline = time.monotonic() + timeout_s if timeout_s else None
    state.timeout_s = timeout_s
    state.timed_out = False


async def within(state: Any, work: Awaitable[T]) -> T:
    """Await `work` before the request's deadline; past it, cancel `work` and raise
    RequestTimedOut (after marking `state.timed_out`)."""
    deadline = getattr(state, "deadline", None)
    if deadline is None:
        return await work
    try:
        # One timer on this task, not wait_for's extra task: a stream awaits this once a chunk.
        async with asyncio.timeout_at(_loop_time(deadline)):
            return await work
    except TimeoutError:
        state.timed_out = True
        raise RequestTimedOut(state.timeout_s) from None


def _loop_time(deadline: float) -> float:
    """`deadline` (time.monotonic) on the event loop's clock, which asyncio.timeout_at takes."""
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())


async def stream_within(state: Any, events: AsyncIterator[T]) -> AsyncIterator[T]:
    """`events`, each one awaited within the request's deadline; closes `events` however it ends."""
    if getattr(state, "deadline", None) is None:
        async with contextlib.aclosing(events) as evs:  # type: ignore[type-var]
            async for ev in evs:
                yield ev
        return
    try:
        while True:
            try:
                ev = await within(state, anext(events))
            except StopAsyncIteration:
                return
            yield ev
    finally:
        with contextlib.suppress(Exception):
            await events.aclose()  # type: ignore[attr-defined]
