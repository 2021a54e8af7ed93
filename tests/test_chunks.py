"""The fast text chunk (`cluster.api.chunks.TextChunks`) is the pydantic chunk byte for byte, on
every character JSON treats specially: quotes, backslashes, every control character, DEL, the
line breaks SSE readers split on, non-ASCII and astral characters, and random mixtures."""

from __future__ import annotations

import json
import random

import pytest

from cluster.api import responses as R
from cluster.api.chunks import TextChunks, usage_json
from cluster.api.sse import sse

SPECIAL = ['"', "\\", "/", "\x7f", "\x85", "\u2028", "\u2029", "é", "日本", "😀", "\ufeff", "</script>", " "]
SPECIAL += [chr(c) for c in range(0x20)]


def _chat(cid: str, model: str):
    return lambda i, text, usage=None: R.ChatCompletionChunk(id=cid, created=1764000000, model=model, choices=[
        R.ChatChunkChoice(index=i, delta=R.DeltaMessage(content=text))], usage=usage)


def _completion(cid: str, model: str):
    return lambda i, text, usage=None: R.CompletionChunk(id=cid, created=1764000000, model=model, choices=[
        R.CompletionChoice(index=i, text=text)], usage=usage)


def _texts() -> list[str]:
    rng = random.Random(7)
    texts = ["", "Hello", " world", *SPECIAL]
    for _ in range(300):
        texts.append("".join(rng.choice(SPECIAL + ["a", "b", " ", "\n"]) for _ in range(rng.randint(1, 12))))
    return texts


@pytest.mark.parametrize("kind", [_chat, _completion])
@pytest.mark.parametrize("model", ["tiny-llama", 'a "quoted"\u2028model/é'])
def test_text_chunk_is_the_pydantic_chunk_byte_for_byte(kind, model):
    make = kind("chatcmpl-0123abcd", model)
    chunks = TextChunks(lambda i, text: make(i, text).model_dump_json())
    for index in (0, 1, 17):
        for text in _texts():
            fast = chunks(index, text)
            assert fast == sse(make(index, text)), (index, text)
            assert fast.startswith("data: ") and fast.endswith("\n\n")
            body = fast[len("data: "):-2]
            assert body.splitlines() == [body]  # one SSE line, whatever str.splitlines splits on
            choice = json.loads(body)["choices"][0]
            assert (choice["text"] if "text" in choice else choice["delta"]["content"]) == text


@pytest.mark.parametrize("kind", [_chat, _completion])
def test_text_chunk_with_usage_is_the_pydantic_chunk_byte_for_byte(kind):
    """Streams that ask for usage in every chunk (`continuous_usage_stats`) take the same path."""
    make = kind("cmpl-42", "m")
    chunks = TextChunks(lambda i, text: make(i, text).model_dump_json())
    rng = random.Random(3)
    for text in _texts()[:80]:
        counts = (rng.randint(0, 10**6), rng.randint(0, 4096), rng.randint(0, 10**6))
        assert usage_json(*counts) == R.Usage.of(*counts).model_dump_json()
        i = rng.randint(0, 3)
        assert chunks(i, text, usage_json(*counts)) == sse(make(i, text, R.Usage.of(*counts))), (text, counts)


def test_a_template_that_holds_its_text_twice_is_refused():
    chunks = TextChunks(lambda i, text: json.dumps({"a": text, "b": text}))
    with pytest.raises(AssertionError, match="2 times"):
        chunks(0, "x")
    without_usage = TextChunks(lambda i, text: json.dumps({"text": text}))
    with pytest.raises(AssertionError, match="does not end with its usage"):
        without_usage(0, "x")
