"""The router: spreads requests over replica actors and keeps serving when one fails.

Policies: `round_robin`; `least_load` (the router's own in-flight count plus the replica's
waiting queue, then KV usage); `cache_aware` (the prefix of the prompt each replica has cached:
go to the best match when its match rate reaches `cache_threshold`, unless the load gap exceeds
both `balance_abs_threshold` and `balance_rel_threshold` × the lightest load, in which case
least load wins). What a replica has cached comes from its KV events (`cluster/kv_index.py`,
pulled with the stats) while they are fresh, else from the router's approximate prefix memory
of what it sent there (`cluster/prefix_tree.py`), which never learns of evictions.

Health: a poller fetches every replica's stats each `stats_interval_s`; a replica that fails
to answer, reports itself unhealthy, or fails a request before its first token is skipped
until it answers healthy again. A request that fails before its first token is retried on
another replica; one that fails later ends with a clean error, unless its caller has shown
nothing of it yet (`restart`: a response that is not streamed), when it runs again elsewhere.

Requests reach a replica through its `ReplicaClient` (`cluster/replica_client.py`), over a
connection of its own (`cluster/replica_channel.py`): batched admissions in, one frame of every
output per engine step out, so the traffic follows the engine's step rate, not the number of
requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import ray

from cluster.engine.client import HealthStatus, NoReplicaAvailable
from cluster.engine.request import ADMITTED, RESTARTED, Admitted, RequestOutput, Restarted
from cluster.kv_index import KVIndex, StoreIndex
from cluster.pd_route import disaggregated_stream
from cluster.prefix_tree import PrefixTree, RecentRoutes
from cluster.replica_client import ReplicaClient, ReplicaGone
from workers.request_errors import QueueFull, RequestError
from workers.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Error types of an output that failed after tokens because its replica did (a lost worker, a
# rebuild, a shutdown: not the request, nor a step that raised, which may be the request's own
# doing): a request whose caller allows it (`restart`) runs again elsewhere, once.
REPLICA_FAILURES = ("internal", "unavailable")

POLICIES = ("round_robin", "least_load", "cache_aware")


@dataclass(frozen=True)
class RouterOptions:
    policy: str = "cache_aware"
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 16
    balance_rel_threshold: float = 1.5
    tree_max_tokens: int = 200_000
    stats_interval_s: float = 0.5
    stats_timeout_s: float = 5.0
    # A replica actor that has answered no stats poll for this long is hung (alive to Ray, its
    # process stopped or wedged): its streams are ended (those without a token are retried
    # elsewhere) and it is treated as dead, so the supervisor kills and replaces it.
    replica_hang_s: float = 30.0
    max_attempts: int = 3
    # Requests the router holds at once over all replicas; 0: unbounded (QueueFull beyond).
    max_inflight: int = 0
    # cache_aware: route on the replicas' KV events (their real prefix caches) while an index
    # was updated within this many seconds; past it, on the approximate prefix memory.
    kv_events: bool = True
    kv_events_max_age_s: float = 2.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"router policy must be one of {POLICIES}, not {self.policy!r}")


@dataclass
class ReplicaHandle:
    name: str
    actor: Any
    healthy: bool = True
    reason: str | None = None
    draining: bool = False
    # The actor itself is gone for good (ActorDiedError: its process or node died): only a new
    # actor serves again (`cluster.supervisor` replaces it).
    dead: bool = False
    silent_since: float | None = None  # when its stats polls began to go unanswered
    inflight: int = 0
    stats: dict = field(default_factory=dict)
    tree: PrefixTree = field(default_factory=PrefixTree)
    recent: RecentRoutes = field(default_factory=lambda: RecentRoutes(2.0))  # routed lately: events may lag
    kv_index: KVIndex = field(default_factory=KVIndex)  # its prefix cache, from its KV events
    client: ReplicaClient | None = None  # the serving path to the actor (set by add_replica)
    role: str = "mixed"  # "prefill" / "decode" in a disaggregated deployment
    kv_source: Any = None  # a prefill replica's: where decode replicas read what it hands off

    @property
    def load(self) -> int:
        return self.inflight + int(self.stats.get("num_waiting", 0))


class Router:
    def __init__(self, options: RouterOptions, metrics, tokenizer, model_name: str,
                 max_context_len: int, vocab_size: int, is_encoder_decoder: bool = False,
                 matryoshka_dimensions: tuple[int, ...] | None = None, embedding_size: int | None = None):
        self.options = options
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_context_len = max_context_len
        self.vocab_size = vocab_size
        self.is_encoder_decoder = is_encoder_decoder  # the prompt is the encoder's input
        self.matryoshka_dimensions = matryoshka_dimensions  # `dimensions` the model allows
        self.embedding_size = embedding_size
        self.replicas: dict[str, ReplicaHandle] = {}
        self.store_index = StoreIndex()  # the shared store's pages, from every replica's KV events
        self.kv_store: tuple[str, str | None] | None = None  # the store's (name, namespace), from a replica's info
        self._store_actor = None
        self._store_lookup = float("-inf")  # when the store's actor was last looked up
        self._rr = itertools.count()
        self._poller: asyncio.Task | None = None
        self._inflight = 0

    # ---------------- membership ----------------
    def add_replica(self, name: str, actor, info: dict | None = None) -> None:
        """Put a replica into rotation; `info` (its `info()`) says its role (default mixed)."""
        info = info or {}
        self.replicas[name] = ReplicaHandle(name, actor, tree=PrefixTree(self.options.tree_max_tokens),
                                            kv_index=KVIndex(self.store_index),
                                            recent=RecentRoutes(self.options.kv_events_max_age_s),
                                            client=ReplicaClient(name, actor), role=info.get("role", "mixed"),
                                            kv_source=info.get("kv_source"))
        if info.get("kv_store"):
            self.kv_store = tuple(info["kv_store"])
        if self.metrics is not None:
            self.metrics.init_replica(name, self.options.policy)
            self.metrics.set_kv_capacity(name, info)
        logger.info("router: replica %s added", name)

    def remove_replica(self, name: str) -> ReplicaHandle | None:
        """Take a replica out of rotation; the streams still open on it end with `ReplicaGone`
        (retried elsewhere if they have no token yet), and its connection closes."""
        handle = self.replicas.pop(name, None)
        if handle is not None and self.metrics is not None:
            self.metrics.remove_replica(name)
        if handle is not None and handle.client is not None:
            try:
                asyncio.get_running_loop().create_task(handle.client.aclose("removed from the router"))
            except RuntimeError:  # no loop (a test's plain call): nothing is open on it
                pass
        return handle

    def _candidates(self, exclude: set[str], roles: tuple[str, ...] | None = None) -> list[ReplicaHandle]:
        return [h for h in self.replicas.values() if h.healthy and not h.draining and h.name not in exclude
                and (roles is None or h.role in roles)]

    # ---------------- policy ----------------
    def choose(self, tokens: list[int], exclude: set[str] = frozenset(),
               roles: tuple[str, ...] | None = None) -> ReplicaHandle | None:
        """The replica (of one of `roles`; None: any) that serves a request of `tokens` next."""
        cands = self._candidates(set(exclude), roles)
        if not cands:
            return None
        policy = self.options.policy
        if policy == "round_robin":
            return cands[next(self._rr) % len(cands)]
        lightest = min(cands, key=lambda h: (h.load, h.stats.get("kv_usage", 0.0)))
        if policy == "least_load":
            return lightest
        heaviest = max(cands, key=lambda h: h.load)
        gap = heaviest.load - lightest.load
        imbalanced = (gap > self.options.balance_abs_threshold
                      and heaviest.load > self.options.balance_rel_threshold * lightest.load)
        if imbalanced or not tokens:
            return lightest
        cached = {h.name: self.cached_prefix(h, tokens) for h in cands}
        best = max(cands, key=lambda h: (cached[h.name][0], -h.load))
        hit, source = cached[best.name]
        if hit < self.options.cache_threshold * len(tokens):
            return lightest
        if self.metrics is not None:
            self.metrics.record_prefix_route(best.name, source, hit)
            if source == "events":
                self.metrics.record_prefix_tiers(best.name, best.kv_index.tiers(tokens))
        return best

    def cached_prefix(self, h: ReplicaHandle, tokens: list[int]) -> tuple[int, str]:
        """(tokens of `tokens`' prefix replica h has cached, where that came from: "events"
        while its KV index is fresh, else "tree", the approximate memory). On events the tokens
        are weighted by the tier that holds them (GPU, its host tier, the shared store:
        `cluster.kv_index.TIER_WEIGHTS`), and what was routed to h within the freshness window
        counts too: a conversation's next turn often arrives before the pages of its last one
        are in an event the router has pulled."""
        max_age = self.options.kv_events_max_age_s
        if self.options.kv_events and h.kv_index.lag_s() <= max_age:
            return max(h.kv_index.score(tokens), h.recent.match(tokens)), "events"
        return h.tree.match(tokens), "tree"

    # ---------------- serving ----------------
    def _tokens(self, prompt: str | list[int]) -> list[int]:
        return list(self.tokenizer(prompt).input_ids) if isinstance(prompt, str) else list(prompt)

    async def generate_stream(self, prompt: str | list[int], params: SamplingParams, rid: str | None = None,
                              is_embedding: bool = False, group: str | None = None, announce: bool = False,
                              restart: bool = False) -> AsyncIterator[RequestOutput | Admitted | Restarted]:
        """The request's outputs; `announce`: first `ADMITTED`, once a replica has queued it
        (not on the disaggregated path); `restart`: the caller shows nothing until the request
        ends, so a replica that fails it mid-generation has it run again on another (`RESTARTED`
        then voids what came before; not on the disaggregated path)."""
        params.validate(self.vocab_size)
        if self._poller is None:  # the stats poller lives on the serving event loop
            await self.start()
        tokens = self._tokens(prompt)
        rid = rid or f"req-{uuid.uuid4().hex}"
        if self.options.max_inflight and self._inflight >= self.options.max_inflight:
            raise QueueFull(f"{self._inflight} requests in flight (router max {self.options.max_inflight})")
        self._inflight += 1
        try:
            if not is_embedding and self._disaggregated():
                stream = disaggregated_stream(self, rid, tokens, params, group)
            else:  # mixed replicas first; without any, a prefill or decode replica serves it whole
                roles = ("mixed",) if any(h.role == "mixed" for h in self.replicas.values()) else None
                stream = self.attempts(rid, tokens, params, is_embedding, group, roles, announce=announce,
                                       restart=restart)
            async with contextlib.aclosing(stream):  # a client gone: the replica hears of it now
                async for out in stream:
                    yield out
        finally:
            self._inflight -= 1

    def _disaggregated(self) -> bool:
        """Prefill and decode replicas are in rotation: generation goes through both."""
        return any(h.role == "prefill" and h.kv_source is not None for h in self._candidates(set())) and any(
            h.role == "decode" for h in self._candidates(set()))

    async def attempts(self, rid: str, tokens: list[int], params: SamplingParams, is_embedding: bool = False,
                       group: str | None = None, roles: tuple[str, ...] | None = None, announce: bool = False,
                       restart: bool = False, **admission) -> AsyncIterator[RequestOutput | Admitted | Restarted]:
        """Serve a request on one replica of `roles`, retried on another while it fails before
        its first output; `admission`: the disaggregation fields of `cluster.replica.Admission`.
        `announce`: yield `ADMITTED` when the first replica queues it (a retry after that is
        the stream's own business: its errors come as outputs or exceptions, as after a token).
        `restart`: a replica's failure after outputs (it died, or failed its requests) yields
        `RESTARTED` and the request runs again on another replica, within the same attempts."""
        tried: set[str] = set()
        saw_full = False
        restarts = 1 if restart else 0  # runs again after outputs it may still have
        for _attempt in range(self.options.max_attempts):
            handle = self.choose(tokens, tried, roles)
            if handle is None:
                break
            tried.add(handle.name)
            if self.metrics is not None:
                self.metrics.record_route(self.options.policy, handle.name)
            handle.tree.insert(tokens)
            if self.options.kv_events:
                handle.recent.insert(tokens)
            first_seen = False
            handle.inflight += 1
            finished = False
            failed = None  # why the replica failed it after outputs (`restart`: it runs again)
            assert handle.client is not None
            stream = handle.client.open(rid, tokens, params, is_embedding, group, **admission)
            try:
                async for out in stream:
                    if out is ADMITTED:
                        if announce:
                            announce = False
                            yield out
                        continue
                    if out.error_type is not None and not first_seen:
                        why = self._admission_failed(handle, out)
                        saw_full |= why == "queue_full"
                        self._record_retry(handle, why)
                        finished = True  # the replica has forgotten it: nothing to abort
                        break
                    first_seen, announce = True, False  # ADMITTED never follows an output
                    finished = out.finished
                    out.replica = handle.name
                    if restarts and out.finish_reason == "error" and out.error_type in REPLICA_FAILURES:
                        failed = out.error or "the replica failed the request"
                        break  # run it again elsewhere (below)
                    yield out
                if finished and first_seen and failed is None:
                    return
                if first_seen and restarts:  # it failed there, or its stream ended early: again elsewhere
                    restarts -= 1
                    self._mark_unhealthy(handle, failed or "the replica closed the stream")
                    self._record_retry(handle, "replica_failed")
                    yield RESTARTED
                    continue
                if first_seen:  # the stream ended without a final output
                    yield self._failed(rid, handle.name, "the replica closed the stream")
                    return
            except ReplicaGone as exc:
                finished = True  # the replica is gone with the request
                self._mark_unhealthy(handle, str(exc))
                # (Ray's ActorDiedError when the actor could not be asked where to connect; a
                # connection that dropped is only unhealthy until the stats poll says more.)
                handle.dead |= isinstance(exc.cause, ray.exceptions.ActorDiedError)
                if first_seen and not restarts:
                    why = type(exc.cause).__name__
                    if isinstance(exc.cause, TimeoutError) and str(exc.cause):  # the router's own words
                        why = f"{why}: {exc.cause}"
                    yield self._failed(rid, handle.name, f"replica {handle.name} failed: {why}")
                    return
                self._record_retry(handle, "replica_failed")
                if first_seen:
                    restarts -= 1
                    yield RESTARTED  # what it sent is void: it runs again elsewhere
                continue  # nothing sent yet (or nothing shown): retry elsewhere
            finally:
                handle.inflight -= 1
                if not finished:
                    await stream.aclose()  # aborts it on the replica, in the next submit
        if saw_full:
            raise QueueFull("every replica's waiting queue is full")
        raise NoReplicaAvailable("no healthy replica can serve the request")

    def _admission_failed(self, handle: ReplicaHandle, out: RequestOutput) -> str:
        """Raise for errors of the request itself; otherwise return why to retry elsewhere."""
        if out.error_type == "invalid_request":  # the request's own fault: the same error, raised here
            raise RequestError.of(out.error_type, out.error or "invalid request", out.error_param or "request")
        if out.error_type == "unavailable":
            self._mark_unhealthy(handle, out.error or "unavailable")
        elif out.error_type != "queue_full":
            raise RuntimeError(out.error or "replica error")
        return out.error_type

    @staticmethod
    def _failed(rid: str, replica: str, error: str) -> RequestOutput:
        return RequestOutput(rid, finished=True, finish_reason="error", error=error, error_type="internal",
                             replica=replica)

    def _record_retry(self, handle: ReplicaHandle, reason: str) -> None:
        """Count a request leaving `handle` before its first token (it is tried elsewhere if
        another replica can take it)."""
        if self.metrics is not None:
            self.metrics.record_retry(handle.name, reason)

    def _mark_unhealthy(self, handle: ReplicaHandle, reason: str) -> None:
        if handle.healthy:
            logger.warning("router: replica %s unhealthy: %s", handle.name, reason)
        handle.healthy, handle.reason = False, reason
        if self.metrics is not None:
            self.metrics.update_replica_stats(handle.name, {"healthy": False})

    # ---------------- health ----------------
    def health(self) -> HealthStatus:
        detail = {h.name: {"healthy": h.healthy, "reason": h.reason, "inflight": h.inflight}
                  for h in self.replicas.values()}
        return HealthStatus(ok=any(h.healthy for h in self.replicas.values()), detail=detail)

    async def poll_once(self) -> None:
        handles = list(self.replicas.values())
        refs = [h.actor.stats.remote() for h in handles]
        if self.options.policy == "cache_aware" and self.options.kv_events:
            await asyncio.gather(*(self._pull_kv_events(h) for h in handles))
            await self._pull_store_removals()  # (after the events: see StoreIndex.sync)

        async def one(h: ReplicaHandle, ref) -> None:
            try:
                stats = await asyncio.wait_for(ref, timeout=self.options.stats_timeout_s)
            except Exception as exc:
                self._mark_unhealthy(h, f"stats failed: {type(exc).__name__}")
                h.dead |= isinstance(exc, ray.exceptions.ActorDiedError)
                self._check_hung(h)
                return
            h.silent_since = None
            h.stats = stats
            if stats.get("healthy"):
                if not h.healthy:
                    logger.info("router: replica %s healthy again", h.name)
                h.healthy, h.reason = True, None
            else:
                self._mark_unhealthy(h, stats.get("reason") or "reported unhealthy")
            if self.metrics is not None:
                self.metrics.update_replica_stats(h.name, stats)

        await asyncio.gather(*(one(h, r) for h, r in zip(handles, refs)))

    def _check_hung(self, h: ReplicaHandle) -> None:
        """`h` did not answer a stats poll: once it has been silent for `replica_hang_s`, end its
        streams and count it dead (`cluster.supervisor` replaces it)."""
        now = time.monotonic()
        h.silent_since = h.silent_since or now
        if h.dead or now - h.silent_since < self.options.replica_hang_s:
            return
        why = f"hung: no stats answer for {now - h.silent_since:.0f} s"
        logger.error("router: replica %s %s; ending its streams and replacing it", h.name, why)
        h.dead, h.reason = True, why
        if h.client is not None:
            h.client.fail(TimeoutError(f"replica {h.name} is {why}"))

    async def _pull_kv_events(self, h: ReplicaHandle) -> None:
        """Bring h's KV index up to date (one call, whatever the number of events); a replica
        that does not answer keeps its index, which goes stale (routing falls back)."""
        idx = h.kv_index
        try:
            reply = await asyncio.wait_for(h.actor.kv_events.remote(idx.epoch, idx.seq),
                                           timeout=self.options.stats_timeout_s)
        except Exception as exc:
            logger.debug("router: KV events of %s: %s", h.name, exc)
            return
        if reply is not None:
            idx.apply(reply)
        if self.metrics is not None:
            self.metrics.set_kv_index(h.name, len(idx.hashes) * idx.block, idx.lag_s())

    async def _pull_store_removals(self) -> None:
        """Drop from the store index the pages the shared store removed (one call a poll; a
        store that does not answer leaves the index as it is)."""
        if self.kv_store is None:
            return
        idx, dropped = self.store_index, 0
        try:
            if self._store_actor is None:  # looked up off the loop (a GCS round trip), at most every 10 s
                if time.monotonic() - self._store_lookup < 10.0:
                    return
                self._store_lookup = time.monotonic()
                self._store_actor = await asyncio.to_thread(ray.get_actor, self.kv_store[0], namespace=self.kv_store[1])
            epoch = None if idx.resync_due() else idx.epoch  # (None: the store lists what it holds)
            reply = await asyncio.wait_for(self._store_actor.removed_since.remote(epoch, idx.seq),
                                           timeout=self.options.stats_timeout_s)
            dropped = idx.sync(reply)
        except ray.exceptions.RayActorError as exc:
            logger.debug("router: the KV store's removals: %s", exc)
            self._store_actor = None  # (gone for good: a store started again is a new actor)
        except Exception as exc:
            logger.debug("router: the KV store's removals: %s", exc)
        finally:
            if self.metrics is not None:
                self.metrics.store_index(len(idx.hashes), dropped)

    async def start(self) -> None:
        if self._poller is None:
            await self.poll_once()
            self._poller = asyncio.create_task(self._poll_loop())

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.options.stats_interval_s)
            if not ray.is_initialized():
                # Ray was shut down under a router nobody closed: a `.remote()` now would
                # auto-start Ray or join whatever cluster it finds on this machine.
                logger.warning("router: Ray is shut down; stats polling stops")
                self._poller = None
                return
            try:
                await self.poll_once()
            except Exception:
                logger.exception("router stats poll failed")

    async def aclose(self) -> None:
        """Stop polling stats. Streams still open keep running to their end (each replica
        client's connection stays open while they do): a router replaced by a new one loses
        nothing."""
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None
