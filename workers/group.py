"""A replica's TP workers behind one interface: `execute(plan)` runs a step on every rank and
returns rank 0's result; where `supports_overlap`, `launch(plan)` / `collect()` run plans ahead
of their results instead (overlapped scheduling). Implementations: in-process (TP=1, and tests), Ray actors
(`workers.ray_group`), torch multiprocessing (TP>1 where Ray is not installed)."""

from __future__ import annotations

import collections
from abc import ABC, abstractmethod

from workers.messages import OverlapCall, StepPlan, StepResult
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

    @property
    def supports_overlap(self) -> bool:
        return False

    def launch(self, plan: StepPlan) -> None:
        """Enqueue a step without waiting for it (only where `supports_overlap`)."""
        raise NotImplementedError(f"{type(self).__name__} runs steps one at a time")

    def collect(self) -> StepResult:
        """The oldest launched step's result, in launch order."""
        raise NotImplementedError(f"{type(self).__name__} runs steps one at a time")

    def discard_inflight(self) -> None:
        """Forget launched steps whose results will never be collected."""
        return None

    def describe(self) -> dict:
        return {"kind": type(self).__name__}

    @property
    def failed(self) -> str | None:
        """Why no step can run on this group any more (a rank died or hung); None while it can."""
        return None

    def kv_store_stats(self, timeout_s: float = 1.0) -> list[dict] | None:
        """Every rank's KV store client and host-tier counters (`workers.kv_offload`); [] when
        the ranks run without a store, None when they could not be asked in time."""
        return []


class RemoteOverlap:
    """`launch`/`collect` for groups whose ranks run in other processes and answer an
    `OverlapCall` per step (Ray actors, torch multiprocessing). A launch call returns the result
    that became ready on the rank (the previous plan's), so a steady stream of steps costs one
    round trip each; `collect` with nothing outstanding sends an empty call to flush."""

    def _submit(self, msg: OverlapCall):
        """Send `msg` to every rank; a handle for rank 0's answer."""
        raise NotImplementedError

    def _wait(self, handle) -> StepResult | None:
        raise NotImplementedError

    @property
    def supports_overlap(self) -> bool:
        return self._overlap_ok

    def launch(self, plan: StepPlan) -> None:
        self._calls.append(self._submit(OverlapCall(plan)))

    def collect(self) -> StepResult:
        while self._calls:
            result = self._wait(self._calls.popleft())
            if result is not None:
                return result
        result = self._wait(self._submit(OverlapCall()))
        assert result is not None, "collect() without a launched plan"
        return result

    def discard_inflight(self) -> None:
        calls, self._calls = list(self._calls), collections.deque()
        try:
            for handle in calls:
                self._wait(handle)
            self._wait(self._submit(OverlapCall(discard=True)))
        except Exception:  # the group is failing anyway; the engine has failed its requests
            pass

    def _init_overlap(self, opts: RunnerOptions) -> None:
        self._calls: collections.deque = collections.deque()
        self._overlap_ok = opts.speculative_draft_model is None  # as ModelRunner.can_overlap


class InProcessWorkerGroup(WorkerGroup):
    """TP=1 in the calling process."""

    def __init__(self, opts: RunnerOptions):
        self.runner = ModelRunner(opts)
        self.model_config = self.runner.model_config
        self.num_pages = self.runner.num_pages

    def execute(self, plan: StepPlan) -> StepResult:
        return self.runner.execute(plan)

    @property
    def supports_overlap(self) -> bool:
        return self.runner.can_overlap

    def launch(self, plan: StepPlan) -> None:
        self.runner.launch(plan)

    def collect(self) -> StepResult:
        return self.runner.collect()

    def discard_inflight(self) -> None:
        self.runner.discard_inflight()

    def kv_store_stats(self, timeout_s: float = 1.0) -> list[dict] | None:
        off = self.runner.kv_offload
        return [off.stats()] if off is not None else []

    def shutdown(self) -> None:
        if self.runner.kv_offload is not None:  # its I/O thread and NIXL agent
            self.runner.kv_offload.close()
