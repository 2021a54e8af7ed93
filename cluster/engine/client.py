"""What the HTTP server needs from the cluster behind it: the `ServingClient` protocol.

In production the client is the Ray router (`cluster.router`); in tests and in the embedded
single-process mode it is `LocalEngineClient`, an adapter over one in-process `Engine`.

Contract of `generate_stream` (the server relies on each point):
- Admission errors are raised before the first output: on the call itself or on the first
  `__anext__` (an async generator runs no code until then). They are `RequestError`s
  (`workers.request_errors`: invalid_request → 400 with `.param`, queue_full → 503 +
  Retry-After, unavailable → 503). The server validates `SamplingParams` itself first, so
  invalid ones are rare.
- Outputs are increments (`RequestOutput.delta_*`); the last one has `finished=True`. A request
  the replica failed finishes with `finish_reason="error"` and `error` set.
- Each output's `replica` names the replica that served it; the server labels latency metrics
  with it (`"local"` in process).
- Closing the iterator (`aclose()`, or cancelling the task iterating it) before the last output
  aborts the request on its replica and frees its KV cache. The server closes it when the HTTP
  client disconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from cluster.engine.request import ADMITTED, RESTARTED, Admitted, RequestOutput, Restarted
from workers.request_errors import Unavailable
from workers.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cluster.engine.loop import Engine


class ReplicaStatsSink(Protocol):
    """Where a client reports its replica's state (the server's `ServerMetrics`)."""

    def update_replica_stats(self, replica: str, stats: dict) -> None: ...


class NoReplicaAvailable(Unavailable):
    """No healthy replica can take the request now (the server answers 503)."""


class GenerationFailed(RuntimeError):
    """A request finished with finish_reason "error" (its replica failed it). `index`: which
    choice of a FanOut, when known."""

    def __init__(self, message: str, index: int | None = None):
        super().__init__(message)
        self.index = index


@dataclass
class HealthStatus:
    ok: bool
    detail: dict = field(default_factory=dict)


@runtime_checkable
class ServingClient(Protocol):
    model_name: str
    tokenizer: Any  # a Hugging Face tokenizer: chat template, token counting
    max_context_len: int
    vocab_size: int
    is_encoder_decoder: bool  # the prompt is the encoder's input
    matryoshka_dimensions: tuple[int, ...] | None  # the `dimensions` an embedding model allows
    embedding_size: int | None  # an embedding's length (the model's hidden size)

    def generate_stream(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        rid: str | None = None,
        is_embedding: bool = False,
        group: str | None = None,
        announce: bool = False,  # yield ADMITTED first, once the request is queued on an engine
        # The caller shows nothing until the request ends: a client with several replicas may run
        # it again on another after one fails it mid-generation, yielding RESTARTED first.
        restart: bool = False,
    ) -> AsyncIterator[RequestOutput | Admitted | Restarted]: ...

    def health(self) -> HealthStatus: ...

    async def aclose(self) -> None: ...


class LocalEngineClient:
    """A `ServingClient` over one in-process `Engine` whose loop runs in a background thread.

    Starts the engine's loop (`engine.start()`, idempotent) and owns the engine: `aclose()`
    shuts it down. With `metrics`, the replica's state (running/waiting requests, KV usage,
    prefix-cache counters) is pushed after every engine step, as the router does for its replicas.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        model_name: str | None = None,
        replica: str = "local",
        metrics: ReplicaStatsSink | None = None,
    ):
        self.engine = engine
        self.model_name = model_name or engine.config.model_name
        self.tokenizer = engine.tokenizer
        self.max_context_len = engine.max_context_len
        self.vocab_size = engine.model_config.vocab_size
        self.is_encoder_decoder = engine.model_config.is_encoder_decoder  # the prompt is the encoder's input
        self.matryoshka_dimensions = engine.model_config.matryoshka_dimensions  # `dimensions` it allows
        self.embedding_size = engine.model_config.hidden_size
        self.replica = replica
        self._metrics = metrics
        self._closed = False
        if metrics is not None:
            engine.step_listeners.append(self._on_step)
            metrics.update_replica_stats(replica, self.stats())
        engine.start()

    def stats(self) -> dict:
        """The replica-stats dict of `ServerMetrics.update_replica_stats`.

        The engine's own counters (`Engine.stats`), speculative decoding's included."""
        return self.engine.stats()

    def _on_step(self, engine: Engine, dt: float) -> None:  # runs on the engine thread
        if self._metrics is not None:
            self._metrics.update_replica_stats(self.replica, self.stats())

    async def generate_stream(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        rid: str | None = None,
        is_embedding: bool = False,
        group: str | None = None,
        announce: bool = False,
        restart: bool = False,  # (one engine: nowhere else to run it)
    ) -> AsyncIterator[RequestOutput | Admitted]:
        if self._closed:
            raise NoReplicaAvailable("the engine is shut down")
        stream = self.engine.generate_stream(prompt, params, rid=rid, is_embedding=is_embedding, group=group,
                                             announce=announce)
        try:
            async for out in stream:
                if out is not ADMITTED:
                    out.replica = self.replica
                yield out
        finally:
            # Closing the engine's generator before its last output aborts the request.
            await stream.aclose()

    def health(self) -> HealthStatus:
        alive = self.engine.alive and not self._closed
        return HealthStatus(ok=alive, detail={"replica": self.replica, "engine_loop": alive})

    @property
    def closed(self) -> bool:
        return self._closed

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._metrics is not None:
            if self._on_step in self.engine.step_listeners:
                self.engine.step_listeners.remove(self._on_step)
            self._metrics.remove_replica(self.replica)
        await asyncio.to_thread(self.engine.shutdown)


