"""Logprobs name each token by its own text and bytes, as OpenAI does: through the real server
with the real `openai` client, on the tiny checkpoint's byte-level BPE, where a quarter of the
vocabulary is single bytes of multi-byte characters. Sampled at temperature 1, the outputs are
full of them: the bytes of a choice's tokens, joined, must be the bytes of its text."""

from __future__ import annotations

import pytest

from cluster.api.logprobs import CompletionOffsets, TokenPieces
from tests.test_server import MODEL, PROMPT, oai, stack  # noqa: F401 - fixtures

N = 40


SPECIAL = {"<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"}  # skipped in the text


def _check_pieces(pieces: list[tuple[str, bytes]], text: str) -> None:
    assert pieces
    joined = b"".join(raw for token, raw in pieces if token not in SPECIAL)
    assert joined.decode("utf-8", errors="replace") == text
    for token, raw in pieces:
        _consistent(token, raw)


def _consistent(token: str, raw: bytes) -> None:
    assert raw, token  # no token is empty
    try:
        assert token == raw.decode("utf-8")
    except UnicodeDecodeError:  # a piece of a character: OpenAI's escaped form
        assert token == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def test_pieces_of_the_tokenizer(stack):  # noqa: F811
    tok = stack["engine"].tokenizer
    pieces = TokenPieces(tok)
    ids = tok("é€ river €", add_special_tokens=False).input_ids
    got = [pieces.of(i) for i in ids]
    assert b"".join(raw for _, raw in got) == "é€ river €".encode()
    assert any(t.startswith("bytes:") for t, _ in got)
    offsets = CompletionOffsets()
    at = [offsets.advance(raw) for _, raw in got]
    # Each piece starts at the character it begins or continues: é at 0, € at 1, " river" at 2...
    text = "é€ river €"
    for (t, _), a in zip(got, at):
        assert 0 <= a <= len(text)
        if not t.startswith("bytes:"):
            assert text[a:a + len(t)] == t


@pytest.mark.parametrize("stream", [False, True])
def test_completion_tokens_and_offsets(stack, oai, stream):  # noqa: F811
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=1.0, seed=11, logprobs=2,
              extra_body={"ignore_eos": True})
    if stream:
        tokens, offsets, text = [], [], ""
        for chunk in oai.completions.create(stream=True, **kw):
            c = chunk.choices[0]
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                offsets += c.logprobs.text_offset
    else:
        c = oai.completions.create(**kw).choices[0]
        tokens, offsets, text = c.logprobs.tokens, c.logprobs.text_offset, c.text
    assert len(tokens) == N and any(t.startswith("bytes:") for t in tokens)
    pieces = TokenPieces(stack["engine"].tokenizer)
    raws = [bytes.fromhex(t[6:].replace("\\x", "")) if t.startswith("bytes:") else t.encode() for t in tokens]
    _check_pieces(list(zip(tokens, raws)), text)
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(text)
    for t, at in zip(tokens, offsets):
        if not t.startswith("bytes:") and t not in SPECIAL:
            assert text[at:at + len(t)] == t  # a whole piece is where its offset says
    assert pieces.of(0)[0] == "<unk>"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_tokens_and_bytes(stack, oai, stream):  # noqa: F811
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Say hello"}], max_tokens=N, temperature=1.0,
              seed=5, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    if stream:
        content, text = [], ""
        for chunk in oai.chat.completions.create(stream=True, **kw):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                if chunk.choices[0].logprobs is not None:
                    content += chunk.choices[0].logprobs.content
    else:
        c = oai.chat.completions.create(**kw).choices[0]
        content, text = c.logprobs.content, c.message.content
    assert len(content) == N and any(e.token.startswith("bytes:") for e in content)
    _check_pieces([(e.token, bytes(e.bytes)) for e in content], text)
    for e in content:
        assert len(e.top_logprobs) == 2
        for top in e.top_logprobs:
            _consistent(top.token, bytes(top.bytes))
