"""`manta bench routing`: the router's policies on a multi-turn workload with shared system prompts.

For each policy — `round_robin`; `tree` (cache_aware on the router's approximate memory of what
it sent where); `events` (cache_aware on the replicas' KV events, their real prefix caches) — a
fresh cluster of `replicas` replicas on Ray serves the same conversations: C conversations, each
opening with one of G system prompts, T turns each, a turn's prompt being the system prompt, the
turns before it with their answers, and a new user message. Conversations run concurrently (at
most `concurrency` at once), each one's turns in order.

Reported per policy: the prefix-hit rate the engines measured (prompt tokens their prefix caches
served over all prompt tokens: what routing is for), TTFT p50/p90 at the router, and errors.
With KV caches smaller than the conversations' state (`--kv-cache-tokens`) the replicas evict,
which the approximate memory never learns of.

With a KV store (`--kv-store`) an evicted page lives on in the replica's host tier and in the
shared store, and any replica can load a prefix from the store: the hit rate then splits by
where the tokens came from — `gpu_hit_rate` (the replica's prefix cache), `host_hit_rate` (its
ranks' host tier: local, no store read), `store_hit_rate` (read from the shared store, which
every replica can do) — and `local_hit_rate` (GPU + host) is what routing decides. The split
of loaded tokens between host and store is the ranks' own count of pages found in their host
tier against pages read from the store. `--tree-max-tokens` bounds the router's memory per
replica as a deployment's does (200,000 tokens by default, against a GPU cache of ~500,000
tokens and a host tier of millions on an H200 with an 8B model).
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import statistics
import time
from dataclasses import dataclass, field

from cluster.bench.serve import percentile
from cluster.engine.config import EngineConfig

POLICIES = ("round_robin", "tree", "events")


@dataclass(frozen=True)
class Workload:
    conversations: int = 32
    turns: int = 6
    system_prompts: int = 4
    system_len: int = 256
    user_len: int = 32
    output_len: int = 16
    concurrency: int = 8
    seed: int = 0

    def script(self, vocab: int) -> list[tuple[list[int], list[list[int]]]]:
        """Per conversation: (its system prompt, its user messages), the same for every policy."""
        rng = random.Random(self.seed)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(10, vocab) for _ in range(n)]

        systems = [tokens(self.system_len) for _ in range(self.system_prompts)]
        return [(systems[c % len(systems)], [tokens(self.user_len) for _ in range(self.turns)])
                for c in range(self.conversations)]


@dataclass
class Turn:
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float | None
    error: str | None
    replica: str


@dataclass
class PolicyResult:
    turns: list[Turn] = field(default_factory=list)
    seconds: float = 0.0

    tiers: dict | None = None  # {"loaded": prompt tokens loaded, "host": of them found in a host tier}

    def summary(self) -> dict:
        ok = [t for t in self.turns if t.error is None and t.ttft_s is not None]
        ttfts = [t.ttft_s for t in ok]
        prompt = sum(t.prompt_tokens for t in ok)
        by_replica: dict[str, int] = {}
        for t in ok:
            by_replica[t.replica] = by_replica.get(t.replica, 0) + 1
        return {"requests": len(self.turns), "errors": len(self.turns) - len(ok),
                "prompt_tokens": prompt, "cached_tokens": sum(t.cached_tokens for t in ok),
                "hit_rate": sum(t.cached_tokens for t in ok) / prompt if prompt else 0.0,
                "ttft_ms_p50": 1e3 * percentile(ttfts, 0.5), "ttft_ms_p90": 1e3 * percentile(ttfts, 0.9),
                "ttft_ms_mean": 1e3 * statistics.mean(ttfts) if ttfts else float("nan"),
                "requests_by_replica": by_replica, "seconds": self.seconds, **self._tier_rates(ok, prompt)}

    def _tier_rates(self, ok: list[Turn], prompt: int) -> dict:
        if self.tiers is None or not prompt:
            return {}
        cached = sum(t.cached_tokens for t in ok)
        loaded = min(self.tiers["loaded"], cached)
        host = min(self.tiers["host"], loaded)
        return {"gpu_hit_rate": (cached - loaded) / prompt, "host_hit_rate": host / prompt,
                "store_hit_rate": (loaded - host) / prompt, "local_hit_rate": (cached - loaded + host) / prompt}


def router_options(policy: str, stats_interval_s: float, tree_max_tokens: int | None = None):
    from cluster.router import RouterOptions

    if policy not in POLICIES:
        raise ValueError(f"routing policy must be one of {POLICIES}, not {policy!r}")
    extra = {} if tree_max_tokens is None else {"tree_max_tokens": tree_max_tokens}
    return RouterOptions(policy="round_robin" if policy == "round_robin" else "cache_aware",
                         kv_events=policy == "events", stats_interval_s=stats_interval_s, **extra)


async def tier_tokens(router, settle_s: float = 2.5) -> dict | None:
    """Prompt tokens the replicas loaded past their prefix caches, and of them the share their
    ranks found in their own host tier (rather than read from the store), from every replica's
    counters (None without a store). The ranks' counters are polled in the background about
    every second (`cluster/kv_store_setup.py`): read after they settle."""
    await asyncio.sleep(settle_s)
    stats = await asyncio.gather(*(h.actor.stats.remote() for h in router.replicas.values()))
    loaded = host = 0
    for st in stats:
        kv = st.get("kvstore")
        if kv is None:
            return None
        rank0 = next((r for r in kv["ranks"] if r.get("tp_rank", 0) == 0), {})
        found, read = rank0.get("offload_host_hit_pages", 0), rank0.get("offload_prefetched_pages", 0)
        loaded += kv["loaded_tokens"]
        host += round(kv["loaded_tokens"] * found / (found + read)) if found + read else 0
    return {"loaded": loaded, "host": host}


async def drive(router, script: list[tuple[list[int], list[list[int]]]], workload: Workload) -> PolicyResult:
    """Every conversation of `script` through `router`; its turns in order, each prompt the
    conversation so far (with the answers the replicas gave) and the next user message."""
    from workers.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=workload.output_len, temperature=0.0, ignore_eos=True)
    result = PolicyResult()
    gate = asyncio.Semaphore(workload.concurrency)

    async def converse(system: list[int], users: list[list[int]]) -> None:
        async with gate:
            history = list(system)
            for user in users:
                prompt = history + user
                t0, first, answer, cached, error, replica = time.perf_counter(), None, [], 0, None, "?"
                async for out in router.generate_stream(prompt, params):
                    if out.delta_token_ids and first is None:
                        first = time.perf_counter() - t0
                    answer += out.delta_token_ids
                    cached = max(cached, out.cached_tokens)
                    error = out.error or error
                    replica = out.replica
                result.turns.append(Turn(len(prompt), cached, first, error, replica))
                history = prompt + answer

    t0 = time.perf_counter()
    await asyncio.gather(*(converse(system, users) for system, users in script))
    result.seconds = time.perf_counter() - t0
    return result


def bench_routing(config: EngineConfig, replicas: int, policies: list[str], workload: Workload,
                  stats_interval_s: float = 0.5, address: str | None = None,
                  tree_max_tokens: int | None = None) -> dict:
    """policy -> its summary, each policy on a fresh cluster serving the same conversations."""
    from cluster.launch import ClusterOptions, ServingCluster
    from workers.model_config import ModelConfig

    script = workload.script(ModelConfig.from_pretrained(config.model).vocab_size)
    out = {}
    for policy in policies:
        # A store of its own under the given one: none starts with another policy's pages.
        engine = config if config.kv_store is None else config.replace(kv_store=f"{config.kv_store}/{policy}")
        kept = engine.kv_store is not None and os.path.exists(engine.kv_store)  # not the bench's to remove
        cluster = ServingCluster(ClusterOptions(engine=engine, replicas=replicas, address=address,
                                                router=router_options(policy, stats_interval_s, tree_max_tokens),
                                                namespace=f"manta-bench-routing-{policy}"))
        router = cluster.start()

        async def run(router=router) -> PolicyResult:
            await router.start()
            try:
                res = await drive(router, script, workload)
                if config.kv_store is not None:
                    res.tiers = await tier_tokens(router)
                return res
            finally:
                await router.aclose()

        try:
            out[policy] = asyncio.run(run()).summary()
        finally:
            cluster.shutdown()
            if engine.kv_store is not None and not kept:  # the next policy's store gets the disk
                shutil.rmtree(engine.kv_store, ignore_errors=True)
    return out