@dataclass
class ChoiceResult:
    """One request's outputs, accumulated."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    embedding: list[float] | None = None  # embedding requests: the pooled vector
    first_token_at: float | None = None  # monotonic time its first token reached this process
    last_token_at: float | None = None  # ... and its latest
    prompt_logprobs: list | None = None  # the prompt's logprobs, when the request asked
    hops: tuple[float | None, float | None] = (None, None)  # its first output's submitted/received_wall
    replica: str = ""  # the replica that sent its last output

    def add(self, out: RequestOutput) -> None:
        self.replica = out.replica or self.replica
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.received_wall is not None and self.hops[1] is None:
            self.hops = (out.submitted_wall, out.received_wall)
        if out.delta_token_ids or out.embedding is not None:
            self.last_token_at = time.monotonic()
            if self.first_token_at is None:
                self.first_token_at = self.last_token_at
        if out.embedding is not None:
            self.embedding = out.embedding
        self.text += out.delta_text
        self.token_ids += out.delta_token_ids
        self.logprobs += out.delta_logprobs
        self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
        self.completion_tokens = out.completion_tokens
        if out.finished:
            self.finish_reason = out.finish_reason


Job = tuple[str | list[int], SamplingParams]


@dataclass(frozen=True)
class EdgeTiming:
    """A request's latencies as the HTTP server saw them, from the moment it received it:
    queueing in the server, the router and the replica included (None: no token). The wall
    clock of its arrival and of its first token here, to set against the engine's."""

    ttft_s: float | None
    e2e_s: float
    arrival_wall: float | None = None
    first_token_wall: float | None = None
    # From the first output (a replica reached through Ray): when the admission left this
    # process, and when the reply with the first output came back (wall clock).
    submitted_wall: float | None = None
    received_wall: float | None = None


