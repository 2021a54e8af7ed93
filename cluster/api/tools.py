"""Tool calling for /v1/chat/completions: the request's tools and tool_choice, the grammar that
enforces `required` and named choices, and the parsers that find tool calls in free output.

- `tool_choice: "none"` (or no tools): plain text; the tools still reach the chat template.
- a named function: the output is that function's arguments, constrained by its `parameters`
  schema; the reply is one tool call.
- `"required"`: the output is a JSON array of 1 (or, with `parallel_tool_calls`, up to
  `MAX_PARALLEL_CALLS`) `{"name": ..., "arguments": {...}}` objects, each name one of the tools and its
  arguments that tool's schema (one `anyOf` branch per tool); the reply is those calls.
- `"auto"`: the model decides; its output is read by the tool-call parser of its family
  (`--tool-call-parser`, or found from the chat template): Hermes/Qwen `<tool_call>{...}</tool_call>`,
  Llama 3.x JSON (`{"name": ..., "parameters": ...}`, optionally after `<|python_tag|>`), Mistral
  `[TOOL_CALLS][...]`, DeepSeek V3 (`<｜tool▁call▁begin｜>function<｜tool▁sep｜>name` + a JSON block).
  Text before the calls stays the message's content. Without a parser, `auto` answers in text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from workers.sampling_params import SamplingParamsError
from workers.structured_output import StructuredOutput

MAX_PARALLEL_CALLS = 8
# Enforced calls are written as chat templates write tool calls (Jinja's `tojson`: `", "` and
# `": "`, no other whitespace), the form models are trained to emit; llguidance reads the
# options from the schema's root.
_CALL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
PARSERS = ("hermes", "llama3_json", "mistral", "deepseek_v3")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _params_schema(f: FunctionDef) -> dict:
    return f.parameters if f.parameters is not None else {"type": "object", "properties": {}}


def check_tools(tools: list[Tool] | None, tool_choice: str | NamedToolChoice | None) -> None:
    """400s naming the field: a duplicate or empty name, a parameters schema that does not
    compile, a tool_choice without tools or naming an unknown function."""
    names: set[str] = set()
    for i, t in enumerate(tools or []):
        if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", t.function.name):
            raise SamplingParamsError(f"tools[{i}].function.name", "must be 1-64 letters, digits, _ . or -")
        if t.function.name in names:
            raise SamplingParamsError(f"tools[{i}].function.name", f"duplicate tool name {t.function.name!r}")
        names.add(t.function.name)
        StructuredOutput.json_schema(_params_schema(t.function), f"tools[{i}].function.parameters").check()
    if isinstance(tool_choice, str) and tool_choice not in ("none", "auto", "required"):
        raise SamplingParamsError("tool_choice", "must be 'none', 'auto', 'required' or a named function")
    if tool_choice not in (None, "none", "auto") and not tools:
        raise SamplingParamsError("tool_choice", "tool_choice needs tools")
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        raise SamplingParamsError("tool_choice.function.name", f"no tool is named {tool_choice.function.name!r}")


def forced_constraint(tools: list[Tool] | None, tool_choice: str | NamedToolChoice | None,
                      parallel: bool | None) -> StructuredOutput | None:
    """The grammar of a `required` or named tool_choice (None: the model is free)."""
    if not tools:
        return None
    if isinstance(tool_choice, NamedToolChoice):
        f = next(t.function for t in tools if t.function.name == tool_choice.function.name)
        schema = _params_schema(f)
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": _CALL_JSON}
        return StructuredOutput.json_schema(schema, "tool_choice")
    if tool_choice != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                               "arguments": _params_schema(t.function)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1,
              "maxItems": MAX_PARALLEL_CALLS if parallel is not False else 1, "x-guidance": _CALL_JSON}
    return StructuredOutput.json_schema(schema, "tool_choice")


def forced_calls(text: str, tool_choice: str | NamedToolChoice) -> list[ToolCall]:
    """The tool calls of a grammar-enforced output (complete: the grammar finished)."""
    if isinstance(tool_choice, NamedToolChoice):
        return [ToolCall(tool_choice.function.name, json.dumps(json.loads(text)))]
    return [ToolCall(c["name"], json.dumps(c["arguments"])) for c in json.loads(text)]


# ---------------------------------------------------------------------------------------------
# Parsers of free output (tool_choice auto)
# ---------------------------------------------------------------------------------------------


def detect_parser(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches its model, or None."""
    t = chat_template or ""
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "tool▁calls▁begin" in t:
        return "deepseek_v3"
    if "<|python_tag|>" in t or ("ipython" in t and "<|eot_id|>" in t):
        return "llama3_json"
    return None


