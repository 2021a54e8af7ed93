"""Faults on a real multi-node Ray cluster (`ray.cluster_utils.Cluster`: several raylets on this
machine, how Ray tests itself), with the real router, replicas and HTTP server.

Layout: the head node has 1 CPU (replica-0's rank), node B has 1 CPU (replica-1's rank, and
replica-1's actor pinned there), so removing node B takes exactly one whole replica with it.

- the router's own bound (`RouterOptions.max_inflight`): a burst over it gets 503 + Retry-After,
  the rest is served, and every replica's queue and KV usage return to 0;
- the router restarted: a new router built from the named replica actors serves, while streams
  the old one had opened finish normally;
- a node removed: requests in flight on it end with a clean error (or are retried elsewhere when
  they had no token yet), the router routes around the dead replica at once, the supervisor
  replaces the replica as soon as a node with room joins, and the replacement serves.

(A rank killed mid-decode: tests/test_ray_cluster.py. The KV store actor killed:
tests/test_kvstore.py and tests/test_kvstore_serving.py.)
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.api.metrics import ServerMetrics
from cluster.api.server import BackgroundServer, build_app
from cluster.engine.config import EngineConfig
from cluster.launch import ClusterOptions, ServingCluster
from cluster.router import Router, RouterOptions
from cluster.supervisor import ReplicaSupervisor
from tests.fixtures import tiny_model_dir
from workers.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NS = "manta-faults"


class PinnedCluster(ServingCluster):
    """Puts the actor of replica `pinned_name` on node `pinned_node` (hard: with a soft affinity
    Ray may place it elsewhere, and the node's loss would then only take its rank). Replacements
    get new names, so they go wherever there is room. Everything else as in production."""

    pinned_name: str | None = None
    pinned_node: str | None = None

    def _actor_options(self, name: str) -> dict:
        extra = {}
        if name == self.pinned_name:
            extra["scheduling_strategy"] = NodeAffinitySchedulingStrategy(self.pinned_node, soft=False)
        return {**super()._actor_options(name), **extra}


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    d = tiny_model_dir(tmp_path_factory, "llama")
    if ray.is_initialized():
        ray.shutdown()
    rc = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False,
        "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3}})
    ray.init(address=rc.address, namespace=NS)
    metrics = ServerMetrics()
    serving = PinnedCluster(ClusterOptions(engine=EngineConfig(model=str(d), kv_cache_tokens=2048),
                                           replicas=1, router=RouterOptions(policy="round_robin",
                                                                            stats_interval_s=0.2)),
                            metrics)
    serving.start()  # replica-0: its rank takes the head's only CPU
    node_b = rc.add_node(num_cpus=1)
    rc.wait_for_nodes()
    serving.pinned_name, serving.pinned_node = "replica-1", node_b.node_id
    name, actor = serving.start_replica()  # its rank can only go to node B
    assert name == "replica-1"
    serving.router.add_replica(name, actor)
    try:
        yield {"cluster": rc, "serving": serving, "metrics": metrics, "node_b": node_b, "model": str(d)}
    finally:
        serving.shutdown()
        ray.shutdown()
        rc.shutdown()


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


async def collect(router: Router, prompt: str, n: int, tokens_from: dict[str, asyncio.Event] | None = None) -> list:
    """Every output of one request; `tokens_from[replica]` is set when a token comes from it."""
    outs = []
    async for out in router.generate_stream(prompt, params(n)):
        outs.append(out)
        if tokens_from is not None and out.delta_token_ids and out.replica in tokens_from:
            tokens_from[out.replica].set()
    return outs


def replica_stats(serving) -> dict[str, dict]:
    return {n: ray.get(a.stats.remote(), timeout=30) for n, a in serving.actors.items()}


def wait_replicas_idle(serving, timeout: float = 30.0) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while True:
        stats = replica_stats(serving)
        idle = all(s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_usage"] == 0.0 for s in stats.values())
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def _node_of(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()), timeout=30)


def test_layout_one_replica_per_node(nodes):
    serving, node_b = nodes["serving"], nodes["node_b"].node_id
    ranks = {n: i["group"]["ranks"][0]["node_id"] for n, i in serving.infos.items()}
    assert ranks["replica-1"] == node_b != ranks["replica-0"]
    assert _node_of(serving.actors["replica-1"]) == node_b != _node_of(serving.actors["replica-0"])


def test_router_bound_burst_then_back_to_zero(nodes):
    serving = nodes["serving"]
    metrics = ServerMetrics()
    first = next(iter(serving.infos.values()))
    router = Router(RouterOptions(policy="least_load", max_inflight=3, stats_interval_s=0.2), metrics,
                    serving.router.tokenizer, "tiny", first["max_context_len"], first["vocab_size"])
    for name, actor in serving.actors.items():
        router.add_replica(name, actor)
    server = BackgroundServer(build_app(router, metrics))
    try:
        async def burst():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
                async def one(i: int):
                    r = await http.post("/v1/completions", json={"prompt": f"burst {i}", "max_tokens": 24,
                                                                  "ignore_eos": True})
                    return r.status_code, r.headers.get("retry-after"), r.json()

                return await asyncio.gather(*(one(i) for i in range(12)))

        results = asyncio.run(burst())
        statuses = [s for s, _, _ in results]
        assert set(statuses) <= {200, 503} and statuses.count(503) >= 1 and statuses.count(200) >= 3, statuses
        for status, retry_after, body in results:
            if status == 503:
                assert retry_after == "1" and body["error"]["code"] == "queue_full"
            else:
                assert body["usage"]["completion_tokens"] == 24
        assert router._inflight == 0
        stats = wait_replicas_idle(serving)
        for s in stats.values():
            assert (s["num_running"], s["num_waiting"], s["kv_usage"]) == (0, 0, 0.0), stats
    finally:
        server.stop()


def test_router_restart_over_the_named_actors(nodes):
    serving = nodes["serving"]

    async def scenario():
        old = serving.rebuild_router()
        await old.start()
        streams = [asyncio.create_task(collect(old, f"old router {i}", 40)) for i in range(4)]
        await asyncio.sleep(0.5)
        await old.aclose()  # the router "restarts": its poller is gone, the object dropped
        new = serving.rebuild_router()
        assert new is not old and set(new.replicas) == {"replica-0", "replica-1"}
        await new.start()
        later = await asyncio.gather(*(collect(new, f"new router {i}", 6) for i in range(4)))
        finished = await asyncio.gather(*streams)
        await new.aclose()
        return finished, later

    finished, later = asyncio.run(scenario())
    assert all(outs[-1].finish_reason == "length" for outs in finished)  # nothing the old one held was lost
    assert all(outs[-1].finish_reason == "length" for outs in later)
    assert {outs[-1].replica for outs in later} == {"replica-0", "replica-1"}


def test_node_removed_replica_replaced(nodes):
    rc, serving = nodes["cluster"], nodes["serving"]

    async def scenario():
        router = serving.rebuild_router()
        await router.start()
        supervisor = ReplicaSupervisor(serving, interval_s=0.2, ready_timeout_s=120, backoff_s=1.0)
        await supervisor.start()
        try:
            tokens_from = {"replica-1": asyncio.Event()}
            inflight = [asyncio.create_task(collect(router, f"in flight {i}", 300, tokens_from)) for i in range(4)]
            # replica-1's requests are producing tokens when its node goes.
            await asyncio.wait_for(tokens_from["replica-1"].wait(), timeout=60)
            t0 = time.monotonic()
            await asyncio.to_thread(rc.remove_node, nodes["node_b"])
            while "replica-1" in router.replicas and time.monotonic() - t0 < 60:
                await asyncio.sleep(0.05)
            retired_s = time.monotonic() - t0
            # The survivor serves everything meanwhile.
            during = await asyncio.gather(*(collect(router, f"during {i}", 5) for i in range(4)))
            results = await asyncio.wait_for(asyncio.gather(*inflight), timeout=120)
            # Capacity comes back: the replacement starts on the new node and joins the router.
            rc.add_node(num_cpus=1)
            t1 = time.monotonic()
            while supervisor.stats.started < 1 and time.monotonic() - t1 < 120:
                await asyncio.sleep(0.2)
            replaced_s = time.monotonic() - t1
            after = await asyncio.gather(*(collect(router, f"after {i}", 5) for i in range(6)))
            return retired_s, during, results, replaced_s, after, set(router.replicas), supervisor.stats
        finally:
            await supervisor.aclose()
            await router.aclose()

    retired_s, during, results, replaced_s, after, names, stats = asyncio.run(scenario())
    assert retired_s < 60, stats.events
    assert all(outs[-1].finish_reason == "length" and outs[-1].replica == "replica-0" for outs in during)
    finals = [outs[-1] for outs in results]
    assert all(f.finished for f in finals)  # nothing hangs
    for f in finals:  # served whole, or cut with a clean error by the replica that died
        assert f.finish_reason == "length" or (f.finish_reason == "error" and f.replica == "replica-1"
                                               and "replica-1" in f.error), f
    assert any(f.replica == "replica-1" for f in finals)
    assert stats.replaced == 1 and stats.started == 1, stats.events
    assert replaced_s < 120, stats.events
    assert names == {"replica-0", "replica-2"}
    assert all(outs[-1].finish_reason == "length" for outs in after)
    assert {outs[-1].replica for outs in after} == {"replica-0", "replica-2"}
    stats_now = wait_replicas_idle(serving)
    assert set(stats_now) == {"replica-0", "replica-2"}
    assert all(s["num_running"] == 0 and s["kv_usage"] == 0.0 for s in stats_now.values()), stats_now
    print(json.dumps({"retired_s": retired_s, "replaced_s": replaced_s, "events": stats.events}, indent=1))
