"""TP ranks as Ray actors (gloo), replicas and the router on a real local Ray instance."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time

import pytest
import ray

from cluster.api.metrics import ServerMetrics
from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from cluster.launch import ClusterOptions, ServingCluster
from cluster.router import RouterOptions
from tests.fixtures import local_ray, tiny_model_dir
from tests.test_engine import PROMPTS, greedy, hf_greedy, run_staggered
from workers.model_runner import RunnerOptions
from workers.ray_group import RayWorkerGroup, shared_gpu

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_local():
    # One logical GPU (no device behind it): what Ray does with fractional GPU shares is real here.
    with local_ray(8, num_gpus=1, namespace="manta-test"):
        yield


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["tp-divides-kv", "tp-exceeds-kv"])
def test_tp2_ray_actors_equal_tp1_and_transformers(ray_local, tmp_path_factory, kv_heads):
    d = tiny_model_dir(tmp_path_factory, "llama", kv_heads=kv_heads, heads=4)
    config = EngineConfig(model=str(d), tp_size=2, page_size=4)
    # (sm_percent: each rank process starts with CUDA MPS's SM limit in its environment)
    group = RayWorkerGroup(RunnerOptions(model=str(d), page_size=4, sm_percent=40), 2, name=f"tp-test-{kv_heads}")
    try:
        assert [p["sm_percent"] for p in group.placements] == ["40", "40"]
        engine = Engine(config, workers=group)
        assert engine.overlap  # launch/collect as OverlapCalls through the step channel
        tp2 = run_staggered(engine, PROMPTS, greedy())
        # Ranks stopped by shutdown() did not die: the replica's monitor must not rebuild them.
        waiter = concurrent.futures.ThreadPoolExecutor(1).submit(group.wait_for_death)
    finally:
        group.shutdown()
    assert waiter.result(timeout=30) is None and group.failed is None
    tp1 = Engine(EngineConfig(model=str(d), page_size=4)).generate(PROMPTS, greedy())
    for prompt, a, b in zip(PROMPTS, tp2, tp1):
        assert a.token_ids == b.token_ids == hf_greedy(d, engine.tokenize(prompt), len(a.token_ids))


def test_tp_ranks_sharing_a_gpu_are_named():
    """NCCL fails two ranks on one GPU with a bare "invalid usage": the group says which ranks
    Ray put together instead (tests/test_gpu_pd.py starts such a replica on a one-GPU machine)."""
    def at(rank, node, *gpus):
        return {"rank": rank, "node_id": node, "ip": f"10.0.0.{node}", "gpu_ids": list(gpus)}

    assert shared_gpu([at(0, 1), at(1, 1)]) is None  # CPU ranks
    assert shared_gpu([at(0, 1, 0), at(1, 1, 1)]) is None
    assert shared_gpu([at(0, 1, 0), at(1, 2, 0)]) is None  # GPU 0 of two nodes
    why = shared_gpu([at(0, 1, 0), at(1, 2, 0), at(2, 1, 1), at(3, 2, "0")])
    assert why == "TP ranks 1 and 3 were placed on one GPU (GPU 0 of node 10.0.0.2)"


def test_tp_ranks_on_one_gpu_are_refused_with_the_reason(ray_local, tmp_path_factory):
    """Two ranks of a TP 2 replica given half a GPU each, on a node of one GPU: Ray puts both on
    it, where NCCL would fail with a bare "invalid usage". The group refuses before any rank
    touches the device, naming the ranks and the flag that fixes it, and gives the share back."""
    d = tiny_model_dir(tmp_path_factory, "llama")
    with pytest.raises(RuntimeError, match=r"TP ranks 0 and 1 were placed on one GPU .*--gpus-per-rank 1"):
        RayWorkerGroup(RunnerOptions(model=str(d), device="cuda", gpu_share=0.5), 2, name="shared-gpu")
    for _ in range(100):  # its placement group is removed (Ray frees it a moment later)
        if ray.available_resources().get("GPU") == 1.0:
            break
        time.sleep(0.1)
    assert ray.available_resources().get("GPU") == 1.0


def test_a_replica_that_cannot_start_leaves_nothing_behind(ray_local, tmp_path_factory):
    """replica-0 cannot place its group (a group of that name is left in this namespace), while
    replica-1 is still loading: start() raises Ray's reason, and neither replica's actor nor
    group is left to refuse the next cluster here (CI, stop 54: one test's leftovers failed the
    six after it)."""
    from ray.util import get_placement_group, placement_group, remove_placement_group

    squatter = placement_group([{"CPU": 0.01}], name="replica-0-pg")
    ray.get(squatter.ready(), timeout=30)
    d = tiny_model_dir(tmp_path_factory, "llama")
    cluster = ServingCluster(ClusterOptions(engine=EngineConfig(model=str(d)), replicas=2), ServerMetrics())
    try:
        with pytest.raises(ray.exceptions.RayError, match="name 'replica-0-pg' already exists"):
            cluster.start()
        assert not cluster.actors
        assert not [a for a in ray.util.list_named_actors() if a.startswith("manta-replica-")]
        with pytest.raises(ValueError):
            get_placement_group("replica-1-pg")
    finally:
        remove_placement_group(squatter)


async def _collect(router, prompt, max_tokens, streaming: dict | None = None):
    """The request's outputs; `streaming[prompt]` is the replica of its latest output."""
    outs = []
    async for out in router.generate_stream(prompt, greedy(max_tokens)):
        outs.append(out)
        if streaming is not None:
            streaming[prompt] = out.replica
    return outs


