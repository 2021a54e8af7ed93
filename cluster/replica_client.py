"""The HTTP server's end of one replica's serving path (the replica's end: `cluster/replica.py`
and its channel, `cluster/replica_channel.py`).

Every request the router sends to a replica goes through one `ReplicaClient`, on the server's
event loop, over one TCP connection to the replica (opened at the first request; its address
and token come from the actor through Ray):
- admissions and aborts go in one frame per round: the first at once, whatever was opened
  while a frame was unanswered in the next one; each admitted request's stream gets the
  `ADMITTED` marker when the answer comes;
- the replica sends a frame with every output of the steps that completed since its last one,
  and the client hands each to its request's stream (an asyncio queue) in the turn of the loop
  that reads it.
So the messages per second depend on the engine's step rate, not on how many requests run, and
an idle server sends and wakes for nothing.

A connection that fails or closes (the replica actor died or cannot be reached) ends every open
stream of this client with `ReplicaGone`; the router decides what to retry, and the next request
connects again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator

from cluster.engine.request import ADMITTED, Admitted, RequestOutput
from cluster.replica import Admission
from cluster.replica_channel import decode_frame, keepalive
from workers.sampling_params import SamplingParams
from workers.step_channel import FRAME_LEN, encode

logger = logging.getLogger(__name__)


class ReplicaGone(RuntimeError):
    """The replica's serving path failed (`cause`: Ray's error when its actor could not say
    where to connect, else the connection's)."""

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


class _Connection(asyncio.Protocol):
    """One serving channel as the event loop sees it: frames out, and each frame in handed to
    the client in the callback that read its last bytes."""

    def __init__(self, client: ReplicaClient):
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.error: Exception | None = None  # why we ended it, when we did
        self._buf = bytearray()

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            keepalive(sock)

    def send(self, obj) -> None:
        payload = encode(obj)
        assert self.transport is not None
        self.transport.write(FRAME_LEN.pack(len(payload)) + payload)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        while len(buf) >= FRAME_LEN.size:
            (n,) = FRAME_LEN.unpack_from(buf)
            end = FRAME_LEN.size + n
            if len(buf) < end:
                return
            msg = decode_frame(bytes(buf[FRAME_LEN.size:end]))
            del buf[:end]
            self.client._on_frame(msg)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.client._on_lost(self, exc)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def fail(self, error: Exception) -> None:
        """End the connection now (unsent data dropped); the client hears `error`."""
        self.error = error
        if self.transport is not None:
            self.transport.abort()