# Where a parser's tool calls start (streaming holds text back from here on).
START_MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "deepseek_v3": "<｜tool▁calls▁begin｜>",
                 "llama3_json": "<|python_tag|>"}


def _call_of(obj: Any, args_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("parameters", obj.get("arguments", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(obj["name"], json.dumps(args))


def _json_values(text: str) -> list[Any] | None:
    """The JSON values `text` is made of, in order (separated by whitespace or ';'), or None."""
    dec, i, out = json.JSONDecoder(), 0, []
    while True:
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i == len(text):
            return out
        try:
            value, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(value)


def parse_tool_calls(parser: str, text: str) -> tuple[str, list[ToolCall]]:
    """(content before the calls, calls) of a model's complete output; ([text], []) when it
    holds no well-formed call (a malformed one stays text: nothing is lost)."""
    if parser == "hermes":
        blocks = re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.S)
        calls = [_call_of(v) for b in blocks for v in (_json_values(b) or [None])]
        if blocks and all(calls):
            return text[: text.index("<tool_call>")].rstrip(), calls  # type: ignore[return-value]
        return text, []
    if parser == "mistral":
        head, sep, rest = text.partition("[TOOL_CALLS]")
        values = _json_values(rest) if sep else None
        items = values[0] if values and len(values) == 1 and isinstance(values[0], list) else values
        calls = [_call_of(v) for v in items or []]
        return (head.rstrip(), calls) if calls and all(calls) else (text, [])  # type: ignore[return-value]
    if parser == "deepseek_v3":
        found = re.findall(r"<｜tool▁call▁begin｜>\s*function\s*<｜tool▁sep｜>\s*([^\n]+?)\s*\n```(?:json)?\s*(.*?)\s*```"
                           r"\s*<｜tool▁call▁end｜>", text, re.S)
        calls = [_call_of({"name": n, "arguments": a}) for n, a in found]
        if found and all(calls):
            return text[: text.index("<｜tool▁calls▁begin｜>")].rstrip(), calls  # type: ignore[return-value]
        return text, []
    if parser == "llama3_json":
        body = text.split("<|python_tag|>", 1)[1] if "<|python_tag|>" in text else text
        values = _json_values(body.strip())
        calls = [_call_of(v, "parameters") for v in values or []]
        head = text.split("<|python_tag|>", 1)[0].rstrip() if "<|python_tag|>" in text else ""
        return (head, calls) if calls and all(calls) else (text, [])  # type: ignore[return-value]
    raise ValueError(f"unknown tool-call parser {parser!r}")


def held_back(parser: str | None, text: str) -> int:
    """Streaming: how many characters of `text` may go out as content now (the rest may be the
    start of a tool call and is held until the output ends)."""
    if parser is None:
        return len(text)
    if parser == "llama3_json" and text.lstrip().startswith("{"):
        return 0  # Llama's bare-JSON call
    marker = START_MARKERS[parser]
    at = text.find(marker)
    if at >= 0:
        return at
    for k in range(min(len(marker) - 1, len(text)), 0, -1):  # a marker's beginning at the end
        if text.endswith(marker[:k]):
            return len(text) - k
    return len(text)


__all__ = ["PARSERS", "Tool", "NamedToolChoice", "ToolCall", "check_tools", "detect_parser", "forced_calls",
           "forced_constraint", "held_back", "parse_tool_calls"]
