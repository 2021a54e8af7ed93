"""Reasoning output: `<think>…</think>` as `reasoning_content`, the rest as `content`, for
DeepSeek-R1 (the template opened the block) and Qwen3 (the model opens it), whole and streamed
(any split of the stream gives what the whole output gives), through the real server."""

from __future__ import annotations

import pytest

from cluster.api.reasoning import ReasoningStream, split_reasoning
from tests.test_server import MODEL, openai_client, served_with, stack  # noqa: F401 - fixtures

CASES = [
    ("deepseek_r1", "let me think</think>\n\nThe answer is 4.", "let me think", "The answer is 4."),
    ("deepseek_r1", "<think>\nhmm, 2+2</think>4", "hmm, 2+2", "4"),
    ("deepseek_r1", "still thinking when it stopped", "still thinking when it stopped", ""),
    ("qwen3", "<think>\nplan a reply\n</think>\n\nHello!", "plan a reply", "Hello!"),
    ("qwen3", "Hello without thinking", None, "Hello without thinking"),
    ("qwen3", "<think>never closed", "never closed", ""),
    ("qwen3", "<think></think>Direct", None, "Direct"),
]


@pytest.mark.parametrize("parser,text,reasoning,content", CASES)
def test_split(parser, text, reasoning, content):
    assert split_reasoning(parser, text) == (reasoning, content)
    assert split_reasoning(None, text) == (None, text)


@pytest.mark.parametrize("parser,text,reasoning,content", CASES)
def test_any_streamed_split_gives_the_whole_answer(parser, text, reasoning, content):
    for size in (1, 2, 3, 5, 8, len(text)):
        stream = ReasoningStream(parser)
        pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
        got_r, got_c = "", ""
        for k, piece in enumerate(pieces):
            r, c = stream.step(piece, finished=k == len(pieces) - 1)
            got_r, got_c = got_r + r, got_c + c
        # Streamed reasoning may keep whitespace the whole split trims at its end.
        assert got_r.rstrip() == (reasoning or "") and got_c == content, (size, got_r, got_c)


def test_reasoning_content_through_the_server(stack):  # noqa: F811
    with served_with(stack, reasoning_parser="qwen3") as url:
        _check_reasoning(openai_client(url))


def _check_reasoning(client) -> None:
    # The random model is held to a thinking model's shape by a regex.
    shape = {"guided_regex": "<think>[a-z]{2,6}( [a-z]{2,6}){1,3}</think>answer [a-z]{2}"}
    ask = [{"role": "user", "content": "hi"}]
    out = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=80, temperature=0.0, extra_body=shape)
    msg = out.choices[0].message
    assert msg.reasoning_content and "<think>" not in msg.reasoning_content
    assert msg.content.startswith("answer ") and "</think>" not in msg.content
    stream = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=80, temperature=0.0, stream=True,
                                         extra_body=shape)
    thought = text = ""
    for chunk in stream:
        if chunk.choices:
            thought += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
            text += chunk.choices[0].delta.content or ""
    assert thought == msg.reasoning_content and text == msg.content  # greedy: the same output
