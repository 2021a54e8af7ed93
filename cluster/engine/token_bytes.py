"""The bytes each token id stands for, read off a Hugging Face fast tokenizer once.

Most tokenizers of the families we serve decode by concatenating per-token byte strings:
byte-level BPE (GPT-2, Llama 3, Qwen, DeepSeek: each vocab character stands for one byte) and
SentencePiece-style BPE (Llama 2, Mistral: "▁" is a space, `<0xNN>` byte-fallback tokens are
single bytes). For them the text of any token sequence is `b"".join(table[t]).decode("utf-8",
"replace")` — `bytes.decode`'s replacement of invalid sequences matches the Rust tokenizers'
`from_utf8_lossy` — so incremental detokenization is a dict lookup and an incremental UTF-8
decode per token instead of two `tokenizer.decode` calls, and logprobs can report each token's
own bytes.

The table is only used where it is proven: `token_bytes` decodes random token sequences both
ways after building it and returns None at the first disagreement (or for a decoder it does not
know, such as WordPiece's), and callers fall back to `tokenizer.decode`. Text is always decoded
after some context, never at the very start of a sequence, where SentencePiece decoders strip
the first space: `validate` compares in context for that reason.
"""

from __future__ import annotations

import codecs
import json
import logging
import random
import re
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's map from the printable stand-in characters back to the bytes they encode."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _decoder_kind(decoder: dict | None) -> str | None:
    """"byte_level", "metaspace" or None (a decoder this table cannot mirror)."""
    if not decoder:
        return None
    kind = decoder.get("type")
    if kind == "ByteLevel":
        return "byte_level"
    if kind == "Metaspace":
        return "metaspace"
    if kind == "Sequence":
        steps = decoder.get("decoders", [])
        types = [d.get("type") for d in steps]
        if types and types[0] == "ByteLevel" and all(t == "ByteLevel" for t in types):
            return "byte_level"
        # Llama 2 / Mistral: Replace("▁", " "), ByteFallback, Fuse, Strip(" ", 1, 0).
        if all(t in ("Replace", "ByteFallback", "Fuse", "Strip") for t in types):
            replaces = [d for d in steps if d.get("type") == "Replace"]
            if all(d.get("pattern", {}).get("String") == "▁" and d.get("content") == " " for d in replaces):
                return "metaspace"
    return None


@dataclass(frozen=True)
class TokenBytes:
    """table[id]: the bytes of token `id` (special tokens: their text); `special`: the ids
    `skip_special_tokens` drops; `byte_tokens`: SentencePiece's `<0xNN>` byte-fallback ids."""

    table: tuple[bytes, ...]
    special: frozenset[int]
    kind: str = "byte_level"  # or "metaspace"
    byte_tokens: frozenset[int] = frozenset()

    def decoder(self, skip_special: bool) -> TextDecoder:
        return TextDecoder(self, skip_special)

    def of(self, token_id: int, skip_special: bool = False) -> bytes:
        if skip_special and token_id in self.special:
            return b""
        return self.table[token_id] if 0 <= token_id < len(self.table) else b""

    def join(self, ids: list[int], skip_special: bool = False) -> bytes:
        return b"".join(self.of(t, skip_special) for t in ids)


