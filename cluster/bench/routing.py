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
"""

from __future__ import annotations

import asyncio
import random
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
                "requests_by_replica": by_replica, "seconds": self.seconds}


def router_options(policy: str, stats_interval_s: float):
    from cluster.router import RouterOptions

    if policy not in POLICIES:
        raise ValueError(f"routing policy must be one of {POLICIES}, not {policy!r}")
    return RouterOptions(policy="round_robin" if policy == "round_robin" else "cache_aware",
                         kv_events=policy == "events", stats_interval_s=stats_interval_s)


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
                  stats_interval_s: float = 0.5, address: str | None = None) -> dict:
    """policy -> its summary, each policy on a fresh cluster serving the same conversations."""
    from cluster.launch import ClusterOptions, ServingCluster
    from workers.model_config import ModelConfig

    script = workload.script(ModelConfig.from_pretrained(config.model).vocab_size)
    out = {}
    for policy in policies:
        cluster = ServingCluster(ClusterOptions(engine=config, replicas=replicas, address=address,
                                                router=router_options(policy, stats_interval_s),
                                                namespace=f"manta-bench-routing-{policy}"))
        router = cluster.start()

        async def run(router=router) -> PolicyResult:
            await router.start()
            try:
                return await drive(router, script, workload)
            finally:
                await router.aclose()

        try:
            out[policy] = asyncio.run(run()).summary()
        finally:
            cluster.shutdown()
    return out
