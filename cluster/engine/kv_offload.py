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
2. `orders()`, every step: a prefetching request stops by the stop policy —
   best_effort: at the first step after the prefetch started (take what has arrived);
   wait_complete: when rank 0 reports the prefetch finished (each rank then waits for its own);
   timeout: when finished or at prefetch_timeout_s + per_page_s × pages (grows with the prompt).
   Then pages are allocated (evicting the radix cache's LRU pages if needed) and a `KVLoad`
   copies the host-tier pages into them; the ranks answer n = min over ranks of what they had.
   Only rank 0 reports its prefetch finished, and the other ranks' may lag behind it (an MLA
   rank != 0 reads pages it never wrote; its first read registers with the store): while the
   policy still allows waiting, the load is `until_done` and the ranks answer `LOAD_PENDING`
   (all of them: it is one agreement) while any rank's prefetch runs; the request keeps its
   pages and the load is ordered again in a later step.
3. `on_result`: the first m + n pages go into the radix cache (locked until admission), the
   other allocated pages are freed, and the request returns to the front of the queue, where
   `_admit` matches the longer prefix and the prefill computes only the rest.

Saving pages (the write policy, when device pages get a copy in the host tier and the store):

- write_back_selective (default): write_back's pages plus write_through_selective's. A page is
  written when it is about to have no other copy (evicted from the GPU, or the replica stops)
  or has proven hot (matched twice: then other replicas may want it too). Each page is written
  at most once, and nothing is written while the GPU cache holds the working set: a workload
  of one-off prompts (a benchmark's random ones) costs the store nothing while it runs.
- write_back: a page when the radix cache evicts it (the plan that evicts it carries the
  save, which runs before the forward that may overwrite the page), and at shutdown the pages
  still cached, most recently cached first, for up to the drain timeout (`drain_saves`).
- write_through_selective: a cached page once admissions have matched it `HIT_THRESHOLD` (2)
  times, so pages used once never cost a store write;
- write_through: every full page the radix cache takes on `release` (a finished or
  preempted request), in the next plan. Every page of every request: the most store traffic
  (an 8B model writes 128 KiB per token), for stores that must survive a crash.

The store down, slow or full never stops serving or holds a step: the probe is read without
waiting, the ranks drop saves their host tier has no room for, a failed or slow probe pauses
probing for `backoff_s`, and a load that finds nothing admits the request with its radix
match only. A store slower than recompute is bypassed. What a load must beat is the first token a user
would otherwise get, so both paths are judged by their requests' time to first token per
prompt token (measured as the replica runs, arrival to first token: queueing included):
requests that loaded most of their prompt against requests that computed it. When loading
has been the slower path, requests are not set aside for `BYPASS_S`, then the store is tried
again. (A throughput comparison — the store's bandwidth against the GPU's prefill rate —
bypassed a store that halved TTFT under load: an H100 prefills an 8B model's tokens faster
than the store moves their 128 KiB each, but a loaded request skips the queue for prefill.)
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from cluster.engine.config import KV_PREFETCH_POLICIES, KV_WRITE_POLICIES
from kvstore.messages import STORE_NAME
from workers.kv_messages import LOAD_PENDING, KVLoad, KVPrefetch, KVSave

logger = logging.getLogger(__name__)

HIT_THRESHOLD = 2  # write_through_selective: matches before a page is saved
MIN_LOAD_TOKENS = 16  # a store load costs two extra steps: skip shorter ones
# Smaller pages cost more to move than to recompute (one store key, slot and file per page):
# replicas with smaller pages run without the store.
MIN_PAGE_TOKENS = 16
WAIT_COMPLETE_CAP_S = 60.0  # wait_complete still gives up after this long
PROBE_WAIT_S = 0.1  # a store lookup not answered by then is a miss (and probing pauses)
BYPASS_S = 30.0  # a store slower than recompute is not used for this long, then tried again
RATE_SAMPLES = 3  # first tokens measured on each path before the store may be bypassed
DRAIN_CHUNK_PAGES = 64  # pages per drain order at shutdown
# Requests loading from the store at once: beyond that the store's pipeline (each rank's I/O
# threads) is busy and one more would queue behind the others; it is computed instead.
MAX_LOADING = 4
WRITE_BACK = ("write_back", "write_back_selective")  # policies that save on eviction and at shutdown
SELECTIVE = ("write_through_selective", "write_back_selective")  # policies that save hot pages


class Verdict:
    """What the store integration says about admitting a request now (`set_aside`)."""

    ADMIT = "admit"  # admit it as usual
    SET_ASIDE = "set_aside"  # it left the queue to have its prefix loaded from the store
    DEFER = "defer"  # its store lookup has not answered yet: admit the ones behind it first


# ---------------------------------------------------------------------------------------------
# the scheduler side


@dataclass
class KVOffloadStats:
    query_pages: int = 0  # pages past the radix match looked up in the store
    probe_hit_pages: int = 0  # of those, present for every rank when probed
    hit_pages: int = 0  # pages loaded into the device pool (agreed by all ranks)
    loaded_tokens: int = 0  # hit_pages * page_size: prompt tokens the prefill did not compute
    loads: int = 0  # requests that went through a store load
    saved_pages: int = 0  # pages ordered saved (device -> host tier -> store)
    early_stops: int = 0  # prefetches stopped before they finished (best_effort, timeout)
    probe_skips: int = 0  # requests not probed while probing pauses after a store error
    probe_timeouts: int = 0  # lookups not answered within PROBE_WAIT_S
    bypassed: int = 0  # requests not probed while the store is slower than recompute
    busy: int = 0  # requests computed because MAX_LOADING others were loading
    drained_pages: int = 0  # pages ordered saved at shutdown


@dataclass(eq=False)
class _Loading:
    req: object
    chain: list[str]
    m: int  # radix pages matched (locked) when set aside
    match_pages: list[int]
    node: object
    s: int  # leading pages every rank's keys were in the store for, when probed (> m)
    started: float
    deadline: float
    executed: bool = False  # the prefetch order has run on the ranks
    finished: bool = False  # rank 0 reported its prefetch done
    pages: list[int] = field(default_factory=list)  # allocated for the KVLoad in flight
    load_step: int = 0  # the step id of the plan carrying that KVLoad
    pending: bool = False  # its KVLoad answered LOAD_PENDING: order it again (same pages)


class _Rate:
    """Tokens per second, averaged (exponentially) over the last few measurements."""

    def __init__(self) -> None:
        self.value, self.samples = 0.0, 0

    def add(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        self.value = rate if self.samples == 0 else 0.7 * self.value + 0.3 * rate
        self.samples += 1


class SchedulerKVOffload:
    """Attached to one `Scheduler` (sets `scheduler.kv_offload`). Every method runs under the
    engine's lock; none waits on the store (lookups are sent by `on_arrival` and read by
    `set_aside` when they have answered)."""

    def __init__(self, scheduler, *, fingerprint: str, layout: str, tp_size: int,
                 write_policy: str = "write_back_selective", prefetch_policy: str = "timeout",
                 prefetch_timeout_s: float = 0.5, prefetch_timeout_per_page_s: float = 0.002,
                 store_name: str = STORE_NAME, namespace: str | None = None, probe_timeout_s: float = 2.0,
                 min_pages: int | None = None, backoff_s: float = 2.0, probe=None):
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
        self.tree_keys: dict[int, str] = {}  # page in the radix tree -> its chain key
        self.saved: set[int] = set()  # tree pages already saved (or loaded from the store)
        self.hits: Counter[int] = Counter()  # write_through_selective: admissions that matched a page
        self.pending_saves: list[tuple[int, str]] = []
        self.loading: dict[str, _Loading] = {}
        self.held: dict[str, tuple[object, object]] = {}  # rid -> (req, locked node) until admitted
        self.probed: set[str] = set()  # requests whose store question is settled
        self.probes: dict[str, object] = {}  # rid -> kvstore.probe.PendingProbe
        self.prompt_pages: set[int] = set()  # tree pages that hold prompt tokens (drained first)
        self.chains: dict[str, list[str]] = {}
        self._prefetch: list[KVPrefetch] = []
        self._skip_until = 0.0
        self._bypass_until = 0.0
        # Prompt tokens per second of time to first token: requests that loaded from the store;
        # requests that computed their prompt (`note_first_token`).
        self.load_rate, self.compute_rate = _Rate(), _Rate()
        self._loaded_by: dict[str, int] = {}  # rid -> prompt tokens it loaded (until its first token)
        self.stats = KVOffloadStats()
        self.poller = None  # the replica's stats poller (cluster/kv_store_setup.py)
        scheduler.kv_offload = self
        self.radix.on_evict = self._on_evict  # bookkeeping always; saves only under write_back

    # ---------------- hooks of the scheduler ----------------
    def has_work(self) -> bool:
        return bool(self.loading or self.pending_saves or self._prefetch)

    def held_pages(self) -> list[int]:
        """Pages allocated to loads in flight (neither free, cached nor owned by a request)."""
        return [p for e in self.loading.values() for p in e.pages]

    def on_arrival(self, req) -> None:
        """Send the store lookup of a new request's prefix (answered while it waits)."""
        if req.is_embedding or req.rid in self.probes or req.params.prompt_logprobs is not None:
            return  # (a prompt-logprobs request computes its whole prompt: nothing to load)
        n = (len(req.prompt_ids) - 1) // self.P  # the last token is always computed
        if n < self.min_pages:
            return
        now = time.monotonic()
        if now < self._bypass_until:
            self.stats.bypassed += 1
            return
        if now < self._skip_until:
            self.stats.probe_skips += 1
            return
        if n - len(self.radix.match_prefix(req.prompt_ids[: n * self.P]).pages) < self.min_pages:
            return  # the GPU cache holds (almost) all of it already
        self.probes[req.rid] = self.probe.start(self._chain(req, n))

    def note_first_token(self, req, ttft_s: float) -> None:
        """`req`'s first token came `ttft_s` after its arrival: a sample of the path its prompt
        took (loaded from the store, or computed), which `_judge` compares."""
        loaded = self._loaded_by.pop(req.rid, 0)
        prompt = req.num_prompt_tokens
        if prompt < self.min_pages * self.P or req.is_embedding or req.num_preemptions:
            return
        if 2 * loaded >= prompt:
            self.load_rate.add(prompt, ttft_s)
            self._judge()
        elif req.cached_tokens * 2 < prompt:
            self.compute_rate.add(prompt, ttft_s)

    def set_aside(self, req) -> str:
        """A `Verdict` for admitting `req` now. SET_ASIDE: it left admission to have its prefix
        fetched from the store (the caller removes it from the waiting queue); it comes back to
        the front when the load is done."""
        if req.rid in self.probed or req.is_embedding or req.num_preemptions:
            return Verdict.ADMIT
        pending = self.probes.get(req.rid)
        if pending is None:  # not looked up at arrival (short, cached, or the store paused)
            self.probed.add(req.rid)
            return Verdict.ADMIT
        now = time.monotonic()
        del self.probes[req.rid]
        self.probed.add(req.rid)
        errors = self.probe.counters.errors
        if pending.done():
            s = pending.pages()
            failed = self.probe.counters.errors > errors
        elif now - pending.started < PROBE_WAIT_S:
            self.probes[req.rid] = pending
            self.probed.discard(req.rid)
            return Verdict.DEFER
        else:
            pending.abandon()
            self.stats.probe_timeouts += 1
            s, failed = 0, True
        if failed:
            self._skip_until = now + self.backoff_s  # the store is down or slow: stop asking for a while
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
        chain = self._chain(req, n)
        self.loading[req.rid] = _Loading(req, chain, m, list(match.pages), match.node, m + found, now, deadline)
        self._prefetch.append(KVPrefetch(req.rid, chain[m : m + found]))
        return Verdict.SET_ASIDE

    def admitted(self, req) -> None:
        """`req` was admitted (its radix match is locked by `_admit` now)."""
        held = self.held.pop(req.rid, None)
        if held is not None:
            self.radix.unlock(held[1])
        if self.write_policy in SELECTIVE and req.kv is not None:
            for p in req.kv.pages[: req.kv.num_cached_pages]:
                self.hits[p] += 1
                if self.hits[p] >= HIT_THRESHOLD and p not in self.saved and p in self.tree_keys:
                    self._save(p, self.tree_keys[p])

    def on_cached(self, req, pages: list[int], num_tokens: int, kept: int, token_ids: list[int]) -> None:
        """`release` put req's full pages into the radix cache; it took pages[kept:n_full].
        token_ids: the request's known tokens (without one still being sampled)."""
        n_full = num_tokens // self.P
        if n_full <= kept:
            return
        chain = self._chain(req, n_full, token_ids=token_ids)
        prompt_full = len(req.prompt_ids) // self.P
        for i in range(kept, n_full):
            self.tree_keys[pages[i]] = chain[i]
            if i < prompt_full:
                self.prompt_pages.add(pages[i])
            if self.write_policy == "write_through":
                self._save(pages[i], chain[i])

    def drain_saves(self) -> list[KVSave]:
        """At shutdown (write_back policies): `sync` saves of every cached page not saved yet,
        prompt pages first, most recently cached first, in chunks the caller sends one at a
        time until its deadline. Empty for the write-through policies (their pages went out)."""
        if self.write_policy not in WRITE_BACK:
            return []
        recent = [p for p in reversed(self.tree_keys) if p not in self.saved]
        order = [p for p in recent if p in self.prompt_pages] + [p for p in recent if p not in self.prompt_pages]
        out = []
        for i in range(0, len(order), DRAIN_CHUNK_PAGES):
            chunk = order[i : i + DRAIN_CHUNK_PAGES]
            out.append(KVSave(chunk, [self.tree_keys[p] for p in chunk], sync=True))
        return out

    def drained(self, save: KVSave) -> None:
        self.saved.update(save.page_ids)
        self.stats.drained_pages += len(save.page_ids)

    def orders(self):
        """This step's KV orders (saves, prefetch starts, loads), or None when there are none
        and no request waits on the store."""
        self._sweep()
        loads: list[KVLoad] = []
        now = time.monotonic()
        for e in list(self.loading.values()):
            if e.pages and not e.pending:
                continue  # its load is in flight
            if not e.pages and (not e.executed or not self._should_stop(e, now)):
                continue
            load = self._start_load(e, now)
            if load is not None:
                e.load_step = self.sched._step_id + 1  # the plan these orders go into
                loads.append(load)
        saves = [KVSave([p for p, _ in self.pending_saves], [k for _, k in self.pending_saves])]
        saves = saves if self.pending_saves else []
        self.pending_saves = []
        prefetch, self._prefetch = self._prefetch, []
        if not (saves or prefetch or loads or self.loading):
            return None
        return _Orders(saves, prefetch, loads)

    def on_result(self, plan, result) -> None:
        for pre in plan.kv_prefetch:
            e = self.loading.get(pre.rid)
            if e is not None:
                e.executed = True
        for rid in result.kv_prefetched:
            e = self.loading.get(rid)
            if e is not None:
                e.finished = True
        for load in plan.kv_loads:
            n = result.kv_loaded.get(load.rid, 0)
            if n == LOAD_PENDING and load.rid in self.loading:
                self.loading[load.rid].pending = True  # a rank's prefetch still runs: again later
                continue
            e = self.loading.pop(load.rid, None)
            if e is not None:
                self._finish_load(e, max(0, min(n, len(e.pages))))

    # ---------------- internals ----------------
    def _chain(self, req, n_pages: int, token_ids: list[int] | None = None) -> list[str]:
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

    def _save(self, page: int, key: str) -> None:
        self.saved.add(page)
        self.pending_saves.append((page, key))
        self.stats.saved_pages += 1

    def _on_evict(self, leaf, take: int) -> None:
        """Radix eviction of leaf's last `take` pages: forget them (the page ids come back with
        other tokens); write_back saves them now."""
        for p in leaf.pages[len(leaf.pages) - take :]:
            key = self.tree_keys.pop(p, None)
            self.hits.pop(p, None)
            self.prompt_pages.discard(p)
            if self.write_policy in WRITE_BACK and key is not None and p not in self.saved:
                self._save(p, key)
            self.saved.discard(p)

    def _should_stop(self, e: _Loading, now: float) -> bool:
        if self.prefetch_policy == "best_effort":
            return True
        if self.prefetch_policy == "wait_complete":
            return e.finished or now - e.started > WAIT_COMPLETE_CAP_S
        return e.finished or now >= e.deadline

    def _start_load(self, e: _Loading, now: float) -> KVLoad | None:
        """The KVLoad of e (its pages allocated now, or kept from a load that answered
        pending); None when no page could be had (the request is requeued)."""
        if e.pending:
            e.pending = False
        else:
            want = e.s - e.m
            pages = self.allocator.alloc(want)
            if pages is None:
                self.radix.evict(want - self.allocator.num_free)
                pages = self.allocator.alloc(min(want, self.allocator.num_free))
            if not pages:
                self.loading.pop(e.req.rid)
                self._finish_load(e, 0)
                return None
            e.pages = pages
            if not e.finished:
                self.stats.early_stops += 1
        if self.prefetch_policy == "best_effort":
            wait = 0.0
        elif self.prefetch_policy == "wait_complete":
            wait = max(0.0, e.started + WAIT_COMPLETE_CAP_S - now)
        else:
            wait = max(0.0, e.deadline - now)
        # While the policy still waits, every rank's prefetch must be done before any page is
        # used (rank 0's finishing, which started this load, says nothing of the others').
        return KVLoad(e.req.rid, e.pages, e.chain[e.m : e.m + len(e.pages)], wait, until_done=wait > 0)

    def _finish_load(self, e: _Loading, n: int) -> None:
        """The ranks put n pages into e.pages[:n]: cache them, free the rest, requeue req."""
        req, m, P = e.req, e.m, self.P
        node = e.node
        if n > 0 and not req.finished:
            tokens = req.prompt_ids[: (m + n) * P]
            k = self.radix.insert(tokens, e.match_pages + e.pages[:n])
            dup = min(max(k - m, 0), n)  # pages another request cached meanwhile: ours are spare
            for p, key in zip(e.pages[dup:n], e.chain[m + dup : m + n]):
                self.tree_keys[p] = key
                self.saved.add(p)  # it came from the store
            self.allocator.free(e.pages[:dup] + e.pages[n:])
            match = self.radix.match_prefix(tokens)
            self.radix.lock(match.node)
            self.radix.unlock(node)
            node = match.node
            self.stats.hit_pages += n
            self.stats.loaded_tokens += n * P
            self._loaded_by[req.rid] = n * P
        else:
            self.allocator.free(e.pages)
        e.pages = []
        self.stats.loads += 1
        if req.finished:
            self.radix.unlock(node)
            return
        self.held[req.rid] = (req, node)
        self.sched.waiting.appendleft(req)

    def _judge(self) -> None:
        """Bypass the store while loading has given later first tokens than computing."""
        if (self.load_rate.samples >= RATE_SAMPLES and self.compute_rate.samples >= RATE_SAMPLES
                and self.load_rate.value < self.compute_rate.value):
            logger.warning("KV store: requests that load their prompt get their first token at %.0f prompt "
                           "tokens/s, those that compute it at %.0f: not using the store for %.0f s",
                           self.load_rate.value, self.compute_rate.value, BYPASS_S)
            self._bypass_until = time.monotonic() + BYPASS_S
            self.load_rate = _Rate()  # measured afresh when the store is tried again

    def _sweep(self) -> None:
        """Forget requests that finished (aborted) while set aside or held. A load still
        holding pages here belongs to a step that failed (its result never came back: a
        successful step's `on_result` ends every load of its plan): it loaded nothing. Under
        overlapped scheduling the newest plan may still be in flight: its loads wait."""
        in_flight_step = self.sched._step_id if self.sched.overlap else None
        for rid, e in list(self.loading.items()):
            if e.pages and e.load_step == in_flight_step and not e.pending:
                continue
            if e.pending and e.req.finished:  # between two tries of its load
                del self.loading[rid]
                self.allocator.free(e.pages)
                e.pages = []
                self.radix.unlock(e.node)
                self.sched._pending_drop.append(rid)  # the ranks cancel its prefetch
            elif e.pending:
                continue  # ordered again by `orders`
            elif e.pages:
                del self.loading[rid]
                self._finish_load(e, 0)
            elif e.req.finished:
                del self.loading[rid]
                self.radix.unlock(e.node)
                self.sched._pending_drop.append(rid)  # the ranks cancel its prefetch
        for rid, (req, node) in list(self.held.items()):
            if req.finished:
                del self.held[rid]
                self.radix.unlock(node)
        live = self.sched.requests
        for rid in [r for r in self._loaded_by if r not in live]:  # ended before a first token
            del self._loaded_by[rid]
        for rid in [r for r in self.probed if r not in live and r not in self.loading]:
            self.probed.discard(rid)
            self.chains.pop(rid, None)
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
                **asdict(self.stats), "probe_errors": probe.errors,
                "ttft_tokens_per_s_loaded": self.load_rate.value, "ttft_tokens_per_s_computed": self.compute_rate.value,
                "bypassing": time.monotonic() < self._bypass_until}


class _Orders:
    """A step's KV orders; truthy even when empty while a request waits on the store (the
    step then gives the ranks a chance to report prefetch progress)."""

    def __init__(self, saves, prefetch, loads):
        self.saves, self.prefetch, self.loads = saves, prefetch, loads

    def apply(self, plan) -> None:
        plan.kv_saves, plan.kv_prefetch, plan.kv_loads = self.saves, self.prefetch, self.loads
