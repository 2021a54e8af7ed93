"""Structured-output request fields, OpenAI's and the extensions of vLLM and SGLang, as one
`StructuredOutput` (workers.structured_output), or a 400 naming the field.

Accepted (at most one per request; two is a 400 naming the second):
- OpenAI `response_format`: {"type": "text"}, {"type": "json_object"}, {"type": "json_schema",
  "json_schema": {"name", "schema", "strict", "description"}}. `strict: false` is served as
  strict: the grammar always holds (what a client asking for a schema wants).
- vLLM `structured_outputs`: {"json" | "regex" | "choice" | "grammar" | "json_object"}, and its
  older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
- SGLang `json_schema` (the schema as a string), `regex`, `ebnf`.
"""

from __future__ import annotations

import threading
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from workers.sampling_params import SamplingParamsError
from workers.structured_output import ANY_OBJECT, StructuredOutput


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str | None = None  # OpenAI requires it; vLLM does not: accepted either way
    description: str | None = None
    schema_: dict | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` (StructuredOutputsParams): exactly one constraint."""

    json_: dict | str | bool | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredFields(_Strict):
    """The request fields of every structured-output dialect (mixed into the request models)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    json_schema: str | None = None  # SGLang
    regex: str | None = None  # SGLang
    ebnf: str | None = None  # SGLang

    def structured(self) -> StructuredOutput | None:
        """The request's output constraint (None: free text); each candidate is compiled, so a
        bad schema, regex or grammar is a 400 naming the field it came from."""
        found = [so for so in self._candidates() if so is not None]
        if len(found) > 1:
            raise SamplingParamsError(found[1].param, f"only one structured output constraint may be given "
                                                      f"(also got {found[0].param})")
        if found:
            found[0].check()
            return found[0]
        return None

    def _candidates(self) -> list[StructuredOutput | None]:
        out = [response_format_constraint(self.response_format)]
        so = self.structured_outputs
        if so is not None:
            given = [k for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                    ("grammar", so.grammar), ("json_object", so.json_object)) if v not in (None, False)]
            if len(given) != 1:
                raise SamplingParamsError("structured_outputs", "give exactly one of json, regex, choice, grammar, "
                                                                f"json_object (got {given or 'none'})")
            out.append(_one(given[0], getattr(so, "json_" if given[0] == "json" else given[0]),
                            f"structured_outputs.{given[0]}"))
        out += [_one("json", self.guided_json, "guided_json"), _one("regex", self.guided_regex, "guided_regex"),
                _one("choice", self.guided_choice, "guided_choice"),
                _one("grammar", self.guided_grammar, "guided_grammar"),
                _one("json", self.json_schema, "json_schema"), _one("regex", self.regex, "regex"),
                _one("grammar", self.ebnf, "ebnf")]
        return out


class TokenizerSupport:
    """Whether the model's tokenizer can drive the grammar engine (llguidance reads byte-level
    BPE and SentencePiece tokenizers, not WordPiece): found out once, in a thread started with
    the server (building llguidance's view of a large vocabulary takes about a second), so a
    constrained request on a model that cannot serve it is a 400 here, not a failure on a rank."""

    def __init__(self, tokenizer: Any):
        self._why = ""
        self._done = threading.Event()
        try:  # here, not in the thread: a package imported by two threads at once can be seen
            import llguidance.hf  # noqa: F401 - half-initialised (tokenizers' pre_tokenizers, found by a test)
        except ImportError as exc:  # a broken install: constrained requests get a 400, the rest is served
            self._why = f"structured outputs need the llguidance package: {exc}"
            self._done.set()
            return
        threading.Thread(target=self._probe, args=(tokenizer,), name="tokenizer-support", daemon=True).start()

    def _probe(self, tokenizer: Any) -> None:
        try:
            import llguidance.hf

            llguidance.hf.from_tokenizer(tokenizer)
        except Exception as exc:  # (ValueError for an unknown decoder, TypeError for a slow tokenizer)
            self._why = f"this model's tokenizer cannot be used for structured outputs: {exc}"
        finally:
            self._done.set()

    def check(self, structured: StructuredOutput | None) -> None:
        if structured is None:
            return
        self._done.wait()
        if self._why:
            raise SamplingParamsError(structured.param, self._why)


def _one(kind: str, value: Any, param: str) -> StructuredOutput | None:
    if value is None:
        return None
    if kind == "json_object":
        return StructuredOutput("json", ANY_OBJECT, param)
    if kind == "json":
        return StructuredOutput.json_schema(value, param)
    if kind == "choice":
        return StructuredOutput.choice(value, param)
    if not value:
        raise SamplingParamsError(param, "must not be empty")
    return StructuredOutput(kind, value, param)


def response_format_constraint(rf: ResponseFormat | None) -> StructuredOutput | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutput("json", ANY_OBJECT, "response_format")
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise SamplingParamsError("response_format.json_schema.schema",
                                  "a json_schema response format needs json_schema.schema")
    return StructuredOutput.json_schema(rf.json_schema.schema_, "response_format.json_schema.schema")


__all__ = ["ResponseFormat", "TokenizerSupport", "StructuredFields", "StructuredOutputs", "response_format_constraint"]
