"""NIXL READ bandwidth between two processes on this host, host memory to host memory: what a
decode rank pulling a prompt's pages from a prefill rank gets here (workers/kv_peer.py).

    python scripts/nixl_read_bench.py [--mib 256] [--page-kib 2048] [--repeat 5]

Run it under different UCX_TLS settings to see which transport UCX picks and what it moves.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time


def _agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def _target(conn, nbytes: int) -> None:
    """The side that lends its memory (the prefill rank): registers it, progresses UCX."""
    import torch

    agent = _agent("target")
    buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    agent.register_memory(buf)
    conn.send((agent.get_agent_metadata(), buf.data_ptr()))
    while not conn.poll(0.0001):
        agent.get_new_notifs()
    conn.recv()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--page-kib", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    import numpy as np
    import torch

    nbytes, page = args.mib << 20, args.page_kib << 10
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_target, args=(child, nbytes), daemon=True)
    proc.start()
    meta, remote_base = parent.recv()
    agent = _agent("reader")
    local = torch.empty(nbytes, dtype=torch.uint8)
    agent.register_memory(local)
    remote_name = agent.add_remote_agent(meta)
    n = nbytes // page
    lo = np.array([(local.data_ptr() + i * page, page, 0) for i in range(n)], np.uint64)
    re = np.array([(remote_base + i * page, page, 0) for i in range(n)], np.uint64)
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        h = agent.initialize_xfer("READ", agent.get_xfer_descs(lo, "DRAM"), agent.get_xfer_descs(re, "DRAM"),
                                  remote_name)
        state = agent.transfer(h)
        while state == "PROC":
            state = agent.check_xfer_state(h)
        agent.release_xfer_handle(h)
        times.append(time.perf_counter() - t0)
        assert state == "DONE", state
    parent.send("stop")
    best = min(times)
    print(f"READ {args.mib} MiB in {n} descriptors: best {best * 1e3:.1f} ms = {nbytes / best / 1e9:.2f} GB/s "
          f"(first {times[0] * 1e3:.1f} ms, incl. connection set-up)")


if __name__ == "__main__":
    main()
