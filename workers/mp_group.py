"""TP ranks as torch.multiprocessing processes, for machines without Ray (the GPU image) and
for tests. The same `RankWorker` and model runner code runs as in the Ray actors; only the
transport differs: a pipe per rank carries each StepPlan (or OverlapCall) in and rank 0's
StepResult out.
"""

from __future__ import annotations

import logging
import os
import traceback

import torch.multiprocessing as mp

from workers.group import RemoteOverlap, WorkerGroup
from workers.messages import OverlapCall, StepPlan, StepResult
from workers.model_runner import RunnerOptions
from workers.worker import RankWorker, free_port

logger = logging.getLogger(__name__)


def _rank_main(opts: RunnerOptions, rank: int, world: int, port: int, conn, env: dict) -> None:
    os.environ.update(env)
    if opts.device == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    try:
        worker = RankWorker(opts, rank, world)
        info = worker.init("127.0.0.1", port)
        conn.send(("ready", info if rank == 0 else None))
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # the parent exited without asking: go quietly
                break
            if msg is None:
                break
            result = worker.execute(msg)
            if rank == 0:
                conn.send(("ok", result))
        worker.shutdown()
    except Exception:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:  # the parent is gone: nobody to tell
            traceback.print_exc()


class MultiprocessWorkerGroup(RemoteOverlap, WorkerGroup):
    def __init__(self, opts: RunnerOptions, tp_size: int, start_timeout_s: float = 600.0):
        ctx = mp.get_context("spawn")
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "GLOO_", "TORCH_"))}
        self.conns = []
        self.procs = []
        for rank in range(tp_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(opts, rank, tp_size, port, child, env), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        info = None
        for rank, conn in enumerate(self.conns):
            if not conn.poll(start_timeout_s):
                self.shutdown()
                raise RuntimeError(f"TP rank {rank} did not start within {start_timeout_s:.0f}s")
            kind, payload = conn.recv()
            if kind == "error":
                self.shutdown()
                raise RuntimeError(f"TP rank {rank} failed to start:\n{payload}")
            if rank == 0:
                info = payload
        self.model_config = info["model_config"]
        self.num_pages = info["num_pages"]
        self.tp_size = tp_size
        self._init_overlap(opts)

    def execute(self, plan: StepPlan) -> StepResult:
        return self._wait(self._submit(plan))

    def _submit(self, msg: StepPlan | OverlapCall) -> None:
        for conn in self.conns:  # answers come back in order on rank 0's pipe
            conn.send(msg)

    def _wait(self, handle: None) -> StepResult | None:
        kind, payload = self.conns[0].recv()
        if kind == "error":
            raise RuntimeError(f"TP rank 0 failed:\n{payload}")
        return payload

    def describe(self) -> dict:
        return {"kind": "multiprocessing", "tp_size": self.tp_size, "pids": [p.pid for p in self.procs]}

    def shutdown(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self.conns, self.procs = [], []
