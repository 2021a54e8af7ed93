"""Per-request sampling parameters, validated once at the boundary with errors that name the
parameter (the HTTP layer turns `SamplingParamsError` into a 400 with `param` set). A validated
object remembers it: the router and the engine, which check what callers that skip the HTTP
edge send them, do not check it again."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from workers.request_errors import InvalidRequest
from workers.structured_output import StructuredOutput


class SamplingParamsError(InvalidRequest):
    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}", param)


MAX_STOP_SEQUENCES = 16
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024


def _is_int(v: object) -> bool:
    # bool is an int subclass; `max_tokens: true` in a JSON body is a client bug, not 1.
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    """A finite int or float (NaN and inf fail every range check, so are rejected here)."""
    return (isinstance(v, float) or _is_int(v)) and math.isfinite(v)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF semantics: over prompt and output tokens
    frequency_penalty: float = 0.0  # OpenAI semantics: over output tokens
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    # None: no logprobs; k >= 0: logprob of the sampled token plus the top k alternatives.
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # The prompt's own logprobs (each token given those before it) plus this many top
    # alternatives; None: not computed. Such a request recomputes its whole prompt (no cached prefix).
    prompt_logprobs: int | None = None  # the stop string that ended the text stays in it
    # (token id, bias) pairs added to the logits before sampling (OpenAI's logit_bias).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # The output must match this (a JSON schema, regex, choice or grammar); None: free text.
    # The grammar decides when the output may end: min_tokens does not hold back its eos.
    structured: StructuredOutput | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    # The vocabulary sizes (None: none given) this object was validated against.
    _validated: tuple = field(default=(), init=False, repr=False, compare=False, hash=False)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_adjustment(self) -> bool:
        """Whether the sampler changes this request's logits before choosing (penalties or a
        logit bias; min_tokens is asked per step)."""
        return self.needs_penalties or bool(self.logit_bias) or self.structured is not None

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Raise `SamplingParamsError` naming the first bad parameter; return self. A second call
        (the same vocabulary, or none) costs nothing."""
        if vocab_size in self._validated or (vocab_size is None and self._validated):
            return self

        def bad(param: str, msg: str):
            raise SamplingParamsError(param, msg)

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
        ):
            if not _is_real(getattr(self, name)):
                bad(name, f"must be a finite number, got {getattr(self, name)!r}")
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad("top_k", f"must be -1 (off) or >= 0, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0.0:
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0 or self.seed >= 2**63):
            bad("seed", f"must be an integer in [0, 2**63), got {self.seed!r}")
        # A bare string would otherwise pass as a sequence of one-character stop strings.
        if isinstance(self.stop, str | bytes) or not isinstance(self.stop, tuple | list):
            bad("stop", f"must be a sequence of strings, got {type(self.stop).__name__}")
        if len(self.stop) > MAX_STOP_SEQUENCES:
            bad("stop", f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(self.stop)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "stop sequences must be non-empty strings")
        if any(len(s) > 1024 for s in self.stop):
            bad("stop", "stop sequences are limited to 1024 characters")
        if isinstance(self.stop_token_ids, str | bytes) or not isinstance(self.stop_token_ids, tuple | list):
            bad(
                "stop_token_ids", f"must be a sequence of token ids, got {type(self.stop_token_ids).__name__}"
            )
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
                bad("stop_token_ids", f"token id {t!r} is out of range")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens!r}")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS
        ):
            bad("logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS
        ):
            bad("prompt_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs!r}")
        if not isinstance(self.logit_bias, tuple | list) or len(self.logit_bias) > MAX_LOGIT_BIAS:
            bad("logit_bias", f"must map at most {MAX_LOGIT_BIAS} token ids to biases")
        for pair in self.logit_bias:
            if not isinstance(pair, tuple | list) or len(pair) != 2:
                bad("logit_bias", f"must map token ids to biases, got {pair!r}")
            t, b = pair
            if not _is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
                bad("logit_bias", f"token id {t!r} is out of range")
            if not _is_real(b) or not -100.0 <= b <= 100.0:
                bad("logit_bias", f"bias of token {t} must be a number in [-100, 100], got {b!r}")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                bad("structured", f"must be a StructuredOutput, got {type(self.structured).__name__}")
            self.structured.check()
        object.__setattr__(self, "_validated", (*self._validated, vocab_size))
        return self
