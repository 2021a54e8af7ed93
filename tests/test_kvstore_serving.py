"""The shared KV store in serving, with real Ray and real NIXL on CPU (the scheduler's side with
exact page counts: `tests/test_kv_offload_policy.py`): a prefix prefilled on one replica is loaded by
another; MLA and MHA at TP=2 write the right keys from the right ranks; pages survive a store
restart; a damaged page is a miss; a dead, hung or full store never stops serving.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import ray

from cluster.kv_store_setup import kv_store_stats
from kvstore.keys import chain_keys, rank_keys
from tests.fixtures import local_ray
from workers.sampling_params import SamplingParams

# ---------------------------------------------------------------------------------------------
# real Ray, real NIXL

NS = "manta-kvstore-serving-test"
# A store killed with SIGKILL serves its pages again within this long: Ray starts a new process
# (which imports torch) and it rebuilds its index from the files; the bound leaves room for a
# loaded CI machine (3.9 s on the idle 2-core VM, 2026-11-27; the test prints it).
BACK_S = 20.0
PAGE = 16  # the store serves replicas with pages of >= 16 tokens (cluster.engine.kv_offload.MIN_PAGE_TOKENS)


def greedy(n=6) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def prompt_ids(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


@pytest.fixture(scope="module")
def ray_local():
    with local_ray(4, namespace=NS):
        yield


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from tests.fixtures import tiny_model_dir

    return str(tiny_model_dir(tmp_path_factory, "llama"))


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory):
    from tests.fixtures import tiny_model_dir

    return str(tiny_model_dir(tmp_path_factory, "deepseek_v2"))


def engine_config(model: str, root, **kw):
    from cluster.engine.config import EngineConfig

    args = dict(model=model, page_size=PAGE, kv_cache_tokens=4096, max_running_requests=8, kv_store=str(root),
                kv_store_host_gb=0.01, kv_store_disk_gb=0.1, kv_host_cache_gb=0.001,
                kv_prefetch_policy="wait_complete", kv_write_policy="write_through")
    args.update(kw)
    return EngineConfig(**args)


_held: list = []


def start_store(root, **kw):
    from kvstore.actor import get_or_create_store
    from kvstore.messages import STORE_NAME

    kw = {"ram_bytes": 8 << 20, "file_bytes": 64 << 20, "slot_bytes": 4096, "flush_interval_s": None, **kw}
    deadline = time.monotonic() + 120
    while True:  # the name is free once Ray has seen the previous store die
        try:
            # Detached: Ray never ends it for want of references, only kill_store does. A store
            # of this process's that ends out of scope is "restartable", and a call to it from
            # this process, its owner (an in-process engine's), then aborts the whole process on
            # a failed check in Ray's ActorTaskSubmitter::DisconnectActor (a CI run lost its
            # pytest process so, when kill_store dropped the handles before killing the store).
            store = get_or_create_store(str(root), name=STORE_NAME, detached=True, **kw)
            ray.get(store.info.remote(), timeout=120)
            _held.append(store)
            return store
        except (ray.exceptions.RayActorError, ValueError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def kill_store() -> None:
    from kvstore.actor import lookup_store
    from kvstore.messages import STORE_NAME
    from tests.fixtures import kill_named_actor

    store = lookup_store()
    if store is not None:
        kill_named_actor(store, STORE_NAME)
    _held.clear()


@pytest.fixture
def no_store_after(ray_local):
    yield
    kill_store()


@pytest.fixture
def engines(no_store_after):
    """Make in-process engines with `engines(cfg)`; they are shut down after the test (their
    ranks' I/O threads must not outlive the test's Ray instance)."""
    from cluster.engine.loop import Engine

    made = []

    def make(cfg):
        made.append(Engine(cfg))
        return made[-1]

    yield make
    for eng in made:
        eng.shutdown()


def wait_for(cond, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def store_keys() -> list[str]:
    from kvstore.actor import lookup_store

    return ray.get(lookup_store().keys.remote())


def page_file(root: Path, key: str) -> Path:
    from kvstore.file_tier import SUFFIX

    return Path(root) / key[:2] / (key + SUFFIX)


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_prefix_prefilled_on_one_replica_is_loaded_by_another(no_store_after, tmp_path, llama_dir, kv_dtype):
    """Replica A prefills a long prompt and writes its pages; replica B, asked the same prompt
    (round robin), loads them from the store: its prefill computes only the last token, its
    greedy output equals A's, and the metrics show the hits. An FP8 KV cache's pages move as
    they are (one byte a value)."""
    from cluster.api.metrics import ServerMetrics
    from cluster.launch import ClusterOptions, ServingCluster
    from cluster.router import RouterOptions

    cfg = engine_config(llama_dir, tmp_path / "kv", kv_cache_dtype=kv_dtype)
    metrics = ServerMetrics()
    cluster = ServingCluster(ClusterOptions(engine=cfg, replicas=2, namespace=NS,
                                            router=RouterOptions(policy="round_robin", stats_interval_s=0.2)),
                             metrics)
    router = cluster.start()  # starts the store first (cfg.kv_store)
    prompt = prompt_ids(201, seed=1)  # prompt[:-1]: 12 whole pages (192 tokens)

    async def collect(p):
        outs = [o async for o in router.generate_stream(p, greedy())]
        return outs[-1], [t for o in outs for t in o.delta_token_ids]

    async def scenario():
        await router.start()
        a, a_tokens = await collect(prompt)
        # A's 12 full pages (of 201 prompt + 5 computed outputs) reach the store in the background.
        await asyncio.to_thread(wait_for, lambda: len(store_keys()) >= 2 * 12, 60, "A's pages in the store")
        b, b_tokens = await collect(prompt)

        def ranks_reported():  # the replica polls its ranks' counters in the background
            return kv(b.replica)["ranks"][0]["pages_read"] == 12 and kv(a.replica)["ranks"][0]["pages_written"] == 12

        await asyncio.to_thread(wait_for, ranks_reported, 30, "the ranks' counters")
        await router.poll_once()
        return a, a_tokens, b, b_tokens

    def kv(replica: str) -> dict:
        return ray.get(cluster.actors[replica].stats.remote())["kvstore"]

    try:
        a, a_tokens, b, b_tokens = asyncio.run(scenario())
        assert {a.replica, b.replica} == {"replica-0", "replica-1"}
        assert a.cached_tokens == 0 and b.cached_tokens == 192  # B computed only the last 9 tokens
        assert b_tokens == a_tokens and len(a_tokens) == 6
        st_b = kv(b.replica)
        assert st_b["hit_pages"] == 12 and st_b["loads"] == 1 and st_b["errors"] == 0
        text = metrics.render().decode()
        assert f'manta:kvstore_hit_pages_total{{replica="{b.replica}"}} 12.0' in text
        assert f'manta:kvstore_query_pages_total{{replica="{b.replica}"}} 12.0' in text
        assert f'manta:kvstore_pages_written_total{{layout="mha",replica="{a.replica}",tp_rank="0"}} 12.0' in text
        assert 'manta:kvstore_usage_bytes{tier="file"}' in text and "manta:kvstore_errors_total" in text
    finally:
        asyncio.run(router.aclose())
        cluster.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["mla", "mha"])
def test_tp2_keys_per_page_and_writer_ranks(no_store_after, tmp_path, llama_dir, mla_dir, layout, monkeypatch):
    """MLA at TP=2: one key per page, every write from rank 0; MHA: two keys per page per rank.
    After the radix cache is dropped and another prompt has pushed the first one out of the
    ranks' host tiers, reloading it reads every page back from the store on both ranks (MLA
    rank 1 reading the keys rank 0 wrote) and the ranks agree on the count; once more, and it
    comes from the host tiers, loaded by the plan that admits it. The scheduler waits up to 5 s
    for the store's answer, not the engine's 0.1 s: on a loaded CI machine the store answered
    later once, the reload counted a miss (`probe_timeouts`), and this test is about the keys."""
    from cluster.engine import kv_offload
    from cluster.engine.loop import Engine

    monkeypatch.setattr(kv_offload, "PROBE_WAIT_S", 5.0)
    from cluster.engine.ranks import runner_options
    from workers.model_config import ModelConfig
    from workers.ray_group import RayWorkerGroup

    start_store(tmp_path / "kv")
    model = mla_dir if layout == "mla" else llama_dir
    mc = ModelConfig.from_pretrained(model, "float32")
    width = mc.kv_lora_rank + mc.qk_rope_head_dim if layout == "mla" else 2 * mc.per_rank_kv_heads(2) * mc.head_dim
    page_bytes = -(-PAGE * mc.num_layers * width * 4 // 64) * 64
    cfg = engine_config(model, tmp_path / "kv", tp_size=2, kv_host_cache_gb=32 * page_bytes / 2**30)  # 32 pages
    group = RayWorkerGroup(runner_options(cfg), 2, name=f"kv-{layout}-tp2")
    try:
        eng = Engine(cfg, workers=group)
        first, other = prompt_ids(401, seed=2), prompt_ids(401, seed=3)  # prompt[:-1]: 25 pages each
        a = eng.generate([first], greedy(4))[0]
        chain = chain_keys(first[:400], PAGE, eng.kv_offload.fingerprint, layout)  # 404 computed: 25 pages
        want = set(chain) if layout == "mla" else {k for c in chain for r in (0, 1) for k in rank_keys(c, layout, r)}
        wait_for(lambda: len(store_keys()) >= len(want), 60, "the pages in the store")
        assert set(store_keys()) == want
        ranks = ray.get([w.kv_store_stats.remote() for w in group.workers])
        writers = ray.get(ray.get_actor("manta-kvstore").stats.remote())["writes_by_client"]
        if layout == "mla":
            assert writers == {ranks[0]["name"]: 25}
            assert (ranks[1]["pages_written"], ranks[1]["pages_backup_skipped"], ranks[1]["bytes_written"]) == (0, 25, 0)
        else:
            assert writers == {ranks[0]["name"]: 2 * 25, ranks[1]["name"]: 2 * 25}
        assert eng.kv_offload.probe.count(chain) == 25  # the store's prefix count, all ranks' keys
        eng.generate([other], greedy(4))
        eng.scheduler.radix.evict(10**9)
        b = eng.generate([first], greedy(4))[0]
        assert b.token_ids == a.token_ids and b.cached_tokens == 400, eng.kv_offload.stats
        ranks = ray.get([w.kv_store_stats.remote() for w in group.workers])
        assert [r["pages_read"] for r in ranks] == [25, 25] and all(r["errors"] == 0 for r in ranks), ranks
        eng.scheduler.radix.evict(10**9)
        c = eng.generate([first], greedy(4))[0]
        assert c.token_ids == a.token_ids and c.cached_tokens == 400
        ranks = ray.get([w.kv_store_stats.remote() for w in group.workers])
        assert [r["pages_read"] for r in ranks] == [25, 25] and all(r["offload_host_hit_pages"] >= 25 for r in ranks)
        assert eng.kv_offload.stats.hit_pages == 50 and eng.kv_offload.stats.loads == 2
        # admitted at once on what the first rank reported its host tier holding: no prefetch
        assert eng.kv_offload.stats.host_admissions == 1 and eng.kv_offload.stats.short_loads == 0
    finally:
        group.shutdown()


@pytest.mark.slow
def test_restart_keeps_prefixes_and_a_damaged_page_misses(engines, tmp_path, llama_dir, monkeypatch):
    """Pages survive a store restart on the same directory; a page file corrupted while the store
    is down, or truncated under the running store, is a miss from that page on, and the request
    still answers exactly as without the store. The scheduler waits up to 5 s for the store's
    answer, not the engine's 0.1 s: on CI's loaded machine two of the three lookups once came
    later (cached tokens 160, 0, 0), and this test is about what the store keeps."""
    from cluster.engine import kv_offload

    monkeypatch.setattr(kv_offload, "PROBE_WAIT_S", 5.0)
    root = tmp_path / "kv"
    start_store(root)
    cfg = engine_config(llama_dir, root)
    x, y, z = (prompt_ids(161, seed=s) for s in (10, 11, 12))  # 10 prompt pages each
    eng = engines(cfg)
    ref = [eng.generate([p], greedy(4))[0] for p in (x, y, z)]
    wait_for(lambda: len(store_keys()) == 3 * 10 * 2, 60, "the pages in the store")
    chains = {id(p): chain_keys(p[:160], PAGE, eng.kv_offload.fingerprint, "mha") for p in (x, y, z)}
    from kvstore.actor import lookup_store
    from kvstore.file_tier import HEADER_BYTES

    assert ray.get(lookup_store().flush.remote()) == 60
    kill_store()
    with open(page_file(root, f"{chains[id(x)][4]}-r0-k"), "r+b") as f:  # a flipped byte in x's page 4
        f.seek(HEADER_BYTES + 100)
        b = f.read(1)
        f.seek(HEADER_BYTES + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    start_store(root)  # the index is rebuilt from the files
    with open(page_file(root, f"{chains[id(y)][6]}-r0-v"), "r+b") as f:  # y's page 6, under the live store
        f.truncate(HEADER_BYTES + 10)
    # An empty host tier, not warmed (a warm racing the requests would make what they find
    # depend on its progress): every page comes from the store's files.
    fresh = engines(cfg.replace(kv_host_warm=False))
    outs = [fresh.generate([p], greedy(4))[0] for p in (z, x, y)]
    assert [o.token_ids for o in outs] == [ref[2].token_ids, ref[0].token_ids, ref[1].token_ids]
    assert [o.cached_tokens for o in outs] == [160, 64, 96]
    assert fresh.kv_offload.stats.hit_pages == 10 + 4 + 6
    assert ray.get(lookup_store().stats.remote())["counters"]["corrupt"] >= 2
    fresh.scheduler.check_integrity()



@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a GPU")
def test_pages_load_into_a_gpu_pool_from_pinned_rows(engines, tmp_path, llama_dir):
    """On a GPU the store's pages land in the rank's pinned host rows and are copied into the
    device pool straight from them: a fresh engine loads what another wrote, answers with the
    same greedy tokens, and every host row it pinned for a copy is unpinned afterwards."""
    root = tmp_path / "kv"
    start_store(root)
    cfg = engine_config(llama_dir, root, device="cuda")
    prompts = [prompt_ids(16 * n + 1, seed=40 + n) for n in (3, 10, 21)]
    eng = engines(cfg)
    ref = [eng.generate([p], greedy(5))[0] for p in prompts]
    wait_for(lambda: len(store_keys()) == 2 * (3 + 10 + 21), 60, "the pages in the store")
    fresh = engines(cfg)
    outs = fresh.generate(prompts, greedy(5))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert [o.cached_tokens for o in outs] == [48, 160, 336]
    fresh.generate([prompt_ids(40, seed=49)], greedy(2))  # a step after the loads' copies ran

    def unpinned():
        ranks = kv_store_stats(fresh)["ranks"]
        return bool(ranks) and ranks[0]["host"]["pinned_rows"] == 0 and ranks[0]["offload_pages_loaded"] == 34

    wait_for(unpinned, 30, "the host rows unpinned")
    fresh.scheduler.check_integrity()


@pytest.mark.slow
def test_killed_store_comes_back_and_serves_its_pages_from_disk(no_store_after, tmp_path, llama_dir):
    """The store actor killed under a serving cluster: requests go on without it, the
    supervisor starts it again on its directory, and a replica that never saw the prompt
    loads the pages the dead store had written to its files."""
    from cluster.api.metrics import ServerMetrics
    from cluster.launch import ClusterOptions, ServingCluster
    from cluster.router import RouterOptions
    from cluster.supervisor import ReplicaSupervisor
    from kvstore.actor import lookup_store

    cfg = engine_config(llama_dir, tmp_path / "kv")
    cluster = ServingCluster(ClusterOptions(engine=cfg, replicas=2, namespace=NS,
                                            router=RouterOptions(policy="round_robin", stats_interval_s=0.2)),
                             ServerMetrics())
    router = cluster.start()
    prompt = prompt_ids(201, seed=5)  # 12 whole pages
    short = [prompt_ids(9, seed=s) for s in (6, 7)]  # no whole page: they never touch the store

    async def collect(p):
        outs = [o async for o in router.generate_stream(p, greedy())]
        return outs[-1], [t for o in outs for t in o.delta_token_ids]

    async def scenario():
        await router.start()
        supervisor = ReplicaSupervisor(cluster, interval_s=0.2)
        await supervisor.start()
        try:
            a, a_tokens = await collect(prompt)  # replica A prefills and writes 12 pages
            await asyncio.to_thread(wait_for, lambda: len(store_keys()) >= 12, 60, "A's pages in the store")
            await asyncio.to_thread(lambda: ray.get(lookup_store().flush.remote()))  # ... onto disk
            await asyncio.to_thread(kill_store)
            served = [await collect(p) for p in short]  # B, then A: no store, still served
            await asyncio.to_thread(wait_for, lambda: supervisor.stats.store_restarts == 1, 60, "the store back")
            b, b_tokens = await collect(prompt)  # replica B: from the restarted store's files
            return a, a_tokens, served, b, b_tokens, supervisor.stats
        finally:
            await supervisor.aclose()

    try:
        a, a_tokens, served, b, b_tokens, stats = asyncio.run(scenario())
        assert [o.finish_reason for o, _ in served] == ["length", "length"]
        assert a.replica != b.replica and b_tokens == a_tokens
        assert b.cached_tokens == 192  # 12 pages loaded, not computed
        assert any("KV store died" in e for e in stats.events)
    finally:
        asyncio.run(router.aclose())
        cluster.shutdown()


@pytest.mark.slow
def test_default_policy_writes_at_eviction_and_shutdown_not_per_request(engines, tmp_path, llama_dir):
    """write_back_selective (the default): one-off prompts the GPU cache holds cost the store
    nothing while they run; at shutdown the replica saves what it caches, and a replica started
    afresh loads those prefixes instead of computing them, with the same greedy output. (It is
    asked once its host tier has warmed: a request that comes while the warm is under way
    loads the part the warm has reached and computes the rest, by design, so the count of pages
    loaded would depend on the warm's progress.)"""
    start_store(tmp_path / "kv")
    cfg = engine_config(llama_dir, tmp_path / "kv", kv_write_policy="write_back_selective")
    prompts = [prompt_ids(161, seed=s) for s in (40, 41, 42)]  # prompt[:-1]: 10 whole pages each
    first = engines(cfg)
    ref = first.generate(prompts, greedy(4))
    time.sleep(1.0)
    assert store_keys() == [] and first.kv_offload.stats.saved_pages == 0
    first.shutdown()  # the drain: every cached page, prompt pages first
    assert first.kv_offload.stats.drained_pages >= 3 * 10
    keys = store_keys()
    assert len(keys) >= 2 * 3 * 10  # MHA: a K and a V key per page
    again = engines(cfg)
    wait_for(lambda: bool(kv_store_stats(again)["ranks"]) and kv_store_stats(again)["ranks"][0]["offload_warming"] == 0,
             60, "the host tier warmed")
    while again.has_work():  # the empty plans that bring the scheduler what the rank warmed
        again.step()
    outs = again.generate(prompts, greedy(4))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert again.kv_offload.stats.hit_pages == 3 * 10
    assert all(o.cached_tokens == 160 for o in outs)


def test_a_restarted_replica_warms_its_host_tier_and_admits_from_it_at_once(engines, tmp_path, llama_dir):
    """Stopped and started again (the store too: its pages only on file), a replica reads the
    store's pages of its model into its host tier before anyone asks, and the idle scheduler
    learns of them from empty plans while the rank says it warms; the same prompts are then
    admitted at once with loads from the host rows (no store prefetch) and answer as before."""
    root = tmp_path / "kv"
    start_store(root)
    cfg = engine_config(llama_dir, root, kv_write_policy="write_back_selective", kv_host_cache_gb=0.01)
    prompts = [prompt_ids(161, seed=s) for s in (60, 61, 62)]  # prompt[:-1]: 10 whole pages each
    first = engines(cfg)
    ref = first.generate(prompts, greedy(4))
    first.shutdown()  # the drain saves what the GPU cache holds
    pages = len(store_keys()) // 2  # MHA: a K and a V key per page
    assert pages >= 3 * 10
    from kvstore.actor import lookup_store

    ray.get(lookup_store().flush.remote())
    kill_store()
    start_store(root)  # its index (and the pages' model tags) rebuilt from the files
    again = engines(cfg)

    def warmed():
        ranks = kv_store_stats(again)["ranks"]
        return bool(ranks) and ranks[0]["offload_warming"] == 0 and ranks[0]["offload_warm_pages"] == pages

    wait_for(warmed, 60, "the host tier warmed")
    assert again.has_work()  # idle, yet an empty plan is due: it brings what the rank warmed
    while again.has_work():
        again.step()
    assert len(again.kv_offload.host.keys) == pages and not again.has_work()  # and no more polls
    outs = again.generate(prompts, greedy(4))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert [o.cached_tokens for o in outs] == [160] * 3
    assert again.kv_offload.stats.host_admissions == 3 and again.kv_offload.stats.hit_pages == 30
    assert again.kv_offload.probe.counters.errors == 0  # a lookup a host admission made moot is no error
    ranks = kv_store_stats(again)["ranks"]
    assert ranks[0]["offload_prefetched_pages"] == 0  # nothing was read on a request's behalf
    again.scheduler.check_integrity()
    cold = engines(engine_config(llama_dir, root, kv_host_warm=False))  # --no-kv-host-warm
    wait_for(lambda: bool(kv_store_stats(cold)["ranks"]), 30, "the ranks' stats")
    assert "offload_warm_pages" not in kv_store_stats(cold)["ranks"][0]


@pytest.mark.slow
def test_store_killed_with_sigkill_under_load_is_back_within_seconds(no_store_after, tmp_path, llama_dir):
    """kill -9 of the store's process while requests stream: none of them fails, Ray starts the
    store again on its directory, and within 10 s of the kill a replica that never saw a prompt
    loads its pages from the new store (a hit); the metrics never report the dead store's bytes."""
    import os
    import signal

    from cluster.api.metrics import ServerMetrics
    from cluster.launch import ClusterOptions, ServingCluster
    from cluster.router import RouterOptions
    from cluster.supervisor import ReplicaSupervisor
    from kvstore.actor import lookup_store

    cfg = engine_config(llama_dir, tmp_path / "kv")
    metrics = ServerMetrics()
    cluster = ServingCluster(ClusterOptions(engine=cfg, replicas=2, namespace=NS,
                                            router=RouterOptions(policy="round_robin", stats_interval_s=0.2)),
                             metrics)
    router = cluster.start()
    prompts = [prompt_ids(201, seed=s) for s in (8, 9, 10, 11)]  # 12 whole pages each

    async def collect(p, n=6):
        outs = [o async for o in router.generate_stream(p, greedy(n))]
        return outs[-1], [t for o in outs for t in o.delta_token_ids]

    async def scenario():
        await router.start()
        supervisor = ReplicaSupervisor(cluster, interval_s=0.2)
        await supervisor.start()
        try:
            first = [await collect(p) for p in prompts]  # prefilled (both replicas) and written
            await asyncio.to_thread(wait_for, lambda: len(store_keys()) >= 4 * 2 * 12, 60, "the pages in the store")
            store = lookup_store()
            await asyncio.to_thread(lambda: ray.get(store.flush.remote()))
            old_pid = ray.get(store.info.remote())["pid"]
            load = [asyncio.create_task(collect(prompt_ids(40, seed=100 + i), 24)) for i in range(8)]
            await asyncio.sleep(0.3)
            os.kill(old_pid, signal.SIGKILL)
            t0 = time.monotonic()

            def back() -> bool:
                try:
                    return ray.get(lookup_store().info.remote(), timeout=2)["pid"] != old_pid
                except Exception:
                    return False

            await asyncio.to_thread(wait_for, back, BACK_S, "a new store process")
            # Each prompt again, on the replica that did not compute it: a hit once the new
            # store answers (lookups pause briefly after the failures of the outage).
            hit = None
            for (a, a_tokens), p in zip(first, prompts):
                while hit is None and time.monotonic() - t0 < BACK_S:
                    out, toks = await collect(p)
                    if out.replica != a.replica:
                        if out.cached_tokens == 192:
                            hit = (out, toks, a_tokens)
                        break
            took = time.monotonic() - t0
            loaded = await asyncio.gather(*load)
            # The live store's usage is reported again: each replica polls it in the background
            # and the router copies what replicas report into the metrics, so wait here, while
            # the router's poll loop runs (asyncio.run cancels it when the scenario returns).
            await asyncio.to_thread(wait_for, lambda: 'manta:kvstore_usage_bytes{tier="file"}' in
                                    metrics.render().decode(), 45, "the new store's usage in the metrics")
            return hit, took, loaded
        finally:
            await supervisor.aclose()

    try:
        hit, took, loaded = asyncio.run(scenario())
        assert [o.finish_reason for o, _ in loaded] == ["length"] * 8  # nothing failed
        assert hit is not None, f"no store hit within {BACK_S} s of the kill"
        print(f"a store hit {took:.1f} s after the kill")
        assert hit[1] == hit[2] and took < BACK_S, took  # the same tokens as computed
    finally:
        asyncio.run(router.aclose())
        cluster.shutdown()


def test_store_usage_metric_is_what_a_replica_last_reached():
    """Two replicas poll the one store on their own: one's failed poll (None) does not hide the
    usage the other just read; once no replica reaches the store its bytes are not reported."""
    from cluster.api.metrics import ServerMetrics

    def usage(metrics) -> list[str]:
        return [line for line in metrics.render().decode().splitlines()
                if line.startswith('manta:kvstore_usage_bytes{tier="file"}')]

    live = {"ram_used_bytes": 1, "file_used_bytes": 4096, "file_write_errors": 0}
    metrics = ServerMetrics()
    metrics.update_replica_stats("r0", {"kvstore": {"store": live}})
    metrics.update_replica_stats("r1", {"kvstore": {"store": None}})  # r1's poll timed out
    assert usage(metrics) == ['manta:kvstore_usage_bytes{tier="file"} 4096.0']
    metrics.update_replica_stats("r0", {"kvstore": {"store": None}})  # the store died
    assert usage(metrics) == []
    metrics.update_replica_stats("r1", {"kvstore": {"store": {**live, "file_used_bytes": 8192}}})  # restarted
    metrics.update_replica_stats("r0", {"kvstore": {"store": None}})
    assert usage(metrics) == ['manta:kvstore_usage_bytes{tier="file"} 8192.0']
    metrics.remove_replica("r1")
    assert usage(metrics) == []


@pytest.mark.slow
def test_a_failing_disk_never_stops_serving(engines, tmp_path, llama_dir, small_fs):
    """The store's files on a small filesystem that then fails (remounted read-only): every
    request is answered exactly as without a store, the failed file writes are counted (by op,
    in what the replica reports for /metrics), and the store serves on from RAM."""
    import subprocess

    prompts = [prompt_ids(161, seed=s) for s in (30, 31, 32, 33)]
    ref = engines(engine_config(llama_dir, None, kv_store=None)).generate(prompts, greedy(4))
    start_store(small_fs / "kv", ram_bytes=32 << 10, file_bytes=16 << 30, slot_bytes=4096)
    eng = engines(engine_config(llama_dir, small_fs / "kv"))
    assert eng.generate(prompts[:2], greedy(4))[0].token_ids == ref[0].token_ids
    # Linux refuses a read-only remount while a file is open for writing ("mount point is busy"):
    # the store's file writes run in the background, so the remount waits for a moment between them.
    deadline = time.monotonic() + 30
    while (r := subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], capture_output=True, text=True)).returncode:
        assert "busy" in r.stderr and time.monotonic() < deadline, r.stderr
        time.sleep(0.05)
    try:
        outs = eng.generate(prompts[2:], greedy(4))
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref[2:]]
        from kvstore.actor import lookup_store

        # A page reaches the files only when the store writes its RAM pages out; keep new pages
        # coming (each prompt's own, answered exactly as without a store) until one write fails.
        more = iter(range(40, 100))

        def failed_write() -> bool:
            if ray.get(lookup_store().stats.remote())["file"]["write_errors"] >= 1:
                return True
            p = prompt_ids(161, seed=next(more))
            assert eng.generate([p], greedy(2))[0].finish_reason == "length"
            return False

        wait_for(failed_write, 60, "a failed write")
        st = ray.get(lookup_store().stats.remote())
        assert st["counters"]["file_write_errors"] == st["file"]["write_errors"]
        wait_for(lambda: (kv_store_stats(eng)["store"] or {}).get("file_write_errors", 0) >= 1, 15,
                 "the failed writes in the replica's report")
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], check=True)


