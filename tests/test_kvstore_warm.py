"""A TP=2 replica started again on a store that outlived it warms both ranks' host tiers
(real Ray rank actors, real NIXL): the first rank reports a warmed page only once every rank
holds it (`workers.host_warm.WarmAgreement`), so the replayed prompts are admitted at once from
the host rows and no load comes back short. The TP=1 case, and the warm's own rules, are in
tests/test_kvstore_serving.py."""

from __future__ import annotations

import pytest
import ray

from cluster.kv_store_setup import kv_store_stats
from tests.test_kvstore_serving import (  # noqa: F401 - fixtures
    PAGE,
    engine_config,
    greedy,
    kill_store,
    llama_dir,
    mla_dir,
    no_store_after,
    prompt_ids,
    ray_local,
    start_store,
    store_keys,
    wait_for,
)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["mha", "mla"])
def test_tp2_ranks_warm_and_admit_only_what_both_hold(no_store_after, tmp_path, llama_dir, mla_dir, layout):  # noqa: F811
    from cluster.engine.loop import Engine
    from cluster.engine.ranks import runner_options
    from kvstore.actor import lookup_store
    from workers.ray_group import RayWorkerGroup

    root = tmp_path / "kv"
    start_store(root)
    cfg = engine_config(mla_dir if layout == "mla" else llama_dir, root, tp_size=2, kv_host_cache_gb=0.01,
                        kv_write_policy="write_back_selective")
    prompts = [prompt_ids(161, seed=s) for s in (70, 71, 72)]  # prompt[:-1]: 10 whole pages each

    def serve(name: str):
        group = RayWorkerGroup(runner_options(cfg), 2, name=name)
        return group, Engine(cfg, workers=group)

    group, first = serve(f"warm-{layout}-a")
    try:
        ref = first.generate(prompts, greedy(4))
        first.shutdown()  # the drain saves what the GPU cache holds
    finally:
        group.shutdown()
    ray.get(lookup_store().flush.remote())
    kill_store()
    start_store(root)
    group, again = serve(f"warm-{layout}-b")
    try:
        keys_per_page = 1 if layout == "mla" else 4  # MHA: K and V of each rank
        pages = len(store_keys()) // keys_per_page
        assert pages >= 3 * 10

        def warmed():
            ranks = kv_store_stats(again)["ranks"]
            return len(ranks) == 2 and all(r["offload_warming"] == 0 and r["offload_warm_pages"] == pages
                                           for r in ranks)

        wait_for(warmed, 60, "both ranks' host tiers warmed")
        wait_for(lambda: again.step() is not None and len(again.kv_offload.host.keys) == pages, 30,
                 "the agreed pages in the scheduler's picture")
        outs = again.generate(prompts, greedy(4))
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
        assert [o.cached_tokens for o in outs] == [10 * PAGE] * 3
        stats = again.kv_offload.stats
        assert (stats.host_admissions, stats.hit_pages, stats.short_loads) == (3, 30, 0), stats
        again.scheduler.check_integrity()
    finally:
        again.shutdown()
        group.shutdown()
