"""The speculative round's messages: a `StepPlan` and a `StepResult` with what a round adds.

A `SpecStepPlan` (mode TARGET_VERIFY) asks every rank for one speculative round over requests
that are decoding. Its `reqs` follow `ScheduledReq`'s meaning from the draft model's side:

- `prefix_len` is Ld, the tokens the *draft* has cached (the target has L >= Ld);
- `input_ids` are all_ids[Ld : L + 1]: the tokens the draft has not seen, ending with the last
  accepted token t0 (position L), whose K/V neither model has yet. Usually just [t0]; after a
  round that accepted every draft, also the last draft (the draft never wrote it);
- `out_cache_loc` holds the slots of positions Ld .. L + K: the draft's catch-up tokens, t0 and
  the K drafts (slot indices are shared by both models' pools).

So L = prefix_len + len(input_ids) - 1, and the target verifies K + 1 tokens at positions
L .. L + K.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.messages import StepPlan, StepResult, TokenLogprobs


@dataclass
class SpecStepPlan(StepPlan):
    num_draft_tokens: int = 0  # K, the same for every request of the round


@dataclass
class SpecStepResult(StepResult):
    """From TP rank 0. One entry per request of the plan, in batch order (also in
    `sampled_rids`; `next_token_ids` holds each request's last emitted token)."""

    # The tokens to emit: the accepted drafts, then the target's own token (1 .. K + 1).
    spec_token_ids: list[list[int]] = field(default_factory=list)
    spec_logprobs: list[list[TokenLogprobs | None]] = field(default_factory=list)
    # Drafts accepted (0 .. K), before any stop condition cuts the tokens.
    spec_num_accepted: list[int] = field(default_factory=list)
