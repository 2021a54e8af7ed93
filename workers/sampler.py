"""Next-token sampling: the LM head's logits in, one token (and maybe logprobs) per request out.

Runs on TP rank 0 of each worker, on the worker's device (CPU or CUDA), once per step. Every
tensor operation works on the whole batch, or on the sub-batch of rows that need it (rows with
penalties, rows that sample rather than take the argmax, rows that want logprobs); which rows
need what is decided on the host from the `SamplingParams`, so no step waits on the device to
decide. The only Python loop over requests that launches device work is the one that draws the
noise of seeded requests. Host-to-device copies are from pinned memory, and the results come
back through one synchronisation at the end.

Order of operations in `Sampler.sample` (vLLM/HF conventions):
  1. penalties (repetition, then frequency and presence)
  2. logit_bias, then min_tokens (stop tokens masked while the output is too short)
  3. structured output: the grammar's token mask (`workers.grammar_masks`)
  4. logprobs, from these processed logits (before temperature and truncation)
  5. greedy rows: argmax
  6. other rows: temperature, top-k, top-p, min-p, then one draw per row
  7. seeded rows draw their noise from a generator keyed by (seed, output position)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from workers.grammar_masks import GrammarMatchers, consume
from workers.messages import TokenLogprobs
from workers.sampling_params import SamplingParams

# Logprobs are clamped here, as the OpenAI API does, so a masked token (-inf) stays valid JSON.
LOGPROB_FLOOR = -9999.0

_MASK64 = (1 << 64) - 1

# A batch whose rows all have a top_k no larger than this truncates with torch.topk (k columns);
# otherwise it sorts the whole vocabulary (topk's edge fades as k grows).
_TOPK_MAX = 1024


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """[B] int64 row argmax, ties to the lowest id (NaN above all, as torch): on CUDA a Triton
    kernel that splits each row over many programs (torch's reduce takes one block a row)."""
    if logits.is_cuda:
        from workers import argmax_kernel  # Triton: CUDA installs only

        return argmax_kernel.argmax_rows(logits)
    return logits.argmax(dim=-1)


def _mix64(x: int) -> int:
    """SplitMix64's finaliser: a bijection on 64-bit ints that spreads every input bit."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def seed_for_position(seed: int, position: int) -> int:
    """The generator seed of a seeded request's draw at output position `position`.

    A pure function of (seed, position), stable across processes and Python versions (unlike
    `hash`), so a request gets the same noise wherever and whenever that position is sampled.
    """
    return _mix64((_mix64(seed & _MASK64) + position + 0x9E3779B97F4A7C15) & _MASK64)


@dataclass
class RequestSamplingState:
    """One running request's sampling inputs; the worker keeps it across steps.

    The worker appends each sampled token to `output_ids` (and, after a preemption, builds a
    new state holding the tokens generated so far): `len(output_ids)` is the output position
    of the next token, which keys a seeded request's noise. `prompt_ids` never changes and
    `output_ids` only grows: the penalties cache both as tensors (private fields below) and
    copy only the new output tokens each step.
    """

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    # Caches of the penalties, filled by the Sampler on first use.
    # The distinct prompt ids in [0, vocab_size), on the sampler's device.
    _prompt_dev: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    # The output ids in [0, vocab_size) so far, on the host: _out_buf[:_out_kept] holds those of
    # output_ids[:_out_seen]. numpy, since a step touches it once per request (torch's per-call
    # overhead is several times numpy's).
    _out_buf: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _out_seen: int = field(default=0, init=False, repr=False, compare=False)
    _out_kept: int = field(default=0, init=False, repr=False, compare=False)
    # Structured output: the request's llguidance matcher (rank 0 sets it; None: unconstrained).
    matcher: Any = field(default=None, repr=False, compare=False)

    def extend(self, tokens: list[int]) -> None:
        """The request emitted these tokens: append them, and advance its grammar over them."""
        self.output_ids.extend(tokens)
        if self.matcher is not None:
            consume(self.matcher, tokens)

    def output_array(self, vocab_size: int) -> np.ndarray:
        """The output ids in [0, vocab_size) as an int64 array view; copies only new tokens."""
        n = len(self.output_ids)
        if self._out_buf is None or n < self._out_seen:  # first use, or the list was replaced
            self._out_buf, self._out_seen, self._out_kept = np.empty(max(16, n), dtype=np.int64), 0, 0
        if n > self._out_seen:
            new = [t for t in self.output_ids[self._out_seen :] if 0 <= t < vocab_size]
            end = self._out_kept + len(new)
            if end > len(self._out_buf):
                grown = np.empty(max(end, 2 * len(self._out_buf)), dtype=np.int64)
                grown[: self._out_kept] = self._out_buf[: self._out_kept]
                self._out_buf = grown
            self._out_buf[self._out_kept : end] = new
            self._out_seen, self._out_kept = n, end
        return self._out_buf[: self._out_kept]


@dataclass
class SampleOutput:
    token_ids: list[int]  # [B], in batch order
    logprobs: list[TokenLogprobs | None]  # [B]: None where params.logprobs is None


class PendingSample:
    """A draw in flight: `token_ids` [B] on the device now, the host lists after `wait()`."""

    def __init__(self, token_ids: torch.Tensor, fetched: list[torch.Tensor], lp_counts: list[int],
                 lp_rows: list[int] | None, event: torch.cuda.Event | None = None):
        self.token_ids = token_ids
        self._fetched, self._lp_counts, self._lp_rows, self._event = fetched, lp_counts, lp_rows or [], event

    def wait(self) -> SampleOutput:
        if self._event is not None:
            self._event.synchronize()
        fetched = [t.tolist() for t in self._fetched]
        if not fetched:
            return SampleOutput(token_ids=[], logprobs=[])
        out_logprobs: list[TokenLogprobs | None] = [None] * len(fetched[0])
        for j, (i, k) in enumerate(zip(self._lp_rows, self._lp_counts)):
            top = list(zip(fetched[3][j][:k], fetched[2][j][:k], strict=True)) if k > 0 else []
            out_logprobs[i] = TokenLogprobs(token_logprob=fetched[1][j], top=top)
        return SampleOutput(token_ids=fetched[0], logprobs=out_logprobs)


class Sampler:
    """Samples one token per row of a batch of logits.

    Logprobs (a choice; document it in the API docs): the log-softmax of the logits after the
    penalties and the min_tokens mask but before temperature, top-k, top-p and min-p, i.e. the
    model's distribution as the request's penalties reshape it, independent of how the draw is
    tempered or truncated. This is vLLM's `logprobs_mode="processed_logprobs"` (its default,
    "raw_logprobs", is taken before the penalties as well). A sampled token's logprob is
    therefore not the probability it was drawn with when temperature != 1 or truncation is on.
    Values are clamped at `LOGPROB_FLOOR`.

    `vocab_size` is the tokenizer's vocabulary: logits may have more columns (the LM head's
    padded vocabulary), and those ids are never sampled nor reported. `eos_token_ids` are the
    tokens min_tokens holds back (besides each request's stop_token_ids).
    """

    def __init__(self, vocab_size: int, device: torch.device | str, eos_token_ids: Iterable[int] = ()):
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self._pin = self.device.type == "cuda"
        self._positions = torch.arange(vocab_size, device=self.device)  # [V], sorted-rank of a column
        # Reseeded before every seeded draw; manual_seed also resets its offset, so a draw
        # depends on the seed alone.
        self._seeded_gen = torch.Generator(device=self.device)
        # Structured output's matchers and masks (the runner sets it where a tokenizer exists).
        self.grammars: GrammarMatchers | None = None

    def warm_up(self, max_rows: int) -> None:
        """On CUDA, compile the argmax launches of every batch up to `max_rows` rows at
        start-up, not in the first serving steps that meet them."""
        if self.device.type == "cuda":
            from workers import argmax_kernel  # Triton: CUDA installs only

            argmax_kernel.warm_up(self.device, self.vocab_size, max_rows)

    # -- host-side helpers ------------------------------------------------------------------

    def _upload(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """CPU tensors of one dtype onto the device in one pinned, non-blocking copy.

        Each is flattened; the results are views of one device buffer, in argument order.
        """
        if any(t.dtype != tensors[0].dtype for t in tensors[1:]):  # (caught on CPU too: nothing is concatenated)
            raise TypeError(f"_upload takes tensors of one dtype, got {[t.dtype for t in tensors]}")
        if self.device.type == "cpu":
            return [t.reshape(-1) for t in tensors]
        buf = torch.cat([t.reshape(-1) for t in tensors])
        if self._pin:
            buf = buf.pin_memory()
        return list(buf.to(self.device, non_blocking=True).split([t.numel() for t in tensors]))

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return self._upload(torch.tensor(values, dtype=dtype))[0]

    def _prompt_ids(self, state: RequestSamplingState) -> torch.Tensor:
        """The state's distinct prompt ids in [0, vocab_size), on the device; uploaded once."""
        if state._prompt_dev is None:
            ids = torch.tensor(state.prompt_ids, dtype=torch.long)
            state._prompt_dev = self._upload(ids[(ids >= 0) & (ids < self.vocab_size)].unique())[0]
        return state._prompt_dev

    # -- the step ---------------------------------------------------------------------------

    def sample(self, logits: torch.Tensor, states: list[RequestSamplingState]) -> SampleOutput:
        """logits: [B, V'] on the sampler's device (any float dtype), V' >= vocab_size, one row
        per state, in the same order. The caller's tensor is not modified; `states` are read,
        not changed (appending the sampled tokens to output_ids is the caller's job).
        """
        return self.launch(logits, states).wait()

    def launch(self, logits: torch.Tensor, states: list[RequestSamplingState],
               grammar_masks: Future | None = None) -> PendingSample:
        """`sample` without waiting: the draw is enqueued on the device, its results start
        their copy to the host, and `PendingSample.wait()` returns them. Meanwhile the caller
        may enqueue more work (and read `token_ids` on the device). `grammar_masks`: the
        constrained rows' masks, already being filled (`GrammarMatchers.fill_async`)."""
        B, V = len(states), self.vocab_size
        if logits.dim() != 2 or logits.shape[0] != B or logits.shape[1] < V:
            raise ValueError(f"logits must be [{B}, >= {V}], got {list(logits.shape)}")
        if B == 0:
            return PendingSample(torch.empty(0, dtype=torch.long, device=self.device), [], [], None)
        # The slice drops the padded vocabulary, so ids >= vocab_size can never be chosen. The
        # penalties and min_tokens mask in place: then a copy keeps the caller's tensor intact
        # (else nothing below writes to it, and a float32 row, as a decode graph's, is read as is).
        params = [s.params for s in states]
        masks = any(p.needs_adjustment or len(s.output_ids) < p.min_tokens for p, s in zip(params, states))
        logits = logits[:, :V].to(torch.float32, copy=masks).contiguous()

        if masks:  # (else no row asks for any of these: skip their walks over the batch)
            self._apply_penalties(logits, states)
            self._apply_logit_bias(logits, states)
            self._apply_min_tokens(logits, states)
            self.apply_grammar(logits, states, grammar_masks)

        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        lp_rows_t = self._tensor(lp_rows, torch.long) if 0 < len(lp_rows) < B else None
        logprobs = None
        if lp_rows:
            # Before temperature/truncation, so these are the processed model logprobs.
            lp_logits = logits if lp_rows_t is None else logits.index_select(0, lp_rows_t)
            logprobs = lp_logits.log_softmax(dim=-1)

        token_ids = self._choose(logits, states)

        to_fetch = [token_ids]
        if logprobs is not None:
            chosen = token_ids if lp_rows_t is None else token_ids.index_select(0, lp_rows_t)
            to_fetch.append(logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).clamp_min(LOGPROB_FLOOR))
            k_max = min(max(params[i].logprobs for i in lp_rows), V)
            if k_max > 0:
                top_lp, top_ids = logprobs.topk(k_max, dim=-1)  # sorted, best first
                to_fetch += [top_lp.clamp_min(LOGPROB_FLOOR), top_ids]

        if self.device.type != "cuda":
            return PendingSample(token_ids, to_fetch, [min(params[i].logprobs, V) for i in lp_rows], lp_rows)
        # Non-blocking copies to pinned host memory; one event covers them all.
        host = [t.to("cpu", non_blocking=True) for t in to_fetch]
        event = torch.cuda.Event()
        event.record()
        return PendingSample(token_ids, host, [min(params[i].logprobs, V) for i in lp_rows], lp_rows, event)

    # -- 1. penalties -----------------------------------------------------------------------

    def _apply_penalties(self, logits: torch.Tensor, states: list[RequestSamplingState]) -> None:
        """In place on logits [B, V], for the rows whose params ask for penalties.

        repetition_penalty (HF/CTRL): over every distinct token of prompt + output, a positive
        logit is divided by the penalty and a negative one multiplied by it (both push it down
        for a penalty > 1). Then, over output tokens only (OpenAI/vLLM order):
        frequency_penalty * count is subtracted, then presence_penalty once per distinct token.

        The work is O(tokens of the penalised requests), not O(rows * V): values are gathered at
        the flat indices of the tokens, changed, and written back. A token listed twice is read
        twice from the same old value and written twice with the same new value, so duplicates
        need no de-duplication; index_add_ of equal addends gives the same sum in any order.
        """
        rows = [i for i, s in enumerate(states) if s.params.needs_penalties]
        if not rows:
            return
        V, P = self.vocab_size, len(rows)
        sub = [states[i] for i in rows]
        do_rep = any(s.params.repetition_penalty != 1.0 for s in sub)
        do_freq = any(s.params.frequency_penalty != 0.0 for s in sub)
        do_pres = any(s.params.presence_penalty != 0.0 for s in sub)

        # Host: cached output ids and per-row numbers, one upload per dtype.
        outs = [s.output_array(V) for s in sub]
        prompts = [self._prompt_ids(s) for s in sub] if do_rep else []
        out_lens = [len(a) for a in outs]
        prompt_lens = [t.shape[0] for t in prompts]
        n_out, n_prompt = sum(out_lens), sum(prompt_lens)
        rows_d, out_lens_d, prompt_lens_d, out_ids_d = self._upload(
            torch.tensor(rows, dtype=torch.long),
            torch.tensor(out_lens, dtype=torch.long),
            torch.tensor(prompt_lens, dtype=torch.long),
            torch.from_numpy(np.concatenate(outs)),
        )
        rep_d, freq_d, pres_d = self._upload(
            torch.tensor(
                [
                    [s.params.repetition_penalty for s in sub],
                    [-s.params.frequency_penalty for s in sub],
                    [-s.params.presence_penalty for s in sub],
                ],
                dtype=torch.float32,
            )
        )[0].view(3, P)

        # Device: flat indices row * V + id of every token (output_size spares a sync).
        sub_rows = torch.arange(P, device=self.device)
        out_owner = sub_rows.repeat_interleave(out_lens_d, output_size=n_out)
        out_flat = rows_d[out_owner] * V + out_ids_d
        flat_logits = logits.view(-1)
        if do_rep:
            prompt_owner = sub_rows.repeat_interleave(prompt_lens_d, output_size=n_prompt)
            seen_owner = torch.cat([prompt_owner, out_owner])
            seen_flat = torch.cat([rows_d[prompt_owner] * V + torch.cat(prompts), out_flat])
            rep = rep_d[seen_owner]  # 1.0 on rows without one: a no-op
            v = flat_logits.index_select(0, seen_flat)
            flat_logits.index_copy_(0, seen_flat, torch.where(v < 0, v * rep, v / rep))
        if do_freq:
            flat_logits.index_add_(0, out_flat, freq_d[out_owner])
        if do_pres:
            flat_logits.index_copy_(
                0, out_flat, flat_logits.index_select(0, out_flat).add_(pres_d[out_owner])
            )

    # -- 2. logit bias ----------------------------------------------------------------------

    def _apply_logit_bias(self, logits: torch.Tensor, states: list[RequestSamplingState]) -> None:
        """In place on logits [B, V]: each row's (token, bias) pairs added (OpenAI's logit_bias;
        -100 all but bans a token, +100 all but forces it)."""
        V = self.vocab_size
        flat = [(i * V + t, b) for i, s in enumerate(states) for t, b in s.params.logit_bias if 0 <= t < V]
        if flat:
            idx = self._tensor([f for f, _ in flat], torch.long)
            add = self._tensor([b for _, b in flat], torch.float32)
            logits.view(-1).index_add_(0, idx, add)

    # -- 2b. min_tokens ---------------------------------------------------------------------

    def _apply_min_tokens(self, logits: torch.Tensor, states: list[RequestSamplingState]) -> None:
        """While len(output_ids) < min_tokens, the request's stop tokens get -inf: its
        stop_token_ids and the eos tokens (unless ignore_eos, where eos does not stop a request
        and is left alone, as in vLLM)."""
        V = self.vocab_size
        flat: list[int] = []
        for i, s in enumerate(states):
            p = s.params
            if len(s.output_ids) >= p.min_tokens or s.matcher is not None:  # a grammar decides
                continue
            stops = set(p.stop_token_ids)
            if not p.ignore_eos:
                stops |= self.eos_token_ids
            flat.extend(i * V + t for t in stops if 0 <= t < V)
        if flat:
            logits.view(-1).index_fill_(0, self._tensor(flat, torch.long), -math.inf)

    # -- 3. structured output ---------------------------------------------------------------

    def apply_grammar(self, logits: torch.Tensor, states: list[RequestSamplingState],
                      masks: Future | None = None) -> None:
        """In place on logits [B, V]: each constrained row keeps only the tokens its grammar
        allows next. The masks are filled on the host now (while the device runs what was
        enqueued before), or were being filled since `masks` was started."""
        if self.grammars is None:
            return
        if masks is not None:
            rows, mask = masks.result()
        else:
            rows = [i for i, s in enumerate(states) if s.matcher is not None]
            mask = self.grammars.fill([states[i].matcher for i in rows]) if rows else None
        if rows:
            self.grammars.apply(logits, rows, mask)

    # -- 5-7. choosing the token ------------------------------------------------------------

    def _choose(self, logits: torch.Tensor, states: list[RequestSamplingState]) -> torch.Tensor:
        """[B] token ids on the device: argmax for greedy rows, a random draw for the others."""
        B = len(states)
        draw_rows = [i for i, s in enumerate(states) if not s.params.greedy]
        if not draw_rows:
            # Greedy (temperature 0 or top_k 1): argmax, ties to the lowest id.
            return _argmax(logits)
        if len(draw_rows) == B:
            return self._draw(logits, states)
        rows_t = self._tensor(draw_rows, torch.long)
        drawn = self._draw(logits.index_select(0, rows_t), [states[i] for i in draw_rows])
        return _argmax(logits).index_copy_(0, rows_t, drawn)

    def _draw(self, logits: torch.Tensor, states: list[RequestSamplingState]) -> torch.Tensor:
        """One draw per row of logits [S, V] (non-greedy rows only); returns [S] ids.

        temperature divides the logits; top_k keeps the k best (by rank: exactly k; -1/0 =
        off); top_p keeps the smallest prefix of the best tokens whose probability, renormalised
        after top-k, reaches top_p (always at least the best token); min_p drops tokens whose
        probability is below min_p times the best one's. The draw is the exponential race
        argmax(p / q), q ~ Exp(1) i.i.d. per token id, which picks token t with probability
        p_t / sum(p): masked probabilities are zeroed and need no renormalisation.

        Truncation works on the logits sorted once per batch: by torch.topk when every row has a
        top_k (cheap: k columns), by a full stable sort otherwise (equal logits rank by id, as
        argmax does). The noise is drawn per token id and gathered into that order, so a row's
        draw does not depend on which of the two orders the batch used.
        """
        S, V = logits.shape
        params = [s.params for s in states]
        top_k = [p.top_k if 0 < p.top_k < V else V for p in params]
        use_k = any(k < V for k in top_k)
        use_p = any(p.top_p < 1.0 for p in params)
        use_min_p = any(p.min_p > 0.0 for p in params)
        # top_p = 1 must keep everything, even where rounding lets the cumulative sum reach 1
        # before the tail: such rows get a threshold no sum reaches.
        per_row = torch.tensor(
            [
                [p.temperature for p in params],
                [p.top_p if p.top_p < 1.0 else 2.0 for p in params],
                [p.min_p for p in params],
            ],
            dtype=torch.float32,
        )
        longs = [torch.tensor(top_k, dtype=torch.long)] if use_k else []
        temp_t, top_p_t, min_p_t = (t.unsqueeze(1) for t in self._upload(per_row)[0].view(3, S))
        x = logits / temp_t
        noise = self._exponential_noise(states, V)

        if not (use_k or use_p):
            probs = x.softmax(dim=-1)
            if use_min_p:
                probs.masked_fill_(probs < min_p_t * probs.amax(dim=-1, keepdim=True), 0.0)
            return _argmax(probs.div_(noise))

        k_max = max(top_k)
        if k_max <= _TOPK_MAX:
            sorted_x, order = x.topk(k_max, dim=-1, sorted=True)
        else:
            sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
        if use_k:
            k_t = self._upload(*longs)[0].unsqueeze(1)
            sorted_x.masked_fill_(self._positions[: sorted_x.shape[1]] >= k_t, -math.inf)
        probs = sorted_x.softmax(dim=-1)
        if use_p:
            mass_before = probs.cumsum(dim=-1).sub_(probs)
            probs.masked_fill_(mass_before >= top_p_t, 0.0)
        if use_min_p:
            probs.masked_fill_(probs < min_p_t * probs[:, :1], 0.0)
        choice = _argmax(probs.div_(noise.gather(1, order))).unsqueeze(1)
        return order.gather(1, choice).squeeze(1)

    def _exponential_noise(self, states: list[RequestSamplingState], V: int) -> torch.Tensor:
        """[S, V] i.i.d. Exp(1) noise on the device.

        Unseeded rows share one batched draw from the device's default generator. A seeded row
        is drawn alone, from a generator seeded by
        seed_for_position(seed, len(output_ids)): the same (seed, position) gives the same noise
        whatever else is in the batch, the row's place in it, or how often the position is
        recomputed (preemption).
        """
        q = torch.empty(len(states), V, device=self.device, dtype=torch.float32)
        seeded = [(i, s) for i, s in enumerate(states) if s.params.seed is not None]
        if len(seeded) < len(states):
            q.exponential_()
        gen = self._seeded_gen
        for i, s in seeded:
            gen.manual_seed(seed_for_position(s.params.seed, len(s.output_ids)))
            # A contiguous [V] row: its values depend on the generator state and V alone.
            q[i].exponential_(generator=gen)
        # Exp(1) can round to 0; a 0 would make p / q inf (or nan where p = 0).
        return q.clamp_min_(torch.finfo(torch.float32).tiny)


__all__ = ["LOGPROB_FLOOR", "RequestSamplingState", "SampleOutput", "Sampler", "seed_for_position"]
