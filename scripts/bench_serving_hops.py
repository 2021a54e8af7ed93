"""What one hop of `manta serve`'s serving path costs with nothing else running: pickling a
step's outputs (200 `RequestOutput`s), and round trips to a replica process awaited from asyncio
as the HTTP server makes them: the serving channel (`cluster/replica_channel.py`, what
`cluster/replica_client.py` uses) against a threaded Ray actor's call (what it used before).

    python3 scripts/bench_serving_hops.py [--outputs 200] [--calls 200]
"""

from __future__ import annotations

import argparse
import asyncio
import pickle
import statistics
import time

import ray

from cluster.engine.request import RequestOutput
from cluster.replica import Admission
from workers.sampling_params import SamplingParams


def _outputs(rids: list[str]) -> list[RequestOutput]:
    return [RequestOutput(rid, delta_text="ab", delta_token_ids=[123], delta_logprobs=[None],
                          prompt_tokens=1024, completion_tokens=i, replica="replica-0") for i, rid in enumerate(rids)]


class Scripted:
    """A replica process with the real serving channel and no engine: each admission is queued
    and answered at once, and its first output is handed to the outbox with it (as a step would)."""

    def __init__(self):
        from cluster.replica_channel import Outboxes, ServingListener

        self.outboxes = Outboxes("bench")
        self.listener = None
        self._listener_cls = ServingListener

    def serving_channel(self):
        if self.listener is None:
            self.listener = self._listener_cls("127.0.0.1", self.outboxes, self.submit, lambda rid: None)
        return (*self.listener.address, self.listener.token)

    def submit(self, client, adds, aborts):
        for adm in adds:
            self.outboxes.own(adm.rid, client)
        if adds:
            self.outboxes.put(_outputs([a.rid for a in adds]))
        return [None] * len(adds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--outputs", type=int, default=200, help="outputs in one frame (running requests)")
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    outs = _outputs([f"cmpl-{i:032x}" for i in range(args.outputs)])
    adm = Admission("cmpl-x", list(range(1024)), SamplingParams(max_tokens=1024))
    reps = 100
    t0 = time.perf_counter()
    for _ in range(reps):
        blob = pickle.dumps(outs, protocol=5)
    t1 = time.perf_counter()
    for _ in range(reps):
        pickle.loads(blob)
    t2 = time.perf_counter()
    print(f"pickle {args.outputs} outputs: {(t1 - t0) / reps * 1e3:.2f} ms, unpickle {(t2 - t1) / reps * 1e3:.2f} ms, "
          f"{len(blob)} bytes")

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    actor = ray.remote(max_concurrency=4)(Scripted).remote()
    ray.get(actor.serving_channel.remote())

    async def rounds() -> None:
        from cluster.replica_client import ReplicaClient

        client = ReplicaClient("bench", actor)
        warm = client.open("warm", [1], SamplingParams())
        await anext(warm)

        async def one_admission(i: int) -> None:  # queued, and its first output back
            stream = client.open(f"a{i}", adm.prompt_ids, adm.params)
            async for _ in stream:
                if not stream.started:
                    continue
                break

        async def burst(i: int) -> None:  # one frame of N admissions, their N outputs in one frame back
            streams = [client.open(f"b{i}-{k}", [1], adm.params) for k in range(args.outputs)]
            for s in streams:
                async for _ in s:
                    if s.started:
                        break

        for name, call in (("Ray actor call, one 1,024-token admission", lambda i: actor.submit.remote("c", [adm], [])),
                           ("channel: one 1,024-token admission to its first output", one_admission),
                           (f"channel: {args.outputs} admissions to their {args.outputs} outputs", burst)):
            ms = []
            for i in range(args.calls):
                t = time.perf_counter()
                await call(i)
                ms.append((time.perf_counter() - t) * 1e3)
            print(f"{name}: p50 {statistics.median(ms):.2f} ms, mean {statistics.mean(ms):.2f} ms")
        await client.aclose()

    asyncio.run(rounds())
    ray.shutdown()


if __name__ == "__main__":
    main()
