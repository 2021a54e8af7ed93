"""The OpenAI-compatible HTTP server (FastAPI) in front of a `ServingClient`.

One request's path: parse and validate the JSON body (`cluster.api.protocol`), tokenize (chat
template for chat), build one `SamplingParams` per choice (n > 1 fans out, seeded seed + i) and
validate it, admit every choice (`_open`: all admission errors surface here, before any byte of
the response is sent, so they become proper 4xx/5xx), then merge the choices' outputs into one
JSON body or one SSE stream.

Cancellation: a client that disconnects aborts its requests. Streaming responses watch for
`http.disconnect` beside the stream (`_SSEResponse`); non-streaming ones run under
`_until_disconnect`. Either way the client's iterators are closed, which aborts on the replica.

Errors: every 4xx/5xx carries the OpenAI body `{"error": {message, type, param, code}}` and is
counted in `manta:request_errors_total{code}`. An error after a stream has started is sent as
one `data: {"error": ...}` event before `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import re
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.api import protocol as P
from cluster.api.deadline import RequestTimedOut, stamp, stream_within, within
from cluster.api.embeddings import EmbeddingRequest, check_dimensions, embedding_response
from cluster.api.errors import APIError, as_api_error
from cluster.api.metrics import CONTENT_TYPE, ServerMetrics
from cluster.api.shutdown import ServerShuttingDown, ShutdownGate
from cluster.engine.client import (
    ChoiceResult,
    EdgeTiming,
    FanOut,
    GenerationFailed,
    NoReplicaAvailable,
    ServingClient,
)
from cluster.engine.request import RequestOutput
from cluster.engine.scheduler import QueueFull, RequestRejected
from workers.sampling_params import SamplingParams, SamplingParamsError

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


class _ClientGone(Exception):
    """The HTTP client disconnected before its non-streaming answer was ready."""


# Exceptions that are answers (4xx/5xx with a message), not bugs.
_EXPECTED = (APIError, SamplingParamsError, RequestRejected, QueueFull, NoReplicaAvailable, ValidationError,
             GenerationFailed, _ClientGone, RequestTimedOut, ServerShuttingDown)


# JSON leaves U+0085, U+2028 and U+2029 unescaped, and line readers built on str.splitlines
# (httpx's `aiter_lines` among them) end an SSE line there, cutting the event's JSON in two.
# They can only occur inside JSON strings, where their escapes mean the same.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse(obj: BaseModel | dict) -> str:
    data = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {data.translate(_LINE_BREAKS)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _until_disconnect(request: Request, work: Awaitable[Any], gate: ShutdownGate) -> Any:
    """Await `work`, cancelling it and raising _ClientGone if the client goes away first, or
    ServerShuttingDown at the server's shutdown deadline."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_wait_disconnect(request))
    stop = asyncio.ensure_future(gate.stopped.wait())
    try:
        done, _ = await asyncio.wait({task, watch, stop}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        if stop in done:
            raise ServerShuttingDown("the server shut down before the request finished")
        raise _ClientGone()
    finally:
        for t in (task, watch, stop):
            t.cancel()
        await asyncio.gather(task, watch, stop, return_exceptions=True)


class _SSEResponse(StreamingResponse):
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
                    body = (_sse(err.body()) + SSE_DONE).encode()
                    await asyncio.wait_for(send({"type": "http.response.body", "body": body, "more_body": False}), 1.0)
        finally:
            # The client left: its disconnect arrived, or sending to it failed.
            gone = watch.done() or (stream.done() and not stream.cancelled() and stream.exception() is not None)
            for t in (stream, watch, stop):
                t.cancel()
            await asyncio.gather(stream, watch, stop, return_exceptions=True)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self._on_close(gone)


def _usage(choices: list[ChoiceResult], n: int) -> P.Usage:
    """Prompt tokens count once per prompt (choices [k*n, (k+1)*n) share prompt k)."""
    firsts = choices[::n]
    return P.Usage.of(sum(c.prompt_tokens for c in firsts), sum(c.completion_tokens for c in choices),
                      sum(c.cached_tokens for c in firsts))


class _Serving:
    def __init__(self, client: ServingClient, metrics: ServerMetrics, gate: ShutdownGate):
        self.client, self.metrics, self.gate = client, metrics, gate
        self.created = int(time.time())
        self.decode = functools.lru_cache(maxsize=1 << 16)(self._decode_one)

    def _decode_one(self, tok: int) -> str:
        return self.client.tokenizer.decode([tok], skip_special_tokens=False)

    # ---------------- request preparation ----------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.client.model_name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves "
                           f"'{self.client.model_name}'", param="model", code="model_not_found")

    def prompt_ids(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            return list(self.client.tokenizer(prompt).input_ids)
        vocab = self.client.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of range [0, {vocab})", param=param)
        return list(prompt)

    @property
    def _encoder_decoder(self) -> bool:
        return bool(getattr(self.client, "is_encoder_decoder", False))

    def default_max_tokens(self, n_prompt: int) -> int:
        """What a request may generate when it names no limit."""
        if self._encoder_decoder:  # the decoder starts from one token, whatever the prompt's length
            return self.client.max_context_len - 1
        return self.client.max_context_len - n_prompt

    def check_context(self, n_prompt: int, max_tokens: int | None, param: str = "max_tokens",
                      prompt_param: str = "prompt") -> None:
        limit = self.client.max_context_len
        if self._encoder_decoder:
            # The prompt is the encoder's input; the decoder has positions of its own.
            if n_prompt > limit:
                raise APIError(400, f"This model's encoder takes at most {limit} tokens, but the prompt has "
                               f"{n_prompt} tokens", param=prompt_param, code="context_length_exceeded")
            if max_tokens is not None and 1 + max_tokens > limit:
                raise APIError(400, f"This model's decoder context is {limit} tokens; you requested "
                               f"{max_tokens} tokens to generate after its start token", param=param,
                               code="context_length_exceeded")
            return
        if n_prompt >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens, but the prompt "
                           f"has {n_prompt} tokens (at least one token must be generated)",
                           param=prompt_param, code="context_length_exceeded")
        if max_tokens is not None and n_prompt + max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens; you requested "
                           f"{n_prompt + max_tokens} ({n_prompt} in the prompt, {max_tokens} to generate)",
                           param=param, code="context_length_exceeded")

    async def open(self, request: Request, jobs: list[tuple[list[int], SamplingParams]], rid: str,
                   is_embedding: bool = False) -> FanOut:
        def finished(out: RequestOutput, edge: EdgeTiming) -> None:
            self.metrics.observe_finished(out.replica, out, edge)

        def first_token(out: RequestOutput, ttft_s: float) -> None:
            self.metrics.observe_first_token(out.replica, ttft_s)

        try:
            fan = await _until_disconnect(request, within(request.state, FanOut.open(
                self.client, list(jobs), rid, finished, is_embedding, arrival=request.state.arrival,
                on_first_token=first_token)), self.gate)
            self.gate.enter()  # left in close(): the shutdown waits for it, up to its deadline
            return fan
        except (_ClientGone, RequestTimedOut) as exc:  # FanOut.open aborted what it had admitted
            self.metrics.record_aborts("client_gone" if isinstance(exc, _ClientGone) else "timeout", len(jobs))
            raise

    async def close(self, request: Request, fan: FanOut, client_gone: bool = False) -> None:
        """Close `fan`, aborting its unfinished requests (their KV pages are freed at once), and
        count them in `manta:request_aborts_total` by why they were cut short."""
        if fan.closed:
            return
        unfinished = sum(1 for c in fan.choices if c.finish_reason is None)
        if unfinished:
            reason = ("timeout" if getattr(request.state, "timed_out", False)
                      else "client_gone" if client_gone else "shutdown" if self.gate.stopped.is_set() else "error")
            self.metrics.record_aborts(reason, unfinished)
        await fan.aclose()
        self.gate.leave()

    async def collect(self, request: Request, fan: FanOut) -> list[ChoiceResult]:
        """Every choice of `fan`, within the deadline and while the client waits; closes `fan`."""
        gone = False
        try:
            return await _until_disconnect(request, within(request.state, fan.collect()), self.gate)
        except _ClientGone:
            gone = True
            raise
        finally:
            await self.close(request, fan, gone)

    async def answer(self, request: Request, fan: FanOut, stream: bool,
                     events: Callable[[FanOut], AsyncIterator[str]],
                     build: Callable[[list[ChoiceResult]], BaseModel | dict]) -> Response:
        """Stream `events(fan)` as SSE, or collect the choices and return `build(choices)`."""
        if stream:
            return _SSEResponse(self._guarded(stream_within(request.state, events(fan))),
                                functools.partial(self.close, request, fan), self.gate)
        body = build(await self.collect(request, fan))
        return Response(body.model_dump_json() if isinstance(body, BaseModel) else json.dumps(body),
                        media_type="application/json")

    async def _guarded(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """An error after the stream started is one error event, then [DONE]."""
        try:
            async with contextlib.aclosing(events) as evs:  # type: ignore[type-var]
                async for ev in evs:
                    yield ev
        except Exception as exc:
            err = as_api_error(exc)
            if err.status >= 500 and not isinstance(exc, APIError):
                logger.exception("stream failed")
            self.metrics.record_error(err.status)
            yield _sse(err.body())
        yield SSE_DONE

    # ---------------- /v1/completions ----------------
    async def completions(self, request: Request, body: Any) -> Response:
        req = _parse(P.CompletionRequest, body)
        req.check_supported()
        self.check_model(req.model)
        jobs = []
        for ids in map(self.prompt_ids, req.prompts()):
            for j in range(req.n):
                params = req.sampling_params(seed_offset=j).validate(self.client.vocab_size)
                self.check_context(len(ids), params.max_tokens)
                jobs.append((ids, params))
        cid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.client.model_name
        want_lp = req.logprobs is not None
        fan = await self.open(request, jobs, cid)

        async def events(fan: FanOut) -> AsyncIterator[str]:
            offsets = [0] * len(jobs)
            async for i, out in fan.outputs_ending_in_error():
                if not (out.delta_text or out.delta_token_ids or out.finished):
                    continue
                lp = None
                if want_lp:
                    lp, offsets[i] = P.completion_logprobs(out.delta_token_ids, out.delta_logprobs,
                                                           self.decode, offsets[i])
                choice = P.CompletionChoice(index=i, text=out.delta_text, logprobs=lp,
                                            finish_reason=out.finish_reason if out.finished else None)
                usage = _usage(fan.choices, req.n) if req.continuous_usage else None
                yield _sse(P.CompletionChunk(id=cid, created=created, model=model, choices=[choice], usage=usage))
            if req.include_usage:
                yield _sse(P.CompletionChunk(id=cid, created=created, model=model, choices=[],
                                             usage=_usage(fan.choices, req.n)))

        def build(choices: list[ChoiceResult]) -> P.CompletionResponse:
            out = []
            for i, c in enumerate(choices):
                lp = P.completion_logprobs(c.token_ids, c.logprobs, self.decode, 0)[0] if want_lp else None
                out.append(P.CompletionChoice(index=i, text=c.text, logprobs=lp, finish_reason=c.finish_reason))
            return P.CompletionResponse(id=cid, created=created, model=model, choices=out,
                                        usage=_usage(choices, req.n))

        return await self.answer(request, fan, req.stream, events, build)

    # ---------------- /v1/chat/completions ----------------
    async def chat(self, request: Request, body: Any) -> Response:
        req = _parse(P.ChatCompletionRequest, body)
        req.check_supported()
        self.check_model(req.model)
        ids = P.render_chat(self.client.tokenizer, req.chat_dicts())
        requested = req.requested_max_tokens()
        self.check_context(len(ids), None, prompt_param="messages")
        max_tokens = requested if requested is not None else self.default_max_tokens(len(ids))
        jobs = []
        for j in range(req.n):
            try:
                params = req.sampling_params(max_tokens, seed_offset=j).validate(self.client.vocab_size)
            except SamplingParamsError as exc:
                renamed = {"max_tokens": req.max_tokens_param, "logprobs": "top_logprobs"}.get(exc.param)
                if renamed is None:
                    raise
                raise SamplingParamsError(renamed, str(exc).split(": ", 1)[-1]) from None
            jobs.append((ids, params))
        self.check_context(len(ids), max_tokens, req.max_tokens_param, "messages")
        cid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.client.model_name
        fan = await self.open(request, jobs, cid)

        def chunk(choices: list[P.ChatChunkChoice], usage: P.Usage | None = None) -> str:
            return _sse(P.ChatCompletionChunk(id=cid, created=created, model=model, choices=choices, usage=usage))

        async def events(fan: FanOut) -> AsyncIterator[str]:
            for i in range(len(jobs)):
                yield chunk([P.ChatChunkChoice(index=i, delta=P.DeltaMessage(role="assistant", content=""))])
            async for i, out in fan.outputs_ending_in_error():
                if not (out.delta_text or out.delta_token_ids or out.finished):
                    continue
                lp = P.chat_logprobs(out.delta_token_ids, out.delta_logprobs, self.decode) if req.logprobs else None
                yield chunk([P.ChatChunkChoice(index=i, delta=P.DeltaMessage(content=out.delta_text), logprobs=lp,
                                               finish_reason=out.finish_reason if out.finished else None)],
                            _usage(fan.choices, req.n) if req.continuous_usage else None)
            if req.include_usage:
                yield chunk([], _usage(fan.choices, req.n))

        def build(choices: list[ChoiceResult]) -> P.ChatCompletionResponse:
            out = [P.ChatChoice(index=i, message=P.AssistantMessage(content=c.text), finish_reason=c.finish_reason,
                                logprobs=P.chat_logprobs(c.token_ids, c.logprobs, self.decode) if req.logprobs else None)
                   for i, c in enumerate(choices)]
            return P.ChatCompletionResponse(id=cid, created=created, model=model, choices=out,
                                            usage=_usage(choices, req.n))

        return await self.answer(request, fan, req.stream, events, build)

    # ---------------- /v1/embeddings ----------------
    async def embeddings(self, request: Request, body: Any) -> Response:
        """One embedding request per input (prefill only, pooled on the ranks)."""
        req = _parse(EmbeddingRequest, body)
        self.check_model(req.model)
        limit, jobs = self.client.max_context_len, []
        matryoshka = getattr(self.client, "matryoshka_dimensions", None)
        size = getattr(self.client, "embedding_size", None)
        if req.dimensions is not None and size is not None:  # refused before anything is computed
            check_dimensions(req.dimensions, size, matryoshka)
        params = SamplingParams(max_tokens=1).validate(self.client.vocab_size)
        for i, ids in enumerate(self.prompt_ids(x, param="input") for x in req.inputs()):
            if len(ids) > limit:
                raise APIError(400, f"This model's maximum context length is {limit} tokens, but input {i} "
                               f"has {len(ids)} tokens", param="input", code="context_length_exceeded")
            jobs.append((ids, params))
        fan = await self.open(request, jobs, f"embd-{uuid.uuid4().hex}", is_embedding=True)
        choices = await self.collect(request, fan)
        out = embedding_response(req, choices, self.client.model_name, matryoshka)
        return Response(out.model_dump_json(), media_type="application/json")

    # ---------------- /generate (native) ----------------
    async def generate(self, request: Request, body: Any) -> Response:
        req = _parse(P.GenerateRequest, body)
        try:
            params = req.params().validate(self.client.vocab_size)
        except SamplingParamsError as exc:
            if exc.param.startswith("sampling_params."):
                raise
            raise SamplingParamsError(f"sampling_params.{exc.param}", str(exc).split(": ", 1)[-1]) from None
        except TypeError as exc:  # a sampling_params value of a type SamplingParams cannot take
            raise APIError(400, f"invalid sampling_params: {exc}", param="sampling_params") from None
        ids = self.prompt_ids(req.prompt())
        self.check_context(len(ids), params.max_tokens, "sampling_params.max_tokens")
        rid = req.rid or f"gen-{uuid.uuid4().hex}"
        fan = await self.open(request, [(ids, params)], rid)

        def meta(c: ChoiceResult, finish_reason: str | None) -> dict:
            m = {"id": rid, "prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
                 "cached_tokens": c.cached_tokens, "finish_reason": finish_reason}
            if params.logprobs is not None:
                m["output_token_logprobs"] = [[lp.token_logprob if lp else None, t]
                                              for t, lp in zip(c.token_ids, c.logprobs)]
            return m

        async def events(fan: FanOut) -> AsyncIterator[str]:
            async for _, out in fan.outputs_ending_in_error():
                if out.delta_text or out.delta_token_ids or out.finished:
                    yield _sse({"text": out.delta_text, "output_ids": out.delta_token_ids,
                                "meta_info": meta(fan.choices[0], out.finish_reason if out.finished else None)})

        def build(choices: list[ChoiceResult]) -> dict:
            c = choices[0]
            return {"text": c.text, "output_ids": c.token_ids, "meta_info": meta(c, c.finish_reason)}

        return await self.answer(request, fan, req.stream, events, build)


def _parse(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return model.model_validate(body)  # ValidationError -> 400 naming the field (as_api_error)


async def _read_json(request: Request, max_bytes: int) -> Any:
    too_big = APIError(413, f"the request body is larger than {max_bytes} bytes", param=None,
                       code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise too_big
    buf, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_big
        buf.append(chunk)
    raw = b"".join(buf)
    try:
        body = json.loads(raw)
        # An escaped lone surrogate ("\ud800") parses into a str that is not text: the
        # tokenizer would fail on it. Paired surrogates are fine; check only when one appears.
        if _SURROGATE_ESCAPE.search(raw):
            json.dumps(body, ensure_ascii=False).encode()
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError and UnicodeEncodeError
        raise APIError(400, f"the request body is not valid JSON text: {exc}") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    return body


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def build_app(client: ServingClient, metrics: ServerMetrics, api_key: str | None = None, *,
              metrics_public: bool = False, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              request_timeout_s: float | None = None, admin=None, gate: ShutdownGate | None = None) -> FastAPI:
    """The HTTP app. With `api_key`, every route but /health (and /metrics when `metrics_public`)
    needs `Authorization: Bearer <api_key>`. With `request_timeout_s`, a POST request (reading its
    body included) that runs longer is aborted and answered 504 (`cluster.api.deadline`). With
    `admin` (the `ServingCluster` behind `client`), the operator routes of `cluster.api.admin`.
    The app does not close `client`: its owner does."""
    app = FastAPI(title="manta", docs_url=None, redoc_url=None, openapi_url=None)
    gate = gate if gate is not None else ShutdownGate()
    app.state.gate = gate
    serving = _Serving(client, metrics, gate)

    def error_response(err: APIError) -> Response:
        metrics.record_error(err.status)
        return Response(json.dumps(err.body()), status_code=err.status, headers=err.headers,
                        media_type="application/json")

    async def on_error(request: Request, exc: Exception) -> Response:
        # Unexpected exceptions of the POST routes were logged by `handle`; any others reach
        # here through Starlette's ServerErrorMiddleware, which logs them after this answer.
        return error_response(as_api_error(exc))

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(APIError(exc.status_code, str(exc.detail), kind, headers=exc.headers))

    async def on_gone(request: Request, exc: _ClientGone) -> Response:
        metrics.record_error(499)  # nginx's "client closed request"; nobody reads the body
        return Response(status_code=499)

    for exc_type in (*_EXPECTED, RequestValidationError, Exception):
        app.add_exception_handler(exc_type, on_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(_ClientGone, on_gone)  # after the loop: replaces on_error

    async def require_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    async def handle(endpoint: Callable[[Request, Any], Awaitable[Response]], request: Request) -> Response:
        if getattr(request.state, "arrival", None) is None:  # a server without the stamp (tests)
            request.state.arrival = time.monotonic()
        gate.check_open()
        stamp(request.state, request_timeout_s)
        try:
            return await endpoint(request, await within(request.state, _read_json(request, max_body_bytes)))
        except _EXPECTED:
            raise
        except Exception as exc:
            logger.exception("unexpected error on %s", request.url.path)
            raise APIError(500, "internal server error", "server_error") from exc

    guarded = APIRouter(dependencies=[Depends(require_key)])
    metrics_router = APIRouter() if metrics_public else guarded
    if admin is not None:
        from cluster.api.admin import add_admin_routes

        add_admin_routes(guarded, admin)

    @app.get("/health")
    async def health() -> Response:
        status = client.health()
        if not status.ok:
            raise APIError(503, f"unhealthy: {json.dumps(status.detail, default=str)}",
                           "service_unavailable", code="unhealthy")
        return Response(json.dumps({"status": "ok"}), media_type="application/json")

    @metrics_router.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def card() -> P.ModelCard:
        return P.ModelCard(id=client.model_name, created=serving.created, root=client.model_name,
                           max_model_len=client.max_context_len)

    @guarded.get("/openapi.json")
    async def openapi_document() -> Response:
        from cluster.api.openapi import openapi_schema

        return Response(json.dumps(openapi_schema()), media_type="application/json")

    @guarded.get("/v1/models")
    async def list_models() -> Response:
        return Response(P.ModelList(data=[card()]).model_dump_json(), media_type="application/json")

    @guarded.get("/v1/models/{model:path}")
    async def get_model(model: str) -> Response:
        serving.check_model(model)
        return Response(card().model_dump_json(), media_type="application/json")

    @guarded.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(serving.completions, request)

    @guarded.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(serving.chat, request)

    @guarded.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await handle(serving.embeddings, request)

    @guarded.post("/generate")
    async def generate(request: Request) -> Response:
        return await handle(serving.generate, request)

    app.include_router(guarded)
    if metrics_public:
        app.include_router(metrics_router)
    app.add_middleware(_ArrivalStamp)
    return app


class _ArrivalStamp:
    """Stamps each HTTP request with the moment the server got it (`request.state.arrival`),
    before routing and before its body is read: latencies are measured from here (the edge)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":  # the protocol may have stamped it already, when its bytes came
            scope.setdefault("state", {}).setdefault("arrival", time.monotonic())
        await self.app(scope, receive, send)


def run_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve `app` in this thread until SIGINT/SIGTERM."""
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


class BackgroundServer:
    """`app` served by uvicorn in a daemon thread (tests, or a server inside a Ray actor).
    Port 0 picks a free port; the socket is bound before the constructor returns."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        self.host, self.port = host, sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off"))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                        name="manta-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
