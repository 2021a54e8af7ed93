"""The HTTP server's end of one replica's serving path (the replica's end: `cluster/replica.py`).

Every request the router sends to a replica goes through one `ReplicaClient`, on the server's
event loop:
- admissions and aborts are sent in one `submit` call per round: the first at once, whatever
  was opened while a call was in flight in the next one; each admitted request's stream gets
  the `ADMITTED` marker when the reply comes;
- one long `poll` call at a time brings back every output of the steps that completed since
  the last one, and the client hands each to its request's stream (an asyncio queue).
So the Ray messages per second depend on the engine's step rate, not on how many requests
run. The poll loop runs only while the client has open streams: an idle server sends nothing.

A failed `submit` or `poll` (the replica actor died or cannot be reached) ends every open
stream of this client with `ReplicaGone`; the router decides what to retry.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable

import ray

from cluster.engine.request import ADMITTED, Admitted, RequestOutput
from cluster.replica import Admission
from workers.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class ReplicaGone(RuntimeError):
    """The replica's actor failed a call of the serving path (`cause` is Ray's error)."""

    def __init__(self, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


class RequestStream:
    """One request's outputs in order, after `ADMITTED` once the replica queued it; ends after
    the finished one. `aclose()` before that aborts the request on the replica."""

    def __init__(self, client: ReplicaClient, rid: str):
        self.client, self.rid = client, rid
        self.queue: asyncio.Queue[RequestOutput | Admitted | ReplicaGone] = asyncio.Queue()
        self.done = False
        self.started = False  # an output of it has been handed over
        self.submitted_wall: float | None = None  # when its admission left (time.time())

    def __aiter__(self) -> AsyncIterator[RequestOutput | Admitted]:
        return self

    async def __anext__(self) -> RequestOutput | Admitted:
        if self.done:
            raise StopAsyncIteration
        item = await self.queue.get()
        if item is ADMITTED:
            return item
        if isinstance(item, ReplicaGone):
            self.done = True
            raise item
        self.done = item.finished
        return item

    async def aclose(self) -> None:
        if not self.done:
            self.done = True
            self.client.abort(self.rid)


class ReplicaClient:
    def __init__(self, name: str, actor, poll_timeout_s: float = 1.0):
        self.name, self.actor = name, actor
        self.poll_timeout_s = poll_timeout_s
        self.client_id = f"router-{uuid.uuid4().hex[:12]}"
        self.streams: dict[str, RequestStream] = {}
        self._adds: list[Admission] = []
        self._aborts: list[str] = []
        self._submit_task: asyncio.Task | None = None
        self._poll_task: asyncio.Task | None = None
        # Serving-path calls made, for tests and the bench (one round trip each).
        self.submit_calls = 0
        self.poll_calls = 0

    def open(self, rid: str, prompt_ids: list[int], params: SamplingParams,
             is_embedding: bool = False, group: str | None = None, **admission) -> RequestStream:
        """Queue a request for the next `submit`; its outputs (or its admission error, as a
        finished output with `error_type` set) arrive on the returned stream."""
        stream = RequestStream(self, rid)
        self.streams[rid] = stream
        self._adds.append(Admission(rid, prompt_ids, params, is_embedding, group, **admission))
        self._kick()
        if self._poll_task is None:
            self._poll_task = asyncio.ensure_future(self._poll_loop())
        return stream

    def abort(self, rid: str) -> None:
        """Forget `rid` here and abort it on the replica (in the next `submit`)."""
        if self.streams.pop(rid, None) is not None:
            self._aborts.append(rid)
            self._kick()

    def _kick(self) -> None:
        """Send what is queued now, unless a `submit` is in flight (then it goes in the next):
        a request that finds the line idle costs no event-loop turn before it leaves."""
        if self._submit_task is None:
            self._submit_task = asyncio.ensure_future(self._submit_loop(self._send()))

    def _send(self) -> tuple[list[Admission], Awaitable]:
        adds, aborts = self._adds, self._aborts
        self._adds, self._aborts = [], []
        self.submit_calls += 1
        now = time.time()
        for adm in adds:
            stream = self.streams.get(adm.rid)
            if stream is not None:
                stream.submitted_wall = now
        try:
            return adds, self.actor.submit.remote(self.client_id, adds, aborts)  # an ObjectRef: awaitable
        except Exception as exc:  # the handle refused the call: fail its admissions in the loop
            failed = asyncio.get_running_loop().create_future()
            failed.set_exception(exc)
            return adds, failed

    async def _submit_loop(self, sent: tuple[list[Admission], Awaitable]) -> None:
        try:
            while True:
                adds, reply = sent
                try:
                    replies = await reply
                except Exception as exc:  # Ray's error, or the handle's
                    self._fail(exc, [a.rid for a in adds])
                else:
                    for adm, out in zip(adds, replies):
                        stream = self.streams.get(adm.rid)
                        if stream is None:
                            continue
                        if out is None:
                            if not stream.started:  # its first output may have come first
                                stream.queue.put_nowait(ADMITTED)
                        else:  # refused: the error is the stream's only output
                            del self.streams[adm.rid]
                            stream.queue.put_nowait(out)
                if not (self._adds or self._aborts):
                    return
                sent = self._send()
        finally:
            self._submit_task = None

    async def _poll_loop(self) -> None:
        try:
            while self.streams:
                self.poll_calls += 1
                try:
                    outs = await self.actor.poll.remote(self.client_id, self.poll_timeout_s)
                except ray.exceptions.RayError as exc:
                    self._fail(exc, list(self.streams))
                    return
                self._deliver(outs)
        finally:
            self._poll_task = None

    def _deliver(self, outs: list[RequestOutput]) -> None:
        """Hand one `poll` reply to the streams."""
        for stream, out in self._first_tokens_first(outs):
            stream.queue.put_nowait(out)
            if out.finished:
                del self.streams[out.rid]

    def _first_tokens_first(self, outs: list[RequestOutput]) -> list[tuple[RequestStream, RequestOutput]]:
        """`outs` paired with their streams, the outputs of streams that have sent nothing yet
        first: a reply carries a step's outputs of every running request, and the streams woken
        first write their chunks first, so a new request's first token does not wait behind a
        whole batch of others' next tokens (its time to first token is what a user waits on).
        Each stream's own outputs keep their order. A stream's first output is stamped with when
        its admission left and when this reply came (`RequestOutput.received_wall`)."""
        first: list[tuple[RequestStream, RequestOutput]] = []
        rest: list[tuple[RequestStream, RequestOutput]] = []
        received = time.time()
        for out in outs:
            stream = self.streams.get(out.rid)
            if stream is None:
                continue  # aborted here while its outputs were on the way
            if not stream.started:
                out.submitted_wall, out.received_wall = stream.submitted_wall, received
                stream.started = True
                first.append((stream, out))
            else:
                rest.append((stream, out))
        return first + rest

    def _fail(self, exc: BaseException, rids: list[str]) -> None:
        logger.warning("replica %s: serving call failed (%s: %s); ending %d stream(s)", self.name,
                       type(exc).__name__, exc, len(rids))
        for rid in rids:
            stream = self.streams.pop(rid, None)
            if stream is not None:
                stream.queue.put_nowait(ReplicaGone(exc))

    async def aclose(self) -> None:
        """Abort every open request and stop the loops."""
        for rid in list(self.streams):
            self.abort(rid)
        if self._submit_task is not None:
            await asyncio.gather(self._submit_task, return_exceptions=True)
        if self._poll_task is not None:
            self._poll_task.cancel()
            await asyncio.gather(self._poll_task, return_exceptions=True)
