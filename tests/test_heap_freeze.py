"""A serving engine freezes the heap it starts with out of the cyclic collector's walks (a full
collection over it stalled every stream for ~0.4 s on an 8B engine) and gives it back when it
stops, so that nothing frozen outlives its use uncollected."""

from __future__ import annotations

import gc
import weakref

from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from tests.fixtures import tiny_model_dir
from workers import heap


def test_a_started_engine_freezes_its_heap_until_the_last_one_stops(tmp_path_factory):
    d = tiny_model_dir(tmp_path_factory, "llama")
    users = heap._users  # engines an earlier test left running keep theirs frozen
    a, b = Engine(EngineConfig(model=str(d))), Engine(EngineConfig(model=str(d)))
    try:
        a.start()
        assert gc.get_freeze_count() > 1000  # the model, the tokenizer, the engine: everything alive at start
        b.start()
        assert heap._users == users + 2
        a.shutdown()
        # b still serves: its heap stays frozen (a's frozen objects that a's shutdown freed leave
        # the count, so it may shrink, but only thawing would empty it)
        assert heap._users == users + 1 and gc.get_freeze_count() > 1000
    finally:  # (an engine left running would keep the next tests' heap frozen)
        a.shutdown()
        b.shutdown()
    assert heap._users == users
    if users == 0:
        assert gc.get_freeze_count() == 0
        heap.thaw()  # one more than froze: nothing to give back
        assert heap._users == 0 and gc.get_freeze_count() == 0


def test_what_was_frozen_is_collected_again_once_the_engine_stops(tmp_path_factory):
    """A cycle alive at start is frozen with the rest; dropped after the engine stopped, the
    collector finds it (it would stay forever in a heap left frozen)."""
    d = tiny_model_dir(tmp_path_factory, "llama")
    users = heap._users

    class Node:
        pass

    node = Node()
    node.self = node  # a cycle: only the cyclic collector frees it
    ref = weakref.ref(node)
    engine = Engine(EngineConfig(model=str(d)))
    try:
        engine.start()
        gc.collect()
        assert (ref() is not None) and (users > 0 or gc.get_freeze_count() > 0)
    finally:
        engine.shutdown()
    del node
    gc.collect()
    # (with an engine an earlier test left running, the heap was frozen before the cycle was
    # made, so it was never frozen: collected either way)
    assert ref() is None


def test_a_tp_rank_freezes_once_its_model_is_loaded(tmp_path_factory):
    """Under `manta serve` the model lives in the TP ranks' processes (`RankWorker`): each
    freezes its heap after loading and thaws at shutdown, once however often it is stopped."""
    from cluster.engine.ranks import runner_options
    from workers.worker import RankWorker, free_port

    d = tiny_model_dir(tmp_path_factory, "llama")
    users = heap._users
    rank = RankWorker(runner_options(EngineConfig(model=str(d))), 0, 1)
    assert heap._users == users
    rank.init("127.0.0.1", free_port())
    assert heap._users == users + 1 and gc.get_freeze_count() > 1000
    rank.shutdown()
    rank.shutdown()
    assert heap._users == users
