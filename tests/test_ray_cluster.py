"""TP ranks as Ray actors (gloo), replicas and the router on a real local Ray instance."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import pytest
import ray

from cluster.api.metrics import ServerMetrics
from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from cluster.launch import ClusterOptions, ServingCluster
from cluster.router import RouterOptions
from tests.fixtures import tiny_model_dir
from tests.test_engine import PROMPTS, greedy, hf_greedy, run_staggered
from workers.model_runner import RunnerOptions
from workers.ray_group import RayWorkerGroup

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_local():
    ray.init(address="local", num_cpus=8, num_gpus=0, include_dashboard=False, namespace="manta-test")
    yield
    ray.shutdown()


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["tp-divides-kv", "tp-exceeds-kv"])
def test_tp2_ray_actors_equal_tp1_and_transformers(ray_local, tmp_path_factory, kv_heads):
    d = tiny_model_dir(tmp_path_factory, "llama", kv_heads=kv_heads, heads=4)
    config = EngineConfig(model=str(d), tp_size=2, page_size=4)
    group = RayWorkerGroup(RunnerOptions(model=str(d), page_size=4), 2, name=f"tp-test-{kv_heads}")
    try:
        engine = Engine(config, workers=group)
        assert engine.overlap  # launch/collect as OverlapCalls through the step channel
        tp2 = run_staggered(engine, PROMPTS, greedy())
    finally:
        group.shutdown()
    tp1 = Engine(EngineConfig(model=str(d), page_size=4)).generate(PROMPTS, greedy())
    for prompt, a, b in zip(PROMPTS, tp2, tp1):
        assert a.token_ids == b.token_ids == hf_greedy(d, engine.tokenize(prompt), len(a.token_ids))


async def _collect(router, prompt, max_tokens):
    outs = []
    async for out in router.generate_stream(prompt, greedy(max_tokens)):
        outs.append(out)
    return outs


def test_dead_worker_is_noticed_and_routed_around(ray_local, tmp_path_factory):
    d = tiny_model_dir(tmp_path_factory, "llama")
    metrics = ServerMetrics()
    cluster = ServingCluster(ClusterOptions(engine=EngineConfig(model=str(d)), replicas=2,
                                            router=RouterOptions(policy="round_robin", stats_interval_s=0.2)),
                             metrics)
    router = cluster.start()
    try:
        async def scenario():
            await router.start()
            # Load: long generations spread over both replicas.
            tasks = [asyncio.create_task(_collect(router, f"{PROMPTS[i % 5]} {i}", 400)) for i in range(8)]
            await asyncio.sleep(1.0)
            victim = ray.get_actor("manta-replica-0-rank0", namespace="manta-test")
            ray.kill(victim)
            t0 = time.monotonic()
            # The router learns of the death from the replica's monitor within seconds.
            while router.replicas["replica-0"].healthy and time.monotonic() - t0 < 10:
                await asyncio.sleep(0.05)
            noticed_s = time.monotonic() - t0
            exported = metrics.render().decode()
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
            # Later requests succeed (on the healthy replica, or on the restarted one).
            later = [await _collect(router, p, 5) for p in PROMPTS]
            return noticed_s, exported, results, later

        noticed_s, exported, results, later = asyncio.run(scenario())
        assert noticed_s < 10
        assert 'manta:replica_healthy{replica="replica-0"} 0.0' in exported
        assert 'manta:replica_healthy{replica="replica-1"} 1.0' in exported
        finals = [outs[-1] for outs in results]
        assert all(f.finished for f in finals)  # nothing hangs
        errored = [f for f in finals if f.finish_reason == "error"]
        ok = [f for f in finals if f.finish_reason == "length"]
        assert errored, "the killed replica's requests must end with a clean error"
        assert all(f.replica == "replica-0" and f.error for f in errored)
        assert ok and all(f.replica == "replica-1" for f in ok)
        assert all(outs[-1].finish_reason == "length" for outs in later)
        # It comes back: the replica rebuilds its TP group.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            stats = ray.get(cluster.actors["replica-0"].stats.remote())
            if stats["healthy"]:
                break
            time.sleep(0.5)
        assert stats["healthy"] and stats["restarts"] == 1
    finally:
        asyncio.run(router.aclose())
        cluster.shutdown()


def test_replicas_added_and_drained_while_serving(ray_local, tmp_path_factory):
    """The operator routes: a replica added while serving takes requests; one removed is drained
    first (its long request finishes normally, no new request reaches it); the last one is kept."""
    import httpx

    from cluster.api.server import BackgroundServer, build_app

    d = tiny_model_dir(tmp_path_factory, "llama")
    metrics = ServerMetrics()
    cluster = ServingCluster(ClusterOptions(engine=EngineConfig(model=str(d)), replicas=1,
                                            router=RouterOptions(policy="round_robin", stats_interval_s=0.2)),
                             metrics)
    router = cluster.start()
    server = BackgroundServer(build_app(router, metrics, admin=cluster))
    url = server.url

    def complete(prompt: str, n: int) -> dict:
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": router.model_name, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()

    try:
        added = httpx.post(url + "/admin/replicas", timeout=300)
        assert added.status_code == 201, added.text
        new = added.json()["name"]
        names = {r["name"] for r in httpx.get(url + "/admin/replicas").json()["replicas"]}
        assert names == {"replica-0", new}
        # Round robin: a long request on each replica, then drain replica-0 while they run.
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            long = [pool.submit(complete, f"{PROMPTS[i]} long", 480) for i in range(2)]
            time.sleep(1.0)
            assert {h.inflight for h in router.replicas.values()} == {1}
            drain = pool.submit(httpx.delete, url + "/admin/replicas/replica-0", timeout=300)
            time.sleep(0.5)
            during = [complete(p, 4) for p in PROMPTS[:3]]  # only the new replica takes these
            removed = drain.result()
            finished = [f.result() for f in long]
        assert removed.status_code == 200 and removed.json()["drained"] is True, removed.text
        assert [c["choices"][0]["finish_reason"] for c in finished] == ["length", "length"]
        assert all(c["usage"]["completion_tokens"] == 480 for c in finished)
        assert all(c["choices"][0]["finish_reason"] == "length" for c in during)
        assert list(router.replicas) == [new] and "replica-0" not in cluster.actors
        last = httpx.delete(url + f"/admin/replicas/{new}")
        assert last.status_code == 409 and last.json()["error"]["code"] == "last_replica"
        assert httpx.delete(url + "/admin/replicas/nope").status_code == 404
        assert complete(PROMPTS[4], 3)["choices"][0]["finish_reason"] == "length"
    finally:
        server.stop()
        asyncio.run(router.aclose())
        cluster.shutdown()