async def _long_requests_streaming_on_replica0(router, n: int) -> list:
    """`n` long requests over the two replicas (tasks), returned once replica-0 streams 2 of them
    or after 60 s: a request with no token yet is retried elsewhere when its replica fails, and
    a loaded machine can take longer than any fixed wait to stream the first."""
    streaming: dict[str, str] = {}
    tasks = [asyncio.create_task(_collect(router, f"{PROMPTS[i % 5]} {i}", 400, streaming)) for i in range(n)]
    until = time.monotonic() + 60
    while list(streaming.values()).count("replica-0") < 2 and time.monotonic() < until:
        await asyncio.sleep(0.005)
    return tasks


@contextlib.contextmanager
def _two_replicas(tmp_path_factory):
    """Two TP=1 replicas of the tiny Llama behind a round-robin router: (cluster, router,
    metrics); the router closed and the cluster shut down afterwards."""
    d = tiny_model_dir(tmp_path_factory, "llama")
    metrics = ServerMetrics()
    cluster = ServingCluster(ClusterOptions(engine=EngineConfig(model=str(d)), replicas=2,
                                            router=RouterOptions(policy="round_robin", stats_interval_s=0.2)),
                             metrics)
    router = cluster.start()
    try:
        yield cluster, router, metrics
    finally:
        asyncio.run(router.aclose())
        cluster.shutdown()


def test_dead_worker_is_noticed_and_routed_around(ray_local, tmp_path_factory):
    with _two_replicas(tmp_path_factory) as (cluster, router, metrics):
        async def scenario():
            await router.start()
            # Load: long generations spread over both replicas; killed while its requests stream.
            tasks = await _long_requests_streaming_on_replica0(router, 8)
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


