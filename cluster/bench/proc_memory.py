"""The memory of a process tree, from /proc (Linux): a server and everything under it, split into
Ray workers (`ray::...` process titles: replicas, ranks, the KV store) and Ray's own daemons."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def _kind(title: str) -> str:
    """What a process under the server is: "ray::Replica", "ray::RankWorker", "ray::IDLE",
    "raylet", "gcs_server", ... (a Ray worker's title also names its current task: dropped)."""
    if title.startswith("ray::"):
        return title.split(".", 1)[0].split(" ", 1)[0]
    return os.path.basename(title.split(" ", 1)[0]) or "?"


def tree_memory(pid: int) -> dict:
    """RSS in MiB of `pid` ("server"), of the Ray workers under it ("ray_workers", by process
    title "ray::..."), of the other processes under it ("ray_daemons"), the process counts, and
    the RSS by kind of process ("by_kind")."""
    kids = _children()
    server = _rss_bytes(pid)
    workers = daemons = 0
    n_workers = n_daemons = 0
    by_kind: Counter[str] = Counter()
    stack = list(kids.get(pid, []))
    while stack:
        p = stack.pop()
        stack.extend(kids.get(p, []))
        rss = _rss_bytes(p)
        title = _title(p)
        by_kind[_kind(title)] += rss
        if title.startswith("ray::"):
            workers, n_workers = workers + rss, n_workers + 1
        else:
            daemons, n_daemons = daemons + rss, n_daemons + 1
    mib = 1 / 2**20
    return {"server_mib": server * mib, "ray_workers_mib": workers * mib, "ray_daemons_mib": daemons * mib,
            "total_mib": (server + workers + daemons) * mib, "ray_workers": n_workers, "ray_daemons": n_daemons,
            "by_kind": {k: round(v * mib, 1) for k, v in sorted(by_kind.items())}}
