"""Scheduling with speculative decoding: prefill steps as usual, decodes as speculative rounds.

The model of a step: while any request still has prompt to compute (or a waiting request can
be admitted), a step is the base scheduler's (`cluster.engine.scheduler.Scheduler.schedule`): prefill
chunks and one-token decodes in one batch, which the draft model computes too, into its own
pool at the same slots. Otherwise the step is one speculative round (a `SpecStepPlan`, mode
TARGET_VERIFY) over every decoding request: each reserves the K + 1 positions L .. L + K (its
last token t0 and K drafts), the ranks draft, verify and accept, and the results come back as
1 .. K + 1 tokens per request.

KV bookkeeping (the draft's pool mirrors the target's slots, so one allocator serves both):
- After a round that accepted n drafts the request keeps L + n + 1 positions (t0 and the
  accepted drafts); `RequestKV.truncate` frees the rest, i.e. the rejected tokens' slots of both
  models.
- The draft wrote positions L .. L + K - 1 with t0 and drafts 1..K-1, so its K/V is valid up to
  L + min(n, K - 1): one position short of the target's when every draft was accepted. The
  scheduler remembers each request's draft length and sends the missing token with the next
  round (the draft's DRAFT_EXTEND_V2 catch-up).
- A request's pages go to the radix cache only as far as both models hold valid K/V (and no
  further than its token ids), so a cache hit serves the draft as well as the target.

Stop conditions (eos, stop token ids, max_tokens, the context limit) are checked token by token
over a round's accepted tokens; tokens after a stop are dropped. Stop strings are cut the same
way by the engine's detokenizer (`Detokenizer.add_tokens_until_stop`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from cluster.engine.config import EngineConfig
from cluster.engine.kv_allocator import slots_for
from cluster.engine.request import Request
from cluster.engine.scheduler import Scheduler, TokenEvent
from workers.forward_batch import ForwardMode
from workers.messages import ScheduledReq, StepPlan, StepResult
from workers.spec_messages import SpecStepPlan, SpecStepResult


def scheduler_class(config: EngineConfig) -> Callable[..., Scheduler]:
    """The scheduler an engine with this config runs (keyword arguments as `Scheduler`'s)."""
    if config.speculative_draft_model is None:
        return Scheduler
    return functools.partial(SpecScheduler, num_draft_tokens=config.speculative_num_tokens)


class SpecScheduler(Scheduler):
    def __init__(self, *, num_draft_tokens: int, **kwargs):
        super().__init__(**kwargs)
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        self.num_draft_tokens = num_draft_tokens
        # rid -> positions whose K/V the draft holds (<= req.num_computed); absent: all of them.
        self.draft_lens: dict[str, int] = {}

    # ---------------- planning ----------------
    def _prefill_pending(self) -> bool:
        if any(not self._decoding(r) for r in self.running):
            return True
        return bool(self.waiting) and len(self.running) < self.max_running and bool(self._free_rows)

    def schedule(self) -> StepPlan | None:
        if not self._prefill_pending():
            dropped, self._pending_drop = self._pending_drop, []
            return self._round(dropped)
        plan = super().schedule()
        if (plan is not None and plan.reqs and not plan.new_requests
                and all(self._decoding_piece(sr) for sr in plan.reqs)):
            # Admission was blocked (KV memory): speculate rather than decode one token each.
            for sr in plan.reqs:
                req = self.requests[sr.rid]
                assert req.kv is not None
                req.kv.truncate(self.allocator, req.kv.num_tokens - len(sr.input_ids))
            return self._round(plan.finished_rids)
        return plan

    def _decoding_piece(self, sr: ScheduledReq) -> bool:
        req = self.requests[sr.rid]
        return bool(req.output_ids) and len(sr.input_ids) == 1 and sr.prefix_len == req.num_tokens - 1

    def _round(self, dropped: list[str]) -> StepPlan | None:
        """One speculative round over the decoding requests (all running ones, here)."""
        decoding = [r for r in self.running if self._decoding(r)]
        reqs: list[ScheduledReq] = []
        k = self.num_draft_tokens
        if decoding:
            # K for this round: the same for every request; the round's K + 1 positions must
            # stay inside the context and the step inside the token budget.
            room = min(self.max_context_len - 1 - r.num_computed for r in decoding)
            k = max(1, min(k, self.max_batched_tokens // len(decoding) - 1, room))
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if not self._decoding(req):
                i += 1
                continue
            L = req.num_computed
            slots = self._reserve_or_preempt(req, k + 1)  # may preempt newer requests, or req
            if slots is None:
                continue
            assert req.kv is not None
            d = self.draft_lens.get(req.rid, L)
            reqs.append(ScheduledReq(
                rid=req.rid,
                req_pool_idx=req.req_pool_idx,
                input_ids=req.ids_slice(d, L + 1),
                prefix_len=d,
                out_cache_loc=slots_for(req.kv.pages, d, L - d, self.page_size) + slots,
            ))
            i += 1
        # Requests preempted above are dropped on the workers with this plan.
        dropped += self._pending_drop
        self._pending_drop = []
        orders = self.kv_offload.orders() if self.kv_offload is not None else None
        if not reqs and not dropped and orders is None:
            return None
        self._step_id += 1
        plan: StepPlan
        if reqs:
            plan = SpecStepPlan(self._step_id, ForwardMode.TARGET_VERIFY, reqs, [], dropped, [], num_draft_tokens=k)
        else:
            plan = StepPlan(self._step_id, ForwardMode.IDLE, [], [], dropped, [])
        if orders is not None:  # the KV store's orders ride on every step
            orders.apply(plan)
        return plan

    # ---------------- results ----------------
    def process_result(self, plan: StepPlan, result: StepResult) -> list[TokenEvent]:
        if not isinstance(plan, SpecStepPlan):
            # Both models computed this plan's pieces. A decoding request whose draft lagged
            # (a fully accepted round) keeps its draft length: the draft wrote the piece but
            # not the position before it, which the next round's catch-up sends again.
            for sr in plan.reqs:
                req = self.requests.get(sr.rid)
                d = self.draft_lens.get(sr.rid)
                if req is not None and req.kv is not None and (d is None or d >= sr.prefix_len):
                    self.draft_lens[sr.rid] = req.num_computed
            return super().process_result(plan, result)
        assert isinstance(result, SpecStepResult)
        if self.kv_offload is not None:
            self.kv_offload.on_result(plan, result)
        K = plan.num_draft_tokens
        index = {rid: j for j, rid in enumerate(result.sampled_rids)}
        events: list[TokenEvent] = []
        for sr in plan.reqs:
            req = self.requests.get(sr.rid)
            if req is None or req.finished:
                continue  # aborted while the round ran (its pages are already free)
            assert req.kv is not None
            j = index[sr.rid]
            n = result.spec_num_accepted[j]
            L = sr.prefix_len + len(sr.input_ids) - 1
            # Keep t0 and the accepted drafts; free the rejected positions (both models).
            req.kv.truncate(self.allocator, L + n + 1)
            self.draft_lens[sr.rid] = L + 1 + min(n, K - 1)
            self.stats.spec_draft_tokens += K
            self.stats.spec_accepted_tokens += n
            self.stats.spec_verify_requests += 1
            toks, lps = result.spec_token_ids[j], result.spec_logprobs[j]
            kept = 0
            for tok in toks:
                req.output_ids.append(tok)
                kept += 1
                reason = self._token_finish_reason(req, tok, len(req.output_ids))
                if reason is not None:
                    self.finish(req, reason)  # the tokens after a stop are dropped
                    break
            events.append(TokenEvent(req, toks[:kept], lps[:kept]))
        return events

    # ---------------- leaving ----------------
    def _release(self, req: Request) -> None:
        """Before the base release hands whole pages to the radix cache: keep only positions
        whose K/V both models hold and whose token ids the request still has."""
        kv = req.kv
        assert kv is not None
        valid = min(kv.num_tokens, self.draft_lens.pop(req.rid, kv.num_tokens), len(req.all_ids))
        if valid < kv.num_tokens:
            kv.truncate(self.allocator, valid)
        super()._release(req)


__all__ = ["SpecScheduler", "scheduler_class"]