def test_a_collected_request_whose_replica_fails_runs_again_elsewhere(ray_local, tmp_path_factory):
    """A response that is not streamed has shown the client nothing: when its replica fails it
    mid-generation (a TP rank killed), it runs again on the other replica and ends whole, with
    the tokens the same prompt gets when nothing fails (greedy)."""
    from cluster.engine.client import FanOut

    with _two_replicas(tmp_path_factory) as (cluster, router, metrics):
        async def scenario():
            await router.start()
            prompts = [f"{PROMPTS[i % 5]} {i}" for i in range(8)]

            async def collected(i: int):
                fan = await FanOut.open(router, [(prompts[i], greedy(300))], f"c{i}", restart=True)
                try:
                    return (await fan.collect())[0]
                finally:
                    await fan.aclose()

            tasks = [asyncio.create_task(collected(i)) for i in range(8)]
            while router.replicas["replica-0"].inflight < 4:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.5)  # its requests are generating
            ray.kill(ray.get_actor("manta-replica-0-rank0", namespace="manta-test"))
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
            exported = metrics.render().decode()
            while not router.replicas["replica-1"].healthy:
                await asyncio.sleep(0.05)
            alone = [await _collect(router, p, 300) for p in prompts]  # nothing fails now
            return results, exported, alone

        results, exported, alone = asyncio.run(scenario())
        assert all(c.finish_reason == "length" and len(c.token_ids) == 300 for c in results), \
            [(c.replica, c.finish_reason, len(c.token_ids)) for c in results]
        assert [c.token_ids for c in results] == [[t for o in outs for t in o.delta_token_ids] for outs in alone]
        retries = [line for line in exported.splitlines() if line.startswith("manta:router_retries_total{")]
        assert any('replica="replica-0"' in line and 'reason="replica_failed"' in line
                   and float(line.split()[-1]) >= 1 for line in retries), retries  # at least one ran again


async def _stop_while_streaming(router, pid: int) -> tuple[float, list, list]:
    """6 long requests over the two replicas; `pid` gets SIGSTOP once replica-0 streams 2 of
    them. (Seconds until every request ended, their outputs, 5 later requests' outputs.)"""
    import os
    import signal

    tasks = await _long_requests_streaming_on_replica0(router, 6)
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
    ended_s = time.monotonic() - t0
    return ended_s, results, [await _collect(router, p, 5) for p in PROMPTS]


def _assert_ended_or_retried(results: list, later: list, why: str) -> None:
    """Those that had streamed tokens on replica-0 end with an error saying `why`; any that had
    none yet were retried on replica-1 (an `unavailable` failure) and ran whole there; later
    requests are served."""
    finals = [(f.replica, f.finish_reason, f.error, f.completion_tokens) for f in (o[-1] for o in results)]
    errored = [f for f in finals if f[1] == "error"]
    assert errored and all(r == "replica-0" and why in e for r, _, e, _ in errored), finals
    assert all(f[1:] == ("length", None, 400) for f in finals if f[1] != "error"), finals
    assert all(outs[-1].finish_reason == "length" for outs in later)


@contextlib.contextmanager
def _stopped_process_killed(pid: int):
    """The body stops `pid`; afterwards it must be gone (killed, not left stopped); it is
    continued whatever happened, so a failed test leaves nothing stopped."""
    import os
    import signal

    try:
        yield
        with pytest.raises(ProcessLookupError):
            for _ in range(50):
                os.kill(pid, 0)
                time.sleep(0.1)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def test_hung_worker_is_noticed_failed_and_rebuilt(ray_local, tmp_path_factory):
    """A rank that stops answering without dying (SIGSTOP: alive to Ray, silent on its step
    channel) is caught by the step watchdog: its replica's requests end with a clean error
    within the step timeout, the router routes around it, and the replica rebuilds its TP
    group (the stopped process is killed), as when a rank dies."""
    d = tiny_model_dir(tmp_path_factory, "llama")
    cluster = ServingCluster(ClusterOptions(engine=EngineConfig(model=str(d), step_timeout_s=5.0), replicas=2,
                                            router=RouterOptions(policy="round_robin", stats_interval_s=0.2)),
                             ServerMetrics())
    router = cluster.start()
    rank = ray.get_actor("manta-replica-0-rank0", namespace="manta-test")
    pid = ray.get(rank.placement.remote())["pid"]
    try:
        with _stopped_process_killed(pid):
            async def scenario():
                await router.start()
                return await _stop_while_streaming(router, pid)

            ended_s, results, later = asyncio.run(scenario())
            _assert_ended_or_retried(results, later, "did not answer")
            assert ended_s < 5.0 + 15, ended_s  # the timeout, then the replica's step raises at once
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                stats = ray.get(cluster.actors["replica-0"].stats.remote())
                if stats["healthy"] and stats["restarts"]:
                    break
                time.sleep(0.5)
            assert stats["healthy"] and stats["restarts"] == 1
    finally:
        asyncio.run(router.aclose())
        cluster.shutdown()


