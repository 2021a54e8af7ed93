"""Bring a serving cluster up on Ray and take it down again.

`ServingCluster.start()` joins (or starts) Ray, creates `replicas` replica actors — each
places its TP ranks with a placement group — waits until they are ready, logs where every
rank landed, and builds the router. `shutdown()` kills every actor it created, so an
interrupted `manta serve` leaves no orphans.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import ray

from cluster.config import EngineConfig
from cluster.replica import Replica
from cluster.router import Router, RouterOptions

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterOptions:
    engine: EngineConfig
    replicas: int = 1
    router: RouterOptions = field(default_factory=RouterOptions)
    address: str | None = None  # None: start a local Ray instance (the embedded default)
    placement_strategy: str = "PACK"
    nic: str | None = None
    cpus_per_rank: float = 1.0
    namespace: str = "manta"

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("replicas must be >= 1")


class ServingCluster:
    def __init__(self, options: ClusterOptions, metrics=None):
        self.options = options
        self.metrics = metrics
        self.router: Router | None = None
        self.actors: dict[str, object] = {}
        self._started_ray = False
        self._next = 0

    def start(self) -> Router:
        opts = self.options
        if not ray.is_initialized():
            if opts.address:
                ray.init(address=opts.address, namespace=opts.namespace, log_to_driver=True)
            else:
                need = opts.replicas * opts.engine.tp_size * opts.cpus_per_rank
                gpus = None if opts.engine.device == "cuda" else 0
                ray.init(num_cpus=max(os.cpu_count() or 1, int(need + 0.999)), num_gpus=gpus,
                         namespace=opts.namespace, include_dashboard=False)
            self._started_ray = True
        ctx = ray.get_runtime_context()
        logger.info("joined Ray cluster: gcs=%s, node=%s, resources=%s",
                    ctx.gcs_address, ctx.get_node_id(), ray.cluster_resources())
        names = [self._new_name() for _ in range(opts.replicas)]
        handles = {n: self._spawn(n) for n in names}
        infos = {n: ray.get(h.info.remote()) for n, h in handles.items()}  # waits for readiness
        for n, info in infos.items():
            logger.info("replica %s ready: %s", n, info["group"])
        first = next(iter(infos.values()))
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(opts.engine.tokenizer or opts.engine.model)
        self.router = Router(opts.router, self.metrics, tokenizer, opts.engine.model_name,
                             first["max_context_len"], first["vocab_size"])
        for n, h in handles.items():
            self.router.add_replica(n, h)
        self.infos = infos
        return self.router

    def _new_name(self) -> str:
        name = f"replica-{self._next}"
        self._next += 1
        return name

    def _spawn(self, name: str):
        opts = self.options
        actor = ray.remote(Replica).options(name=f"manta-{name}", num_cpus=0, max_concurrency=1000).remote(
            opts.engine, name, opts.placement_strategy, opts.nic, opts.cpus_per_rank
        )
        self.actors[name] = actor
        return actor

    def add_replica(self) -> str:
        """Start one more replica and put it into rotation (while serving)."""
        assert self.router is not None
        name = self._new_name()
        actor = self._spawn(name)
        self.infos[name] = ray.get(actor.info.remote())
        self.router.add_replica(name, actor)
        return name

    def remove_replica(self, name: str) -> None:
        """Take a replica out of rotation and stop it (requests on it end with an error)."""
        assert self.router is not None
        self.router.remove_replica(name)
        actor = self.actors.pop(name, None)
        if actor is not None:
            _stop_actor(actor)

    def shutdown(self) -> None:
        for name in list(self.actors):
            _stop_actor(self.actors.pop(name))
        if self._started_ray and ray.is_initialized():
            ray.shutdown()


def _stop_actor(actor) -> None:
    try:
        ray.get(actor.shutdown.remote(), timeout=30)
    except Exception:
        pass
    try:
        ray.kill(actor)
    except Exception:
        pass
