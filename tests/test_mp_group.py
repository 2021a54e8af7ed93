"""TP=2 without Ray (torch multiprocessing + gloo): the same rank code, equal greedy tokens."""

from __future__ import annotations

import pytest

from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from tests.fixtures import tiny_model_dir
from tests.test_engine import PROMPTS, greedy, run_staggered

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("arch", ["qwen2", "deepseek_v2"])  # GQA; MLA with MoE experts sharded
def test_multiprocess_tp2_equals_tp1(tmp_path_factory, arch):
    d = tiny_model_dir(tmp_path_factory, arch)
    tp2 = Engine(EngineConfig(model=str(d), tp_size=2, page_size=4))
    try:
        assert type(tp2.workers).__name__ == "MultiprocessWorkerGroup"
        # Overlapped: rank 1 resolves each decode's input from rank 0's broadcast tokens (a
        # wrong one would change its embedding rows and with them every logit).
        assert tp2.overlap
        got = run_staggered(tp2, PROMPTS, greedy())
    finally:
        tp2.shutdown()
    want = Engine(EngineConfig(model=str(d), page_size=4)).generate(PROMPTS, greedy())
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
