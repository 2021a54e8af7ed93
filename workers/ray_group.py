"""A replica's TP ranks as Ray actors, placed by one placement group.

Rendezvous: rank 0 reports its node's IP and a free port; every rank joins the process group
there (gloo on CPU, NCCL on GPU). The network interface gloo/NCCL use is set per actor with
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME when `nic` is given (multi-node clusters).
"""

from __future__ import annotations

import logging
import threading

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from workers.group import RemoteOverlap, WorkerGroup
from workers.messages import OverlapCall, StepPlan, StepResult
from workers.model_runner import RunnerOptions
from workers.step_channel import RankFailed, StepChannel
from workers.worker import MPS_SM_ENV, RANK_THREADS, RankWorker

logger = logging.getLogger(__name__)

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def placed_gpus(placements: list[dict]) -> list[tuple[tuple[str, str], dict]]:
    """((node id, GPU id), the rank's placement) for each GPU each rank was placed on (the
    ranks' `RankWorker.placement()`)."""
    return [((str(p["node_id"]), str(g)), p) for p in placements for g in p.get("gpu_ids") or ()]


def shared_gpu(placements: list[dict]) -> str | None:
    """Which TP ranks Ray placed on one GPU of one node (None: each has its own)."""
    seen: dict[tuple[str, str], int] = {}
    for (node, gpu), p in placed_gpus(placements):
        first = seen.setdefault((node, gpu), p["rank"])
        if first != p["rank"]:
            return f"TP ranks {first} and {p['rank']} were placed on one GPU (GPU {gpu} of node {p['ip']})"
    return None


def rank_env(opts: RunnerOptions, nic: str | None) -> dict[str, str]:
    """What each rank actor's process starts with: the interface gloo and NCCL bind to, and the
    SMs CUDA MPS lets it occupy (read once, when the process creates its CUDA context)."""
    env = {"GLOO_SOCKET_IFNAME": nic, "NCCL_SOCKET_IFNAME": nic} if nic else {}
    if opts.sm_percent is not None:
        env[MPS_SM_ENV] = str(opts.sm_percent)
    return env


class WorkerDied(RuntimeError):
    """A rank of this group is gone; the group cannot run another step."""