@ray.remote(num_cpus=0)
class HungStore:
    """A store that answers nothing in time."""

    def _hang(self, *args):
        time.sleep(30)

    register_client = exists = batch_exists_prefix = reserve = locate = commit = stats = info = _hang


@pytest.mark.slow
def test_dead_hung_or_full_store_never_stops_serving(engines, tmp_path, llama_dir):
    """A full store refuses writes, a dead one is gone, a hung one never answers: every request
    still answers exactly as without a store, in bounded time, and the refusals (dropped pages,
    not errors) and the errors are counted."""
    from kvstore.messages import STORE_NAME

    prompts = [prompt_ids(161, seed=s) for s in (20, 21, 22, 23)]
    ref = engines(engine_config(llama_dir, None, kv_store=None)).generate(prompts, greedy(4))
    cfg = engine_config(llama_dir, tmp_path / "kv")

    def errors(eng) -> int:  # the scheduler's probe and the rank's client and host tier
        return eng.kv_offload.probe.counters.errors + eng.workers.runner.kv_offload.stats()["errors"]

    # Full: the RAM tier is smaller than one page key, so every write is refused.
    start_store(tmp_path / "kv", ram_bytes=1024, slot_bytes=1024)
    eng = engines(cfg)
    assert eng.generate([prompts[0]], greedy(4))[0].token_ids == ref[0].token_ids
    wait_for(lambda: eng.workers.runner.kv_offload.stats()["pages_refused"] > 0, 30, "a refused write counted")
    assert eng.workers.runner.kv_offload.stats()["errors"] == 0
    assert ray.get(ray.get_actor(STORE_NAME).stats.remote())["counters"]["refused_full"] > 0

    # Dead: misses at once; the failed probe pauses probing.
    kill_store()
    t0 = time.monotonic()
    assert eng.generate([prompts[1]], greedy(4))[0].token_ids == ref[1].token_ids
    assert time.monotonic() - t0 < 10
    # (the probe's error may come after the request was admitted without its answer)
    wait_for(lambda: eng.kv_offload.probe.counters.errors >= 1 and errors(eng) >= 1, 10, "the failed probe counted")
    # The replica's report (what the metrics export) catches up with them in the background.
    wait_for(lambda: kv_store_stats(eng)["errors"] >= 1, 10, "the errors in the report")

    # Hung: the probe times out once, then probing pauses; writes time out on the I/O thread.
    hung = HungStore.options(name=STORE_NAME, namespace=NS).remote()
    try:
        eng2 = engines(cfg)
        eng2.kv_offload.probe.link.timeout_s = 0.5
        t0 = time.monotonic()
        outs = eng2.generate(prompts[2:], greedy(4))
        assert time.monotonic() - t0 < 15
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref[2:]]
        assert eng2.kv_offload.stats.hit_pages == 0 and eng2.kv_offload.probe.counters.errors >= 1
    finally:
        ray.kill(hung)


