"""A chat choice's reply when tools are in play: the message (content and/or tool calls) of a
finished output, and the stream of deltas while it is generated.

Streaming: a named tool_choice streams the arguments as they are generated (the output *is*
the arguments); a `required` choice and a parsed (`auto`) output send their calls when the
output ends (only then is a call known to be complete and well formed); under `auto`, text is
streamed as content until a tool-call marker may begin, and held from there.
"""

from __future__ import annotations

from cluster.api import protocol as P
from cluster.api import responses as R
from cluster.api.tools import NamedToolChoice, ToolCall, forced_calls, held_back, parse_tool_calls


class ToolReplies:
    """How one request's choices become messages: `forced` (tool_choice required or named),
    `parser` (the tool-call parser for `auto`; None: text only)."""

    def __init__(self, req: P.ChatCompletionRequest, parser: str | None):
        self.choice = req.tool_choice
        self.forced = req.forced_tools is not None
        self.parser = parser if req.tools and req.tool_choice in (None, "auto") else None

    @property
    def active(self) -> bool:
        return self.forced or self.parser is not None

    def calls(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output."""
        if self.forced:
            if finish_reason != "stop":  # cut by max_tokens: an incomplete call is returned as text
                return text, []
            assert self.choice is not None
            return None, forced_calls(text, self.choice)
        if self.parser is not None:
            content, calls = parse_tool_calls(self.parser, text)
            return (content or None, calls) if calls else (text, [])
        return text, []

    def message(self, text: str, finish_reason: str | None) -> tuple[R.AssistantMessage, str | None]:
        content, calls = self.calls(text, finish_reason)
        if not calls:
            return R.AssistantMessage(content=content), finish_reason
        return (R.AssistantMessage(content=content, tool_calls=[_out(c) for c in calls]), "tool_calls")

    def stream(self) -> ToolStream:
        return ToolStream(self)


def _out(c: ToolCall) -> R.ToolCallOut:
    return R.ToolCallOut(id=c.id, function=R.FunctionCall(name=c.name, arguments=c.arguments))


class ToolStream:
    """One choice's streamed deltas: `step(delta_text, finished, finish_reason)` returns the
    DeltaMessage to send (None: nothing yet) and the finish reason to report."""

    def __init__(self, replies: ToolReplies):
        self.r = replies
        self.text = ""
        self.sent = 0  # characters of text sent as content (auto) or as arguments (named)
        self.named = isinstance(replies.choice, NamedToolChoice) and replies.forced
        self.call: ToolCall | None = None

    def step(self, delta: str, finished: bool, finish_reason: str | None) -> tuple[R.DeltaMessage | None, str | None]:
        self.text += delta
        if self.named:
            return self._named(delta, finished, finish_reason)
        if not finished:
            if self.r.forced:
                return None, None
            upto = held_back(self.r.parser, self.text)
            if upto > self.sent:
                piece, self.sent = self.text[self.sent : upto], upto
                return R.DeltaMessage(content=piece), None
            return None, None
        content, calls = self.r.calls(self.text, finish_reason)
        rest = (content or "")[self.sent :] if calls else self.text[self.sent :]
        deltas = [R.ToolCallDelta(index=i, id=c.id, type="function",
                                  function=R.FunctionDelta(name=c.name, arguments=c.arguments))
                  for i, c in enumerate(calls)]
        return R.DeltaMessage(content=rest or None, tool_calls=deltas or None), ("tool_calls" if calls else finish_reason)

    def _named(self, delta: str, finished: bool, finish_reason: str | None) -> tuple[R.DeltaMessage | None, str | None]:
        assert isinstance(self.r.choice, NamedToolChoice)
        first = self.call is None
        if first:
            self.call = ToolCall(self.r.choice.function.name, "")
        assert self.call is not None
        reason = ("tool_calls" if finish_reason == "stop" else finish_reason) if finished else None
        if not delta and not first:
            return (R.DeltaMessage(), reason) if finished else (None, None)
        d = R.ToolCallDelta(index=0, id=self.call.id if first else None, type="function" if first else None,
                            function=R.FunctionDelta(name=self.call.name if first else None, arguments=delta))
        return R.DeltaMessage(tool_calls=[d]), reason


__all__ = ["ToolReplies", "ToolStream"]