class FanOut:
    """Requests admitted together (the n choices of one HTTP request): `open` admits all or none,
    `outputs` merges their outputs tagged with the request's index, `aclose` aborts the unfinished.

    Whoever holds a FanOut must `aclose` it (idempotent), whether or not it iterated `outputs`.
    """

    def __init__(self, firsts: list[tuple[RequestOutput | Admitted, float]],
                 streams: list[AsyncIterator[RequestOutput | Admitted]],
                 on_finished: Callable[[RequestOutput, EdgeTiming, int], None], arrival: float,
                 on_first_token: Callable[[RequestOutput, float], None], n: int = 1,
                 on_token_gap: Callable[[RequestOutput, float], None] = lambda out, gap: None):
        self.firsts, self.streams, self._on_finished = firsts, streams, on_finished
        self.n = n  # choices per prompt: jobs i, i+1, ... i+n-1 share one (i % n == 0 the first)
        self._on_first_token, self._on_token_gap = on_first_token, on_token_gap
        self.arrival = arrival
        self.choices = [ChoiceResult() for _ in streams]
        self._tasks: list[asyncio.Future] = []
        self._closed = False

    @classmethod
    async def open(cls, client: ServingClient, jobs: list[Job], rid: str,
                   on_finished: Callable[[RequestOutput, EdgeTiming, int], None] = lambda out, timing, i: None,
                   is_embedding: bool = False, arrival: float | None = None,
                   on_first_token: Callable[[RequestOutput, float], None] = lambda out, ttft: None,
                   n: int = 1, restart: bool = False,
                   on_token_gap: Callable[[RequestOutput, float], None] = lambda out, gap: None) -> FanOut:
        """Admit every job concurrently (request ids `{rid}-{i}`) and wait until each one is
        queued on an engine (`ADMITTED`) or has its first output. If any admission fails, or
        this is cancelled, the admitted ones are aborted and the error propagates.
        `is_embedding`: the jobs are embedding requests. `arrival`: when the request reached the
        server (monotonic; default now): latencies are measured from it.
        `on_first_token(out, ttft_s)` runs when a choice's first token is handed on by `outputs`
        (a stream sends it at once; also for one its client abandons later); `on_finished(out,
        timing, i)` when choice i finishes; `on_token_gap(out, gap_s)` when an output brings a
        choice tokens after earlier ones (`gap_s` since those were handed on). `n`: consecutive
        jobs that share a prompt (its choices).
        `restart`: the outputs are collected, not streamed: a choice its replica fails
        mid-generation may run again elsewhere (what it had is then dropped)."""
        arrival = time.monotonic() if arrival is None else arrival
        streams: list[AsyncIterator[RequestOutput | Admitted]] = []
        tasks: list[asyncio.Future] = []

        async def first(s: AsyncIterator[RequestOutput | Admitted]) -> tuple[RequestOutput | Admitted, float]:
            try:
                return await anext(s), time.monotonic()
            except StopAsyncIteration:
                raise GenerationFailed("the serving client's stream ended without output") from None

        try:
            for i, (prompt, params) in enumerate(jobs):
                # The choices of one HTTP request share a group: the scheduler's fair share
                # counts them together (a request with n=64 cannot starve the others).
                streams.append(client.generate_stream(prompt, params, rid=f"{rid}-{i}", is_embedding=is_embedding,
                                                      group=rid, announce=True, restart=restart))
            if len(streams) == 1:  # the common case: no task, so no turn of the event loop
                firsts = [await first(streams[0])]
            else:
                tasks = [asyncio.ensure_future(first(s)) for s in streams]
                firsts = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await _close_all(streams)
            raise
        return cls(list(firsts), streams, on_finished, arrival, on_first_token, n, on_token_gap)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(index, output) in arrival order until every request finished; raises
        GenerationFailed when one finishes with an error. Iterate at most once."""
        if len(self.streams) == 1:  # the common case: no merging task, no queue hop per token
            async for item in self._single():
                yield item
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | Restarted | BaseException | None]] = asyncio.Queue()

        async def pump(i: int) -> None:
            got = self.firsts[i][0] is not ADMITTED
            try:
                async for out in self.streams[i]:  # ADMITTED only ever comes first
                    got |= out is not RESTARTED
                    queue.put_nowait((i, out))  # (a restart too: it voids what is queued before it)
                if not got:
                    raise GenerationFailed("the serving client's stream ended without output", index=i)
            except Exception as exc:
                queue.put_nowait((i, exc))
            finally:
                queue.put_nowait((i, None))

        for i, (first, _) in enumerate(self.firsts):
            if first is not ADMITTED:
                queue.put_nowait((i, first))
        self._tasks = [asyncio.ensure_future(pump(i)) for i in range(len(self.streams))]
        remaining = len(self.streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            if item is RESTARTED:
                self._restarted(i)
                continue
            yield self._took(i, item)

    async def _single(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        first, _ = self.firsts[0]
        if first is not ADMITTED:
            yield self._took(0, first)
            if first.finished:
                return
        # After ADMITTED, this task waits on the stream itself: the first token is handed on in
        # the turn of the event loop that brings it.
        got = first is not ADMITTED
        async for item in self.streams[0]:  # ADMITTED only ever comes first
            if item is RESTARTED:
                self._restarted(0)
                continue
            got = True
            yield self._took(0, item)
            if item.finished:
                return
        if not got:
            raise GenerationFailed("the serving client's stream ended without output", index=0)

    def _restarted(self, i: int) -> None:
        """Choice i runs again on another replica: drop what it generated (its first token's
        time, its prompt's size and the replica stay: that TTFT was counted, and an abort before
        the next output is booked there)."""
        old = self.choices[i]
        self.choices[i] = ChoiceResult(first_token_at=old.first_token_at, prompt_tokens=old.prompt_tokens,
                                       replica=old.replica)

    def _took(self, i: int, item: RequestOutput) -> tuple[int, RequestOutput]:
        """Book an output of choice i (first token, finish) before it is handed on."""
        choice = self.choices[i]
        had_token, last = choice.first_token_at is not None, choice.last_token_at
        choice.add(item)  # stamps first/last_token_at: when it is handed on (a stream sends it now)
        if not had_token and choice.first_token_at is not None:
            self._on_first_token(item, choice.first_token_at - self.arrival)
        elif last is not None and item.delta_token_ids:
            self._on_token_gap(item, choice.last_token_at - last)
        if item.finished:
            now = time.monotonic()
            first = choice.first_token_at
            wall = time.time() - (now - self.arrival)  # the arrival, on the wall clock
            self._on_finished(item, EdgeTiming(None if first is None else first - self.arrival,
                                               now - self.arrival, wall,
                                               None if first is None else wall + (first - self.arrival),
                                               *choice.hops), i)
            if item.finish_reason == "error":
                raise GenerationFailed(item.error or "the replica failed the request", index=i)
        return i, item

    async def outputs_ending_in_error(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """`outputs()`, where a choice that fails yields one last output of its own
        (finish_reason "error", so a stream says which choice ended and why) before the
        GenerationFailed is raised."""
        try:
            async for item in self.outputs():
                yield item
        except GenerationFailed as exc:
            if exc.index is not None:
                yield exc.index, RequestOutput("", finished=True, finish_reason="error", error=str(exc))
            raise

    async def collect(self) -> list[ChoiceResult]:
        async with contextlib.aclosing(self.outputs()) as outs:
            async for _ in outs:
                pass
        return self.choices

    @property
    def closed(self) -> bool:
        return self._closed

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await _close_all(self.streams)


async def _close_all(streams: list[AsyncIterator[RequestOutput]]) -> None:
    for s in streams:
        with contextlib.suppress(Exception):
            await s.aclose()  # type: ignore[attr-defined]
