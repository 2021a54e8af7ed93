"""The messages of a chat completion request: text, an assistant's earlier tool calls, a tool's
result; and their dict form for the checkpoint's chat template."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(_Strict):
    """A tool call of an earlier assistant turn, sent back in the conversation."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None only for an assistant turn of tool calls
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this is the result of
    # What an OpenAI response's message carries besides, so that a client may send that message
    # back as it came (`message.model_dump()`): a refusal's text and annotations describe that
    # earlier answer and are not shown to the model; audio and a legacy function call are not
    # supported, and taken only as null.
    refusal: str | None = None
    annotations: list[dict] | None = None
    audio: None = None
    function_call: None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)

    def as_dict(self) -> dict[str, Any]:
        """The message as chat templates take it (arguments as objects where they parse:
        templates render them with `tojson`)."""
        d: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _maybe_json(c.function.arguments)}} for c in self.tool_calls]
        return d


def _maybe_json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
