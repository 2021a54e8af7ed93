"""Prometheus export of the engine's step times (cluster/engine/step_times.py), from what replicas
report: `manta:engine_step_seconds{replica, mode}`, a histogram of every completed step's time by
its mode (DECODE, MIXED, EXTEND, ...). The gaps a stream sees are `manta:inter_token_latency_seconds`;
this says which steps made them. Like the other polled counters, a replica that rebuilds its
engine starts from zero and the export carries on from where it was: the restart is seen once
per (replica, mode), when any of its counts goes down, and every bucket and the sum are rebased
together (a rebuilt engine whose every count passed the old ones before the next poll goes
unseen, as in cluster/api/monotonic.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from cluster.engine.step_times import STEP_BUCKETS


class StepTimeCollector(Collector):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        # replica -> mode -> (base, last reported): each a (cumulative buckets + count, sum)
        self._values: dict[str, dict[str, tuple[tuple[list[float], float], tuple[list[float], float]]]] = {}

    def set(self, replica: str, steps: dict[str, dict]) -> None:
        with self._lock:
            mine = self._values.setdefault(replica, {})
            for mode, st in steps.items():
                now = ([*map(float, st["buckets"]), float(st["count"])], float(st["sum_s"]))
                base, last = mine.get(mode, (([0.0] * len(now[0]), 0.0), None))
                if last is not None and any(n < c for n, c in zip(now[0], last[0])):
                    # The engine began again (a count went down): what it had counted becomes the
                    # base of every bucket and of the sum at once, so the buckets stay cumulative.
                    base = ([b + x for b, x in zip(base[0], last[0])], base[1] + last[1])
                mine[mode] = (base, now)

    def remove(self, replica: str) -> None:
        with self._lock:
            self._values.pop(replica, None)

    def collect(self) -> Iterator[Metric]:
        fam = HistogramMetricFamily("manta:engine_step_seconds",
                                    "Engine steps by mode and the time each took (as the streams saw it).",
                                    labels=["replica", "mode"])
        bounds = [str(b) for b in STEP_BUCKETS] + ["+Inf"]
        with self._lock:
            for replica, modes in self._values.items():
                for mode, (base, now) in modes.items():
                    cum = [b + x for b, x in zip(base[0], now[0])]
                    fam.add_metric([replica, mode], list(zip(bounds, cum)), base[1] + now[1])
        yield fam

    def describe(self) -> Iterator[Metric]:
        return self.collect()
