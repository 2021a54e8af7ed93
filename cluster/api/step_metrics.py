"""Prometheus export of the engine's step times (cluster/engine/step_times.py), from what replicas
report: `manta:engine_step_seconds{replica, mode}`, a histogram of every completed step's time by
its mode (DECODE, MIXED, EXTEND, ...). The gaps a stream sees are `manta:inter_token_latency_seconds`;
this says which steps made them. Like the other polled counters, a replica that rebuilds its
engine starts from zero and the export carries on from where it was (cluster/api/monotonic.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from cluster.api.monotonic import Monotonic
from cluster.engine.step_times import STEP_BUCKETS


class StepTimeCollector(Collector):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = Monotonic()
        self._values: dict[str, dict[str, tuple[list[float], float]]] = {}  # replica -> mode -> (cumulative buckets + count, sum)

    def set(self, replica: str, steps: dict[str, dict]) -> None:
        with self._lock:
            mine = self._values.setdefault(replica, {})
            for mode, st in steps.items():
                labels = (replica, mode)
                cum = [self._count.total(("bucket", labels, i), float(c))
                       for i, c in enumerate([*st["buckets"], st["count"]])]
                mine[mode] = (cum, self._count.total(("sum", labels), float(st["sum_s"])))

    def remove(self, replica: str) -> None:
        with self._lock:
            self._values.pop(replica, None)
            self._count.forget(replica)

    def collect(self) -> Iterator[Metric]:
        fam = HistogramMetricFamily("manta:engine_step_seconds",
                                    "Engine steps by mode and the time each took (as the streams saw it).",
                                    labels=["replica", "mode"])
        bounds = [str(b) for b in STEP_BUCKETS] + ["+Inf"]
        with self._lock:
            for replica, modes in self._values.items():
                for mode, (cum, total) in modes.items():
                    fam.add_metric([replica, mode], list(zip(bounds, cum)), total)
        yield fam

    def describe(self) -> Iterator[Metric]:
        return self.collect()
