"""The streamed chunk almost every token is: one choice's new text (no logprobs, no finish
reason), with usage when the client asked for it in every chunk. Written by joining fixed
strings around the escaped text instead of building and dumping three pydantic models per
token: at a GPU's step rate the server formats thousands of these a second on one event loop,
and every microsecond there is queueing for the next request's bytes.

The two fixed parts come from the protocol models themselves (one chunk rendered by pydantic with
a probe text, split around it), so the fast chunk is the pydantic chunk byte for byte
(tests/test_chunks.py checks that on every character class JSON escapes).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from json.encoder import encode_basestring  # C-accelerated; escapes like pydantic, non-ASCII raw

from cluster.api.sse import LINE_BREAKS

_NO_USAGE = '"usage":null}'


def usage_json(prompt: int, completion: int, cached: int) -> str:
    """`responses.Usage.of(prompt, completion, cached)` as pydantic writes it."""
    return (f'{{"prompt_tokens":{prompt},"completion_tokens":{completion},"total_tokens":{prompt + completion},'
            f'"prompt_tokens_details":{{"cached_tokens":{cached}}}}}')


class TextChunks:
    """`chunks(index, text, usage=None)`: the SSE event of choice `index`'s plain text chunk, with
    `usage` (a `usage_json`) for a stream that asked for usage in every chunk. `render(index,
    text)` is the JSON pydantic writes for it without usage (called once per index)."""

    def __init__(self, render: Callable[[int, str], str]):
        self._render = render
        self._parts: dict[int, tuple[str, str, str]] = {}

    def __call__(self, index: int, text: str, usage: str | None = None) -> str:
        parts = self._parts.get(index)
        if parts is None:
            parts = self._parts[index] = self._split(index)
        body = parts[0] + encode_basestring(text).translate(LINE_BREAKS)
        return body + parts[1] if usage is None else body + parts[2] + usage + "}\n\n"

    def _split(self, index: int) -> tuple[str, str, str]:
        probe = uuid.uuid4().hex
        quoted = encode_basestring(probe)
        pieces = self._render(index, probe).split(quoted)
        if len(pieces) != 2:
            raise AssertionError(f"the chunk template holds its text {len(pieces) - 1} times")
        head, tail = pieces[0].translate(LINE_BREAKS), pieces[1].translate(LINE_BREAKS)
        if not tail.endswith(_NO_USAGE):
            raise AssertionError(f"the chunk template does not end with its usage: {tail!r}")
        return "data: " + head, tail + "\n\n", tail[: -len("null}")]
