"""The Ray actor of one TP rank: its model shard, KV pools and model runner.

The actor is threaded (`RANK_THREADS`) so that `hold()`, a call that never returns while the
actor lives, runs beside `execute()`: the replica waits on every rank's `hold()` and learns of
a dead rank as soon as Ray does, not at the next request. The other threads answer stats and
decode replicas' requests for handed-off pages (`pd_locate`), which may wait a moment.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading

import torch
import torch.distributed as dist

from workers import actor_exit, gil_switch, heap
from workers.messages import OverlapCall, StepPlan, StepResult
from workers.model_runner import ModelRunner, RunnerOptions
from workers.parallel import TPGroup

logger = logging.getLogger(__name__)

RANK_THREADS = 6  # hold(), stats, and decode ranks' pd_locate/pd_release calls


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# The share of the SMs CUDA MPS lets this process's kernels occupy, read as its CUDA context is
# made (`RunnerOptions.sm_percent`: a Ray rank actor starts with it, `workers.ray_group.rank_env`).
MPS_SM_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


def mps_pipe_directory() -> str:
    return os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")


def mps_daemon_running() -> bool:
    """Whether an MPS control daemon's pipe is where this process's CUDA looks for it."""
    return os.path.exists(os.path.join(mps_pipe_directory(), "control"))


class RankWorker:
    """Plain class; `workers.ray_group` wraps it with `ray.remote`. Also usable in-process."""

    def __init__(self, opts: RunnerOptions, rank: int, world_size: int):
        self.opts = opts
        self.rank = rank
        self.world_size = world_size
        self.runner: ModelRunner | None = None
        self._frozen = False  # this rank counts as a user of workers.heap's frozen heap
        self._stop = threading.Event()
        # The step thread shares the GIL with the KV offload's I/O thread (prefetch and PD reads,
        # their checksums, the store's writes) and the actor's own threads (a PD peer's
        # `pd_locate`, stats): back from waiting on its forward, the step could wait up to
        # CPython's 5 ms switch interval to run again.
        gil_switch.apply()
        actor_exit.install()  # Ray's SIGTERM at shutdown never prints a traceback into the driver's log
        if opts.device == "cpu":
            # Several ranks share the host's cores: one thread each keeps them from fighting.
            torch.set_num_threads(max(1, int(os.environ.get("MANTA_WORKER_THREADS", "1"))))

    def node_address(self) -> tuple[str, int]:
        """This node's IP (as Ray sees it) and a free port on it, for the rendezvous."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def placement(self) -> dict:
        import ray

        ctx = ray.get_runtime_context()
        return {"rank": self.rank, "node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(),
                "pid": os.getpid(), "gpu_ids": ray.get_gpu_ids(),
                "sm_percent": os.environ.get(MPS_SM_ENV)}

    def init(self, master_addr: str, master_port: int) -> dict:
        """Join the TP process group and load this rank's shard; returns what the replica needs."""
        tp = TPGroup()
        if self.world_size > 1:
            backend = "nccl" if self.opts.device == "cuda" else "gloo"
            if self.opts.device == "cuda":
                torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
            dist.init_process_group(
                backend,
                init_method=f"tcp://{master_addr}:{master_port}",
                rank=self.rank,
                world_size=self.world_size,
                timeout=datetime.timedelta(seconds=120),
            )
            tp = TPGroup(self.rank, self.world_size, cpu_group=_cpu_group(backend))
        if self.opts.sm_percent is not None and self.opts.device == "cuda" and not mps_daemon_running():
            logger.warning("rank %d: --sm-percent %d has no effect: no CUDA MPS daemon answers at %s",
                           self.rank, self.opts.sm_percent, mps_pipe_directory())
        self.runner = ModelRunner(self.opts, tp)
        heap.freeze()  # the model and its graphs live as long as the rank: out of the collector's walks
        self._frozen = True
        return {"num_pages": self.runner.num_pages, "model_config": self.runner.model_config,
                "attention": f"{self.runner.attn_backend.describe()} ({self.opts.kernels.describe()})"}

    def execute(self, msg: StepPlan | OverlapCall) -> StepResult | None:
        assert self.runner is not None, "init() first"
        if not isinstance(msg, OverlapCall):
            return self.runner.execute(msg)
        if msg.discard:
            self.runner.discard_inflight()
            return None
        if msg.plan is None:
            return self.runner.collect()
        self.runner.launch(msg.plan)
        return self.runner.take_ready()

    def connect_steps(self, address: tuple[str, int], token: bytes) -> None:
        """Connect to the replica's step channel; from now on `execute` runs on its thread
        for every message the replica sends (workers/step_channel.py)."""
        from workers.step_channel import serve_rank

        serve_rank(tuple(address), token, self.rank, self.execute, self._stop)

    def kv_store_stats(self) -> dict | None:
        """This rank's KV store client and host-tier counters (None: no store). Runs beside
        execute() on the actor's second thread: it only reads counters."""
        off = self.runner.kv_offload if self.runner is not None else None
        return off.stats() if off is not None else None

    # ---------------- prefill/decode hand-off (workers/kv_peer.py) ----------------
    def pd_locate(self, keys: list[str], ttl_s: float, wait_s: float = 1.0) -> dict | None:
        """A decode rank asks for a handed-off prompt's pages: their hand-off rows, pinned for
        ttl_s (waiting up to wait_s for a save on its way), with their NIXL agent's metadata
        (None: this rank has no hand-off rows)."""
        off = self.runner.kv_offload if self.runner is not None else None
        leases = getattr(off, "leases", None)
        return leases.locate(keys, ttl_s, wait_s) if leases is not None else None

    def pd_release(self, lease: str) -> None:
        off = self.runner.kv_offload if self.runner is not None else None
        if getattr(off, "leases", None) is not None:
            off.leases.release(lease)

    def pd_fault(self, kind: str | None, seconds: float = 0.0) -> None:
        """Fault injection for the hand-off's tests: "delay" (locate answers `seconds` late),
        "corrupt" (one page's checksum goes out wrong), "corrupt_bytes" (one lent page's bytes
        change after its checksum was taken), None (off)."""
        off = self.runner.kv_offload if self.runner is not None else None
        if getattr(off, "leases", None) is not None:
            off.leases.fault = (kind, seconds) if kind else None

    def hold(self) -> None:
        """Returns only at shutdown; its failure tells the replica that this rank died."""
        self._stop.wait()

    def shutdown(self) -> None:
        self._stop.set()
        if self._frozen:
            self._frozen = False
            heap.thaw()
        if self.runner is not None and self.runner.kv_offload is not None:
            self.runner.kv_offload.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _cpu_group(backend: str):
    """A gloo group of every rank beside an NCCL default group (every rank calls this, in the
    same order); None under gloo, or where gloo cannot start (agreements then go over NCCL)."""
    if backend != "nccl":
        return None
    try:
        return dist.new_group(backend="gloo")
    except Exception:
        logger.warning("no gloo group beside NCCL: the ranks' KV store agreements wait on the GPU")
        return None
