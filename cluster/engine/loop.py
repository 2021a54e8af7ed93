"""The engine loop of one replica: tokenizer, scheduler, detokenizer, a TP worker group.

One loop (`step`) serves everything: the offline `generate` runs it in the caller's thread,
the server and the replica actor run it in a background thread (`start`). They differ only in
where requests come from and where outputs go (a callback per request).

Threading: `add_request` and `abort` may be called from any thread; they take `_lock`, as do
the scheduler calls of `step`. The forward pass runs outside the lock, so requests can be
added while a step is in flight.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from cluster.engine import step_budget
from cluster.engine.config import EngineConfig
from cluster.engine.detokenizer import Detokenizer, DetokState
from cluster.engine.kv_events import KVEventLog
from cluster.engine.kv_store_link import attach_kv_offload, kv_host_pages
from cluster.engine.ranks import make_worker_group
from cluster.engine.request import ADMITTED, Admitted, FinishReason, GenerationResult, Request, RequestOutput
from cluster.engine.scheduler import RequestRejected, TokenEvent
from cluster.engine.spec_scheduler import scheduler_class
from cluster.engine.step_times import StepTimes
from workers import heap
from workers.encoder_decoder import GenerationRules
from workers.forward_batch import ForwardMode
from workers.group import WorkerGroup
from workers.messages import StepPlan
from workers.model_config import serving_mode
from workers.prompt_graphs import DEFAULT_BUCKETS as PROMPT_BUCKETS
from workers.request_errors import Unavailable
from workers.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Sink = Callable[[RequestOutput], None]
# Receives every output of one engine step at once (requests added with `sink=None`): a replica
# actor hands them to its router in one message per step, whatever the batch size.
BatchSink = Callable[[list[RequestOutput]], None]


@dataclass
class _Tracked:
    req: Request
    sink: Sink | None  # None: the engine's batch sink
    detok: DetokState


class Engine:
    def __init__(self, config: EngineConfig, workers: WorkerGroup | None = None, tokenizer=None,
                 batch_sink: BatchSink | None = None):
        self.config = config
        self.batch_sink = batch_sink
        self.workers = workers or make_worker_group(config)
        mc = self.workers.model_config
        self.model_config = mc
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
        self.tokenizer = tokenizer
        self.detokenizer = Detokenizer(tokenizer)
        self.max_context_len = min(config.max_context_len or mc.max_context_len, mc.max_context_len)
        # Encoder-decoder: the prompt is the encoder input; the decoder starts as generate does.
        self.decoder_prompt = GenerationRules.of(mc).decoder_prompt if mc.is_encoder_decoder else None
        # What the checkpoint forces (an encoder: whole prompts, no prefix cache); every rank
        # derives the same mode for its attention backend.
        self.serving = serving_mode(mc, is_embedding=config.is_embedding,
                                    chunked_prefill_size=config.chunked_prefill_size,
                                    disable_radix_cache=config.disable_radix_cache)
        if self.serving != (config.is_embedding, config.chunked_prefill_size, config.disable_radix_cache):
            logger.info("checkpoint %s runs as %s", config.model, self.serving)
        self.scheduler = scheduler_class(config)(  # a SpecScheduler with a draft model
            num_pages=self.workers.num_pages,
            page_size=config.page_size,
            max_running_requests=config.max_running_requests,
            max_num_batched_tokens=config.max_num_batched_tokens,
            chunked_prefill_size=self.serving.chunked_prefill_size,
            max_context_len=self.max_context_len,
            eos_token_ids=mc.eos_token_ids,
            disable_radix_cache=self.serving.disable_radix_cache,
            max_waiting=config.max_waiting,
            mixed_prefill_tokens=config.prefill_cap,
        )
        self.scheduler.step_budget = step_budget.for_config(config, self.serving.chunked_prefill_size, PROMPT_BUCKETS)
        if config.itl_target_ms and self.scheduler.step_budget is None:  # (the checkpoint forbids chunking)
            logger.warning("--itl-target-ms is ignored: %s computes whole prompts", config.model)
        self.kv_offload = attach_kv_offload(self)  # the shared KV store (None: off)
        # Overlapped scheduling: plan and launch step k+1 before step k's tokens are read.
        self.overlap = (not config.disable_overlap_schedule and self.workers.supports_overlap
                        and not self.serving.is_embedding)
        self.scheduler.overlap = self.overlap
        if self.scheduler.step_budget is not None:  # a plan starts after the one in flight
            self.scheduler.step_budget.steps_ahead = int(self.overlap)
        self._inflight: collections.deque = collections.deque()  # launched plans, oldest first
        # fail_all() ended the requests of the launched plans: the engine thread forgets them
        # (and has the workers forget them) before its next step. Only that thread calls the
        # workers, and never under the lock.
        self._discard = False
        self._tracked: dict[str, _Tracked] = {}
        self._lock = threading.Lock()
        self._kv_events: KVEventLog | None = None
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stop = False
        self._closed: str | None = None  # why admissions are refused (fail_all(close=True), shutdown)
        self._ids = itertools.count()
        self.step_listeners: list[Callable[[Engine, float], None]] = []
        self.step_times = StepTimes()  # every completed plan's time, by mode (stats()["steps"])
        # Benchmarks: set to a list to record (step call start, completion time, mode, requests,
        # new tokens) of every completed plan (cluster/bench/serve.py's step summary).
        self.step_trace: list[tuple[float, float, str, int, int]] | None = None

    # ---------------- requests in ----------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        return list(prompt)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        sink: Sink | None,
        rid: str | None = None,
        is_embedding: bool = False,
        group: str | None = None,
        resume_ids: list[int] | None = None,
        kv_source=None,
        hand_off: bool = False,
    ) -> str:
        """Queue a request; raises (and queues nothing) if it is invalid or the queue is full.
        An embedding replica refuses generation; an encoder-decoder model refuses embeddings.
        `sink` receives each output; None: the engine's `batch_sink`, once per step for all.
        Disaggregated serving: `resume_ids` are output tokens another replica already produced
        (and streamed): this one continues after them, reading the prompt's KV pages from
        `kv_source` where it can; `hand_off` keeps the prompt's pages for a decode replica."""
        if sink is None and self.batch_sink is None:
            raise ValueError("a request without a sink needs an engine with a batch_sink")
        params.validate(self.model_config.vocab_size)
        if not is_embedding and self.serving.is_embedding:
            raise RequestRejected("model", f"{self.config.model_name} is an embedding model: it serves "
                                  "/v1/embeddings, not text generation")
        if is_embedding and self.model_config.is_encoder_decoder:
            raise RequestRejected("model", f"{self.config.model_name} is an encoder-decoder model and "
                                  "does not serve embeddings")
        if params.prompt_logprobs is not None and (is_embedding or self.model_config.is_encoder_decoder):
            raise RequestRejected("prompt_logprobs", "prompt logprobs are computed for decoder-only generation")
        rid = rid or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        if self.decoder_prompt is not None:
            req = Request(rid, list(self.decoder_prompt), params, encoder_ids=self.tokenize(prompt), group=group)
        else:
            req = Request(rid, self.tokenize(prompt), params, is_embedding=is_embedding, group=group)
        detok = self.detokenizer.new_state(req.prompt_ids, params.stop, params.skip_special_tokens,
                                            params.include_stop_str_in_output)
        if resume_ids:
            if len(resume_ids) >= params.max_tokens or self.decoder_prompt is not None or is_embedding:
                raise RequestRejected("max_tokens", "nothing left to generate after the resumed tokens")
            req.output_ids, req.resumed = list(resume_ids), len(resume_ids)
            self.detokenizer.add_tokens(detok, list(resume_ids), final=False)  # streamed already
        req.kv_source, req.hand_off = kv_source, hand_off
        with self._lock:
            if self._closed is not None:  # nothing would ever end it: refuse, to be retried elsewhere
                raise Unavailable(self._closed)
            self.scheduler.add_request(req)
            self._tracked[rid] = _Tracked(req, sink, detok)
            self._wake.notify()
        return rid

    def abort(self, rid: str) -> None:
        with self._lock:
            req = self.scheduler.abort(rid)
            tracked = self._tracked.pop(rid, None)
            self._wake.notify()
        if req is not None and tracked is not None:
            self._deliver([(tracked, req.final_output(FinishReason.ABORT.value))])

    def stats(self) -> dict:
        """What a replica reports (`ServerMetrics.update_replica_stats`). Read without the lock:
        each value is one attribute read, so a concurrent step makes them at worst one step stale."""
        sch = self.scheduler
        return {
            "num_running": len(sch.running),
            "num_waiting": len(sch.waiting),
            "kv_usage": sch.kv_usage(),
            "prefix_hit_tokens": sch.stats.prefix_hit_tokens,
            "prefix_query_tokens": sch.stats.prefix_query_tokens,
            "preemptions": sch.stats.preemptions,
            # Speculative decoding (zero without a draft model): cluster/api/spec_metrics.py
            "spec_draft_tokens": sch.stats.spec_draft_tokens,
            "spec_accepted_tokens": sch.stats.spec_accepted_tokens,
            "spec_verify_requests": sch.stats.spec_verify_requests,
            # Prompt tokens a MIXED step may compute: the step budget's last choice, else the fixed cap.
            "prompt_token_cap": (sch.step_budget.last_cap if sch.step_budget else
                                 sch.mixed_prefill_tokens if sch.chunk_size else sch.max_batched_tokens),
            "step_budget": sch.step_budget.stats() if sch.step_budget else None,
            "steps": self.step_times.stats(),
        }

    def kv_events(self, epoch: str | None, seq: int) -> dict:
        """What the prefix cache took and dropped since `seq` (`cluster/engine/kv_events.py`;
        the log starts at the first call)."""
        if self._kv_events is None:
            with self._lock:
                if self._kv_events is None:
                    off = self.kv_offload  # with a KV store, evicted pages live on in its tiers
                    log = KVEventLog(self.scheduler.radix, host_capacity=kv_host_pages(self.config),
                                     copied=off.saves.evict_copies if off is not None else None)
                    if off is not None:
                        off.host.listeners.append(log.host_changed)
                    self._kv_events = log
        return self._kv_events.since(epoch, seq)

    def has_work(self) -> bool:
        with self._lock:
            return self._has_work()

    def _has_work(self) -> bool:  # under the lock
        return bool(self._inflight) or self._discard or self.scheduler.has_work()

    # ---------------- the loop ----------------
    def step(self) -> bool:
        """Run one scheduled step; False when there was nothing to run.

        Overlapped, a step launches the next plan and then completes the previous one: the
        device computes plan k+1 while the host reads plan k's tokens, detokenizes and plans
        k+2. A step with no new plan completes the last launched one."""
        t0 = time.perf_counter()
        if self._discard:
            self._discard = False
            self._inflight.clear()
            self.workers.discard_inflight()
        with self._lock:
            plan = self.scheduler.schedule()
        if self.overlap:
            if plan is not None:
                self.workers.launch(plan)
                self._inflight.append(plan)
            if not self._inflight:
                return False
            if plan is not None and len(self._inflight) < 2:
                return True  # the first plan of a burst: nothing to complete yet
            done, result = self._inflight.popleft(), self.workers.collect()
        elif plan is None:
            return False
        else:
            done, result = plan, self.workers.execute(plan)
        with self._lock:
            self._take_prompt_logprobs(result.prompt_logprobs)
            events = self.scheduler.process_result(done, result)
            outputs = [self._emit(ev) for ev in events]
        self._deliver(outputs)
        end = time.perf_counter()
        dt = end - t0
        self.step_times.observe(done.mode.name, dt, done.reqs)
        if self.scheduler.step_budget is not None:  # the step's time as its streams saw it
            self.scheduler.step_budget.observe(done, dt)
        if self.step_trace is not None:
            self.step_trace.append((t0, end, done.mode.name, len(done.reqs),
                                    sum(len(r.input_ids) for r in done.reqs)))
        for listener in self.step_listeners:
            listener(self, dt)
        return True

    def _take_prompt_logprobs(self, pieces: dict) -> None:
        """Put each prefill piece's prompt logprobs at their positions (a piece recomputed after
        a preemption writes the same values again)."""
        for rid, (first, entries) in pieces.items():
            tracked = self._tracked.get(rid)
            if tracked is None:
                continue
            lps = tracked.req.prompt_logprobs
            if len(lps) < first:
                lps.extend([None] * (first - len(lps)))
            lps[first : first + len(entries)] = entries

    def _emit(self, ev: TokenEvent) -> tuple[_Tracked | None, RequestOutput]:
        """Detokenize one request's new tokens (under the lock: may finish it on a stop string)."""
        req = ev.req
        tracked = self._tracked.get(req.rid)
        if tracked is None:
            return None, RequestOutput(req.rid)
        # A handed-off prefill that ends at its token limit goes on on a decode replica: text held
        # back (an incomplete character, a possible stop string) is that replica's to emit.
        final = req.finished and not (req.hand_off and req.finish_reason == FinishReason.LENGTH)
        text, hit_stop, used = self.detokenizer.add_tokens_until_stop(tracked.detok, ev.token_ids, final=final)
        if used < len(ev.token_ids):  # a speculative round's tokens after a stop string: dropped
            end = req.num_output_tokens
            del req.output_ids[end - len(ev.token_ids) + used : end]
            ev = TokenEvent(req, ev.token_ids[:used], ev.logprobs[:used], ev.embedding)
        if hit_stop and not req.finished:
            self.scheduler.finish(req, FinishReason.STOP)
            # Flush nothing more: the text was cut before the stop string.
        elif hit_stop and req.finish_reason == FinishReason.LENGTH:
            # The last token it was allowed (or a handed-off prefill's one token) holds a stop
            # string: the stop ended it, and a disaggregated request does not go on to decode.
            req.finish_reason = FinishReason.STOP
        now = time.monotonic()
        if ev.token_ids and req.first_token_time is None:
            req.first_token_time = now
            if self.kv_offload is not None:  # which path (store load or prefill) answers sooner
                self.kv_offload.note_first_token(req, now - req.arrival_time)
        out = RequestOutput(
            rid=req.rid,
            delta_text=text,
            delta_token_ids=list(ev.token_ids),
            delta_logprobs=list(ev.logprobs),
            prompt_tokens=req.num_prompt_tokens,
            completion_tokens=req.num_output_tokens,
            cached_tokens=req.cached_tokens,
            embedding=ev.embedding,
        )
        if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent and (ev.token_ids or req.finished):
            req.prompt_logprobs_sent = True
            lps = req.prompt_logprobs
            out.prompt_logprobs = [None] + lps[1 : req.num_prompt_tokens] + [None] * (req.num_prompt_tokens - len(lps))
        if req.finished:
            req.stamp_finish(out, now)
            del self._tracked[req.rid]
        return tracked, out

    def fail_all(self, error: str, close: bool = False, error_type: str = "internal") -> None:
        """Finish every request with an error (the worker group died). Requests that had no
        token yet are marked `unavailable`, so a router may retry them elsewhere; the others
        `error_type` ("internal": the replica's fault, a response not yet shown may run again
        elsewhere; "step_failed": a step raised, maybe for a request's own input). `close`: this
        engine is being replaced, and from the same moment refuses admissions (as unavailable),
        so none lands after the others were failed and waits forever."""
        with self._lock:
            if close:
                self._closed = error
            self._discard = self.overlap
            tracked = list(self._tracked.values())
            self._tracked.clear()
            for t in tracked:
                self.scheduler.finish(t.req, FinishReason.ERROR)
        self._deliver([(t, t.req.final_output(FinishReason.ERROR.value, error,
                                              "unavailable" if t.req.num_output_tokens <= t.req.resumed
                                              else error_type))
                       for t in tracked])

    def _deliver(self, outputs: list[tuple[_Tracked | None, RequestOutput]]) -> None:
        """Hand outputs to their sinks (outside the lock): per-request sinks one by one, the
        rest to the batch sink in one call."""
        batch = []
        for tracked, out in outputs:
            if tracked is None:
                continue
            if tracked.sink is None:
                batch.append(out)
            else:
                tracked.sink(out)
        if batch and self.batch_sink is not None:
            self.batch_sink(batch)

    # ---------------- offline API ----------------
    def generate(
        self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[GenerationResult]:
        """Run prompts to completion in this thread (not while the background loop runs)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        return self._run_here(lambda i, sink: self.add_request(prompts[i], plist[i], sink), len(prompts))

    def embed(self, prompts: list[str | list[int]]) -> list[GenerationResult]:
        """Embed prompts in this thread (not while the background loop runs); each result's
        `embedding` is the pooled vector."""
        return self._run_here(lambda i, sink: self.add_request(prompts[i], SamplingParams(max_tokens=1), sink,
                                                               is_embedding=True), len(prompts))

    def _run_here(self, add, n: int) -> list[GenerationResult]:
        """`add(i, sink)` for each of n requests (returning its rid), then step until none has work."""
        assert self._thread is None, "the offline API runs the loop itself; use generate_stream with start()"
        results = [GenerationResult(rid="") for _ in range(n)]
        for i, res in enumerate(results):
            res.rid = add(i, res.add)
        while self.has_work():
            self.step()
        return results

    # ---------------- background loop + async API ----------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop = False
        heap.freeze()  # what the engine built lives as long as it serves: out of the collector's walks
        self._thread = threading.Thread(target=self._run, name="manta-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self._has_work():
                    self._wake.wait(timeout=0.5)
                if self._stop:
                    return
            try:
                stepped = self.step()
            except Exception as exc:  # a failed forward must not hang its requests
                logger.exception("engine step failed")
                # A lost worker fails its requests as the replica's fault ("internal": a response
                # not yet shown may run again elsewhere); any other exception may be a request's
                # own doing, which must not fail the next replica's batch too ("step_failed").
                self.fail_all(f"engine step failed: {exc}",
                              error_type="internal" if self.workers.failed else "step_failed")
                continue
            if not stepped:  # work that cannot run yet (a store lookup in flight): do not spin
                with self._lock:
                    self._wake.wait(timeout=0.002)

    @property
    def alive(self) -> bool:
        """The background loop is running (start() was called and shutdown() was not)."""
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self, drain_s: float | None = None) -> None:
        """Stop the loop, save the cached KV pages a write-back store policy still owes the
        store (for at most `drain_s`, default the config's `kv_drain_timeout_s`), release the
        workers."""
        with self._lock:
            self._stop = True
            self._closed = self._closed or "the engine is shut down"
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
            heap.thaw()
        if self.kv_offload is not None and self.workers.failed:  # the ranks cannot save anything
            logger.warning("KV store: the cached KV pages are not saved at shutdown: %s", self.workers.failed)
        elif self.kv_offload is not None:
            try:
                self._drain_kv(self.config.kv_drain_timeout_s if drain_s is None else drain_s)
            except Exception:  # the workers may be the reason we stop
                logger.exception("saving the cached KV pages at shutdown failed")
            self.kv_offload.close()
        self.workers.shutdown()

    def _drain_kv(self, budget_s: float) -> None:
        """Write-back policies: write the pages still cached to the store, a chunk per idle
        plan, until done or `budget_s` has passed (the loop is stopped: nothing else steps)."""
        saves = self.kv_offload.saves.drain() if budget_s > 0 else []
        if not saves:
            return
        while self._inflight:  # overlapped plans still on the ranks: finish them first
            self._inflight.popleft()
            self.workers.collect()

        def execute(save) -> None:
            self.scheduler._step_id += 1
            self.workers.execute(StepPlan(self.scheduler._step_id, ForwardMode.IDLE, [], kv_saves=[save]))

        self.kv_offload.saves.write_out(saves, budget_s, execute)

    async def generate_stream(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        rid: str | None = None,
        is_embedding: bool = False,
        group: str | None = None,
        announce: bool = False,
    ) -> AsyncIterator[RequestOutput | Admitted]:
        """Yield outputs as they come (after `ADMITTED`, with `announce`); cancelling the
        iterator aborts the request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        rid = self.add_request(prompt, params, lambda o: loop.call_soon_threadsafe(queue.put_nowait, o),
                               rid=rid, is_embedding=is_embedding, group=group)
        finished = False
        try:
            if announce:
                yield ADMITTED
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(rid)
