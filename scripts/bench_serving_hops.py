"""What one hop of `manta serve`'s serving path costs with nothing else running: pickling a
step's outputs (200 `RequestOutput`s), an admission, and a threaded Ray actor's `submit` and
`poll` round trips awaited from asyncio, as `cluster/replica_client.py` makes them.

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--outputs", type=int, default=200, help="outputs in one poll reply (running requests)")
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    outs = [RequestOutput(f"cmpl-{i:032x}", delta_text="ab", delta_token_ids=[123], delta_logprobs=[None],
                          prompt_tokens=1024, completion_tokens=i, replica="replica-0") for i in range(args.outputs)]
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
    t0 = time.perf_counter()
    for _ in range(reps):
        pickle.loads(pickle.dumps([adm]))
    print(f"one 1,024-token admission, pickle + unpickle: {(time.perf_counter() - t0) / reps * 1e3:.3f} ms")

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

    @ray.remote(max_concurrency=4)
    class Replica:
        def submit(self, client, adds, aborts):
            return [None] * len(adds)

        def poll(self, client, timeout_s):
            return outs

    actor = Replica.remote()
    ray.get(actor.submit.remote("c", [], []))

    async def rounds() -> None:
        for name, call in (("submit, one admission", lambda: actor.submit.remote("c", [adm], [])),
                           (f"poll, {args.outputs} outputs back", lambda: actor.poll.remote("c", 1.0))):
            ms = []
            for _ in range(args.calls):
                t = time.perf_counter()
                await call()
                ms.append((time.perf_counter() - t) * 1e3)
            print(f"{name}: p50 {statistics.median(ms):.2f} ms, mean {statistics.mean(ms):.2f} ms")

    asyncio.run(rounds())
    ray.shutdown()


if __name__ == "__main__":
    main()
