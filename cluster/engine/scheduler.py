"""Continuous batching with chunked prefill, a page-granular prefix cache and preemption.

The model of a step: every running request has tokens whose K/V is not cached yet — the rest
of its prompt (a prefill, maybe in chunks) or its last sampled token (a decode). A step
computes, within a token budget (`max_num_batched_tokens`), the next piece of each running
request in admission order (at most `chunk_size` tokens each), then admits waiting requests
into what budget and KV memory remain. A request whose piece reaches the end of its tokens is
sampled. Prefill chunks and decodes share one batch (MIXED); a batch of only one-token pieces
is DECODE, one without any is EXTEND.

With `mixed_prefill_tokens` > 0, a step computes at most that many prompt tokens while requests
decode (continued chunks first): each stream's next token then waits for a step of bounded
length, not for a burst of prompts. The engine's default was measured (`EngineConfig.prefill_cap`).
With a step time target (`step_budget`, `cluster/engine/step_budget.py`) the cap is what the
step is predicted to fit in that time beside its decodes, at most `mixed_prefill_tokens`.

Guarantees:
- KV pages are reserved before a plan leaves the scheduler; a plan never refers to a page
  another request owns.
- When memory runs out, unlocked prefix-cache pages are evicted first; then the most recently
  admitted running request is preempted (its K/V is put into the prefix cache and released;
  it re-enters the front of the queue and is recomputed, mostly from that cache).
- Every finished, aborted or preempted request's rid goes to the workers in the next plan's
  `finished_rids`, after its pages are back in the free lists.
- `check_integrity()` holds between steps: free + cached + owned pages == all pages.

Overlapped scheduling (`overlap = True`, set by the engine when its workers support it): the
engine plans step k+1 while step k runs, before k's tokens are known. A request sampled by a
plan gets a PENDING_TOKEN placeholder at the end of its output_ids at once (`pending` counts
them); its next decode piece has that placeholder as input, which the worker resolves on the
device from the token it sampled; `process_result` then writes the real token in its place.
A request that will end by length when its pending token lands is not planned again; one that
ends on a stop token or string has one wasted step in flight, whose token is dropped. A
preempted request with a token in flight is not re-admitted until the token is known.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

from cluster.engine import encoder_decoder as encdec
from cluster.engine.admission import RequestRejected, rejection
from cluster.engine.fair_share import fair_share, group_of
from cluster.engine.kv_allocator import PageAllocator, RequestKV, slots_for
from cluster.engine.kv_loads import Verdict
from cluster.engine.radix_cache import RadixCache
from cluster.engine.request import PENDING_TOKEN, FinishReason, Request, RequestStatus
from cluster.engine.step_budget import prompt_backlog
from workers.forward_batch import ForwardMode
from workers.messages import NewRequest, ScheduledReq, StepPlan, StepResult, TokenLogprobs
from workers.request_errors import QueueFull
from workers.sampling_params import SamplingParamsError


@dataclass
class TokenEvent:
    """New tokens of one request from one step, before detokenization."""

    req: Request
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    embedding: list[float] | None = None


@dataclass
class SchedulerStats:
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    preemptions: int = 0
    fair_preemptions: int = 0  # of those, to give a waiting group its fair share of running slots
    # Speculative decoding (cluster/engine/spec_scheduler.py): drafts proposed, drafts accepted, and
    # request-rounds verified (mean acceptance length = (accepted + rounds) / rounds).
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verify_requests: int = 0


class Scheduler:
    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        max_running_requests: int,
        max_num_batched_tokens: int,
        chunked_prefill_size: int,
        max_context_len: int,
        eos_token_ids: tuple[int, ...],
        disable_radix_cache: bool = False,
        max_waiting: int = 0,
        mixed_prefill_tokens: int = 0,
    ):
        self.page_size = page_size
        self.max_running = max_running_requests
        self.max_batched_tokens = max_num_batched_tokens
        self.chunk_size = chunked_prefill_size if chunked_prefill_size > 0 else None
        # Prompt tokens a step computes beside decoding requests (0: no cap but the budget).
        self.mixed_prefill_tokens = mixed_prefill_tokens if mixed_prefill_tokens > 0 else max_num_batched_tokens
        self.max_context_len = max_context_len
        self.eos_token_ids = set(eos_token_ids)
        self.max_waiting = max_waiting
        self.allocator = PageAllocator(num_pages, page_size)
        self.radix = RadixCache(self.allocator, page_size, disabled=disable_radix_cache)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._free_rows = list(range(max_running_requests - 1, -1, -1))
        self._pending_drop: list[str] = []
        # Requests sent back to compute again while plans that sampled them were launched
        # (`recompute`): rid -> the last such plan; their samples are dropped until its result.
        self._discard: dict[str, int] = {}
        # Requests the scheduler itself ended (no token event carried the news yet).
        self._finished_silently: list[Request] = []
        self._step_id = 0
        self.done_step = 0  # the latest plan whose result has been read: its K/V writes are done
        self.stats = SchedulerStats()
        self.kv_offload = None  # cluster.engine.kv_offload.SchedulerKVOffload when a KV store is on
        # cluster.engine.step_budget.StepBudget with a step time target: it sets the cap above.
        self.step_budget = None
        self.overlap = False  # plans may run ahead of results (see the module docstring)

    # ---------------- requests in ----------------
    @property
    def kv_capacity_tokens(self) -> int:
        return self.allocator.num_total * self.page_size

    def add_request(self, req: Request) -> None:
        """Queue a request or raise RequestRejected / QueueFull (nothing is queued then)."""
        req.params.validate()
        rejected = rejection(req, max_context_len=self.max_context_len, kv_capacity_tokens=self.kv_capacity_tokens,
                             max_batched_tokens=self.max_batched_tokens, chunked=self.chunk_size is not None,
                             page_size=self.page_size)
        if rejected is not None:
            raise rejected
        if req.rid in self.requests:
            raise RequestRejected("request_id", f"duplicate request id {req.rid!r}")
        # A burst arrives between steps, so it waits even for free running slots: those count
        # as room too, and only what would wait for a slot to free up is bounded.
        if self.max_waiting and len(self.waiting) >= self.max_waiting + len(self._free_rows):
            raise QueueFull(f"{len(self.waiting)} requests are waiting for {len(self._free_rows)} free running "
                            f"slots (max_waiting={self.max_waiting})")
        self.requests[req.rid] = req
        self.waiting.append(req)
        if self.kv_offload is not None:  # its store lookup goes out now, answered while it waits
            self.kv_offload.on_arrival(req)

    def abort(self, rid: str) -> Request | None:
        """Finish a request now (client gone); its pages are freed immediately."""
        req = self.requests.get(rid)
        if req is None or req.finished:
            return None
        req.aborted = True
        self.finish(req, FinishReason.ABORT)
        return req

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._pending_drop
                    or (self.kv_offload is not None and self.kv_offload.has_work()))

    # ---------------- one step ----------------
    def schedule(self) -> StepPlan | None:
        if self.kv_offload is not None:  # store prefetches that stop now: admitted in this plan
            self.kv_offload.requeue_ready()
        budget = self.max_batched_tokens
        plan_reqs: list[ScheduledReq] = []
        new_reqs: list[NewRequest] = []
        table_writes: list[tuple[int, int, list[int]]] = []
        share, counts, starved = fair_share(self)  # (may preempt over-share requests)
        # Prompt tokens this step may compute (stall-free mixing: see the module docstring); a
        # prompt that cannot be chunked takes what the budget holds.
        decoding = [r for r in self.running if self._decoding(r)]
        capped = bool(decoding) and self.chunk_size is not None and (
            self.mixed_prefill_tokens < budget or self.step_budget is not None)
        cap = self.mixed_prefill_tokens
        if capped and self.step_budget is not None and (self.waiting or len(decoding) < len(self.running)):
            # prompt work beside the decodes: what fits the step's time target
            cap = self.step_budget.prompt_tokens(len(decoding), sum(r.num_computed for r in decoding),
                                                 prompt_backlog(self, 64 * self.step_budget.ceiling))
        prefill = room = min(cap, budget) if capped else budget

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.pending and self._ends_by_length(req, len(req.output_ids)):
                i += 1  # its last token is in flight: nothing more to compute
                continue
            decoding = self._decoding(req)
            n = self._piece(req, budget if decoding else min(budget, prefill))
            if n == 0:  # overlapped: an embedding's last piece is in flight, or no prefill room left
                i += 1
                continue
            slots = self._reserve_or_preempt(req, n)
            if slots is None:  # req itself was preempted
                continue
            plan_reqs.append(self._scheduled(req, n, slots))
            budget -= n
            if not decoding:
                prefill -= n
            i += 1

        skip = 0  # waiting requests passed over this step (store lookup in flight, token in flight, over share)
        while len(self.waiting) > skip and min(budget, prefill) > 0 and len(self.running) < self.max_running \
                and self._free_rows:
            req = self.waiting[skip]
            if req.pending or req.rid in self._discard:
                skip += 1  # preempted with a token in flight: re-admit once it is known
                continue
            group = group_of(req)
            if counts[group] >= share and starved - {group}:
                skip += 1  # its group has its share while another group's requests wait with less
                continue
            if self.kv_offload is not None and req.params.prompt_logprobs is None:
                verdict = self.kv_offload.set_aside(req)
                if verdict == Verdict.DEFER:
                    skip += 1
                    continue
                if verdict == Verdict.SET_ASIDE:
                    del self.waiting[skip]  # its prefix is fetched from the KV store first
                    continue
            if self.chunk_size is None and req.num_tokens > budget and plan_reqs:
                break  # whole-prompt prefill must wait for a step with room
            # An encoder runs whole in its admitting step: one longer than the prefill room
            # takes the step's budget while no other prompt tokens are in it.
            enc_len = encdec.encoder_len(req)
            admitted = self._admit(req, budget if enc_len >= prefill and prefill == room else min(budget, prefill))
            if admitted is None:
                if not plan_reqs and not self.running and self.kv_offload is not None:
                    # Nothing runs, so nothing will free pages: let go of the prefixes that
                    # requests waiting on loads hold locked (the next plan admits as usual).
                    self.kv_offload.release_holds()
                break
            del self.waiting[skip]
            counts[group] += 1
            if counts[group] >= share:
                starved.discard(group)
            if self.kv_offload is not None:
                self.kv_offload.admitted(req)
            n, slots, prefix_slots = admitted
            if prefix_slots:
                table_writes.append((req.req_pool_idx, 0, prefix_slots))
            new_reqs.append(
                NewRequest(req.rid, req.params, req.prompt_ids, list(req.output_ids), req.is_embedding,
                           encoder_ids=req.encoder_ids)
            )
            plan_reqs.append(self._scheduled(req, n, slots))
            budget -= n + enc_len  # the encoder runs whole in this step
            prefill -= n + enc_len

        kv_orders = self.kv_offload.orders() if self.kv_offload is not None else None
        dropped, self._pending_drop = self._pending_drop, []
        if not plan_reqs and not dropped and kv_orders is None:
            return None
        if not plan_reqs:
            mode = ForwardMode.IDLE
        elif all(len(r.input_ids) == 1 for r in plan_reqs):
            mode = ForwardMode.DECODE
        elif all(len(r.input_ids) > 1 or r.prefix_len == 0 for r in plan_reqs):
            mode = ForwardMode.EXTEND
        else:
            mode = ForwardMode.MIXED
        self._step_id += 1
        plan = StepPlan(self._step_id, mode, plan_reqs, new_reqs, dropped, table_writes)
        if kv_orders is not None:
            kv_orders.apply(plan)
        return plan

    def _decoding(self, req: Request) -> bool:
        """Everything but the last sampled token is cached: the request's next piece is a decode."""
        return bool(req.output_ids) and req.num_computed == req.num_tokens - 1

    def _piece(self, req: Request, budget: int) -> int:
        n = min(req.num_tokens - req.num_computed, budget)
        return min(n, self.chunk_size) if self.chunk_size else n

    def _scheduled(self, req: Request, n: int, slots: list[int]) -> ScheduledReq:
        start = req.num_computed - n  # reserve() has already advanced num_tokens
        req.last_step = self._step_id + 1  # the plan being built
        ids = req.ids_slice(start, start + n)
        sr = ScheduledReq(
            rid=req.rid,
            req_pool_idx=req.req_pool_idx,
            input_ids=ids,
            prefix_len=start,
            out_cache_loc=slots,
            sample=(start + n == req.num_tokens) and not req.is_embedding,
            encoder_len=encdec.encoder_len(req),
        )
        if self.overlap and sr.sample:  # the next piece may be planned before this token is known
            req.output_ids.append(PENDING_TOKEN)
            req.pending += 1
        return sr

    def _admit(self, req: Request, budget: int) -> tuple[int, list[int], list[int]] | None:
        """Give `req` a row, its cached prefix and pages for its first piece, or change nothing."""
        tokens = req.all_ids
        enc_len = encdec.encoder_len(req)
        if enc_len and enc_len >= budget:
            return None  # its encoder runs whole in the admitting step: wait for room
        # Leave at least one token to compute: its logits sample the next token. An
        # encoder-decoder request matches nothing (cluster/engine/encoder_decoder.py says why),
        # nor does one that asks for its prompt's logprobs (a cached prefix has no logits: it
        # computes its whole prompt; its pages still serve later requests).
        whole = enc_len or req.params.prompt_logprobs is not None
        match = self.radix.match_prefix([] if whole else tokens[: len(tokens) - 1])
        kv = RequestKV()
        kv.pages = list(match.pages)
        kv.num_tokens = match.num_tokens
        kv.num_cached_pages = len(match.pages)
        self.radix.lock(match.node)
        req.kv, req.prefix_node = kv, match.node
        if self.kv_offload is not None:  # pages loaded from the KV store in this step extend the prefix
            self.kv_offload.extend(req, kv)
        # Encoder pages first: they take the first columns of the row, before decoder tokens.
        enc_slots = encdec.reserve_encoder(req, self.allocator, self.radix) if enc_len else []
        n = self._piece(req, budget - enc_len)
        slots = self._reserve(req, n, allow_preempt=False) if enc_slots is not None else None
        if slots is None:
            if enc_slots:
                encdec.free_encoder(req, self.allocator)
            if self.kv_offload is not None:
                self.kv_offload.unextend(req)
            self.radix.unlock(match.node)
            req.kv, req.prefix_node = None, None
            return None
        prefix = kv.num_tokens - n  # the radix match, and any pages loaded from the store
        if req.num_preemptions == 0:
            req.scheduled_time = time.monotonic()
            req.cached_tokens = prefix
            self.stats.prefix_hit_tokens += prefix
            self.stats.prefix_query_tokens += len(req.prompt_ids)
        req.req_pool_idx = self._free_rows.pop()
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        prefix_slots = slots_for(kv.pages, 0, prefix, self.page_size)
        # An encoder-decoder request's row starts with its encoder slots (it has no prefix).
        return n, slots, enc_slots or prefix_slots

    def _reserve(self, req: Request, n: int, allow_preempt: bool) -> list[int] | None:
        assert req.kv is not None
        slots = req.kv.reserve(self.allocator, n)
        if slots is not None:
            return slots
        needed = req.kv.pages_needed(n, self.page_size)
        self.radix.evict(needed - self.allocator.num_free)
        slots = req.kv.reserve(self.allocator, n)
        if slots is not None or not allow_preempt:
            return slots
        # Preempt the newest running requests (never one already scheduled this step: those
        # precede `req` in self.running) until the reservation fits or `req` is the victim.
        while slots is None:
            victim = self.running[-1]
            if victim is req and len(self.running) == 1:
                # Alone and still out of memory: the whole KV cache cannot hold this request
                # one token longer. Preempting it would re-admit and preempt it forever; end it.
                self.finish(req, FinishReason.LENGTH)
                self._finished_silently.append(req)
                return None
            self._preempt(victim)
            if victim is req:
                return None
            self.radix.evict(needed - self.allocator.num_free)
            slots = req.kv.reserve(self.allocator, n)
        return slots

    def _reserve_or_preempt(self, req: Request, n: int) -> list[int] | None:
        return self._reserve(req, n, allow_preempt=True)

    # ---------------- results back ----------------
    def process_result(self, plan: StepPlan, result: StepResult) -> list[TokenEvent]:
        self.done_step = max(self.done_step, plan.step_id)
        if self.kv_offload is not None:  # prefetch progress; a failed load fails its request
            self.kv_offload.on_result(plan, result)
        events: list[TokenEvent] = [TokenEvent(req, [], []) for req in self._finished_silently]
        self._finished_silently = []
        logprobs = result.logprobs or [None] * len(result.sampled_rids)
        for rid, tok, lp in zip(result.sampled_rids, result.next_token_ids, logprobs):
            req = self.requests.get(rid)
            if req is None or req.finished or plan.step_id <= self._discard.get(rid, -1):
                continue  # aborted (or ended on a stop string) while the step ran, or computed again
            if req.pending:  # overlapped: the oldest placeholder is this token
                n_out = req.num_output_tokens + 1
                req.output_ids[n_out - 1] = tok
                req.pending -= 1
            else:
                req.output_ids.append(tok)
                n_out = len(req.output_ids)
            events.append(TokenEvent(req, [tok], [lp]))
            reason = self._token_finish_reason(req, tok, n_out)
            if reason is not None:
                self.finish(req, reason)
        if self.overlap:  # a planned sample that never came back (never expected): unblock it
            sampled = set(result.sampled_rids)
            for sr in plan.reqs:
                req = self.requests.get(sr.rid)
                if sr.sample and sr.rid not in sampled and req is not None and req.pending:
                    req.pending -= 1
                    del req.output_ids[req.num_output_tokens]
        for rid, emb in result.embeddings.items():
            req = self.requests.get(rid)
            if req is None or req.finished:
                continue
            events.append(TokenEvent(req, [], [], embedding=emb))
            self.finish(req, FinishReason.STOP)
        self._forget_discards(plan.step_id)
        return events

    def _forget_discards(self, step_id: int) -> None:
        """The result of plan `step_id` is in: requests waiting on it to be computed again may be."""
        if self._discard:
            for rid in [r for r, last in self._discard.items() if last <= step_id]:
                del self._discard[rid]

    def _token_finish_reason(self, req: Request, tok: int, n_out: int) -> FinishReason | None:
        """Why `req` ends with `tok` as its n_out-th output token (None: it goes on)."""
        p = req.params
        if n_out >= p.min_tokens and (
            (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids
        ):
            return FinishReason.STOP
        return FinishReason.LENGTH if self._ends_by_length(req, n_out) else None

    def _ends_by_length(self, req: Request, n_out: int) -> bool:
        return n_out >= req.params.max_tokens or len(req.prompt_ids) + n_out >= self.max_context_len

    # ---------------- leaving ----------------
    def finish(self, req: Request, reason: FinishReason) -> None:
        if req.finished:
            return
        req.finish_reason = reason  # before the release: its hooks tell a finish from a preemption
        if req.status == RequestStatus.RUNNING:
            self._release(req)
            self.running.remove(req)
            self._pending_drop.append(req.rid)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        del self.requests[req.rid]
        self._discard.pop(req.rid, None)

    def fail(self, req: Request) -> None:
        """End `req` with an error (`req.error` says which); its final output goes out with
        the next result's events."""
        self.finish(req, FinishReason.ERROR)
        self._finished_silently.append(req)

    def recompute(self, req: Request) -> None:
        """`req`'s KV past `req.kv.num_tokens` is wrong (a load came back short after the plan
        that read it was launched): what it sampled since is dropped, and (running) it goes to
        the front of the queue to compute the rest (the good pages go to the prefix cache),
        once the results of the plans launched so far are in."""
        if req.pending:
            del req.output_ids[len(req.output_ids) - req.pending :]
            req.pending = 0
        self._discard[req.rid] = self._step_id
        if req.status == RequestStatus.RUNNING:
            self._preempt(req)

    def _preempt(self, req: Request) -> None:
        self._release(req)
        self.running.remove(req)
        self._pending_drop.append(req.rid)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        """Return a running request's pages: whole pages of computed tokens go to the prefix
        cache (it keeps one copy; our duplicates are freed), the rest to the allocator."""
        assert req.kv is not None
        ids = req.all_ids
        if req.pending:  # cache (and save) only tokens that are known: not the one in flight
            ids = req.known_ids
            req.kv.num_tokens = min(req.kv.num_tokens, len(ids))
        if self.kv_offload is not None:  # nothing from a load whose result has not come
            self.kv_offload.unconfirmed(req)
        pages, computed = req.kv.pages, req.kv.num_tokens
        if req.encoder_ids is not None:  # never cached: its K/V depend on its encoder input
            encdec.release(req, self.allocator)
        else:
            kept = self.radix.release(req.kv, ids, req.prefix_node)
            if self.kv_offload is not None:
                self.kv_offload.on_cached(req, pages, computed, kept, ids)
        self._free_rows.append(req.req_pool_idx)
        req.kv, req.prefix_node, req.req_pool_idx = None, None, -1

    # ---------------- introspection ----------------
    def kv_usage(self) -> float:
        total = self.allocator.num_total
        used = total - self.allocator.num_free - self.radix.evictable_pages
        return used / total if total else 0.0

    def check_integrity(self) -> None:
        owned = [p for r in self.running if r.kv for p in r.kv.owned_pages + r.encoder_pages]
        self.radix.check_integrity(extra_used=owned)


__all__ = ["Scheduler", "TokenEvent", "RequestRejected", "QueueFull", "SamplingParamsError"]
