"""The OpenAPI 3.1 document of the HTTP API, built from the request and response models.

The routes of `cluster.api.server` read their JSON bodies themselves (so that a bad body is an
OpenAI error, not FastAPI's 422), which leaves FastAPI's generated schema without request bodies.
This module states the API instead: each POST route's body is the pydantic model that parses it,
each answer the model that builds it, and every 4xx/5xx the OpenAI error body. The server serves
it at `GET /openapi.json` (behind the API key); `tests/test_api_fuzz.py` feeds it to schemathesis.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from cluster.api import protocol as P
from cluster.api import responses as R
from cluster.api.embeddings import EmbeddingRequest, EmbeddingResponse

_REF = "#/components/schemas/{model}"

# (path, request model, response model, summary) of the POST routes.
_POSTS: tuple[tuple[str, type[BaseModel], type[BaseModel] | None, str], ...] = (
    ("/v1/completions", P.CompletionRequest, R.CompletionResponse, "Text completion (SSE when stream is true)"),
    ("/v1/chat/completions", P.ChatCompletionRequest, R.ChatCompletionResponse,
     "Chat completion (SSE when stream is true)"),
    ("/v1/embeddings", EmbeddingRequest, EmbeddingResponse, "Embeddings (embedding models only)"),
    ("/generate", P.GenerateRequest, None, "Native generation (SGLang-style body)"),
)

# A small body each route answers, shown in the document (and the first case a fuzzer sends).
_EXAMPLES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "Hello", "max_tokens": 4},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4},
    "/v1/embeddings": {"input": "Hello"},
    "/generate": {"text": "Hello", "sampling_params": {"max_tokens": 4}},
}

# Error statuses any route may answer, and why.
_ERRORS = {
    "400": "invalid request (the body names the parameter)",
    "401": "missing or wrong API key",
    "404": "unknown model or route",
    "413": "request body too large",
    "499": "the client closed the connection (never read by that client)",
    "500": "internal error (the message leaks nothing)",
    "503": "overloaded (Retry-After) or no healthy replica",
    "504": "the request ran past the server's per-request timeout",
}


# One server-sent event (OpenAPI 3.1: a stream's `schema` describes each event): `data` is a JSON
# chunk of the response, an error body, or "[DONE]".
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}


def _error_responses() -> dict[str, Any]:
    body = {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}}
    return {code: {"description": why, "content": body} for code, why in _ERRORS.items()}


def openapi_schema(title: str = "manta", version: str = "0.1.0") -> dict[str, Any]:
    """The whole document (a fresh dict on each call: callers may change it)."""
    models: list[type[BaseModel]] = [R.ErrorResponse, R.ModelList, R.ModelCard]
    for _, req, resp, _ in _POSTS:
        models.append(req)
        if resp is not None:
            models.append(resp)
    pairs = [(m, "validation" if m in {r for _, r, _, _ in _POSTS} else "serialization") for m in models]
    _, top = models_json_schema(pairs, ref_template=_REF)
    schemas = top.get("$defs", {})
    paths: dict[str, Any] = {}
    for path, req, resp, summary in _POSTS:
        ok: dict[str, Any] = {"description": "the answer"}
        content: dict[str, Any] = {"text/event-stream": {"schema": _SSE_EVENT}}
        content["application/json"] = {"schema": {"$ref": _REF.format(model=resp.__name__)}} if resp else {
            "schema": {"type": "object"}}
        ok["content"] = content
        paths[path] = {"post": {
            "summary": summary,
            "operationId": path.strip("/").replace("/", "_").replace(".", "_"),
            "requestBody": {"required": True,
                            "content": {"application/json": {"schema": {"$ref": _REF.format(model=req.__name__)},
                                                             "example": _EXAMPLES[path]}}},
            "responses": {"200": ok, **_error_responses()},
        }}
    json_ok = {"description": "the answer", "content": {"application/json": {"schema": {"type": "object"}}}}
    paths["/v1/models"] = {"get": {"summary": "The served model", "operationId": "list_models",
                                   "responses": {"200": {"description": "the model list", "content": {
                                       "application/json": {"schema": {"$ref": _REF.format(model="ModelList")}}}},
                                       **_error_responses()}}}
    paths["/v1/models/{model}"] = {"get": {
        "summary": "One model", "operationId": "get_model",
        "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
        "responses": {"200": {"description": "the model card", "content": {
            "application/json": {"schema": {"$ref": _REF.format(model="ModelCard")}}}}, **_error_responses()}}}
    paths["/health"] = {"get": {"summary": "200 while a replica is healthy, else 503", "operationId": "health",
                                "security": [], "responses": {"200": json_ok, **_error_responses()}}}
    paths["/metrics"] = {"get": {"summary": "Prometheus metrics", "operationId": "metrics", "responses": {
        "200": {"description": "Prometheus text exposition", "content": {"text/plain": {"schema": {"type": "string"}}}},
        **_error_responses()}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version,
                 "description": "OpenAI-compatible API of a manta serving cluster."},
        "paths": paths,
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
    }