def test_a_lookup_abandoned_then_failed_counts_and_drops_the_dead_store(ray_local):
    """A request admitted before its store lookup answered abandons the lookup; when the store
    then dies, the failure still counts as an error (it is what the metrics show) and the dead
    handle is dropped, so the next lookup finds the store by name again."""
    from kvstore.probe import StoreProbe

    hung = HungStore.options(namespace=NS).remote()
    probe = StoreProbe(hung, "mha", 1, namespace=NS)
    pending = probe.start(chain_keys(list(range(64)), 16, "fp", "mha"))
    assert not pending.done()
    pending.abandon()
    assert probe.counters.errors == 0
    ray.kill(hung)
    wait_for(lambda: probe.counters.errors == 1, 10, "the abandoned lookup's failure counted")
    assert probe.link.store is None


# ------------------------------------------------------------------------------------------------
# A PD hand-off's save may be copied beside the step in flight only when no plan still in flight
# writes its pages (`KVSave.settled`, workers/kv_offload.py `_copy_out`).
# ------------------------------------------------------------------------------------------------


def handoff_saves(eng) -> list:
    """Record every plan's hand-off saves (host only) as the engine schedules them."""
    seen, schedule = [], eng.scheduler.schedule

    def recording():
        plan = schedule()
        if plan is not None:
            seen.extend(s for s in plan.kv_saves if not s.store)
        return plan

    eng.scheduler.schedule = recording
    return seen


