"""Two simulated nodes (`ray.cluster_utils.Cluster`, how Ray tests itself): one replica's TP
ranks spread over both nodes, all-reducing through gloo across them."""

from __future__ import annotations

import asyncio

import pytest
import ray
from ray.cluster_utils import Cluster

from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from cluster.launch import ClusterOptions, ServingCluster
from cluster.router import RouterOptions
from tests.fixtures import tiny_model_dir
from tests.test_engine import PROMPTS, greedy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes():
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="manta-multinode")
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_replica_ranks_spread_over_two_nodes(two_nodes, tmp_path_factory):
    d = tiny_model_dir(tmp_path_factory, "llama")
    serving = ServingCluster(ClusterOptions(engine=EngineConfig(model=str(d), tp_size=2), replicas=1,
                                            placement_strategy="STRICT_SPREAD",
                                            router=RouterOptions(policy="least_load")))
    router = serving.start()
    try:
        ranks = serving.infos["replica-0"]["group"]["ranks"]
        assert len({r["node_id"] for r in ranks}) == 2, ranks
        assert serving.infos["replica-0"]["group"]["step_channel"] == "tcp"

        async def run():
            await router.start()
            results = []
            for p in PROMPTS:
                toks = []
                async for out in router.generate_stream(p, greedy()):
                    toks += out.delta_token_ids
                results.append(toks)
            await router.aclose()
            return results

        spread = asyncio.run(run())
    finally:
        serving.shutdown()
    local = Engine(EngineConfig(model=str(d))).generate(PROMPTS, greedy())
    assert spread == [r.token_ids for r in local]


def test_kv_store_runs_on_the_head_node(two_nodes, tmp_path):
    """The shared KV store is placed on the head node, whichever node asks for it: losing a
    worker node never takes the store (and its file tier) with it."""
    from kvstore.actor import get_or_create_store

    head_id = two_nodes.head_node.node_id

    @ray.remote(num_cpus=1)
    def create_from_a_worker_node(root):
        store = get_or_create_store(root, name="manta-kvstore-placement", namespace="manta-multinode",
                                    ram_bytes=1 << 20, file_bytes=1 << 20)
        return ray.get_runtime_context().get_node_id(), ray.get(store.info.remote())["node_id"]

    workers = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head_id]
    assert workers
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    caller, store_node = ray.get(create_from_a_worker_node.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(workers[0], soft=False)).remote(str(tmp_path)))
    assert caller == workers[0] and store_node == head_id  # (the store ends with the task that owns it)
