"""How long the engine's steps take, by the kind of step: the replica-side view of the inter-token
latency a stream sees.

A stream's gap between two tokens is the step that computed the second one, so its tail is the
tail of the steps: a MIXED step carrying a long prompt piece, a decode replica's step that
admits a hand-off, a collector pause. The server sees only the gaps
(`manta:inter_token_latency_seconds`); these counts say which steps made them. Each completed plan
is observed once, by its mode, with the time the engine loop spent on it (under overlapped
scheduling: from the launch of the next plan to this one's tokens, i.e. the step as the
streams saw it). Cumulative, read by `Engine.stats` and exported as the histogram
`manta:engine_step_seconds{replica, mode}` (cluster/api/step_metrics.py).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

from cluster.engine.histogram import Histogram

# Upper bounds, seconds: 5 ms apart up to 50 (a decode step of an 8B model at batch 1 to 64, the
# ITL goals), then the tail.
STEP_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.045, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5,
                1.0, 2.5)
# Steps over SLOW_S (issue 26's ITL goal) are kept with what they ran, the latest SLOW_KEPT per mode:
# the steps that make a stream's gaps long, for whoever reads a window of them (`manta bench serve`).
SLOW_S = 0.04
SLOW_KEPT = 64


class StepTimes:
    def __init__(self, slow_s: float = SLOW_S) -> None:
        self._lock = threading.Lock()  # observed by the engine thread, read by the stats poll
        # The kinds every engine runs, reported (at 0) from the start: a dashboard has its series.
        self._modes: dict[str, _Mode] = {mode: _Mode() for mode in ("DECODE", "EXTEND", "MIXED")}
        self.slow_s = slow_s

    def observe(self, mode: str, seconds: float, reqs: Sequence = ()) -> None:
        """One completed step: its mode, time and the requests it ran (`input_ids` each: counted
        only for a slow step)."""
        with self._lock:
            m = self._modes.get(mode)
            if m is None:
                m = self._modes[mode] = _Mode()
            m.times.observe(seconds)
            if seconds > self.slow_s:
                m.slow.append((seconds, time.time(), len(reqs), sum(len(r.input_ids) for r in reqs)))

    def stats(self) -> dict[str, dict]:
        """Per mode: `count`, `sum_s`, `max_s` and `buckets`, the cumulative count of steps at or
        under each bound of STEP_BUCKETS (the count is the +Inf bucket); `slow`, the latest steps
        over `slow_s` (`ms`, `at`: when it ended, wall clock; `reqs`, `tokens`: the requests and
        input tokens it ran), oldest first; `read_at`, the wall clock of this reading."""
        with self._lock:
            out, now = {}, time.time()
            for mode, m in self._modes.items():
                slow = [{"ms": 1e3 * t, "at": at, "reqs": r, "tokens": n} for t, at, r, n in m.slow]
                out[mode] = {**m.times.stats(), "slow": slow, "read_at": now}
            return out


class _Mode:
    __slots__ = ("times", "slow")

    def __init__(self) -> None:
        self.times = Histogram(STEP_BUCKETS)
        self.slow: deque[tuple[float, float, int, int]] = deque(maxlen=SLOW_KEPT)  # (seconds, at, reqs, tokens)


def step_summary(after: dict[str, dict], before: dict[str, dict] | None = None) -> dict[str, dict]:
    """Per mode, the steps between two `StepTimes.stats()` readings (all of `after` without
    `before`): how many, their mean, the bucket bounds their p50 and p99 fell under, and how many
    took longer than 40 ms (issue 26's ITL goal). `max_ms` is the largest since the engine
    started, not only in between; `slow`, the steps over the engine's `slow_s` that ended in
    between, slowest first (the latest SLOW_KEPT at most: fewer than `over_40ms` when more came)."""
    out = {}
    for mode, a in after.items():
        b = (before or {}).get(mode) or {"count": 0, "sum_s": 0.0, "buckets": [0] * len(a["buckets"])}
        n = a["count"] - b["count"]
        if n <= 0:
            continue
        cum = [x - y for x, y in zip(a["buckets"], b["buckets"])]
        since = b.get("read_at", 0.0)
        out[mode] = {"steps": n, "mean_ms": 1e3 * (a["sum_s"] - b["sum_s"]) / n,
                     "p50_ms_under": 1e3 * _bound_of(cum, 0.5 * n, a["max_s"]),
                     "p99_ms_under": 1e3 * _bound_of(cum, 0.99 * n, a["max_s"]),
                     "over_40ms": n - cum[STEP_BUCKETS.index(SLOW_S)], "max_ms": 1e3 * a["max_s"],
                     "slow": sorted((x for x in a.get("slow", []) if x["at"] > since), key=lambda x: -x["ms"])}
    return out


def _bound_of(cum: list[int], rank: float, max_s: float) -> float:
    """The first bucket bound with `rank` steps at or under it (past the last bound: the max)."""
    return next((bound for bound, c in zip(STEP_BUCKETS, cum) if c >= rank), max_s)
