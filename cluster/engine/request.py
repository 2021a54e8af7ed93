"""A request as the scheduler sees it, and what the engine reports back for it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, fields
from typing import Any

from cluster.engine.kv_allocator import RequestKV
from workers.messages import TokenLogprobs
from workers.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # the client went away or asked
    ERROR = "error"  # the replica failed the request


# The input id of a decode piece whose token is still being sampled by the step in flight: the
# worker reads the real id from its device-side buffer of each row's last sampled token.
PENDING_TOKEN = -1


@dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    is_embedding: bool = False
    group: str | None = None  # requests sharing one fair share (the choices of one HTTP request); None: its own
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None  # why the replica failed it (finish_reason ERROR)
    # KV bookkeeping while running (None while waiting).
    kv: RequestKV | None = None
    req_pool_idx: int = -1
    prefix_node: Any = None  # radix node locked for this request's cached prefix
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    # Prompt logprobs (params.prompt_logprobs): position i holds token i's given those before
    # it (position 0: None), filled as the prefill pieces complete; sent with the first output.
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    num_preemptions: int = 0
    # Wall-clock marks for metrics.
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_wall: float = field(default_factory=time.time)  # the same moment, wall clock (across processes)
    scheduled_time: float | None = None  # first admitted into the running batch
    first_token_time: float | None = None
    finish_time: float | None = None
    aborted: bool = False
    # Encoder-decoder (cluster/engine/encoder_decoder.py): the encoder input (the user's prompt; then
    # prompt_ids is the decoder's start) and its KV pages while running.
    encoder_ids: list[int] | None = None
    encoder_pages: list[int] = field(default_factory=list)
    # Overlapped scheduling (cluster/engine/scheduler.py): output tokens still being sampled by a step
    # in flight; they sit at the end of output_ids as PENDING_TOKEN until the result arrives.
    pending: int = 0
    # The id of the latest plan that computes this request's tokens (its K/V written there):
    # pages it wrote are settled once that plan's result is read (Scheduler.done_step).
    last_step: int = 0
    # Prefill/decode disaggregation: a prefill replica saves the prompt's pages for a decode
    # replica to read (`hand_off`); a decode replica reads them from `kv_source` (a
    # workers.kv_messages.KVSource) and continues from the first token (in output_ids).
    hand_off: bool = False
    kv_source: Any = None
    resumed: int = 0  # output tokens it came with (`resume_ids`): none of them is this replica's

    @property
    def num_output_tokens(self) -> int:
        """Output tokens known so far (without the ones still in flight)."""
        return len(self.output_ids) - self.pending

    @property
    def known_ids(self) -> list[int]:
        """Prompt and output tokens known so far (all_ids without the in-flight placeholders)."""
        return self.prompt_ids + self.output_ids[: self.num_output_tokens]

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens of the user's prompt: the encoder input of an encoder-decoder request."""
        return len(self.encoder_ids) if self.encoder_ids is not None else len(self.prompt_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def ids_slice(self, start: int, stop: int) -> list[int]:
        """all_ids[start:stop] without building all_ids (a decode step takes one token of a
        long context: concatenating it every step cost O(context) per request)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n : stop - n]
        if stop <= n:
            return self.prompt_ids[start:stop]
        return self.prompt_ids[start:] + self.output_ids[: stop - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_computed(self) -> int:
        """Tokens whose K/V is in the cache."""
        return self.kv.num_tokens if self.kv is not None else 0

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def final_output(self, reason: str, error: str | None = None, error_type: str | None = None) -> RequestOutput:
        """The one output of a request ended outside a step (aborted, or its replica failed)."""
        return RequestOutput(rid=self.rid, finished=True, finish_reason=reason, error=error, error_type=error_type,
                             prompt_tokens=self.num_prompt_tokens, completion_tokens=self.num_output_tokens,
                             cached_tokens=self.cached_tokens)

    def stamp_finish(self, out: RequestOutput, now: float) -> None:
        """Mark `out` as this finished request's last output, with its reason and timings."""
        self.finish_time = now
        out.finished = True
        out.finish_reason = self.finish_reason.value if self.finish_reason else None
        if self.finish_reason == FinishReason.ERROR:
            out.error, out.error_type = self.error or "the replica failed the request", "internal"
        out.ttft_s = (self.first_token_time or now) - self.arrival_time
        out.e2e_s = now - self.arrival_time
        out.queue_s = (self.scheduled_time or now) - self.arrival_time
        out.arrival_wall = self.arrival_wall
        if self.first_token_time is not None:
            out.first_token_wall = self.arrival_wall + (self.first_token_time - self.arrival_time)


@dataclass
class RequestOutput:
    """One increment of a request's result, as the engine emits it (and a replica streams it)."""

    rid: str
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    # Set with `error` on a request refused at admission by a remote replica, so the router
    # can raise the same typed error the in-process engine raises: "invalid_request" (with
    # error_param naming the field), "queue_full", "unavailable" or "internal".
    error_type: str | None = None
    error_param: str | None = None
    embedding: list[float] | None = None
    # The prompt's logprobs (the request asked: params.prompt_logprobs), whole, on the first output.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Which replica served the request (set by the router); `first_replica`, on a disaggregated
    # request's final output, the one that made its first token (its timings below are that one's).
    replica: str = "local"
    first_replica: str | None = None
    # Seconds from the engine's arrival, filled when finished (for metrics and clients that ask):
    # to the first token, to the last, and waiting in the engine's queue before the first step.
    ttft_s: float | None = None
    e2e_s: float | None = None
    queue_s: float | None = None
    # Wall-clock times (time.time()) of the engine receiving the request and emitting its first
    # token, filled when finished: the server splits its edge latency with them (same host, or
    # clocks in sync).
    arrival_wall: float | None = None
    first_token_wall: float | None = None
    # Stamped in the HTTP server by its `ReplicaClient` on a request's first output (wall clock):
    # when the request's admission left for the replica, and when the reply carrying this output
    # came back. They split the serving path's two hops between the server and the transport,
    # and never cross a process (`__reduce__` leaves them out: they come last).
    submitted_wall: float | None = None
    received_wall: float | None = None

    def __reduce__(self):
        # Positional, not a __dict__: a step's outputs cross to the server in one message, and
        # unpickling 200 of them this way takes ~0.2 ms instead of ~1.8 ms on its event loop.
        return (RequestOutput, tuple(getattr(self, f) for f in _OUTPUT_FIELDS))


_SERVER_STAMPS = ("submitted_wall", "received_wall")
_OUTPUT_FIELDS = tuple(f.name for f in fields(RequestOutput) if f.name not in _SERVER_STAMPS)
assert _OUTPUT_FIELDS + _SERVER_STAMPS == tuple(f.name for f in fields(RequestOutput))  # positional: stamps last


@dataclass
class GenerationResult:
    """A finished request, assembled from its outputs (offline API)."""

    rid: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    embedding: list[float] | None = None
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def add(self, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.text += out.delta_text
        self.token_ids += out.delta_token_ids
        self.logprobs += out.delta_logprobs
        self.prompt_tokens = out.prompt_tokens
        self.cached_tokens = out.cached_tokens
        if out.embedding is not None:
            self.embedding = out.embedding
        if out.finished:
            self.finish_reason = out.finish_reason
            self.error = out.error


class Admitted:
    """The marker a stream yields first (at most once, never after an output), when its caller
    asked (`announce=True`), once its request is queued on an engine: admission can no longer fail with an HTTP status (invalid, queue
    full, no replica), so a streamed response may send its headers and wait on the stream for
    the first token itself. The first token then reaches the client in the event-loop turn that
    receives it, not after the turns that hand a finished "wait for the first output" on
    (each of which queues behind every other stream's chunk of that step)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "ADMITTED"


ADMITTED = Admitted()


class Restarted:
    """The marker a stream yields, when its caller allowed it (`restart=True`: nothing it
    received has reached the client yet, as for a response that is not streamed), after the
    replica serving it failed mid-generation: what came before is void, and the request runs
    again from its prompt on another replica."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "RESTARTED"


RESTARTED = Restarted()
