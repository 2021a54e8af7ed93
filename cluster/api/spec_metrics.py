"""Prometheus export of speculative decoding's counters, from what replicas report.

A replica's `stats()` carries the scheduler's cumulative `spec_draft_tokens`,
`spec_accepted_tokens` and `spec_verify_requests` (cluster/engine/spec_scheduler.py; zero without a
draft model). Like the prefix-cache counters they are exported from the latest polled values.

    manta:spec_draft_tokens_total{replica}       draft tokens proposed
    manta:spec_accepted_tokens_total{replica}    draft tokens the target accepted
    manta:spec_mean_acceptance_length{replica}   tokens emitted per request per round, i.e.
                                                 (accepted + rounds) / rounds (1 .. K + 1; 0 before
                                                 the first round)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

SPEC_STATS_KEYS = ("spec_draft_tokens", "spec_accepted_tokens", "spec_verify_requests")


class SpecCollector(Collector):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._replicas: dict[str, tuple[float, float, float]] = {}

    def set(self, replica: str, stats: dict) -> None:
        with self._lock:
            self._replicas[replica] = tuple(float(stats.get(k, 0)) for k in SPEC_STATS_KEYS)  # type: ignore[assignment]

    def remove(self, replica: str) -> None:
        with self._lock:
            self._replicas.pop(replica, None)

    def collect(self) -> Iterator[Metric]:
        drafts = CounterMetricFamily("manta:spec_draft_tokens", "Draft tokens proposed by the speculative draft model.",
                                     labels=["replica"])
        accepted = CounterMetricFamily("manta:spec_accepted_tokens", "Draft tokens the target model accepted.",
                                       labels=["replica"])
        mean = GaugeMetricFamily("manta:spec_mean_acceptance_length",
                                 "Tokens emitted per request per speculative round (accepted drafts + 1); "
                                 "0 before the first round.", labels=["replica"])
        with self._lock:
            for replica, (d, a, rounds) in self._replicas.items():
                drafts.add_metric([replica], d)
                accepted.add_metric([replica], a)
                mean.add_metric([replica], (a + rounds) / rounds if rounds else 0.0)
        yield drafts
        yield accepted
        yield mean

    def describe(self) -> Iterator[Metric]:
        return self.collect()
