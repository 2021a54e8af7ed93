"""Server-sent events and the client's disconnect: how an answer reaches an HTTP client.

`SSEResponse` streams events while watching for `http.disconnect` beside the stream; a
non-streaming answer runs under `until_disconnect`. Either way a client that leaves ends the
work (its requests are aborted on their replica by the caller's close hook), and the server's
shutdown deadline ends it too (`ServerShuttingDown`, or one last error event on a stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from cluster.api.errors import APIError
from cluster.api.shutdown import ServerShuttingDown, ShutdownGate


class ClientGone(Exception):
    """The HTTP client disconnected before its non-streaming answer was ready."""


# JSON leaves U+0085, U+2028 and U+2029 unescaped, and line readers built on str.splitlines
# (httpx's `aiter_lines` among them) end an SSE line there, cutting the event's JSON in two.
# They can only occur inside JSON strings, where their escapes mean the same.
LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(obj: BaseModel | dict) -> str:
    data = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {data.translate(LINE_BREAKS)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[Any], gate: ShutdownGate) -> Any:
    """Await `work`, cancelling it and raising ClientGone if the client goes away first, or
    ServerShuttingDown at the server's shutdown deadline.

    `work` runs in the caller's own task, and the watchers cancel that task (as `asyncio.timeout`
    does): a task for `work` would start it a turn of the event loop later, and under load a turn
    waits for every stream's chunk of a step. That turn sat before each admission's `submit`."""
    me = asyncio.current_task()
    assert me is not None
    why: list[BaseException | None] = []  # the interrupt, or None once `work` is over

    def interrupt(make: Callable[[], BaseException]) -> Callable[[asyncio.Future], None]:
        def done(watcher: asyncio.Future) -> None:
            if not why and not watcher.cancelled():
                why.append(make())
                me.cancel()
        return done

    watch = asyncio.ensure_future(_wait_disconnect(request))
    stop = asyncio.ensure_future(gate.stopped.wait())
    watch.add_done_callback(interrupt(ClientGone))
    stop.add_done_callback(interrupt(lambda: ServerShuttingDown("the server shut down before the request finished")))
    try:
        return await work
    except asyncio.CancelledError:
        if why and why[0] is not None and me.uncancel() == 0:  # ours, not a cancel from outside
            raise why[0] from None
        raise
    finally:
        if not why:
            why.append(None)
        for t in (watch, stop):
            t.cancel()
        await asyncio.gather(watch, stop, return_exceptions=True)


class SSEResponse(StreamingResponse):
    """Streams SSE while watching for the client's disconnect; always closes the body iterator
    and runs `on_close(client_gone)` (which aborts unfinished requests), however the response ends."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[bool], Awaitable[None]], gate: ShutdownGate):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close
        self._gate = gate

    async def __call__(self, scope, receive, send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        watch = asyncio.ensure_future(self.listen_for_disconnect(receive))
        stop = asyncio.ensure_future(self._gate.stopped.wait())
        try:
            await asyncio.wait({stream, watch, stop}, return_when=asyncio.FIRST_COMPLETED)
            if stop.done() and not stream.done():  # the shutdown deadline: one last event, then close
                stream.cancel()
                await asyncio.gather(stream, return_exceptions=True)
                err = APIError(503, "the server shut down before the request finished", "server_error",
                               code="server_shutting_down")
                with contextlib.suppress(Exception):  # a client that does not read gets 1 s
                    body = (sse(err.body()) + SSE_DONE).encode()
                    await asyncio.wait_for(send({"type": "http.response.body", "body": body, "more_body": False}), 1.0)
        finally:
            # The client left: its disconnect arrived, or sending to it failed.
            gone = watch.done() or (stream.done() and not stream.cancelled() and stream.exception() is not None)
            for t in (stream, watch, stop):
                t.cancel()
            await asyncio.gather(stream, watch, stop, return_exceptions=True)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self._on_close(gone)