def test_hung_replica_actor_is_routed_around_and_replaced(ray_local, tmp_path_factory):
    """A replica actor that stops answering without dying (SIGSTOP) holds its streams until the
    router counts it hung (`replica_hang_s` without a stats answer): then its streams end (a
    request with no token yet is retried on the other replica), and the supervisor kills it and
    starts a replacement. Nothing waits forever."""
    import os

    from cluster.supervisor import ReplicaSupervisor

    d = tiny_model_dir(tmp_path_factory, "llama")
    metrics = ServerMetrics()
    cluster = ServingCluster(ClusterOptions(engine=EngineConfig(model=str(d)), replicas=2, router=RouterOptions(
        policy="round_robin", stats_interval_s=0.2, stats_timeout_s=1.0, replica_hang_s=4.0)), metrics)
    router = cluster.start()
    pid = ray.get(cluster.actors["replica-0"].__ray_call__.remote(lambda self: os.getpid()))
    try:
        with _stopped_process_killed(pid):
            async def scenario():
                await router.start()
                supervisor = ReplicaSupervisor(cluster, interval_s=0.2, ready_timeout_s=120, backoff_s=1.0)
                await supervisor.start()
                try:
                    ended_s, results, later = await _stop_while_streaming(router, pid)
                    deadline = time.monotonic() + 120
                    while supervisor.stats.started < 1 and time.monotonic() < deadline:
                        await asyncio.sleep(0.2)
                    return ended_s, results, later, supervisor.stats
                finally:
                    await supervisor.aclose()

            ended_s, results, later, stats = asyncio.run(scenario())
            _assert_ended_or_retried(results, later, "hung")
            assert ended_s < 4.0 + 10, ended_s
            assert stats.replaced == 1 and stats.started == 1, stats
            assert metrics.registry.get_sample_value("manta:replica_replacements_total") == 1
            assert "replica-0" not in router.replicas and len(router.replicas) == 2
    finally:
        asyncio.run(router.aclose())
        cluster.shutdown()


def test_replicas_added_and_drained_while_serving(ray_local, tmp_path_factory):
    """The operator routes: a replica added while serving takes requests; one removed is drained
    first (its long request finishes normally, no new request reaches it); the last one is kept."""
    import httpx

    from cluster.api.server import BackgroundServer, build_app

    # A context of 4,096: the long requests run for seconds, past the drain's start (at 512, on
    # an idle machine one could end before the check that both run).
    d = tiny_model_dir(tmp_path_factory, "llama", max_position=4096)
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
            long = [pool.submit(complete, f"{PROMPTS[i]} long", 1500) for i in range(2)]
            deadline = time.monotonic() + 30
            while {h.inflight for h in router.replicas.values()} != {1} and time.monotonic() < deadline:
                time.sleep(0.05)
            assert {h.inflight for h in router.replicas.values()} == {1}
            drain = pool.submit(httpx.delete, url + "/admin/replicas/replica-0", timeout=300)
            time.sleep(0.5)
            during = [complete(p, 4) for p in PROMPTS[:3]]  # only the new replica takes these
            removed = drain.result()
            finished = [f.result() for f in long]
        assert removed.status_code == 200 and removed.json()["drained"] is True, removed.text
        assert [c["choices"][0]["finish_reason"] for c in finished] == ["length", "length"]
        assert all(c["usage"]["completion_tokens"] == 1500 for c in finished)
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
