"""The scheduler's side of the hierarchical KV cache (device pool → rank host tier → shared store).

The scheduler keeps its model (`cluster.engine.scheduler`); this file adds the store through a few
hooks and `StepPlan` orders (`workers.kv_messages`) that the ranks carry out
(`workers.kv_offload`). Pages are named by chain keys (`kvstore.keys`): the key of page i names
the whole prefix through page i, so a page found in the store is the KV of exactly those tokens
of this model (fingerprint: config, weights, dtype, page size, TP layout).

Loading a prefix (when the store has a longer prefix than the radix cache):

0. `on_arrival(req)`, when a request is added (on the thread that adds it, not the engine's):
   chain keys of the whole pages of prompt[:-1], and a lookup of how many leading pages every
   rank can load is sent to the store (`StoreProbe.start`: all keys of a page for every rank),
   without waiting for the answer.
1. `set_aside(req)`, when the admission loop reaches the request: the answer is read without
   waiting (`DEFER` while it has not come, for at most `PROBE_WAIT_S`: the loop admits the
   requests behind it meanwhile; a slower store is a miss and probing pauses); match the radix
   cache (m pages). If the store has at least `min_pages` past m: the match is locked, the
   request leaves the waiting queue and its keys go out as a `KVPrefetch` (ranks read them from
   the store into their host tier in the background while the replica keeps stepping its other
   requests). Otherwise it is admitted as usual.
2. Every step the ranks report each prefetch's progress, agreed among them: the pages every
   rank holds (pinned until the load) and whether every rank's read has ended (`on_result`).
   At the start of each `schedule`, a prefetching request stops by the stop policy and goes
   back to the front of the waiting queue (`requeue_ready`) —
   best_effort: at the first report (take what has arrived);
   wait_complete: when every rank's read has ended;
   timeout: when they have ended or at prefetch_timeout_s + per_page_s × pages (grows with the
   prompt), taking what every rank holds by then.
3. Its admission, in that same plan, carries the load (`extend`): device pages are allocated
   for the reported pages past its radix match, they join its page table as computed prefix,
   and a `KVLoad` copies them in ahead of the forward that computes the rest of its prompt.
   (Before, the load was a step of its own whose result then requeued the request: two more
   round trips through overlapped steps, ~50 ms at 200 running requests.) The ranks load only
   what they all reported holding; if their agreed count still comes back short, the token
   that step sampled is dropped and the request computes its prompt past the good pages
   (`Scheduler.recompute`; the good pages stay cached).

Pages the first rank's host tier holds skip all that: such a request is admitted at once, its
load in the plan that admits it (`cluster/engine/kv_host_admission.py`).

Saving pages (the write policy: when device pages get a copy in the host tier and the store)
is `cluster.engine.kv_saves`, held here as `saves`.

The store down, slow or full never stops serving or holds a step: the probe is read without
waiting, the ranks drop saves their host tier has no room for, a failed or slow probe pauses
probing for `backoff_s`, and a load that finds nothing admits the request with its radix
match only. A store slower than recompute is bypassed (`cluster/engine/kv_store_judge.py`
judges by time to first token, what users see).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict

from cluster.engine import kv_handoff
from cluster.engine.config import KV_PREFETCH_POLICIES, KV_WRITE_POLICIES
from cluster.engine.histogram import Histogram
from cluster.engine.kv_host_admission import HostTierPicture
from cluster.engine.kv_loads import KVOffloadStats, Loading, Verdict
from cluster.engine.kv_saves import KVSaves
from cluster.engine.kv_store_judge import StoreJudge
from kvstore.messages import STORE_NAME
from workers.kv_messages import KVLoad, KVPrefetch, KVSave

logger = logging.getLogger(__name__)

MIN_LOAD_TOKENS = 16  # a store load costs two extra steps: skip shorter ones
# Smaller pages cost more to move than to recompute (one store key, slot and file per page):
# replicas with smaller pages run without the store.
MIN_PAGE_TOKENS = 16
WAIT_COMPLETE_CAP_S = 60.0  # wait_complete still gives up after this long
PROBE_WAIT_S = 0.1  # a store lookup not answered by then is a miss (and probing pauses)
# Requests loading from the store at once: beyond that the store's pipeline (each rank's I/O
# threads) is busy and one more would queue behind the others; it is computed instead.
MAX_LOADING = 4


# ---------------------------------------------------------------------------------------------
# the scheduler side


class SchedulerKVOffload:
    """Attached to one `Scheduler` (sets `scheduler.kv_offload`). Every method runs under the
    engine's lock; none waits on the store (lookups are sent by `on_arrival` and read by
    `set_aside` when they have answered)."""

    def __init__(self, scheduler, *, fingerprint: str, layout: str, tp_size: int,
                 write_policy: str = "write_back_selective", prefetch_policy: str = "timeout",
                 prefetch_timeout_s: float = 0.5, prefetch_timeout_per_page_s: float = 0.002,
                 store_name: str = STORE_NAME, namespace: str | None = None, probe_timeout_s: float = 2.0,
                 min_pages: int | None = None, backoff_s: float = 2.0, probe=None, host_pages: int = 1 << 20,
                 warm: bool = False):
        from kvstore.probe import StoreProbe

        if write_policy not in KV_WRITE_POLICIES or prefetch_policy not in KV_PREFETCH_POLICIES:
            raise ValueError(f"bad KV store policy {write_policy!r} / {prefetch_policy!r}")
        self.sched = scheduler
        self.radix = scheduler.radix
        self.allocator = scheduler.allocator
        self.P = scheduler.page_size
        self.fingerprint, self.layout = fingerprint, layout
        self.write_policy, self.prefetch_policy = write_policy, prefetch_policy
        self.timeout_s, self.per_page_s = prefetch_timeout_s, prefetch_timeout_per_page_s
        self.min_pages = min_pages if min_pages is not None else max(1, -(-MIN_LOAD_TOKENS // self.P))
        self.backoff_s = backoff_s
        self.probe = probe or StoreProbe(None, layout, tp_size, timeout_s=probe_timeout_s, store_name=store_name,
                                         namespace=namespace)
        self.store_name, self.namespace = store_name, namespace
        self.loading: dict[str, Loading] = {}  # set aside or requeued, until admitted
        self.inflight: dict[str, Loading] = {}  # admitted with a load whose result has not come
        self.from_store: set[int] = set()  # loaded pages owned by running requests (not saved again)
        self._loads: list[KVLoad] = []  # this plan's loads (its admissions')
        self.probed: set[str] = set()  # requests whose store question is settled
        self.probes: dict[str, object] = {}  # rid -> kvstore.probe.PendingProbe
        self.chains: dict[str, list[str]] = {}
        self.in_store: dict[str, int] = {}  # rid -> leading pages its lookup found in the store (never saved again)
        self._prefetch: list[KVPrefetch] = []
        self.host = HostTierPicture(host_pages, warm)  # what the first rank's host tier holds
        self._skip_until = 0.0
        self.judge = StoreJudge(self.min_pages * self.P)  # store or recompute, by time to first token
        self.stats = KVOffloadStats()
        self.saves = KVSaves(write_policy, self.stats)  # the write side
        self.handoff = kv_handoff.HandoffStats()  # prefill/decode disaggregation
        self.handoff_wait = Histogram(kv_handoff.WAIT_BUCKETS)  # decode requests' waits on their pages
        self.pending_handoff: list[KVSave] = []
        self.poller = None  # the replica's stats poller (cluster/kv_store_setup.py)
        scheduler.kv_offload = self
        self.radix.on_evict = self.saves.on_evict  # bookkeeping always; saves only under write_back

    # ---------------- hooks of the scheduler ----------------
    def has_work(self) -> bool:
        return bool(self.loading or self.saves.pending or self._prefetch or self._loads or self.pending_handoff) \
            or self.host.poll_due(time.monotonic())

    def on_arrival(self, req) -> None:
        """Send the store lookup of a new request's prefix (answered while it waits)."""
        if req.is_embedding or req.rid in self.probes or req.params.prompt_logprobs is not None \
                or req.kv_source is not None:
            return  # (a prompt-logprobs request computes its whole prompt; a decode one reads its prefill's)
        n = (len(req.prompt_ids) - 1) // self.P  # the last token is always computed
        if n < self.min_pages:
            return
        now = time.monotonic()
        if now < self._skip_until:
            self.stats.probe_skips += 1
            return
        if n - len(self.radix.match_prefix(req.prompt_ids[: n * self.P]).pages) < self.min_pages:
            return  # the GPU cache holds (almost) all of it already
        self.probes[req.rid] = self.probe.start(self.chain_of(req, n))

    def note_first_token(self, req, ttft_s: float) -> None:
        """`req`'s first token came `ttft_s` after its arrival (the engine loop says)."""
        self.judge.first_token(req, ttft_s)

    def set_aside(self, req) -> str:
        """A `Verdict` for admitting `req` now. SET_ASIDE: it left admission to have its prefix
        fetched from the store (the caller removes it from the waiting queue); it comes back to
        the front when the load is done."""
        if req.rid in self.probed or req.is_embedding or req.num_preemptions:
            return Verdict.ADMIT
        if req.kv_source is not None:  # disaggregated: its prompt waits on a prefill replica
            self.probed.add(req.rid)
            now = time.monotonic()
            f = kv_handoff.plan_fetch(self, req, now)
            if f is None:
                return Verdict.ADMIT
            self.radix.lock(f.node)
            self.loading[req.rid] = Loading(req, f.chain, f.m, f.node, f.n, now, f.deadline, peer=True)
            self._prefetch.append(f.prefetch)
            return Verdict.SET_ASIDE
        if self.host.trusted():
            e = self.host.plan_load(self, req)
            if e is not None:  # admitted with a load of what the host tier holds, in this plan
                self.loading[req.rid] = e
                self.probed.add(req.rid)
                pending = self.probes.pop(req.rid, None)
                if pending is not None:
                    pending.abandon()
                self.stats.host_admissions += 1
                return Verdict.ADMIT
        pending = self.probes.get(req.rid)
        if pending is None:  # not looked up at arrival (short, cached, or the store paused)
            self.probed.add(req.rid)
            return Verdict.ADMIT
        now = time.monotonic()
        del self.probes[req.rid]
        self.probed.add(req.rid)
        errors = self.probe.counters.errors
        # While the store is bypassed its answers still say which pages it holds (those are
        # never saved again), but no request waits for one.
        bypass = self.judge.bypassing(now)
        if pending.done():
            s = pending.pages()
            failed = self.probe.counters.errors > errors
        elif bypass:
            pending.abandon()
            s, failed = 0, False
        elif now - pending.started < PROBE_WAIT_S:
            self.probes[req.rid] = pending
            self.probed.discard(req.rid)
            return Verdict.DEFER
        else:
            pending.abandon(too_slow=True)
            self.stats.probe_timeouts += 1
            s, failed = 0, True
        if failed:
            self._skip_until = now + self.backoff_s  # the store is down or slow: stop asking for a while
        if s:
            self.in_store[req.rid] = s
        if bypass:
            self.stats.bypassed += 1
            return Verdict.ADMIT
        if s and len(self.loading) >= MAX_LOADING:
            self.stats.busy += 1
            return Verdict.ADMIT
        tokens = req.prompt_ids[:-1]
        n = len(tokens) // self.P
        match = self.radix.match_prefix(tokens)
        m = len(match.pages)
        found = max(0, min(s, n) - m)
        self.stats.query_pages += n - m
        self.stats.probe_hit_pages += found
        if found < self.min_pages:
            return Verdict.ADMIT
        self.radix.lock(match.node)
        deadline = now + self.timeout_s + self.per_page_s * found
        chain = self.chain_of(req, n)
        self.loading[req.rid] = Loading(req, chain, m, match.node, m + found, now, deadline)
        self._prefetch.append(KVPrefetch(req.rid, chain[m : m + found]))
        return Verdict.SET_ASIDE

    def requeue_ready(self) -> None:
        """At the start of a schedule: prefetching requests whose stop policy says stop go
        back to the front of the waiting queue (in the order they were set aside), to be
        admitted with their loads (`extend`)."""
        self._sweep()
        now = time.monotonic()
        stop = [e for e in self.loading.values() if not e.queued and e.reported and self._should_stop(e, now)]
        for e in reversed(stop):
            e.queued, e.requeued_at = True, now
            if e.peer:
                kv_handoff.note_stop(self, e, now)
            elif not e.finished:
                self.stats.early_stops += 1
            self.sched.waiting.appendleft(e.req)

    def extend(self, req, kv) -> None:
        """`_admit` of a requeued request (its radix match in kv, locked): the pages every rank
        reported holding past that match become its own computed prefix, filled by a KVLoad in
        this plan (empty when none is worth loading: it just ends the ranks' prefetch)."""
        e = self.loading.get(req.rid)
        if e is None or not e.queued:
            return
        base = len(kv.pages)
        want = max(0, e.m + e.ready - base)  # pages another request cached meanwhile are matched
        pages: list[int] = []
        if want:
            pages = self.allocator.alloc(want)
            if pages is None:
                self.radix.evict(want - self.allocator.num_free)
                pages = self.allocator.alloc(min(want, self.allocator.num_free)) or []
        e.base, e.pages = base, pages
        kv.pages += pages
        kv.num_tokens = (base + len(pages)) * self.P
        self._loads.append(KVLoad(req.rid, pages, e.chain[base : base + len(pages)]))

    def unextend(self, req) -> None:
        """`_admit` gave up after `extend` (no room for the first piece): undo it."""
        e = self.loading.get(req.rid)
        if e is None or not e.queued:
            return
        self._loads = [ld for ld in self._loads if ld.rid != req.rid]
        self.allocator.free(e.pages)
        e.pages = []

    def release_holds(self) -> int:
        """Nothing runs and the head of the queue cannot get the pages it needs: requests set
        aside or requeued for a load hold their radix matches locked (the pages a load extends),
        and together they can hold the memory that every one of them needs. Their loads are
        dropped (the ranks end the prefetches) and their locks let go; they are admitted the
        usual way, computing what they would have loaded. How many were let go."""
        held = list(self.loading.items())
        for rid, e in held:
            del self.loading[rid]
            self.radix.unlock(e.node)
            self.sched._pending_drop.append(rid)  # the ranks cancel its prefetch
            if not e.queued and not e.req.finished:  # set aside: back into the queue, at its front
                self.sched.waiting.appendleft(e.req)
            self.stats.released_holds += 1
        if held:
            logger.warning("KV store: %d requests waiting on loads held the memory the next one needs, with "
                           "nothing running; their loads are dropped and they are computed", len(held))
        return len(held)

    def admitted(self, req) -> None:
        """`req` was admitted (its radix match is locked by `_admit` now)."""
        e = self.loading.pop(req.rid, None)
        if e is not None:
            self.radix.unlock(e.node)
            if e.queued:
                e.load_step = self.sched._step_id + 1  # the plan being built
                e.admitted_at = time.monotonic()
                self.inflight[req.rid] = e
                if not e.peer:  # (a prefill replica's pages are not the store's: saved as usual)
                    self.from_store.update(e.pages)
                if e.peer:  # not the store's: its judge and counters leave it out
                    self.handoff.fetched_pages += len(e.pages)
                else:
                    self.stats.loads += 1
                    self.stats.hit_pages += len(e.pages)
                    self.stats.loaded_tokens += len(e.pages) * self.P
                    if not e.host:  # the judge weighs the store against recompute
                        self.judge.loaded(req.rid, len(e.pages) * self.P, e)
            else:  # set aside, yet admitted before its stop (never expected): end its prefetch
                self._loads.append(KVLoad(req.rid, [], []))
        if req.kv is not None:
            self.saves.matched(req.kv.pages[: req.kv.num_cached_pages])

    def on_cached(self, req, pages: list[int], num_tokens: int, kept: int, token_ids: list[int]) -> None:
        """`release` put req's full pages into the radix cache; it took pages[kept:n_full].
        token_ids: the request's known tokens (without one still being sampled)."""
        if req.hand_off and req.finish_reason is not None:  # a prefill for a decode replica, finished
            # Settled: no plan still in flight writes its pages (an abort, or a request ended
            # while its next piece runs, is not): the ranks may copy them beside that step.
            settled = not self.sched.overlap or req.last_step <= self.sched.done_step
            kv_handoff.hand_off_pages(self, req, pages, num_tokens, token_ids, settled)
        n_full = num_tokens // self.P
        loaded = self.from_store.intersection(pages)
        self.from_store -= loaded
        if n_full <= kept:
            return
        self.saves.cached(pages, kept, self.chain_of(req, n_full, token_ids=token_ids), len(req.prompt_ids) // self.P,
                          loaded, self.in_store.get(req.rid, 0))

    def orders(self):
        """This step's KV orders (saves, prefetch starts, its admissions' loads), or None when
        there are none and no request waits on the store."""
        saves = self.saves.take() + kv_handoff.take_handoff_saves(self)
        prefetch, self._prefetch = self._prefetch, []
        loads, self._loads = self._loads, []
        waiting = any(not e.queued for e in self.loading.values())
        now = time.monotonic()
        if self.host.poll_due(now):  # (an empty plan brings what a warming rank published)
            self.host.polled(now)
            waiting = True
        if not (saves or prefetch or loads or waiting):
            return None
        return _Orders(saves, prefetch, loads)

    def on_result(self, plan, result) -> None:
        self.host.update(result.kv_host_ready, result.kv_host_evicted, result.kv_host_warming)
        for rid, (ready, ended) in result.kv_prefetched.items():
            e = self.loading.get(rid)
            if e is not None:
                e.ready, e.finished, e.reported = min(ready, e.s - e.m), ended, True
        for load in plan.kv_loads:
            e = self.inflight.pop(load.rid, None)
            n = result.kv_loaded.get(load.rid, 0)
            if e is not None:
                e.loaded_at = time.monotonic()
            if e is not None and n < len(load.page_ids):
                self._short_load(e, max(n, 0))

    # ---------------- internals ----------------
    def chain_of(self, req, n_pages: int, token_ids: list[int] | None = None) -> list[str]:
        """Chain keys of req's first n_pages pages (cached per request, extended as it grows)."""
        from kvstore.keys import chain_keys

        chain = self.chains.get(req.rid, [])
        if len(chain) < n_pages:
            ids = token_ids if token_ids is not None else req.prompt_ids
            start = len(chain) * self.P
            chain = chain + chain_keys(ids[start : n_pages * self.P], self.P, self.fingerprint, self.layout,
                                       parent=chain[-1] if chain else None)
            self.chains[req.rid] = chain
        return chain[:n_pages]

    def _should_stop(self, e: Loading, now: float) -> bool:
        if e.peer:
            return kv_handoff.should_stop(e, now)
        if self.prefetch_policy == "best_effort":
            return True  # what the first report said the ranks hold
        if self.prefetch_policy == "wait_complete":
            return e.finished or now - e.started > WAIT_COMPLETE_CAP_S
        return e.finished or now >= e.deadline

    def _short_load(self, e: Loading, n: int) -> None:
        """The ranks agreed on n < the pages a load was ordered with (they had reported
        holding them all: a row lost meanwhile, a failed copy): the forward that read the load
        computed garbage past them. What that plan (and, overlapped, the next) sampled for the
        request is dropped; a running request computes its prompt again past the good pages
        (which the radix cache keeps). A request preempted or ended before this result cached
        none of the load's pages (`unconfirmed`)."""
        req = e.req
        missing = len(e.pages) - n
        if e.peer:
            self.handoff.fetched_pages -= missing
        else:
            self.stats.hit_pages -= missing
            self.stats.loaded_tokens -= missing * self.P
        self.stats.short_loads += 1
        req.cached_tokens = max(0, req.cached_tokens - missing * self.P)
        self.sched.stats.prefix_hit_tokens -= missing * self.P
        if e.host:  # the picture was wrong about these; a rank that loads none lacks the tier
            self.host.forget(e.chain[e.base + n : e.base + len(e.pages)])
            if n == 0:
                self.host.distrust()
        self.from_store.difference_update(e.pages[n:])
        logger.warning("KV store: request %s loaded %d of %d pages its ranks reported holding; computing the rest",
                       req.rid, n, len(e.pages))
        if req.finished:
            return
        if req.kv is not None:
            req.kv.num_tokens = min(req.kv.num_tokens, (e.base + n) * self.P)
        self.sched.recompute(req)

    def unconfirmed(self, req) -> None:
        """Before `req`'s pages go to the radix cache (it ends or is preempted): none that a load
        whose result has not come filled (the load may come back short)."""
        e = self.inflight.get(req.rid)
        if e is not None and e.pages and req.kv is not None:
            req.kv.num_tokens = min(req.kv.num_tokens, e.base * self.P)

    def _sweep(self) -> None:
        """Forget requests that finished (aborted) while set aside or requeued (the ranks
        cancel their prefetches), and loads whose step's result never came (the step failed:
        the engine failed its requests)."""
        for rid, e in list(self.loading.items()):
            if e.req.finished:
                del self.loading[rid]
                self.radix.unlock(e.node)
                self.sched._pending_drop.append(rid)  # the ranks cancel its prefetch
        for rid, e in list(self.inflight.items()):
            if e.load_step < self.sched._step_id:  # its result came (and removed it) or never will
                del self.inflight[rid]
        live = self.sched.requests
        self.judge.forget(live)
        for rid in [r for r in self.probed if r not in live and r not in self.loading]:
            self.probed.discard(rid)
            self.chains.pop(rid, None)
            self.in_store.pop(rid, None)
        for rid in [r for r in self.probes if r not in live]:  # finished before admission
            self.probes.pop(rid).abandon()
            self.chains.pop(rid, None)

    # ---------------- metrics ----------------
    def close(self) -> None:
        """Stop the replica's stats poller, if it started one (the engine shuts down)."""
        if self.poller is not None:
            self.poller.stop()

    def counters(self) -> dict:
        """The scheduler side's counters (`kv_store_setup.kv_store_stats` adds the ranks' and
        the store's)."""
        probe = self.probe.counters
        return {"layout": self.layout, "write_policy": self.write_policy, "prefetch_policy": self.prefetch_policy,
                **asdict(self.stats), "probe_errors": probe.errors, "handoff": {**asdict(self.handoff), "wait": self.handoff_wait.stats()},
                **self.judge.counters()}


class _Orders:
    """A step's KV orders; truthy even when empty while a request waits on the store (the
    step then gives the ranks a chance to report prefetch progress)."""

    def __init__(self, saves, prefetch, loads):
        self.saves, self.prefetch, self.loads = saves, prefetch, loads

    def apply(self, plan) -> None:
        plan.kv_saves, plan.kv_prefetch, plan.kv_loads = self.saves, self.prefetch, self.loads
