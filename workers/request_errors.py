"""A request refused before it ran, in one typed form from where it is found to the HTTP answer.

`RequestError.kind` is what the HTTP layer answers (`cluster.api.errors.as_api_error`):
"invalid_request" a 400 naming `param`, "queue_full" a 503 with Retry-After (the request may be
retried later), "unavailable" a 503 (no replica can take it now). The engine and the router
raise these classes; across the Ray hop from a replica to the router the error travels as its
kind, message and param in a finished `RequestOutput` and is raised again as the class of that
kind (`RequestError.of`), so every layer sees the same form.
"""

from __future__ import annotations

from typing import ClassVar


class RequestError(Exception):
    kind: ClassVar[str] = "invalid_request"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param

    @staticmethod
    def of(kind: str, message: str, param: str | None = None) -> RequestError:
        """The error of `kind` (an unknown kind: RuntimeError's message as an unavailable one)."""
        cls = {c.kind: c for c in (InvalidRequest, QueueFull, Unavailable)}.get(kind, Unavailable)
        return cls(message, param)


class InvalidRequest(RequestError, ValueError):
    """The request itself is wrong (a parameter, a prompt too long for the model): never retried."""

    kind = "invalid_request"


class QueueFull(RequestError):
    """Every waiting queue that could take the request is full: answer 503 and let it retry."""

    kind = "queue_full"


class Unavailable(RequestError):
    """No healthy replica can take the request now."""

    kind = "unavailable"