class ReplicaClient:
    def __init__(self, name: str, actor, connect_timeout_s: float = 30.0, answer_timeout_s: float = 20.0):
        self.name, self.actor = name, actor
        # An admission frame unanswered for answer_timeout_s means a replica that stopped
        # serving without closing the connection: it is ended, and its streams with it.
        self.connect_timeout_s, self.answer_timeout_s = connect_timeout_s, answer_timeout_s
        self._answer_timer: asyncio.TimerHandle | None = None
        self.streams: dict[str, RequestStream] = {}
        self._adds: list[Admission] = []
        self._aborts: list[str] = []
        self._conn: _Connection | None = None
        self._connecting: asyncio.Task | None = None
        self._unanswered: deque[list[Admission]] = deque()  # frames sent, in order, not answered yet
        # Serving-path messages, for tests and the bench.
        self.submit_calls = 0
        self.output_messages = 0

    def open(self, rid: str, prompt_ids: list[int], params: SamplingParams,
             is_embedding: bool = False, group: str | None = None, **admission) -> RequestStream:
        """Queue a request for the next admission frame; its outputs (or its admission error, as
        a finished output with `error_type` set) arrive on the returned stream."""
        stream = RequestStream(self, rid)
        self.streams[rid] = stream
        self._adds.append(Admission(rid, prompt_ids, params, is_embedding, group, **admission))
        self._kick()
        return stream

    def fail(self, error: Exception) -> None:
        """End the serving connection now: its streams end with `error` (a request with no
        output yet as unavailable, which the router retries elsewhere)."""
        if self._conn is not None:
            self._conn.fail(error)

    def abort(self, rid: str) -> None:
        """Forget `rid` here and abort it on the replica (in the next frame)."""
        if self.streams.pop(rid, None) is not None:
            self._aborts.append(rid)
            self._kick()

    def _kick(self) -> None:
        """Send what is queued now, unless a frame is unanswered (then it goes when the answer
        comes): a request that finds the line idle leaves inside the caller's own turn of the
        loop, and a burst goes in a few frames, not one per request."""
        if self._unanswered or not (self._adds or self._aborts):
            return
        if self._conn is None:
            if self._connecting is None:
                self._connecting = asyncio.ensure_future(self._connect())
            return
        adds, aborts = self._adds, self._aborts
        self._adds, self._aborts = [], []
        self.submit_calls += 1
        now = time.time()
        for adm in adds:
            stream = self.streams.get(adm.rid)
            if stream is not None:
                stream.submitted_wall = now
        self._unanswered.append(adds)
        self._conn.send((adds, aborts))
        if self._answer_timer is None:
            self._answer_timer = asyncio.get_running_loop().call_later(
                self.answer_timeout_s, self._answer_overdue, self._conn)

    def _answer_overdue(self, conn: _Connection) -> None:
        self._answer_timer = None
        if conn is self._conn and self._unanswered:
            logger.warning("replica %s: an admission frame unanswered for %g s; ending its connection",
                           self.name, self.answer_timeout_s)
            conn.fail(TimeoutError(f"replica {self.name} did not answer an admission in {self.answer_timeout_s:g} s"))

    def _stop_timer(self) -> None:
        if self._answer_timer is not None:
            self._answer_timer.cancel()
            self._answer_timer = None

    async def _connect(self) -> None:
        """Open the channel (the actor says where), then send what queued meanwhile; on failure
        end the streams that waited for it."""
        conn = None
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                host, port, token = await self.actor.serving_channel.remote()
                _, conn = await asyncio.get_running_loop().create_connection(lambda: _Connection(self), host, port)
            if conn.lost:
                raise ConnectionError(f"replica {self.name} closed its serving channel at once")
            conn.transport.write(token)
        except Exception as exc:  # Ray's error (the actor died), or the connection's
            if conn is not None:
                conn.close()
            waiting = [a.rid for a in self._adds]
            self._adds, self._aborts = [], []  # aborts of a replica we cannot reach: nothing to do
            self._fail(exc, waiting)
            return
        finally:
            self._connecting = None
        self._conn = conn
        self._kick()

    def _on_frame(self, msg: tuple) -> None:
        kind, body = msg
        if kind == "outputs":
            self.output_messages += 1
            self._deliver(body)
            return
        # "submitted": the answer to the oldest unanswered frame, one entry per admission
        self._stop_timer()
        adds = self._unanswered.popleft()
        for adm, out in zip(adds, body):
            stream = self.streams.get(adm.rid)
            if stream is None:
                continue
            if out is None:
                if not stream.started:  # its first output may have come first
                    stream.queue.put_nowait(ADMITTED)
            else:  # refused: the error is the stream's only output
                del self.streams[adm.rid]
                stream.queue.put_nowait(out)
        self._kick()

    def _on_lost(self, conn: _Connection, exc: Exception | None) -> None:
        if conn is not self._conn:
            return
        self._reset()
        if self.streams:
            why = conn.error or exc or ConnectionError(f"replica {self.name} closed its serving channel")
            self._fail(why, list(self.streams))

    def _reset(self) -> None:
        """Forget the connection and what was queued for it (its replica aborts what it owned)."""
        self._stop_timer()
        self._conn = None
        self._unanswered.clear()
        self._adds, self._aborts = [], []

    def _deliver(self, outs: list[RequestOutput]) -> None:
        """Hand one frame of outputs to the streams."""
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

    async def aclose(self, reason: str = "its replica client was closed") -> None:
        """Abort every open request (their streams end with `ReplicaGone(reason)`) and close
        the connection; the client may be used again (it connects anew)."""
        streams = list(self.streams.values())
        for stream in streams:
            self.abort(stream.rid)  # sent now where the line is idle; else the replica aborts at the close
        for stream in streams:
            stream.queue.put_nowait(ReplicaGone(ConnectionError(f"replica {self.name}: {reason}")))
        if self._connecting is not None:
            self._connecting.cancel()
            await asyncio.gather(self._connecting, return_exceptions=True)
            self._connecting = None
        conn = self._conn
        self._reset()
        if conn is not None:
            conn.close()  # what was written goes first
