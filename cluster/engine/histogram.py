"""Counts of observed durations under fixed upper bounds, with their sum and max: what an engine
reports in its stats (cumulative) and the server exports as a Prometheus histogram
(`cluster/api/polled_histograms.py`). One thread observes; others may read `stats()` (a
lock keeps one reading's count, buckets and sum together)."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence


class Histogram:
    __slots__ = ("bounds", "counts", "sum_s", "max_s", "_lock")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: over every bound
        self.sum_s = 0.0
        self.max_s = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
            self.sum_s += seconds
            self.max_s = max(self.max_s, seconds)

    def stats(self) -> dict:
        """`count`, `sum_s`, `max_s` and `buckets`: the cumulative count at or under each bound
        (the count is the +Inf bucket)."""
        with self._lock:
            counts, sum_s, max_s = list(self.counts), self.sum_s, self.max_s
        cum, buckets = 0, []
        for c in counts[:-1]:
            cum += c
            buckets.append(cum)
        return {"count": sum(counts), "sum_s": sum_s, "max_s": max_s, "buckets": buckets}
