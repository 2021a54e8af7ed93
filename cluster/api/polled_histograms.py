"""Histograms that replicas report cumulatively (`cluster.engine.histogram.Histogram.stats()`),
exported from the latest polled values. Like the other polled counters, a replica that rebuilds
its engine starts from zero and the export carries on from where it was: the restart is seen once
per series, when any of its counts goes down, and every bucket and the sum are rebased together
(a rebuilt engine whose every count passed the old ones before the next poll goes unseen, as in
cluster/api/monotonic.py)."""

from __future__ import annotations

import threading

from prometheus_client.core import HistogramMetricFamily

Series = tuple[list[float], float]  # (cumulative buckets + count, sum)


class PolledHistograms:
    def __init__(self, name: str, documentation: str, labels: list[str], bounds) -> None:
        self.name, self.documentation, self.labels = name, documentation, labels
        self.bounds = [str(b) for b in bounds] + ["+Inf"]
        self._lock = threading.Lock()
        self._values: dict[tuple[str, ...], tuple[Series, Series]] = {}  # labels -> (base, last reported)

    def set(self, labels: tuple[str, ...], stats: dict) -> None:
        """The series' latest cumulative reading (`Histogram.stats()`)."""
        now = ([*map(float, stats["buckets"]), float(stats["count"])], float(stats["sum_s"]))
        with self._lock:
            base, last = self._values.get(labels, (([0.0] * len(now[0]), 0.0), None))
            if last is not None and any(n < c for n, c in zip(now[0], last[0])):
                # The engine began again (a count went down): what it had counted becomes the
                # base of every bucket and of the sum at once, so the buckets stay cumulative.
                base = ([b + x for b, x in zip(base[0], last[0])], base[1] + last[1])
            self._values[labels] = (base, now)

    def remove(self, first_label: str) -> None:
        """Every series whose first label (the replica) is `first_label`."""
        with self._lock:
            for key in [k for k in self._values if k[0] == first_label]:
                del self._values[key]

    def family(self) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(self.name, self.documentation, labels=self.labels)
        with self._lock:
            for labels, (base, now) in self._values.items():
                cum = [b + x for b, x in zip(base[0], now[0])]
                fam.add_metric(list(labels), list(zip(self.bounds, cum)), base[1] + now[1])
        return fam