class RayWorkerGroup(RemoteOverlap, WorkerGroup):
    def __init__(
        self,
        opts: RunnerOptions,
        tp_size: int,
        *,
        placement_strategy: str = "PACK",
        nic: str | None = None,
        cpus_per_rank: float = 1.0,
        name: str = "replica",
        ready_timeout_s: float = 300.0,
        step_timeout_s: float = 0.0,
    ):
        if placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"placement strategy must be one of {PLACEMENT_STRATEGIES}")
        self.tp_size = tp_size
        gpu = opts.device == "cuda"
        gpus = opts.gpu_share if gpu else 0  # a fraction: ranks of other replicas share the GPU
        bundle = {"CPU": cpus_per_rank, **({"GPU": gpus} if gpu else {})}
        self.pg: PlacementGroup | None = placement_group([dict(bundle) for _ in range(tp_size)],
                                                         strategy=placement_strategy, name=f"{name}-pg")
        ready, _ = ray.wait([self.pg.ready()], timeout=ready_timeout_s)
        self.channel: StepChannel | None = None  # set once the ranks are up (shutdown may come first)
        self.hold_refs: list = []  # one never-returning call per rank, once they are up
        self._closing = False  # shutdown() began: ranks that die from here on were stopped by it
        if not ready:
            remove_placement_group(self.pg)
            raise RuntimeError(f"placement group for {tp_size} ranks ({bundle} each, {placement_strategy}) "
                               f"could not be placed within {ready_timeout_s:.0f}s: not enough resources")
        env = rank_env(opts, nic)
        actor_cls = ray.remote(RankWorker)
        self.workers = [
            actor_cls.options(
                name=f"manta-{name}-rank{i}",
                num_cpus=cpus_per_rank,
                num_gpus=gpus,
                max_concurrency=RANK_THREADS,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
                runtime_env={"env_vars": env} if env else None,
            ).remote(opts, i, tp_size)
            for i in range(tp_size)
        ]
        self.placements = ray.get([w.placement.remote() for w in self.workers])
        clash = shared_gpu(self.placements) if gpu and tp_size > 1 else None
        if clash:  # NCCL cannot join two ranks on one GPU ("invalid usage"): say why, before it tries
            self.shutdown()
            raise RuntimeError(f"{name}: {clash}. NCCL needs a GPU of its own for each TP rank, and Ray places "
                               f"fractional shares (--gpus-per-rank {gpus:g}) without keeping a replica's ranks "
                               "apart: give TP replicas --gpus-per-rank 1")
        addr, port = ray.get(self.workers[0].node_address.remote())
        infos = ray.get([w.init.remote(addr, port) for w in self.workers])
        self.model_config = infos[0]["model_config"]
        self.num_pages = infos[0]["num_pages"]
        self.attention = infos[0]["attention"]  # backend and kernels; the same on every rank
        # One never-returning call per rank: it fails the moment its actor dies.
        self.hold_refs = [w.hold.remote() for w in self.workers]
        self._dead: str | None = None
        self._failed = threading.Event()  # a rank died, failed or hung (or the group shut down)
        self._watch_lock = threading.Lock()
        self._watcher: threading.Thread | None = None
        # Steps travel over one TCP connection per rank (workers/step_channel.py says why not a
        # Ray compiled graph); the ranks connect to this process on Ray's address of its node.
        self.channel = StepChannel(ray.util.get_node_ip_address(), tp_size, step_timeout_s)
        ray.get([w.connect_steps.remote(self.channel.address, self.channel.token) for w in self.workers])
        self.channel.accept(timeout_s=60)
        self._init_overlap(opts)

    def execute(self, plan: StepPlan) -> StepResult:
        return self._wait(self._submit(plan))

    def _submit(self, msg: StepPlan | OverlapCall) -> None:
        if self._dead:
            raise WorkerDied(self._dead)
        try:
            self.channel.send(msg)
        except RankFailed as exc:
            self._died(f"a TP rank failed: {exc}")
            raise WorkerDied(self._dead or "the TP group was shut down") from exc

    @property
    def failed(self) -> str | None:
        return self._dead

    def _died(self, why: str) -> None:
        if not self._closing:  # a rank stopped by shutdown() did not die
            self._dead = self._dead or why
        self._failed.set()

    def _wait(self, handle: None) -> StepResult | None:
        """The replies to the oldest message sent (the channel keeps them in order)."""
        if self._dead:
            raise WorkerDied(self._dead)
        try:
            return self.channel.recv()
        except RankFailed as exc:
            self._died(f"a TP rank failed: {exc}")
            raise WorkerDied(self._dead or "the TP group was shut down") from exc

    def wait_for_death(self, timeout: float | None = None) -> str | None:
        """Block until a rank dies or the step channel finds one failed or hung (returns why),
        the group is shut down, or the timeout passes (both: None). A thread waits on every
        rank's never-returning `hold()` (a dead rank's raises at once); a hung rank never
        returns from it, so the step channel's watchdog wakes the waiter too (`_died`)."""
        with self._watch_lock:
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch_holds, name="rank-death-watch", daemon=True)
                self._watcher.start()
        self._failed.wait(timeout)
        return self._dead

    def _watch_holds(self) -> None:
        ready: list = []
        try:
            ready, _ = ray.wait(self.hold_refs, num_returns=1)
            ray.get(ready[0])  # returned normally: shutdown
        except Exception as exc:
            if isinstance(exc, ray.exceptions.RayError) and ready:
                self._died(f"TP rank {self.hold_refs.index(ready[0])} died: {type(exc).__name__}")
        finally:
            self._failed.set()

    def kv_store_stats(self, timeout_s: float = 1.0) -> list[dict] | None:
        """Each rank actor answers on its second thread (beside a running step)."""
        try:
            return [s for s in ray.get([w.kv_store_stats.remote() for w in self.workers], timeout=timeout_s) if s]
        except Exception:
            return None

    def describe(self) -> dict:
        return {"kind": "ray", "tp_size": self.tp_size, "step_channel": "tcp",
                "attention": self.attention, "ranks": self.placements}

    def shutdown(self, grace_s: float = 5.0) -> None:
        """Stop the ranks: each is asked to (its process group and KV store agent close), then
        killed once its `hold()` returned or after `grace_s`. Their deaths are not reported as
        failures (`wait_for_death` returns None), so the replica does not rebuild the group."""
        self._closing = True
        if self.channel is not None:
            self.channel.close()  # each rank's step loop ends
        for w in self.workers:
            try:
                w.shutdown.remote()
            except Exception:
                pass
        if self.hold_refs:
            ray.wait(self.hold_refs, num_returns=len(self.hold_refs), timeout=grace_s)
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:
                pass
        self.workers = []
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None
