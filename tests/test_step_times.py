"""The engine's step times by mode (cluster/engine/step_times.py): the steps over the slow bound
kept with what they ran, and a summary between two readings that keeps only the slow steps in
between."""

from __future__ import annotations

import time
from types import SimpleNamespace

from cluster.engine.step_times import SLOW_KEPT, StepTimes, step_summary


def _reqs(*lens: int) -> list:
    return [SimpleNamespace(input_ids=[0] * n) for n in lens]


def test_slow_steps_are_kept_with_what_they_ran():
    st = StepTimes(slow_s=0.010)
    times = [0.001 * ((7 * i) % 23 + 1) for i in range(23)]  # 1..23 ms, shuffled
    for i, t in enumerate(times):
        st.observe("MIXED", t, _reqs(1, 1, i + 1))
    got = st.stats()["MIXED"]
    assert [x["ms"] for x in got["slow"]] == [1e3 * t for t in times if t > 0.010]  # oldest first
    for x in got["slow"]:  # each with its own step's requests and input tokens
        i = min(range(len(times)), key=lambda j: abs(times[j] - x["ms"] / 1e3))
        assert (x["reqs"], x["tokens"]) == (3, i + 3)
    assert got["count"] == 23 and abs(got["max_s"] - 0.023) < 1e-12
    for _ in range(2 * SLOW_KEPT):  # only the latest are kept
        st.observe("MIXED", 0.5)
    assert [x["ms"] for x in st.stats()["MIXED"]["slow"]] == [500.0] * SLOW_KEPT


def test_a_summary_keeps_the_slow_steps_of_its_window_slowest_first():
    st = StepTimes()
    st.observe("DECODE", 0.090, _reqs(1))  # before the window, and slower than anything in it
    before = st.stats()
    time.sleep(0.01)
    for t in (0.004, 0.050, 0.006, 0.070):
        st.observe("DECODE", t, _reqs(1, 1))
    got = step_summary(st.stats(), before)["DECODE"]
    assert got["steps"] == 4 and got["over_40ms"] == 2
    assert [round(x["ms"]) for x in got["slow"]] == [70, 50]
    assert got["max_ms"] == 90.0  # (the engine's, since it started)


def _exported(collector) -> dict:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry()
    registry.register(collector)
    (fam,) = text_string_to_metric_families(generate_latest(registry).decode())
    return {(s.name.rsplit("_", 1)[1], s.labels.get("le")): s.value for s in fam.samples}


def test_the_export_carries_on_over_a_replica_that_restarts():
    """A replica whose engine is rebuilt reports from zero again: the exported histogram goes on
    from where it was, every bucket, the count and the sum together (cumulative, never down)."""
    from cluster.api.step_metrics import StepTimeCollector

    collector = StepTimeCollector()
    first = StepTimes()
    for t in (0.003, 0.012, 0.012, 0.3):
        first.observe("DECODE", t)
    collector.set("r0", {"DECODE": first.stats()["DECODE"]})
    collector.set("r0", {"DECODE": first.stats()["DECODE"]})  # the same reading twice: no change
    got = _exported(collector)
    assert (got[("count", None)], got[("bucket", "0.005")], got[("bucket", "0.015")], got[("bucket", "+Inf")]) \
        == (4, 1, 3, 4)
    again = StepTimes()  # rebuilt: counts from zero
    again.observe("DECODE", 0.004)
    collector.set("r0", {"DECODE": again.stats()["DECODE"]})
    got = _exported(collector)
    assert (got[("count", None)], got[("bucket", "0.005")], got[("bucket", "0.015")], got[("bucket", "+Inf")]) \
        == (5, 2, 4, 5)
    assert abs(got[("sum", None)] - 0.331) < 1e-9
    collector.remove("r0")
    assert _exported(collector) == {}
