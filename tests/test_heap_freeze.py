"""A serving engine freezes the heap it starts with out of the cyclic collector's walks (a full
collection over it stalled every stream for ~0.4 s on an 8B engine) and gives it back when it
stops, so that nothing frozen outlives its use uncollected."""

from __future__ import annotations

import gc
import weakref

from cluster.engine import heap
from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from tests.fixtures import tiny_model_dir


def test_a_started_engine_freezes_its_heap_until_the_last_one_stops(tmp_path_factory):
    d = tiny_model_dir(tmp_path_factory, "llama")
    users = heap._users  # engines an earlier test left running keep theirs frozen
    a, b = Engine(EngineConfig(model=str(d))), Engine(EngineConfig(model=str(d)))
    a.start()
    frozen = gc.get_freeze_count()
    assert frozen > 1000  # the model, the tokenizer, the engine: everything alive at start
    b.start()
    a.shutdown()
    assert gc.get_freeze_count() >= frozen  # b still serves: its heap stays frozen
    b.shutdown()
    assert heap._users == users
    if users == 0:
        assert gc.get_freeze_count() == 0
        heap.thaw()  # one more than froze: nothing to give back
        assert heap._users == 0 and gc.get_freeze_count() == 0


def test_cyclic_garbage_made_while_serving_is_still_collected(tmp_path_factory):
    d = tiny_model_dir(tmp_path_factory, "llama")
    engine = Engine(EngineConfig(model=str(d)))
    engine.start()
    try:
        class Node:
            pass

        n = Node()
        n.self = n  # a cycle made after the freeze
        ref = weakref.ref(n)
        del n
        gc.collect()
        assert ref() is None
    finally:
        engine.shutdown()
