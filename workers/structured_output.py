"""What a request's output must match: a JSON schema, a regular expression, one of a list of
strings, or a context-free grammar (Lark or GBNF/EBNF). The grammar engine is llguidance.

`StructuredOutput` is plain data: it travels inside `SamplingParams` from the HTTP edge to TP
rank 0, where `workers.grammar_masks` turns it into per-step token masks. Here it is checked
(compiled once per distinct spec, without a tokenizer) so that a bad schema or regex is a 400
naming the request field, not a failure deep in a replica.

JSON output: keys and values as the schema says, whitespace between tokens allowed but bounded
(`JSON_WHITESPACE`). Unbounded whitespace lets a model emit newlines forever in JSON mode (a
failure users of other servers have reported); a bound keeps pretty-printed JSON possible.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

from workers.request_errors import InvalidRequest

KINDS = ("json", "regex", "choice", "grammar")

# Up to this many whitespace characters between two JSON tokens (enough for an indented line).
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,24}"
_JSON_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE}
# json_object (OpenAI's JSON mode): any JSON object.
ANY_OBJECT = '{"type": "object"}'
MAX_SPEC_CHARS = 256 * 1024


@dataclass(frozen=True)
class StructuredOutput:
    """kind: one of KINDS; spec: the schema as JSON text, the regex, the choices as a JSON list
    of strings, or the grammar text. `param` names the request field it came from (errors
    name it); it takes no part in equality, so equal specs share one compiled grammar."""

    kind: str
    spec: str
    param: str = field(default="structured_outputs", compare=False)

    @classmethod
    def json_schema(cls, schema: dict | str | bool, param: str) -> StructuredOutput:
        if isinstance(schema, bool | dict):
            text = json.dumps(schema)  # (key order kept: properties come out in the schema's order)
        elif isinstance(schema, str):
            text = schema
        else:
            raise StructuredOutputError(param, f"must be a JSON schema object, got {type(schema).__name__}")
        return cls("json", text, param)

    @classmethod
    def choice(cls, choices: list, param: str) -> StructuredOutput:
        if not isinstance(choices, list | tuple) or not choices or not all(isinstance(c, str) for c in choices):
            raise StructuredOutputError(param, "must be a non-empty list of strings")
        return cls("choice", json.dumps(list(choices)), param)

    def grammar(self) -> str:
        """The llguidance grammar (raises `StructuredOutputError` naming `param` if it is bad)."""
        text, error = _compile(self.kind, self.spec)
        if error:
            raise StructuredOutputError(self.param, error)
        return text

    def check(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputError(self.param, f"unknown structured output kind {self.kind!r}")
        if not isinstance(self.spec, str) or not self.spec:
            raise StructuredOutputError(self.param, "must not be empty")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise StructuredOutputError(self.param, f"is limited to {MAX_SPEC_CHARS} characters")
        self.grammar()


class StructuredOutputError(InvalidRequest):
    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}", param)


@functools.lru_cache(maxsize=512)
def _compile(kind: str, spec: str) -> tuple[str, str]:
    """(llguidance grammar, error message or ''): built and validated once per distinct spec."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        if kind == "json":
            schema = json.loads(spec)
            if not isinstance(schema, dict | bool):
                return "", "must be a JSON schema object"
            # A schema with its own "x-guidance" options (tool calls' compact form) takes none of ours.
            own = isinstance(schema, dict) and "x-guidance" in schema
            text = LLMatcher.grammar_from_json_schema(schema, defaults=None if own else _JSON_OPTIONS)
        elif kind == "regex":
            text = LLMatcher.grammar_from_regex(spec)
        elif kind == "choice":
            text = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(spec)))
        else:  # Lark, or GBNF/EBNF (llama.cpp's notation, as vLLM's guided_grammar takes)
            text = LLMatcher.grammar_from_lark(any_to_lark(spec))
    except Exception as exc:  # (the GBNF converter raises plain Exception for a missing rule)
        return "", f"invalid {kind}: {exc}"
    error = LLMatcher.validate_grammar(text)
    return (text, "") if not error else ("", f"invalid {kind}: {error.strip()}")


__all__ = ["ANY_OBJECT", "JSON_WHITESPACE", "KINDS", "StructuredOutput", "StructuredOutputError"]
