"""Every serving process that runs Python threads beside a busy one shortens CPython's GIL switch
interval (`workers/gil_switch.py`): the HTTP server, the replica actors, and the TP rank actors,
whose step thread shares the GIL with the KV offload's I/O thread and a PD peer's calls."""

from __future__ import annotations

import sys

import pytest

from cluster.engine.config import EngineConfig
from tests.fixtures import tiny_model_dir
from workers import gil_switch


@pytest.fixture
def restore_interval():
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_a_rank_actor_takes_the_serving_switch_interval(tmp_path_factory, monkeypatch, restore_interval):
    from cluster.engine.ranks import runner_options
    from workers.worker import RankWorker

    d = tiny_model_dir(tmp_path_factory, "llama")
    sys.setswitchinterval(0.005)  # CPython's own
    RankWorker(runner_options(EngineConfig(model=str(d))), 0, 1)
    assert sys.getswitchinterval() == pytest.approx(gil_switch.DEFAULT_MS / 1000.0)
    monkeypatch.setenv("MANTA_GIL_SWITCH_MS", "2.5")
    RankWorker(runner_options(EngineConfig(model=str(d))), 0, 1)
    assert sys.getswitchinterval() == pytest.approx(0.0025)


def test_a_switch_interval_that_is_not_positive_is_refused(monkeypatch, restore_interval):
    monkeypatch.setenv("MANTA_GIL_SWITCH_MS", "0")
    with pytest.raises(ValueError, match="MANTA_GIL_SWITCH_MS"):
        gil_switch.apply()
