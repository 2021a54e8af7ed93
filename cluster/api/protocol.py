"""The OpenAI HTTP API as pydantic v2 models, and their conversion to `SamplingParams`.

Requests are validated strictly (no "0.5" for a float, no `true` for an int) and unknown fields
are refused, like the OpenAI API does ("Unrecognized request argument"). Range checks of the
sampling fields are left to `SamplingParams.validate`, whose errors name the parameter. Request
fields that exist in the OpenAI API but that manta does not implement are refused with a 400 that
names them (`check_supported`), never silently ignored.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.api.chat_messages import ChatMessage
from cluster.api.structured import StructuredFields
from cluster.api.tools import NamedToolChoice, Tool, check_tools, forced_constraint
from workers.sampling_params import MAX_TOP_LOGPROBS, SamplingParams, SamplingParamsError
from workers.structured_output import StructuredOutput

MAX_N = 128

# Used when the tokenizer has no chat template of its own (ChatML, as Qwen and many others use).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


class StreamOptions(_Strict):
    include_usage: bool = False
    # vLLM's extension: with include_usage, every chunk carries the usage so far.
    continuous_usage_stats: bool = False


class _SamplingRequest(StructuredFields):
    """Fields shared by /v1/completions and /v1/chat/completions (None: the default); the
    structured-output fields of every dialect come from `StructuredFields`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """OpenAI types its optional fields "T or null", and SDKs send a null for a setting they
        were given as None: a known field sent as null takes its default (`n`, `stream`,
        `echo`, ... as much as `temperature`). A required one is then missing, and named so."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted, ignored
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Extensions (vLLM/SGLang names).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk (`stream_options.continuous_usage_stats`, with include_usage)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def _check_common(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise SamplingParamsError("n", f"must be in [1, {MAX_N}], got {self.n}")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise SamplingParamsError("truncate_prompt_tokens", f"must be >= 1, got {self.truncate_prompt_tokens}")
        if self.stream_options is not None and not self.stream:
            raise SamplingParamsError("stream_options", "stream_options is only allowed when stream is true")

    def truncate(self, ids: list[int]) -> list[int]:
        """The prompt as the model sees it: its last `truncate_prompt_tokens` tokens, if set."""
        k = self.truncate_prompt_tokens
        return ids[-k:] if k is not None and len(ids) > k else ids

    def _params(self, max_tokens: int, logprobs: int | None, seed_offset: int,
                prompt_logprobs: int | None = None) -> SamplingParams:
        def pick(v: Any, default: Any) -> Any:
            return default if v is None else v

        stop: tuple[str, ...] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=pick(self.temperature, 1.0),
            top_p=pick(self.top_p, 1.0),
            top_k=pick(self.top_k, -1),
            min_p=pick(self.min_p, 0.0),
            repetition_penalty=pick(self.repetition_penalty, 1.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0),
            presence_penalty=pick(self.presence_penalty, 0.0),
            seed=None if self.seed is None else self.seed + seed_offset,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            prompt_logprobs=prompt_logprobs,
            logit_bias=logit_bias_pairs(self.logit_bias, "logit_bias"),
            structured=self.structured(),
        )


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    prompt_logprobs: int | None = None  # vLLM: the prompt tokens' logprobs, with this many alternatives

    def check_supported(self) -> None:
        self._check_common()
        if self.max_tokens == 0 and not self.echo:
            raise SamplingParamsError("max_tokens", "must be an integer >= 1 (0 only with echo: score the prompt)")
        if self.suffix:
            raise SamplingParamsError("suffix", "suffix is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise SamplingParamsError("best_of", "best_of other than n is not supported by this server")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt (each gets n choices)."""
        p = self.prompt
        out: list[str | list[int]]
        if isinstance(p, str):
            out = [p]
        elif p and all(isinstance(x, int) for x in p):
            out = [list(p)]  # type: ignore[arg-type]
        else:
            out = list(p)  # type: ignore[arg-type]
        if not out or any(len(x) == 0 for x in out):
            raise SamplingParamsError("prompt", "the prompt must not be empty")
        return out

    @property
    def scores_only(self) -> bool:
        """echo with max_tokens 0: the prompt and its logprobs, nothing generated (one token is,
        and dropped: the engine always samples after a prompt)."""
        return self.echo and self.max_tokens == 0

    @property
    def wanted_prompt_logprobs(self) -> int | None:
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    def sampling_params(self, seed_offset: int = 0) -> SamplingParams:
        max_tokens = 16 if self.max_tokens is None else max(self.max_tokens, 1 if self.scores_only else 0)
        return self._params(max_tokens, self.logprobs, seed_offset, self.wanted_prompt_logprobs)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM: the rendered prompt's logprobs (not streamed)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Refused when used (check_supported): present so that the 400 names them precisely.
    functions: list[dict] | None = None
    function_call: str | dict | None = None

    def check_supported(self) -> None:
        self._check_common()
        check_tools(self.tools, self.tool_choice)
        if self.prompt_logprobs is not None and self.stream:
            raise SamplingParamsError("prompt_logprobs", "prompt_logprobs is returned in a non-streamed chat "
                                                         "response only")
        if self.forced_tools is not None and self.structured() is not None:
            raise SamplingParamsError("tool_choice", "a required or named tool_choice cannot be combined with "
                                                     "another output constraint")
        for i, m in enumerate(self.messages):
            if m.content is None and not (m.role == "assistant" and m.tool_calls):
                raise SamplingParamsError(f"messages[{i}].content", "content is required (null only for an "
                                                                   "assistant message with tool_calls)")
            if (m.tool_calls and m.role != "assistant") or (m.tool_call_id is not None and m.role != "tool"):
                field = "tool_calls" if m.tool_calls else "tool_call_id"
                raise SamplingParamsError(f"messages[{i}].{field}", f"not allowed in a {m.role} message")
            if m.role == "tool" and m.tool_call_id is None:
                raise SamplingParamsError(f"messages[{i}].tool_call_id", "a tool message needs the id of the "
                                                                        "tool call it answers")
        if self.functions or self.function_call not in (None, "none"):
            param = "functions" if self.functions else "function_call"
            raise SamplingParamsError(param, "function calling is not supported by this server")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise SamplingParamsError("top_logprobs", "top_logprobs requires logprobs to be true")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise SamplingParamsError(
                    "top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
                )

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def forced_tools(self):
        """The grammar of a `required` or named tool_choice (None: no tool call is forced)."""
        return forced_constraint(self.tools, self.tool_choice, self.parallel_tool_calls)

    def sampling_params(self, max_tokens: int, seed_offset: int = 0) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        params = self._params(max_tokens, logprobs, seed_offset, self.prompt_logprobs)
        forced = self.forced_tools
        return dataclasses.replace(params, structured=forced) if forced is not None else params

    def chat_dicts(self) -> list[dict[str, Any]]:
        return [m.as_dict() for m in self.messages]

    def template_tools(self) -> list[dict] | None:
        """The tools as chat templates take them (none with tool_choice "none": OpenAI's
        semantics are that the model may not call them)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


# SGLang's names of `SamplingParams` fields in the native endpoint's `sampling_params`.
SGLANG_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


class GenerateRequest(_Strict):
    """The native endpoint: `sampling_params` takes `SamplingParams` field names, and SGLang's
    `max_new_tokens` / `min_new_tokens` for theirs."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    rid: str | None = None

    def prompt(self) -> str | list[int]:
        if (self.text is None) == (self.input_ids is None):
            raise SamplingParamsError("text", "give exactly one of text and input_ids")
        if self.text == "" or self.input_ids == []:
            raise SamplingParamsError("text" if self.text is not None else "input_ids", "the prompt must not be empty")
        return self.text if self.text is not None else list(self.input_ids or [])

    def params(self) -> SamplingParams:
        # SGLang's constraint keys stand for `structured`, which is not given directly.
        known = {f.name for f in dataclasses.fields(SamplingParams) if f.init} - {"extra", "structured"}
        known |= {"json_schema", "regex", "ebnf"}
        sp = dict(self.sampling_params)
        for sglang, ours in SGLANG_NAMES.items():  # SGLang's own names for the same fields
            if sglang in sp:
                if ours in sp:
                    raise SamplingParamsError(f"sampling_params.{sglang}", f"give one of {sglang!r} and {ours!r}")
                sp[ours] = sp.pop(sglang)
        for key in sp:
            if key not in known:
                raise SamplingParamsError(f"sampling_params.{key}", f"unknown sampling parameter {key!r}")
        for key in ("stop", "stop_token_ids"):
            v = sp.get(key)
            if isinstance(v, str):
                sp[key] = (v,)
            elif isinstance(v, list):
                sp[key] = tuple(v)
        if isinstance(sp.get("logit_bias"), dict):
            sp["logit_bias"] = logit_bias_pairs(sp["logit_bias"], "sampling_params.logit_bias")
        found = [(k, sp.pop(k)) for k in ("json_schema", "regex", "ebnf") if sp.get(k) is not None]
        if len(found) > 1:
            raise SamplingParamsError(f"sampling_params.{found[1][0]}", "only one structured output constraint may be given")
        if found:
            (key, value), param = found[0], f"sampling_params.{found[0][0]}"
            sp["structured"] = (StructuredOutput.json_schema(value, param) if key == "json_schema"
                                else StructuredOutput("regex" if key == "regex" else "grammar", value, param))
        return SamplingParams(**sp)


def logit_bias_pairs(bias: dict | None, param: str) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias ({"token id": bias}) as (id, bias) pairs; the ranges are checked
    with the other sampling parameters."""
    pairs = []
    for key, value in (bias or {}).items():
        tok = key.strip() if isinstance(key, str) else key
        if isinstance(tok, str) and tok.isdigit():
            tok = int(tok)
        if not isinstance(tok, int) or isinstance(tok, bool):
            raise SamplingParamsError(param, f"keys must be token ids, got {key!r}")
        pairs.append((tok, value))
    return tuple(pairs)


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> list[int]:
    """Token ids of the chat prompt, ready for generation (with `tools`, the template is given
    them: `apply_chat_template(..., tools=...)`).

    Templates usually emit the BOS token themselves, so the rendered text is encoded without
    special tokens; the built-in fallback template does not, so it gets the tokenizer's own."""
    template = getattr(tokenizer, "chat_template", None)
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False,
            chat_template=None if template else DEFAULT_CHAT_TEMPLATE,
        )
    except Exception as exc:  # jinja errors: raise_exception() in a template, bad role order
        raise SamplingParamsError("messages", f"the chat template refused these messages: {exc}") from exc
    return list(tokenizer(text, add_special_tokens=not template).input_ids)
