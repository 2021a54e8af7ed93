"""The OpenAI-compatible HTTP server (FastAPI) in front of a `ServingClient`.

This module is the app: routes, the API key, the body size limit, the arrival stamp, the
error handlers, and running it (uvicorn). One request's path: the body read here
(`_read_json`), then its endpoint's work in `cluster.api.endpoints` (parse and check, tokenize
once, one `SamplingParams` per choice (n > 1 fans out, seeded seed + i), admit every choice
before any byte of the answer is sent, merge the choices' outputs into one JSON body or one SSE
stream).

Cancellation: a client that disconnects aborts its requests (`cluster.api.sse`: streaming
responses watch for `http.disconnect` beside the stream; non-streaming ones run under
`until_disconnect`). Either way the client's iterators are closed, which aborts on the replica.

Errors: every 4xx/5xx carries the OpenAI body `{"error": {message, type, param, code}}` and is
counted in `manta:request_errors_total{code}`. An error after a stream has started is sent as
one `data: {"error": ...}` event before `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.api import responses as R
from cluster.api.deadline import RequestTimedOut, stamp, within
from cluster.api.endpoints import Endpoints
from cluster.api.errors import APIError, as_api_error
from cluster.api.http_protocol import StampedProtocol
from cluster.api.metrics import CONTENT_TYPE, ServerMetrics
from cluster.api.shutdown import ServerShuttingDown, ShutdownGate
from cluster.api.sse import ClientGone
from cluster.engine.client import (
    GenerationFailed,
    ServingClient,
)
from workers.request_errors import RequestError

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


# Exceptions that are answers (4xx/5xx with a message), not bugs.
_EXPECTED = (APIError, RequestError, ValidationError, GenerationFailed, ClientGone, RequestTimedOut,
             ServerShuttingDown)


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
              request_timeout_s: float | None = None, admin=None, gate: ShutdownGate | None = None,
              tool_call_parser: str = "auto", reasoning_parser: str | None = None) -> FastAPI:
    """The HTTP app. With `api_key`, every route but /health (and /metrics when `metrics_public`)
    needs `Authorization: Bearer <api_key>`. With `request_timeout_s`, a POST request (reading its
    body included) that runs longer is aborted and answered 504 (`cluster.api.deadline`). With
    `admin` (the `ServingCluster` behind `client`), the operator routes of `cluster.api.admin`.
    The app does not close `client`: its owner does."""
    app = FastAPI(title="manta", docs_url=None, redoc_url=None, openapi_url=None)
    gate = gate if gate is not None else ShutdownGate()
    app.state.gate = gate
    serving = Endpoints(client, metrics, gate, tool_call_parser, reasoning_parser)

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

    async def on_gone(request: Request, exc: ClientGone) -> Response:
        metrics.record_error(499)  # nginx's "client closed request"; nobody reads the body
        return Response(status_code=499)

    for exc_type in (*_EXPECTED, RequestValidationError, Exception):
        app.add_exception_handler(exc_type, on_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(ClientGone, on_gone)  # after the loop: replaces on_error

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
        # Off the event loop: a scrape of many replicas' series takes tens of ms to render.
        return Response(await asyncio.to_thread(metrics.render), media_type=CONTENT_TYPE)

    def card() -> R.ModelCard:
        return R.ModelCard(id=client.model_name, created=serving.created, root=client.model_name,
                           max_model_len=client.max_context_len)

    @guarded.get("/openapi.json")
    async def openapi_document() -> Response:
        from cluster.api.openapi import openapi_schema

        return Response(json.dumps(openapi_schema()), media_type="application/json")

    @guarded.get("/v1/models")
    async def list_models() -> Response:
        return Response(R.ModelList(data=[card()]).model_dump_json(), media_type="application/json")

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
        # The protocol `manta serve` runs (request stamps, TCP_NODELAY), so tests see what users get.
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off", http=StampedProtocol))
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
