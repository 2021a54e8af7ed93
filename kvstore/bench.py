"""Micro-benchmark of the KV store data path: set/get bandwidth of N pages of S bytes.

    python -m kvstore.bench --pages 256 --page-bytes 1048576

Runs a client in this process against a store actor (a fresh one under a temporary directory
unless `store` is given). Pages are MLA-layout (one key each), so the numbers are per key.
Measured: batch_set (copy into staging, crc32, reserve, NIXL WRITE over UCX, commit), batch_get
from RAM (locate, NIXL READ, crc32, copy out), the same straight from registered host rows as a
rank's host tier moves them (write_rows/read_rows: no staging copy) and, after a flush and a store restart, batch_get
from the file tier (POSIX read into the store's RAM first).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import torch

from kvstore.actor import get_or_create_store
from kvstore.client import KVStoreClient
from kvstore.keys import chain_keys, model_fingerprint


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6 if seconds > 0 else float("inf")


def bench_store(num_pages: int = 256, page_bytes: int = 1 << 20, batch_pages: int = 32,
                store=None, root: str | None = None, repeats: int = 3, file_tier: bool = True,
                print_table: bool = True, store_name: str | None = None) -> dict:
    """Set/get bandwidth in MB/s (best of `repeats`); returns a dict of the results.

    store: an existing store actor (its `store_name` for re-lookup); None starts a private one
    under `root` (a temporary directory by default), which also measures file-tier reads."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", include_dashboard=False)
    own_root = None
    name = store_name or f"manta-kvstore-bench-{time.monotonic_ns()}"
    if store is None:
        own_root = root or tempfile.mkdtemp(prefix="manta-kvbench-")
        ram = max(2 * num_pages * page_bytes, 64 << 20)
        store = get_or_create_store(own_root, name=name, ram_bytes=ram, file_bytes=4 * ram,
                                    slot_bytes=min(page_bytes, 1 << 20), flush_interval_s=None)
    ray.get(store.info.remote())  # started: its start-up is not part of the numbers
    fp = model_fingerprint({"bench": page_bytes}, "uint8", 1, 1, "mla")
    client = KVStoreClient(store, "mla", 0, 1, page_bytes, fp, staging_pages=batch_pages,
                           timeout_s=30.0, store_name=name, retry_interval_s=0.0)
    warm = chain_keys([-1], 1, fp, "mla")  # registration and the UCX connection, untimed
    client.batch_set(warm, [[torch.zeros(page_bytes, dtype=torch.uint8)]])
    pages = [[torch.randint(0, 255, (page_bytes,), dtype=torch.uint8)] for _ in range(num_pages)]
    outs = [[torch.empty(page_bytes, dtype=torch.uint8)] for _ in range(num_pages)]
    total = num_pages * page_bytes
    results: dict = {"pages": num_pages, "page_bytes": page_bytes, "batch_pages": batch_pages,
                     "path": "UCX DRAM<->DRAM (client staging <-> store RAM tier)"}
    try:
        best_set = best_get = float("inf")
        for r in range(repeats):
            if own_root is not None:
                ray.get(store.clear.remote())  # every round writes into RAM without evictions
            chain = chain_keys(list(range(r * num_pages, (r + 1) * num_pages)), 1, fp, "mla")
            t0 = time.perf_counter()
            ok = client.batch_set(chain, pages)
            best_set = min(best_set, time.perf_counter() - t0)
            t0 = time.perf_counter()
            got = client.batch_get(chain, outs)
            best_get = min(best_get, time.perf_counter() - t0)
            if not ok or got != num_pages or not torch.equal(outs[-1][0], pages[-1][0]):
                raise RuntimeError(f"bench round trip failed: set {ok}, got {got}/{num_pages}")
        results["set_MBps"] = _rate(total, best_set)
        results["get_ram_MBps"] = _rate(total, best_get)
        # The rank's path: straight between registered host rows (its host tier) and the store.
        rows = torch.cat([p[0] for p in pages]).view(num_pages, page_bytes)
        rows = rows.pin_memory() if torch.cuda.is_available() else rows.clone()
        if client.register_rows(rows):
            best_set = best_get = float("inf")
            for r in range(repeats):
                if own_root is not None:
                    ray.get(store.clear.remote())
                chain = chain_keys(list(range((r + 10) * num_pages, (r + 11) * num_pages)), 1, fp, "mla")
                t0 = time.perf_counter()
                ok = client.write_rows(chain, list(rows), [page_bytes])
                best_set = min(best_set, time.perf_counter() - t0)
                t0 = time.perf_counter()
                got = client.read_rows(chain, list(rows), [page_bytes])
                best_get = min(best_get, time.perf_counter() - t0)
                if not ok or got != num_pages:
                    raise RuntimeError(f"bench row round trip failed: set {ok}, got {got}/{num_pages}")
            results["set_rows_MBps"] = _rate(total, best_set)
            results["get_rows_MBps"] = _rate(total, best_get)
        if file_tier and own_root is not None:
            ray.get(store.flush.remote())
            ray.kill(store)
            time.sleep(0.5)
            store = get_or_create_store(own_root, name=name, ram_bytes=max(2 * total, 64 << 20),
                                        file_bytes=8 * total + (64 << 20),
                                        slot_bytes=min(page_bytes, 1 << 20), flush_interval_s=None)
            ray.get(store.info.remote())  # started (the index is rebuilt in __init__)
            t0 = time.perf_counter()
            got = client.batch_get(chain, outs)
            results["get_file_MBps"] = _rate(total, time.perf_counter() - t0)
            if got != num_pages:
                raise RuntimeError(f"file-tier read got {got}/{num_pages}")
        results["client"] = client.stats()
    finally:
        client.close()
        if own_root is not None:
            ray.kill(store)
            if root is None:
                shutil.rmtree(own_root, ignore_errors=True)
    if print_table:
        print(f"KV store: {num_pages} pages x {page_bytes / 2**10:.0f} KiB, batches of {batch_pages}")
        print(f"{'operation':<24}{'MB/s':>12}")
        for key in ("set_MBps", "get_ram_MBps", "set_rows_MBps", "get_rows_MBps", "get_file_MBps"):
            if key in results:
                print(f"{key.removesuffix('_MBps'):<24}{results[key]:>12.1f}")
    return results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--page-bytes", type=int, default=1 << 20)
    ap.add_argument("--batch-pages", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    bench_store(args.pages, args.page_bytes, args.batch_pages, repeats=args.repeats)


if __name__ == "__main__":
    main()
