"""The one form every error takes on its way to an HTTP client: `APIError`, with the OpenAI
body `{"error": {message, type, param, code}}`; `as_api_error` maps onto it the one form a
refused request has below the server (`workers.request_errors.RequestError`, by its kind) and
the server's own exceptions (unexpected ones become a 500 that leaks nothing)."""

from __future__ import annotations

from pydantic import ValidationError

from cluster.api import responses as R
from cluster.api.deadline import RequestTimedOut
from cluster.api.shutdown import ServerShuttingDown
from cluster.engine.client import GenerationFailed
from workers.request_errors import RequestError


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return R.ErrorResponse(error=R.ErrorInfo(message=self.message, type=self.type, param=self.param,
                                                 code=self.code)).model_dump()


def json_path(loc: tuple) -> str:
    """A pydantic error location as the path of the field in the request body, as the other
    errors name fields (`messages[0].content`, `tools[0].function.name`): list indices in
    brackets, keys after dots, and none of the tags pydantic puts between them for the member
    of a union it tried (`str`, `list[TextPart]`, `NamedToolChoice`, `function-after[...]`)."""
    out = ""
    for x in loc:
        if isinstance(x, int):
            out += f"[{x}]"
        elif not _union_tag(str(x)):
            out += f".{x}"
    return out.lstrip(".")


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "none", "dict", "list", "tuple", "set", "bytes"})


def _union_tag(x: str) -> bool:
    # The API's field names are snake_case; tags are type names, class names or expressions.
    return x in _TYPE_NAMES or x[:1].isupper() or any(c in x for c in "[]()'\",- ")


def as_api_error(exc: BaseException) -> APIError:
    """The HTTP error of an exception (unexpected ones become a 500 that leaks nothing)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestError):
        if exc.kind == "queue_full":
            return APIError(503, f"the server is overloaded: {exc}", "server_overloaded", code="queue_full",
                            headers={"Retry-After": "1"})
        if exc.kind == "unavailable":
            return APIError(503, f"no replica is available: {exc}", "service_unavailable", code="no_replica",
                            headers={"Retry-After": "1"})
        code = "context_length_exceeded" if "context" in str(exc) else None
        return APIError(400, str(exc), param=exc.param, code=code)
    if isinstance(exc, RequestTimedOut):
        return APIError(504, str(exc), "timeout_error", code="request_timeout")
    if isinstance(exc, ServerShuttingDown):
        return APIError(503, str(exc), "service_unavailable", code="server_shutting_down",
                        headers={"Retry-After": "1"})
    if isinstance(exc, GenerationFailed):
        return APIError(500, f"generation failed: {exc}", "server_error")
    if isinstance(exc, ValidationError):
        # Of a union's failed branches, the deepest error is the most specific one.
        err = max(exc.errors(), key=lambda e: len(e.get("loc") or ()))
        path = json_path(err.get("loc") or ())
        if err["type"] == "extra_forbidden":  # name the unknown key itself, nested ones by their path
            return APIError(400, f"Unrecognized request argument supplied: {path}", param=path or None)
        return APIError(400, f"Invalid value for '{path}': {err['msg']}", param=path or None)
    return APIError(500, "internal server error", "server_error")
