"""TP=4 simulated on CPU (four gloo ranks under torch multiprocessing): greedy tokens equal TP=1
for a GQA model whose kv heads are replicated (tp > num_kv_heads) and for an MLA + MoE model."""

from __future__ import annotations

import pytest

from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from tests.fixtures import tiny_model_dir
from tests.test_engine import PROMPTS, greedy

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("arch", ["llama", "deepseek_v2"])
def test_tp4_equals_tp1(tmp_path_factory, arch):
    d = tiny_model_dir(tmp_path_factory, arch)
    prompts = PROMPTS[:3]
    want = Engine(EngineConfig(model=str(d), page_size=4)).generate(prompts, greedy(8))
    tp4 = Engine(EngineConfig(model=str(d), tp_size=4, page_size=4))
    try:
        got = tp4.generate(prompts, greedy(8))
    finally:
        tp4.shutdown()
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
