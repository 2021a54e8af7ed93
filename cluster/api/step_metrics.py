"""Prometheus export of the engine's step times (cluster/engine/step_times.py), from what replicas
report: `manta:engine_step_seconds{replica, mode}`, a histogram of every completed step's time by
its mode (DECODE, MIXED, EXTEND, ...). The gaps a stream sees are `manta:inter_token_latency_seconds`;
this says which steps made them. A replica that rebuilds its engine starts from zero; the export
carries on from where it was (cluster/api/polled_histograms.py)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from cluster.api.polled_histograms import PolledHistograms
from cluster.engine.step_times import STEP_BUCKETS


class StepTimeCollector(Collector):
    def __init__(self) -> None:
        self._steps = PolledHistograms("manta:engine_step_seconds",
                                       "Engine steps by mode and the time each took (as the streams saw it).",
                                       ["replica", "mode"], STEP_BUCKETS)

    def set(self, replica: str, steps: dict[str, dict]) -> None:
        for mode, st in steps.items():
            self._steps.set((replica, mode), st)

    def remove(self, replica: str) -> None:
        self._steps.remove(replica)

    def collect(self) -> Iterator[Metric]:
        yield self._steps.family()

    def describe(self) -> Iterator[Metric]:
        return self.collect()
