"""How many prompt tokens a step may compute beside decodes so that the step stays under a time
target (`EngineConfig.itl_target_ms`): the gap that step puts between every decoding stream's
tokens.

A fixed cap (`mixed_prefill_tokens`) bounds a step's prompt tokens whatever the decodes beside
them cost; but a step's time is the decodes' part plus the prompt's, and the decodes' part grows
with how many requests decode and how much KV they read. Here the cap follows the step's
predicted time, from what the engine measured of its own recent steps (no offline profile: it
follows the GPU, the model, the TP size and what the KV cache holds):

- the decodes' part, a + b·D + c·K (D decoding requests, K the KV tokens they read), fitted on
  DECODE steps by least squares with exponential forgetting, every coefficient >= 0 (D and K
  rise together: an unconstrained fit trades one against the other and extrapolates badly);
- the prompt's part, p + r·S at the size S a prompt forward runs at (its CUDA-graph bucket: a
  piece padded up to the next bucket costs that bucket), fitted alike on recent MIXED steps'
  time beyond their predicted decode part and on EXTEND steps (prompts alone, of every size),
  p and r >= 0, with a weak prior that a prompt of no tokens costs nothing. One model
  for every size, so each MIXED step refreshes every size's estimate (a cost kept per size
  goes stale at a size the cap no longer picks, and one slow step would keep it from being
  picked); its fixed part keeps small pieces from pricing large ones too high.

A step far slower than predicted (a collector pause, a page fault) counts as at most `CLIP`
times the prediction. The fits predict a step's mean; the target is for the tail (a MIXED step
makes a gap in every decoding stream), so each prediction is scaled by a `margin`: the 95th
percentile of recent MIXED steps' time over what was predicted for them (through `manta serve`
on an H200 at a 36-38 ms target, 7-8 MIXED steps a run took 40-45 ms with the fits' mean under
the target). The cap is the largest size whose step, so scaled, is predicted to fit the target,
never below `floor` (prompts always progress) nor above `ceiling` (the fixed cap). Until it has
seen enough steps, it answers `ceiling`. A step's time is that of the engine's step call that
completes it: under overlapped scheduling about its device time (`cluster/bench/serve.py` reads
them alike). The scheduler asks for a cap only when prompt work waits beside decodes
(`capped_steps` counts those plans), and only with chunked prefill (a whole prompt cannot be cut
to fit: `EngineConfig` refuses the target without chunking).

The cap trades prompt throughput for the gap: capped steps may compute prompt tokens more
slowly than they arrive, and then the queue, and every first token, would grow without bound.
So the scheduler also says which prompts wait (`backlog`: those being computed and the queued
requests it has running slots for, each with how long it has waited and its tokens left); when
one of them is predicted to get its first token later than the time-to-first-token target
(`ttft_target_s`) allows, counting its wait so far and the capped steps that compute it and
every prompt ahead of it, the cap grows to the smallest size under which none is, up to
`ceiling` (`relaxed_steps` counts those plans). The wait so far counts because a prompt that
has already waited is late whatever waits behind it: through `manta serve` (H200, 2026-11-28,
a 36 ms target) a bound on the queue's length alone never raised the cap while TTFT p99 reached
325 ms against its 288 ms target (with the wait counted, one run on another H200: 325 ms again,
5 plans relaxed; BENCHMARKS.md). A burst thus costs some streams a longer gap for a few steps
instead of costing the queue's first tokens many steps each.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from collections.abc import Sequence

import numpy as np

from workers.forward_batch import ForwardMode

MIN_DECODE_STEPS = 8  # DECODE steps seen before the decode fit is trusted
FORGET = 0.97  # weight of the decode fit's past per new DECODE step (~30 steps of memory)
FORGET_PROMPT = 0.95  # weight of the prompt fit's past per new prompt step (~20 steps)
PRIOR = 0.5  # weight of the prompt fit's prior: no prompt tokens, no time
CLIP = 1.5  # an observation counts as at most this many times its prediction
REFIT = 4  # DECODE steps per refit (a constrained fit takes up to ~0.15 ms of the engine thread)
TTFT_PER_ITL = 8  # the TTFT target when none is given, in ITL targets
# A MIXED step holds every decoding stream (on the 8B serve workload ~10% of the steps made ~20%
# of the gaps), so the ITL p99 is about the MIXED steps' p95: the target holds that quantile of
# their time, not the fit's mean, over the last RATIOS of them (once MIN_RATIOS are seen).
TAIL = 0.95
RATIOS = 64
MIN_RATIOS = 32


class StepBudget:
    def __init__(self, target_s: float, *, ceiling: int, floor: int, sizes: tuple[int, ...] | None = None,
                 granule: int = 64, ttft_target_s: float | None = None):
        if target_s <= 0:
            raise ValueError("target_s must be > 0")
        self.target_s = target_s
        self.ttft_target_s = TTFT_PER_ITL * target_s if ttft_target_s is None else ttft_target_s
        self.ceiling = ceiling
        self.floor = min(floor, ceiling)
        # The sizes a prompt forward runs at (prompt graphs' buckets), or multiples of `granule`.
        self.sizes = sorted(s for s in (sizes or ()) if s <= ceiling)
        self.granule = granule
        self._sizes_down = sorted({s for s in self.sizes or range(granule, ceiling + 1, granule) if s <= ceiling}
                                  | {ceiling}, reverse=True)
        self._decode = ForgettingFit(3, FORGET)  # over (1, D / 100, K / 1e5)
        self._decode_steps = 0
        self._coef: np.ndarray | None = None
        self._prompt_fit = ForgettingFit(2, FORGET_PROMPT, prior=PRIOR)  # over (1, S / 1000)
        self._prompt: tuple[float, float] | None = None  # p, r per 1000 tokens (seconds)
        self.last_cap = ceiling
        self.capped_steps = 0  # plans whose cap was below the ceiling
        self.relaxed_steps = 0  # plans whose cap the waiting prompts raised above what fits the target
        self._ratios: deque[float] = deque(maxlen=RATIOS)  # recent MIXED steps: time / predicted time
        # Steps already launched that the next plan runs after (overlapped scheduling: 1, set by
        # the engine): a waiting prompt's first token waits for them too.
        self.steps_ahead = 0

    # ---------------- measurements ----------------
    def observe(self, plan, seconds: float) -> None:
        """One completed plan and the time it took."""
        if plan.mode not in (ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.EXTEND) or seconds <= 0:
            return
        if any(r.encoder_len for r in plan.reqs):  # an encoder ran whole in it: not modelled
            return
        decodes = [r for r in plan.reqs if len(r.input_ids) == 1]
        d, k = len(decodes), sum(r.prefix_len for r in decodes)
        if plan.mode == ForwardMode.DECODE:
            if self._coef is not None:
                seconds = min(seconds, CLIP * max(self.decode_s(d, k), 1e-4))
            self._decode.add(self._features(d, k), seconds)
            self._decode_steps += 1
            if self._decode_steps >= MIN_DECODE_STEPS and (self._coef is None or self._decode_steps % REFIT == 0):
                self._coef = self._decode.solve()
            return
        prompt = sum(len(r.input_ids) for r in plan.reqs) - d
        mixed = plan.mode == ForwardMode.MIXED
        if self._coef is None or prompt <= 0:  # (the first prompts pay first-use costs: warm-up)
            return
        size = self._size_of(prompt)
        if mixed and self._prompt is not None:  # how far over its prediction this step ran
            self._ratios.append(min(seconds / max(self.decode_s(d, k) + self.prompt_s(size), 1e-4), CLIP))
        spent = max(seconds - (self.decode_s(d, k) if mixed else 0.0), 0.0)
        if self._prompt is not None:
            spent = min(spent, CLIP * max(self.prompt_s(size), 1e-4))
        self._prompt_fit.add(np.array([1.0, size / 1000.0]), spent)
        p, r = self._prompt_fit.solve()
        self._prompt = (float(p), float(r))

    @staticmethod
    def _features(d: int, k: int) -> np.ndarray:
        return np.array([1.0, d / 100.0, k / 1e5])

    def decode_s(self, decodes: int, kv_tokens: int) -> float:
        """The decodes' part of a step, predicted (0 before the fit)."""
        if self._coef is None:
            return 0.0
        return max(float(self._features(decodes, kv_tokens) @ self._coef), 0.0)

    def prompt_s(self, size: int) -> float | None:
        """The prompt part of a step computing `size` tokens, predicted (None: nothing seen)."""
        if self._prompt is None:
            return None
        p, r = self._prompt
        return p + r * self._size_of(size) / 1000.0

    # ---------------- the cap ----------------
    def margin(self) -> float:
        """What the next MIXED step's predicted time is multiplied by before it is held to the
        target: the TAIL quantile of recent MIXED steps' time over their prediction, in [1, CLIP]
        (1 until MIN_RATIOS have been seen)."""
        if len(self._ratios) < MIN_RATIOS:
            return 1.0
        ranked = sorted(self._ratios)
        return min(max(ranked[min(len(ranked) - 1, int(TAIL * len(ranked)))], 1.0), CLIP)

    def prompt_tokens(self, decodes: int, kv_tokens: int, backlog: Sequence[tuple[float, int]] = ()) -> int:
        """The prompt tokens the next step may compute beside `decodes` decoding requests that
        read `kv_tokens` KV tokens, while the prompts of `backlog` wait to be computed (each as
        the seconds it has waited and the tokens it has left, in the order they will be computed:
        `prompt_backlog`)."""
        cap = self.ceiling
        if self._coef is not None and self._prompt is not None:
            decode_s = self.decode_s(decodes, kv_tokens)
            left = self.target_s / self.margin() - decode_s
            cap = self.floor
            for size in self._sizes_down:
                if size <= self.floor:
                    break
                if self.prompt_s(size) <= left:
                    cap = size
                    break
            limit = self.ttft_target_s
            if cap < self.ceiling and backlog and self.first_token_s(cap, decode_s, backlog) > limit:
                cap = next((s for s in reversed(self._sizes_down)
                            if s > cap and self.first_token_s(s, decode_s, backlog) <= limit), self.ceiling)
                self.relaxed_steps += 1
        self.last_cap = cap
        self.capped_steps += cap < self.ceiling
        return cap

    def first_token_s(self, size: int, decode_s: float, backlog: Sequence[tuple[float, int]]) -> float:
        """The latest first token among `backlog`'s prompts, predicted for steps of `size` prompt
        tokens (and decodes costing `decode_s`): each prompt's wait so far plus the steps that
        compute it and every prompt ahead of it, after `steps_ahead` already launched (priced
        alike). A prompt that has waited long makes the cap grow even when little waits behind
        it; a long queue, even when nothing in it is old."""
        step = decode_s + self.prompt_s(size)
        worst, ahead = 0.0, 0
        for waited, tokens in backlog:
            ahead += tokens
            worst = max(worst, waited + (self.steps_ahead + -(-ahead // size)) * step)
        return worst

    def _size_of(self, tokens: int) -> int:
        """The size a prompt forward of `tokens` tokens runs at."""
        if self.sizes and tokens <= self.sizes[-1]:
            return self.sizes[bisect.bisect_left(self.sizes, tokens)]
        return -(-tokens // self.granule) * self.granule

    def stats(self) -> dict:
        coef = [] if self._coef is None else [float(c) for c in self._coef]
        return {"target_ms": 1e3 * self.target_s, "ttft_target_ms": 1e3 * self.ttft_target_s,
                "last_cap": self.last_cap, "capped_steps": self.capped_steps, "relaxed_steps": self.relaxed_steps,
                "margin": self.margin(),
                "decode_fit_ms": [1e3 * c for c in coef],  # a, b per 100 decodes, c per 100k KV tokens
                # p, and r per 1000 tokens of the padded size
                "prompt_fit_ms": [] if self._prompt is None else [1e3 * c for c in self._prompt]}


def for_config(config, chunked_prefill_size: int, prompt_buckets: Sequence[int]) -> StepBudget | None:
    """The step budget an engine config asks for (`itl_target_ms`), or None. The prompt ceiling is
    the config's prefill cap (else its batched-token limit); a prompt always takes a quarter of it,
    at most 256 tokens. Without chunking (the checkpoint computes whole prompts) there is none."""
    if not config.itl_target_ms or chunked_prefill_size <= 0:
        return None
    ceiling = config.prefill_cap or config.max_num_batched_tokens
    return StepBudget(config.itl_target_ms / 1e3, ceiling=ceiling,
                      floor=max(config.page_size, min(256, ceiling // 4)),
                      sizes=tuple(prompt_buckets) if config.prompt_graphs else None,
                      ttft_target_s=config.ttft_target_ms / 1e3 if config.ttft_target_ms else None)


def prompt_backlog(scheduler, limit: int, now: float | None = None) -> list[tuple[float, int]]:
    """The prompts a scheduler's running requests and the waiting ones it has free running
    slots for still have to compute, in the order it computes them: (seconds since the request
    arrived, prompt tokens left). Only requests still to send their first token count (not a
    preempted one recomputing, nor one resumed from a prefill replica's first token); a waiting
    prompt's cached prefix is not known yet; a queue held back by the slots is not one a bigger
    cap would drain. Counting stops past `limit` tokens."""
    now = time.monotonic() if now is None else now
    out, n = [], 0
    slots = max(0, scheduler.max_running - len(scheduler.running))
    for req in itertools.chain(scheduler.running, itertools.islice(scheduler.waiting, slots)):
        if req.output_ids:  # its first token is out (preempted, resumed from a prefill replica)
            continue
        left = req.num_tokens - req.num_computed
        if left > 1:
            out.append((now - req.arrival_time, left))
            n += left
            if n > limit:
                break
    return out


class ForgettingFit:
    """Least squares over a stream of (x, y) with exponential forgetting, coefficients >= 0:
    the normal equations, each old observation's weight times `forget` per new one. `prior`:
    the weight of a pseudo-observation that the first feature alone (the constant) explains
    nothing, never forgotten."""

    def __init__(self, n: int, forget: float, prior: float = 0.0):
        self.forget = forget
        self._prior = np.zeros((n, n))
        self._prior[0, 0] = prior
        self.xtx = self._prior.copy()
        self.xty = np.zeros(n)

    def add(self, x: np.ndarray, y: float) -> None:
        self.xtx = self.forget * (self.xtx - self._prior) + np.outer(x, x) + self._prior
        self.xty = self.forget * self.xty + x * y

    def solve(self) -> np.ndarray:
        return nonnegative_fit(self.xtx, self.xty)


def nonnegative_fit(xtx: np.ndarray, xty: np.ndarray) -> np.ndarray:
    """argmin |Xb - y|^2 over b >= 0, from the normal equations (X'X, X'y): the best of the
    unconstrained solutions on each subset of the features whose coefficients are all >= 0."""
    n = len(xty)
    try:  # the usual case, one solve: the unconstrained optimum is feasible, hence the answer
        b = np.linalg.solve(xtx + 1e-12 * np.eye(n), xty)
        if (b >= 0).all():
            return b
    except np.linalg.LinAlgError:
        pass
    best, best_loss = np.zeros(n), 0.0  # (all zero: loss y'y, the same constant dropped from every loss)
    for mask in range(1, 1 << n):
        idx = [i for i in range(n) if mask >> i & 1]
        sub = xtx[np.ix_(idx, idx)] + 1e-12 * np.eye(len(idx))
        try:
            b = np.linalg.solve(sub, xty[idx])
        except np.linalg.LinAlgError:
            continue
        if (b < 0).any():
            continue
        loss = float(b @ sub @ b - 2 * b @ xty[idx])
        if loss < best_loss:
            full = np.zeros(n)
            full[idx] = b
            best, best_loss = full, loss
    return best
