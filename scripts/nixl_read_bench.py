"""NIXL READ bandwidth between two processes on this host, host memory to host memory or (with
--device cuda) GPU memory to GPU memory: what a decode rank pulling a prompt's pages from a
prefill rank gets here (workers/kv_peer.py).

    python scripts/nixl_read_bench.py [--device cpu|cuda] [--mib 256] [--page-kib 2048] [--repeat 5]
        [--chunk-pages 8 16] [--out F]

Times a hand-off both ways: one READ of every page and then their checksums, and READs of a
chunk of pages at a time with each chunk's checksums computed beside the next READ
(workers/kv_peer.py): `kvstore.transfer.page_sums` on the buffer's device (what the hand-off
uses), and on the host also zlib's crc32 on the checksum threads (what it used before).
On one GPU both processes share it (CUDA IPC); CUDA_VISIBLE_DEVICES=0,1 --target-gpu 1 reads
from a second GPU. Run it under different UCX_TLS settings to see which transport UCX picks.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time


def _agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def _target(conn, nbytes: int, device: str) -> None:
    """The side that lends its memory (the prefill rank): registers it, progresses UCX."""
    import torch

    agent = _agent("target")
    buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8).to(device)
    agent.register_memory(buf)
    conn.send((agent.get_agent_metadata(), buf.data_ptr(), buf.device.index or 0))
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
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where both buffers live")
    ap.add_argument("--target-gpu", type=int, default=0, help="--device cuda: the lending process's GPU")
    ap.add_argument("--out", default=None, help="write the medians as JSON here")
    args = ap.parse_args()
    import json
    import sys
    import zlib
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from kvstore.transfer import checksums, checksums_started, nixl_transfer, page_sums

    nbytes, page = args.mib << 20, args.page_kib << 10
    target_dev = "cpu" if args.device == "cpu" else f"cuda:{args.target_gpu}"
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_target, args=(child, nbytes, target_dev), daemon=True)
    proc.start()
    meta, remote_base, remote_dev = parent.recv()
    agent = _agent("reader")
    local = torch.empty(nbytes, dtype=torch.uint8, device="cpu" if args.device == "cpu" else "cuda:0")
    agent.register_memory(local)
    remote_name = agent.add_remote_agent(meta)
    mem = "DRAM" if args.device == "cpu" else "VRAM"
    n = nbytes // page
    lo = [(local.data_ptr() + i * page, page, 0) for i in range(n)]
    re = [(remote_base + i * page, page, remote_dev) for i in range(n)]
    pages = local.view(n, page)
    views = [pages[i].numpy() for i in range(n)] if args.device == "cpu" else []

    def read(a: int, b: int) -> None:
        assert nixl_transfer(agent, "READ", lo[a:b], re[a:b], remote_name, 30.0, mem) == "done"

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    def whole(crc: bool) -> tuple[float, float]:  # one READ, then every checksum
        t0 = time.perf_counter()
        read(0, n)
        t1 = time.perf_counter()
        checksums(views) if crc else page_sums(pages).tolist()
        return t1 - t0, time.perf_counter() - t1

    def chunked(k: int, crc: bool) -> tuple[float, float]:
        t0, started = time.perf_counter(), []
        for a in range(0, n, k):
            read(a, a + k)
            started += checksums_started(views[a : a + k]) if crc else [page_sums(pages[a : a + k])]
        t1 = time.perf_counter()
        got = [f.result() for f in started] if crc else torch.cat(started).tolist()
        assert not crc or got[0] == zlib.crc32(views[0])
        sync()
        return t1 - t0, time.perf_counter() - t1

    rows = {"one READ, then the page sums": lambda: whole(False)}
    rows.update({f"{k}-page READs, page sums beside": (lambda k=k: chunked(k, False)) for k in args.chunk_pages})
    if args.device == "cpu":
        rows["one READ, then the crc32s"] = lambda: whole(True)
        rows.update({f"{k}-page READs, crc32s beside": (lambda k=k: chunked(k, True)) for k in args.chunk_pages})
    results = {}
    print(f"{args.mib} MiB in {n} pages of {args.page_kib} KiB, median of {args.repeat} (after one untimed run)")
    for name, fn in rows.items():
        fn()
        runs = sorted((fn() for _ in range(args.repeat)), key=sum)
        read_s, after_s = runs[len(runs) // 2]
        results[name] = {"read_ms": 1e3 * read_s, "checksums_after_ms": 1e3 * after_s, "total_ms": 1e3 * (read_s + after_s)}
        print(f"  {name:36s} READ {1e3 * read_s:7.1f} ms  checksums after {1e3 * after_s:6.1f} ms  "
              f"total {1e3 * (read_s + after_s):7.1f} ms ({nbytes / (read_s + after_s) / 1e9:.2f} GB/s)")
    parent.send("stop")
    if args.out:
        Path(args.out).write_text(json.dumps({"mib": args.mib, "page_kib": args.page_kib, "device": args.device,
                                                 "results": results}, indent=1))


if __name__ == "__main__":
    main()
