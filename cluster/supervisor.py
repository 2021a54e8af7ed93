"""Keeps the number of replicas up: a replica actor that died is replaced by a new one.

A replica survives the loss of one of its ranks by itself (it rebuilds its TP group, see
`cluster.replica`). What it cannot survive is the loss of its own actor: its node went away, or
its process was killed. The router learns of that from Ray (`ActorDiedError` on a stats poll or
on a request) and marks the handle `dead`; this supervisor, a task on the serving event loop,
then

1. takes the dead replica out of rotation and forgets its actor (the router already routes
   around it: requests that had no token yet were retried elsewhere, the others ended with a
   clean error);
2. starts a new replica (`ServingCluster.start_replica`, in a thread: it blocks until the
   replica's placement group is placed and its ranks loaded the model, which waits for
   resources if the cluster has none free, e.g. until the autoscaler or an operator adds a node);
3. puts it into rotation. A start that fails is retried with backoff, so a cluster that lost a
   node gets its replica back once the capacity returns.

Meanwhile the remaining replicas serve everything.

It also keeps the shared KV store up: a store actor this cluster started that no longer answers
is started again on the same directory (`ServingCluster.restore_kv_store`); meanwhile every
replica serves without it (its misses and errors are counted, nothing waits on it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class SupervisorStats:
    replaced: int = 0  # dead replicas taken out of rotation
    started: int = 0  # replacements that came up and joined the router
    failed_starts: int = 0
    store_restarts: int = 0  # the KV store actor died and was started again
    missing: int = 0  # replacements still to start
    events: list[str] = field(default_factory=list)  # what happened, in order (bounded)

    def log(self, msg: str) -> None:
        logger.warning("supervisor: %s", msg)
        self.events = [*self.events[-99:], f"{time.strftime('%H:%M:%S')} {msg}"]


class ReplicaSupervisor:
    """Replaces dead replica actors of `cluster` (a `ServingCluster` whose router is serving).

    interval_s: how often the router's handles are checked. ready_timeout_s: how long one start
    may wait for resources before it is abandoned and retried. backoff_s: the first wait after a
    failed start (doubles, up to 60 s)."""

    def __init__(self, cluster, interval_s: float = 1.0, ready_timeout_s: float = 600.0, backoff_s: float = 2.0):
        self.cluster = cluster
        self.interval_s, self.ready_timeout_s, self.backoff_s = interval_s, ready_timeout_s, backoff_s
        self.stats = SupervisorStats()
        self._task: asyncio.Task | None = None
        self._starting: asyncio.Task | None = None
        self._store_check: asyncio.Task | None = None
        self._roles: list[str] = []  # roles of the replicas still to replace, oldest first

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop())

    async def aclose(self) -> None:
        for t in (self._task, self._starting, self._store_check):
            if t is not None:
                t.cancel()
        self._task = self._starting = None

    async def _loop(self) -> None:
        while True:
            try:
                self.check_once()
            except Exception:
                logger.exception("supervisor check failed")
            await asyncio.sleep(self.interval_s)

    def check_once(self) -> None:
        """Retire dead replicas; make sure a start is under way while any replacement is missing."""
        router = self.cluster.router
        if router is None:
            return
        for name, handle in list(router.replicas.items()):
            if handle.dead:
                router.remove_replica(name)
                self.cluster.forget_replica(name)
                self._roles.append(handle.role)  # a prefill or decode replica is replaced by its like
                self.stats.replaced += 1
                self.stats.missing += 1
                if getattr(self.cluster, "metrics", None) is not None:
                    self.cluster.metrics.replica_replacements.inc()
                self.stats.log(f"replica {name} died ({handle.reason}); starting a replacement")
        if self.stats.missing and (self._starting is None or self._starting.done()):
            self._starting = asyncio.create_task(self._replace())
        if self.cluster.kv_store is not None and (
                self._store_check is None or self._store_check.done()):
            self._store_check = asyncio.create_task(self._restore_store())

    async def _restore_store(self) -> None:
        if await asyncio.to_thread(self.cluster.restore_kv_store):
            self.stats.store_restarts += 1
            self.stats.log("the KV store died; started it again on its directory")

    async def _replace(self) -> None:
        backoff = self.backoff_s
        while self.stats.missing:
            try:
                role = self._roles[0] if self._roles else "mixed"
                name, actor = await asyncio.to_thread(self.cluster.start_replica, self.ready_timeout_s, role)
            except Exception as exc:
                self.stats.failed_starts += 1
                self.stats.log(f"a replacement replica did not start ({type(exc).__name__}: {exc}); "
                               f"retrying in {backoff:.0f} s")
                await asyncio.sleep(backoff)
                backoff = min(60.0, backoff * 2)
                continue
            # on the loop: the router is not thread-safe
            self.cluster.router.add_replica(name, actor, self.cluster.infos.get(name))
            if self._roles:
                self._roles.pop(0)
            self.stats.missing -= 1
            self.stats.started += 1
            self.stats.log(f"replacement {name} is serving")
            backoff = self.backoff_s
