"""`manta serve` as users run it: a child process on a free port, waited for until /health
answers, stopped with SIGTERM; and what its process tree is doing (pids, CPU time)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from cluster.bench.ports import free_port

TICKS = os.sysconf("SC_CLK_TCK")


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS
    except OSError:
        return 0.0


class ServeProcess:
    """`python -m cluster.cli serve --port P *args` with its own cache directory (the embedded
    default keeps its model and KV store there)."""

    def __init__(self, cache_dir: Path, *args: str, env: dict | None = None, ready_timeout_s: float = 240):
        for attempt in range(3):  # another process may still take the port before the server binds it
            try:
                self._start(cache_dir, args, env, ready_timeout_s)
                return
            except RuntimeError:
                if attempt == 2 or "address already in use" not in self.log:
                    raise

    def _start(self, cache_dir: Path, args: tuple[str, ...], env: dict | None, ready_timeout_s: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        full_env = {**os.environ, "MANTA_CACHE_DIR": str(cache_dir), "RAY_ADDRESS": "", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", "--port", str(self.port), *args],
                                     env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log = ""
        deadline = time.monotonic() + ready_timeout_s
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"manta serve did not come up:\n{self.log}")
            time.sleep(0.5)

    def tree(self) -> list[int]:
        return [self.proc.pid, *descendants(self.proc.pid)]

    def manta_pids(self) -> dict[str, int]:
        """The server and every manta actor process of its cluster, by role."""
        out = {"server": self.proc.pid}
        for pid in descendants(self.proc.pid):
            cmd = cmdline(pid)
            for role in ("Replica", "RankWorker", "KVStore"):
                if cmd.startswith(f"ray::{role}"):
                    out[f"{role}-{pid}"] = pid
        return out

    def stop(self, timeout_s: float = 60) -> int:
        """SIGTERM, wait; returns the exit code (kills it past the timeout)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log += self.proc.stdout.read() if self.proc.stdout else ""
        return self.proc.returncode