def test_a_finished_prefill_is_settled_an_aborted_one_is_not(engines, tmp_path, llama_dir):
    root = tmp_path / "kv"
    start_store(root)
    eng = engines(engine_config(llama_dir, root, chunked_prefill_size=2 * PAGE, max_num_batched_tokens=2 * PAGE))
    assert eng.overlap  # (else nothing is ever in flight and every hand-off is settled)
    saves = handoff_saves(eng)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    done = []
    eng.add_request(prompt_ids(5 * PAGE + 3, seed=1), one, done.append, hand_off=True)
    while eng.has_work():
        eng.step()
    assert done[-1].finished and len(saves) == 1 and saves[0].settled and len(saves[0].page_ids) == 5

    rid = eng.add_request(prompt_ids(9 * PAGE + 3, seed=2), one, done.append, hand_off=True)
    req = eng.scheduler.requests[rid]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # until a piece of it is in flight past one whose result was read
        if not eng.step():
            time.sleep(0.01)  # (its admission waits on the store's answer)
        if req.last_step > eng.scheduler.done_step and req.num_computed >= 4 * PAGE:
            break
    assert req.last_step > eng.scheduler.done_step and eng._inflight
    eng.abort(rid)
    while eng.has_work():
        eng.step()
    assert len(saves) == 2 and not saves[1].settled  # a piece of it was in flight at the abort
    eng.scheduler.check_integrity()
