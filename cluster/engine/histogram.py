"""Counts of observed durations under fixed upper bounds, with their sum and max: what an engine
reports in its stats (cumulative) and the server exports as a Prometheus histogram
(`cluster/api/polled_histograms.py`). One thread observes; others may read `stats()`."""

from __future__ import annotations

import bisect
from collections.abc import Sequence


class Histogram:
    __slots__ = ("bounds", "counts", "sum_s", "max_s")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: over every bound
        self.sum_s = 0.0
        self.max_s = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum_s += seconds
        self.max_s = max(self.max_s, seconds)

    def stats(self) -> dict:
        """`count`, `sum_s`, `max_s` and `buckets`: the cumulative count at or under each bound
        (the count is the +Inf bucket)."""
        counts = list(self.counts)  # one copy (the stats poll reads beside the engine thread)
        cum, buckets = 0, []
        for c in counts[:-1]:
            cum += c
            buckets.append(cum)
        return {"count": sum(counts), "sum_s": self.sum_s, "max_s": self.max_s, "buckets": buckets}
