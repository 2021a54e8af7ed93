"""Reasoning models' thinking, split from their answer: `<think>…</think>` goes to the chat
message's `reasoning_content` when the server runs with `--reasoning-parser`.

- `deepseek_r1`: the chat template opens the think block itself (DeepSeek-R1's newer templates end
  the prompt with `<think>\\n`), so the output is reasoning up to `</think>` (a leading `<think>`
  is dropped if the model writes one) and the answer after it; an output with no `</think>` is
  all reasoning (the model was still thinking when it stopped).
- `qwen3`: the model opens the block (`<think>` first); an output that does not start with it has
  no reasoning (Qwen3 with thinking turned off), one that never closes it is all reasoning.
"""

from __future__ import annotations

PARSERS = ("deepseek_r1", "qwen3")
OPEN, CLOSE = "<think>", "</think>"


def split_reasoning(parser: str | None, text: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a complete output."""
    if parser is None:
        return None, text
    body = text.lstrip()
    opened = body.startswith(OPEN)
    if parser == "qwen3" and not opened:
        return None, text
    if opened:
        body = body[len(OPEN):]
    else:
        body = text
    thought, sep, answer = body.partition(CLOSE)
    if not sep:
        return thought.strip() or None, ""
    return thought.strip() or None, answer.lstrip()


class ReasoningStream:
    """Splits one choice's streamed text into (reasoning delta, content delta) as it arrives,
    holding back what may be the start of a tag."""

    def __init__(self, parser: str):
        self.parser = parser
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0

    def step(self, delta: str, finished: bool) -> tuple[str, str]:
        self.text += delta
        if finished:
            reasoning, content = split_reasoning(self.parser, self.text)
        else:
            reasoning, content = self._partial()
        r_out = (reasoning or "")[self.sent_reasoning:]
        c_out = content[self.sent_content:]
        self.sent_reasoning += len(r_out)
        self.sent_content += len(c_out)
        return r_out, c_out

    def _partial(self) -> tuple[str, str]:
        body = self.text.lstrip()
        if not body or OPEN.startswith(body):  # too early to know whether the block opens
            return "", ""
        opened = body.startswith(OPEN)
        if self.parser == "qwen3" and not opened:
            return "", self.text
        body = body[len(OPEN):] if opened else self.text
        thought, sep, answer = body.partition(CLOSE)
        if sep:
            return thought.strip(), answer.lstrip()
        # Still thinking: send all but a possible partial "</think>" at the end, without the
        # leading whitespace the finished split strips.
        keep = len(thought)
        for k in range(min(len(CLOSE) - 1, len(thought)), 0, -1):
            if thought.endswith(CLOSE[:k]):
                keep = len(thought) - k
                break
        return thought[:keep].lstrip(), ""


__all__ = ["PARSERS", "ReasoningStream", "split_reasoning"]