def build_table(tokenizer) -> TokenBytes | None:
    """The table of a fast tokenizer, or None (a slow tokenizer, or a decoder it cannot mirror)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    kind = _decoder_kind(spec.get("decoder"))
    if kind is None:
        return None
    size = max(len(tokenizer), backend.get_vocab_size(with_added_tokens=True))
    table = [b""] * size
    chars = _byte_level_chars()

    def piece_bytes(piece: str) -> bytes:
        # The decoder runs over every token's string, added tokens included.
        if kind == "byte_level":
            if all(c in chars for c in piece):
                return bytes(chars[c] for c in piece)
            return piece.encode()
        m = _BYTE_FALLBACK.fullmatch(piece)
        return bytes([int(m.group(1), 16)]) if m else piece.replace("▁", " ").encode()

    for piece, idx in backend.get_vocab(with_added_tokens=True).items():
        if idx < size:
            table[idx] = piece_bytes(piece)
    special: set[int] = set(tokenizer.all_special_ids)
    special |= {a["id"] for a in spec.get("added_tokens", []) if a.get("special") and a["id"] < size}
    byte_tokens = frozenset(idx for piece, idx in backend.get_vocab(with_added_tokens=True).items()
                            if kind == "metaspace" and _BYTE_FALLBACK.fullmatch(piece))
    return TokenBytes(tuple(table), frozenset(special), kind, byte_tokens)


class TextDecoder:
    """The text of one token stream, incrementally: `decode(ids, final)` returns the text that
    became final (an unfinished UTF-8 character is held back until its last byte, or `final`).

    Byte-level tokenizers: an incremental UTF-8 decoder over the tokens' bytes, exactly the
    tokenizer's text. SentencePiece byte fallback: a run of `<0xNN>` tokens that forms valid
    UTF-8 is its text; an invalid byte is one U+FFFD per byte token held (the tokenizer, which
    sees the whole sequence, replaces a whole invalid run: only malformed output differs)."""

    def __init__(self, tb: TokenBytes, skip_special: bool):
        self.tb, self.skip = tb, skip_special
        if tb.kind == "byte_level":
            self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        else:
            self._run = codecs.getincrementaldecoder("utf-8")("strict")
            self._held = 0  # byte tokens of an unfinished character

    def decode(self, ids: list[int], final: bool) -> str:
        tb = self.tb
        if tb.kind == "byte_level":
            return self._utf8.decode(tb.join(ids, self.skip), final)
        out: list[str] = []
        for t in ids:
            if self.skip and t in tb.special:
                continue
            if t in tb.byte_tokens:
                try:
                    text = self._run.decode(tb.table[t])
                    self._held = 0 if text else self._held + 1
                    out.append(text)
                except UnicodeDecodeError:
                    out.append("\ufffd" * (self._held + 1))
                    self._run.reset()
                    self._held = 0
                continue
            self._flush(out)
            out.append(tb.of(t).decode("utf-8", "replace"))
        if final:
            self._flush(out)
        return "".join(out)

    def _flush(self, out: list[str]) -> None:
        if self._held:
            out.append("\ufffd" * self._held)
            self._run.reset()
            self._held = 0


def validate(tokenizer, tb: TokenBytes, samples: int = 200, length: int = 8, seed: int = 0) -> bool:
    """Random token sequences decode the same through the table as through the tokenizer
    (after a context token, with and without special tokens)."""
    rng = random.Random(seed)
    ids = [i for i in range(len(tb.table)) if i not in tb.special]
    # Context tokens are whole characters, so that decode(ctx) is a prefix of decode(ctx + seq).
    whole = [i for i in ids if tb.table[i] and _complete_utf8(tb.table[i])]
    if not whole:
        return False
    for k in range(samples):
        ctx = [rng.choice(whole)]
        seq = [rng.choice(ids) for _ in range(length)]
        if k % 2 == 0 and tb.special:  # special tokens mixed in, skipped or kept
            seq[rng.randrange(length)] = rng.choice(sorted(tb.special))
        skip = k % 4 < 2
        want = tokenizer.decode(ctx + seq, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        if tb.kind == "metaspace" and "\ufffd" in want:
            continue  # malformed byte runs: replaced per run there, per byte here (TextDecoder)
        head = tokenizer.decode(ctx, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        got = head + tb.decoder(skip).decode(seq, final=True)
        if want != got:
            logger.info("token byte table disagrees with the tokenizer on %s: %r != %r", ctx + seq, got, want)
            return False
    return True


def _complete_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def token_bytes(tokenizer) -> TokenBytes | None:
    """The validated table of `tokenizer`, or None (callers decode with the tokenizer)."""
    try:
        tb = build_table(tokenizer)
    except Exception as exc:  # an unusual tokenizer.json: the slow path is always right
        logger.info("no token byte table (%s: %s)", type(exc).__name__, exc)
        return None
    if tb is None or not validate(tokenizer, tb):
        return None
    return tb
