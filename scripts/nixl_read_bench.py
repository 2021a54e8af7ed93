"""NIXL READ bandwidth between two processes on this host, host memory to host memory: what a
decode rank pulling a prompt's pages from a prefill rank gets here (workers/kv_peer.py).

    python scripts/nixl_read_bench.py [--mib 256] [--page-kib 2048] [--repeat 5] [--chunk-pages 8 16] [--out F]

Times a hand-off both ways: one READ of every page and then their crc32s, and READs of a chunk
of pages at a time with each chunk's crc32s running beside the next READ (workers/kv_peer.py).
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
    ap.add_argument("--chunk-pages", type=int, nargs="*", default=[8, 16],
                    help="also time a hand-off as workers/kv_peer.py reads it: READs of this many pages, "
                         "each chunk's crc32s on the checksum threads beside the next READ")
    ap.add_argument("--out", default=None, help="write the medians as JSON here")
    args = ap.parse_args()
    import json
    import sys
    import zlib
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from kvstore.transfer import checksums, checksums_started, nixl_transfer

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
    lo = [(local.data_ptr() + i * page, page, 0) for i in range(n)]
    re = [(remote_base + i * page, page, 0) for i in range(n)]
    views = [local[i * page : (i + 1) * page].numpy() for i in range(n)]

    def whole() -> tuple[float, float]:  # one READ, then every checksum
        t0 = time.perf_counter()
        assert nixl_transfer(agent, "READ", lo, re, remote_name, 30.0) == "done"
        t1 = time.perf_counter()
        checksums(views)
        return t1 - t0, time.perf_counter() - t1

    def chunked(k: int) -> tuple[float, float]:
        t0, started = time.perf_counter(), []
        for a in range(0, n, k):
            assert nixl_transfer(agent, "READ", lo[a : a + k], re[a : a + k], remote_name, 30.0) == "done"
            started += checksums_started(views[a : a + k])
        t1 = time.perf_counter()
        got = [f.result() for f in started]
        assert got[0] == zlib.crc32(views[0])
        return t1 - t0, time.perf_counter() - t1

    rows = {"one READ, then the checksums": whole}
    rows.update({f"{k}-page READs, checksums beside": (lambda k=k: chunked(k)) for k in args.chunk_pages})
    results = {}
    print(f"{args.mib} MiB in {n} pages of {args.page_kib} KiB, median of {args.repeat} (after one untimed run)")
    for name, fn in rows.items():
        fn()
        runs = sorted((fn() for _ in range(args.repeat)), key=sum)
        read_s, after_s = runs[len(runs) // 2]
        results[name] = {"read_ms": 1e3 * read_s, "checksums_after_ms": 1e3 * after_s, "total_ms": 1e3 * (read_s + after_s)}
        print(f"  {name:34s} READ {1e3 * read_s:7.1f} ms  checksums after {1e3 * after_s:6.1f} ms  "
              f"total {1e3 * (read_s + after_s):7.1f} ms ({nbytes / (read_s + after_s) / 1e9:.2f} GB/s)")
    parent.send("stop")
    if args.out:
        Path(args.out).write_text(json.dumps({"mib": args.mib, "page_kib": args.page_kib, "results": results}, indent=1))


if __name__ == "__main__":
    main()
