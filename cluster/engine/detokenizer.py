"""Incremental detokenization with exact stop strings.

Text is emitted only once it is final: bytes of an unfinished UTF-8 character (decoded as
U+FFFD) are held back, and so is any tail that could still grow into a stop string. When a
stop string appears the text is cut right before it, and nothing after it is ever emitted.

Two ways to turn tokens into text, the same text either way: where the tokenizer decodes by
concatenating per-token bytes (`cluster/engine/token_bytes.py` proves it at start-up), each token is
a table lookup fed to an incremental UTF-8 decoder (~1 µs); otherwise the new tokens are
decoded with a few tokens of context by the tokenizer itself, twice per call (~20-40 µs). The
engine detokenizes on its own thread at every step, so this is on the serving path's budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.engine.token_bytes import TextDecoder, TokenBytes, token_bytes

# How many already-decoded tokens to re-decode with the new ones, so that tokenizers which
# merge spaces or bytes across tokens decode each new piece in context.
_CONTEXT_TOKENS = 6


@dataclass
class DetokState:
    stop: tuple[str, ...]
    skip_special_tokens: bool = True
    prompt_tail: list[int] = field(default_factory=list)  # last prompt tokens, for context
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # all final text so far (before any stop string)
    emitted: int = 0  # characters of `text` already handed out
    read_offset: int = 0  # tokens of token_ids whose text is in `text`
    stopped: bool = False
    include_stop: bool = False  # keep the stop string that ended the text (include_stop_str_in_output)
    utf8: TextDecoder | None = None  # the byte-table path's incremental decoder


class Detokenizer:
    def __init__(self, tokenizer, table: TokenBytes | None | bool = True):
        """table: the tokenizer's byte table; True: build it (None if it cannot be proven);
        None or False: always decode with the tokenizer."""
        self.tokenizer = tokenizer
        self.bytes: TokenBytes | None = token_bytes(tokenizer) if table is True else (table or None)

    def new_state(self, prompt_ids: list[int], stop: tuple[str, ...], skip_special_tokens: bool,
                  include_stop: bool = False) -> DetokState:
        return DetokState(stop=stop, skip_special_tokens=skip_special_tokens, include_stop=include_stop,
                          prompt_tail=list(prompt_ids[-_CONTEXT_TOKENS:]),
                          utf8=self.bytes.decoder(skip_special_tokens) if self.bytes else None)

    def _decode(self, ids: list[int], skip: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)

    def add_tokens(self, st: DetokState, new_ids: list[int], final: bool) -> tuple[str, bool]:
        """Append tokens; return (text that became final, whether a stop string matched).

        `final` flushes everything held back (the request has finished for another reason)."""
        if st.stopped:
            return "", True
        st.token_ids.extend(new_ids)
        if st.utf8 is not None:
            return self._append(st, st.utf8.decode(new_ids, final), final)
        ctx = (st.prompt_tail + st.token_ids)[: len(st.prompt_tail) + st.read_offset][-_CONTEXT_TOKENS:]
        pending = st.token_ids[st.read_offset :]
        before = self._decode(ctx, st.skip_special_tokens)
        full = self._decode(ctx + pending, st.skip_special_tokens)
        piece = full[len(before) :] if full.startswith(before) else full[len(before):]
        if piece.endswith("\ufffd") and not final:
            # An incomplete UTF-8 sequence: wait for the next token.
            return self._release(st, final=False)
        return self._append(st, piece, final)

    def _append(self, st: DetokState, piece: str, final: bool) -> tuple[str, bool]:
        """Add final text; cut at a stop string; release what can no longer change."""
        st.text += piece
        st.read_offset = len(st.token_ids)
        if st.stop:
            window_start = max(0, len(st.text) - len(piece) - max(len(s) for s in st.stop))
            found = [(i, -len(s)) for i, s in ((st.text.find(s, window_start), s) for s in st.stop) if i >= 0]
            if found:
                cut, neg_len = min(found)  # the first to start (the longest of those)
                st.text = st.text[: cut - neg_len if st.include_stop else cut]
                st.stopped = True
                return self._release(st, final=True)[0], True
        return self._release(st, final)

    def add_tokens_until_stop(self, st: DetokState, new_ids: list[int], final: bool) -> tuple[str, bool, int]:
        """`add_tokens` for several tokens of one step (a speculative round), taken one at a
        time so that a stop string ends the output at the token that completes it. Returns
        (text, stopped, tokens used); the caller drops new_ids[used:]."""
        if len(new_ids) <= 1 or not st.stop:
            text, stopped = self.add_tokens(st, new_ids, final)
            return text, stopped, len(new_ids)
        pieces = []
        for k, tok in enumerate(new_ids):
            text, stopped = self.add_tokens(st, [tok], final and k == len(new_ids) - 1)
            pieces.append(text)
            if stopped:
                return "".join(pieces), True, k + 1
        return "".join(pieces), False, len(new_ids)

    def _release(self, st: DetokState, final: bool) -> tuple[str, bool]:
        hold = 0 if final else _stop_prefix_overlap(st.text, st.stop)
        end = len(st.text) - hold
        if end <= st.emitted:
            return "", st.stopped
        out = st.text[st.emitted : end]
        st.emitted = end
        return out, st.stopped


def _stop_prefix_overlap(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
