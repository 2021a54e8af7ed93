"""Logprobs in the two OpenAI layouts, with each token's own text and bytes.

A token's text is what it adds to the output on its own: for byte-level BPE and SentencePiece
byte-fallback pieces, its bytes from the tokenizer's table (`cluster.engine.token_bytes`); a
piece that is part of a multi-byte character (not valid UTF-8 alone) is written as OpenAI writes
it, `bytes:\\xe2\\x80`, with its raw bytes in `bytes`. So the bytes of a choice's tokens, joined,
are the bytes of its text. Without a table (a tokenizer whose decoding the table cannot mirror)
the tokenizer decodes each token alone.

Completions' `text_offset` is each token's offset in characters into the choice's text: the
characters completed by the bytes before it (a piece inside a character starts where that
character does); `CompletionOffsets` carries the count across a stream's chunks. A special token
the text does not show (an echoed prompt's BOS, one skipped by `skip_special_tokens`) takes no
characters: its offset is where the next token's text starts.
"""

from __future__ import annotations

import codecs
import functools
from typing import Any

from cluster.api.responses import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    TopLogprob,
)
from cluster.engine.token_bytes import token_bytes
from workers.messages import TokenLogprobs


class TokenPieces:
    """token id -> (its text, its bytes), cached."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.table = token_bytes(tokenizer)
        self.special = frozenset(getattr(tokenizer, "all_special_ids", None) or ())
        self.of = functools.lru_cache(maxsize=1 << 16)(self._of)

    def _of(self, tok: int) -> tuple[str, bytes]:
        if self.table is None:
            text = self.tokenizer.decode([tok], skip_special_tokens=False)
            return text, text.encode()
        raw = self.table.of(tok)
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


class CompletionOffsets:
    """The text offset of a choice's next token (characters of the bytes before it). `hidden`:
    token ids its generated text does not show (the special ones, when they are skipped)."""

    def __init__(self, hidden: frozenset[int] = frozenset()) -> None:
        self.chars = 0
        self.hidden = hidden
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def advance(self, raw: bytes, shown: bool = True) -> int:
        """The offset of a token of bytes `raw`; moves past it if the text `shown` it."""
        at = self.chars
        if not shown:
            return at
        pending = self._utf8.getstate()[0]  # an unfinished character's bytes so far
        if pending and raw and not 0x80 <= raw[0] <= 0xBF:  # it never finishes: U+FFFD before this token
            at += len(pending.decode("utf-8", errors="replace"))
        self.chars += len(self._utf8.decode(raw))
        return at


def completion_logprobs(token_ids: list[int], logprobs: list[TokenLogprobs | None], pieces: TokenPieces,
                        offsets: CompletionOffsets) -> CompletionLogprobs:
    """Completions layout for new tokens of one choice (`offsets` carries over chunks)."""
    out = CompletionLogprobs()
    for tok, lp in zip(token_ids, logprobs):
        text, raw = pieces.of(tok)
        out.tokens.append(text)
        out.text_offset.append(offsets.advance(raw, tok not in offsets.hidden))
        if lp is None:
            out.token_logprobs.append(0.0)
            out.top_logprobs.append({})
            continue
        out.token_logprobs.append(lp.token_logprob)
        top = {pieces.of(t)[0]: v for t, v in lp.top}
        top.setdefault(text, lp.token_logprob)
        out.top_logprobs.append(top)
    return out


def chat_logprobs(token_ids: list[int], logprobs: list[TokenLogprobs | None], pieces: TokenPieces) -> ChatLogprobs:
    content = []
    for tok, lp in zip(token_ids, logprobs):
        text, raw = pieces.of(tok)
        top = [] if lp is None else [
            TopLogprob(token=pieces.of(t)[0], logprob=v, bytes=list(pieces.of(t)[1])) for t, v in lp.top
        ]
        content.append(ChatTokenLogprob(token=text, logprob=0.0 if lp is None else lp.token_logprob,
                                        bytes=list(raw), top_logprobs=top))
    return ChatLogprobs(content=content)


def echoed_prompt_logprobs(ids: list[int], prompt_lps: list[TokenLogprobs | None] | None, pieces: TokenPieces,
                           offsets: CompletionOffsets) -> CompletionLogprobs:
    """Completions layout for an echoed prompt: each prompt token, its logprob given the tokens
    before it (the first: None, as OpenAI gives it) and its top alternatives."""
    out = CompletionLogprobs()
    lps = prompt_lps or [None] * len(ids)
    for tok, lp in zip(ids, lps):
        text, raw = pieces.of(tok)
        out.tokens.append(text)
        out.text_offset.append(offsets.advance(raw, tok not in pieces.special))  # (the echo shows none)
        out.token_logprobs.append(None if lp is None else lp.token_logprob)
        if lp is None:
            out.top_logprobs.append(None)
            continue
        top = {pieces.of(t)[0]: v for t, v in lp.top}
        top.setdefault(text, lp.token_logprob)
        out.top_logprobs.append(top)
    return out


def joined(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=a.tokens + b.tokens, token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs, text_offset=a.text_offset + b.text_offset)


def vllm_prompt_logprobs(ids: list[int], prompt_lps: list[TokenLogprobs | None] | None,
                         pieces: TokenPieces) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs`: per prompt position None (the first) or {token id: {logprob,
    rank, decoded_token}} for the prompt's own token and its top alternatives."""
    out: list[dict[str, PromptLogprob] | None] = []
    for tok, lp in zip(ids, prompt_lps or [None] * len(ids)):
        if lp is None:
            out.append(None)
            continue
        entry = {str(t): PromptLogprob(logprob=v, rank=i + 1, decoded_token=pieces.of(t)[0])
                 for i, (t, v) in enumerate(lp.top)}
        entry[str(tok)] = PromptLogprob(logprob=lp.token_logprob, rank=lp.rank or None,
                                        decoded_token=pieces.of(tok)[0])
        out.append(entry)
    return out
