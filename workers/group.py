"""A replica's TP workers behind one interface: `execute(plan)` runs a step on every rank and
returns rank 0's result. Implementations: in-process (TP=1, and tests), Ray actors
(`workers.ray_group`), torch multiprocessing (TP>1 where Ray is not installed)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from workers.messages import StepPlan, StepResult
from workers.model_config import ModelConfig
from workers.model_runner import ModelRunner, RunnerOptions


class WorkerGroup(ABC):
    model_config: ModelConfig
    num_pages: int

    @abstractmethod
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step on every rank; rank 0's result."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release every rank (idempotent)."""

    def describe(self) -> dict:
        return {"kind": type(self).__name__}


class InProcessWorkerGroup(WorkerGroup):
    """TP=1 in the calling process."""

    def __init__(self, opts: RunnerOptions):
        self.runner = ModelRunner(opts)
        self.model_config = self.runner.model_config
        self.num_pages = self.runner.num_pages

    def execute(self, plan: StepPlan) -> StepResult:
        return self.runner.execute(plan)

    def shutdown(self) -> None:
        if self.runner.kv_offload is not None:  # its I/O thread and NIXL agent
            self.runner.kv_offload.close()
