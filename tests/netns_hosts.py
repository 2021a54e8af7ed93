"""Machines for `ray up` on one box: each host is a network namespace behind one bridge, with its
own sshd, its own /root and /tmp (a private mount namespace) and its own process table (a PID
namespace, so that a `ray stop` on one host cannot see, let alone kill, another host's Ray).
The file system is otherwise shared, as on machines installed from one image.

Needs root, iproute2, util-linux's unshare and Debian's openssh-server (scripts/setup.sh
installs it). The hosts have no default route: nothing on them reaches beyond the bridge.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = "/usr/sbin/sshd"
SUBNETS = [f"10.231.{k}" for k in range(256)]  # each Hosts takes a free /24: bridge .1, hosts .2, .3, ...


def missing_tools() -> str | None:
    """Why hosts cannot be built here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "ssh", "ssh-keygen", "rsync", SSHD):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/setup.sh installs openssh-server and rsync)"
    return None


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


@dataclass
class Host:
    name: str  # the network namespace
    ip: str
    home: Path  # what the host sees as /root
    tmp: Path  # what the host sees as /tmp
    sshd: subprocess.Popen | None = None

    def pids(self) -> list[int]:
        """Every process in this host's network namespace."""
        out = _sh("ip", "netns", "pids", self.name, check=False).stdout
        return [int(p) for p in out.split()]

    def processes(self) -> dict[int, str]:
        """pid -> command line of every process on the host but its sshd (listener and
        sessions) and the `unshare` that holds its namespaces."""
        found = {}
        for pid in self.pids():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:
                continue
            if cmd.startswith(("sshd", SSHD, "unshare")):
                continue
            found[pid] = cmd
        return found


class Hosts:
    """`with Hosts(base, 2) as hosts:` two reachable hosts; all gone after the block."""

    def __init__(self, base: Path, count: int):
        self.base = Path(base)
        self.tag = secrets.token_hex(2)
        self.bridge = f"mbr{self.tag}"
        self.key = self.base / "id_ed25519"  # the key `ray up` logs in with
        self.subnet = _free_subnet()
        self.unused_ip = f"{self.subnet}.99"  # on the bridge's subnet, where no host answers
        self.hosts = [Host(f"manta-{self.tag}-{i}", f"{self.subnet}.{i + 2}", self.base / f"host{i}" / "root",
                           self.base / f"host{i}" / "tmp") for i in range(count)]

    def __enter__(self) -> list[Host]:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self.hosts

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key))
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        _sh("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
        for i, h in enumerate(self.hosts):
            outside, inside = f"mv{self.tag}{i}", f"mi{self.tag}{i}"
            _sh("ip", "netns", "add", h.name)
            _sh("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            _sh("ip", "link", "set", outside, "master", self.bridge, "up")
            _sh("ip", "link", "set", inside, "netns", h.name)
            _sh("ip", "-n", h.name, "link", "set", inside, "name", "eth0")
            _sh("ip", "-n", h.name, "addr", "add", f"{h.ip}/24", "dev", "eth0")
            _sh("ip", "-n", h.name, "link", "set", "eth0", "up")
            _sh("ip", "-n", h.name, "link", "set", "lo", "up")
            self._start_sshd(h)
        for h in self.hosts:
            _wait_for_port(h.ip, 22, 30)

    def _start_sshd(self, h: Host) -> None:
        etc = h.home / ".sshd"  # inside the host: /root/.sshd
        for d in (h.home / ".ssh", etc, h.tmp):
            d.mkdir(parents=True, exist_ok=True)
        h.home.chmod(0o700)
        h.tmp.chmod(0o1777)
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(etc / "host_key"))
        (h.home / ".ssh" / "authorized_keys").write_text(self.key.with_suffix(".pub").read_text())
        (etc / "sshd_config").write_text(
            f"ListenAddress {h.ip}\nPort 22\nHostKey /root/.sshd/host_key\nPidFile none\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "UsePAM no\nStrictModes no\nAuthorizedKeysFile /root/.ssh/authorized_keys\nPrintMotd no\n"
            "MaxSessions 64\nMaxStartups 64\nSubsystem sftp internal-sftp\n")
        script = (f"mount --bind {h.home} /root && mount --bind {h.tmp} /tmp && "
                  f"exec {SSHD} -D -e -f /root/.sshd/sshd_config")
        h.sshd = subprocess.Popen(
            ["ip", "netns", "exec", h.name, "unshare", "--mount", "--pid", "--fork", "--mount-proc",
             "--propagation", "private", "--kill-child", "sh", "-c", script],
            stdout=open(self.base / f"{h.name}-sshd.log", "wb"), stderr=subprocess.STDOUT)

    def close(self) -> None:
        """Stop every sshd (the first process of a PID namespace: all of the host's processes die
        with it), then remove the namespaces and the bridge."""
        for h in self.hosts:
            if h.sshd is not None and h.sshd.poll() is None:
                h.sshd.terminate()
                try:
                    h.sshd.wait(10)
                except subprocess.TimeoutExpired:
                    h.sshd.kill()
                    h.sshd.wait(10)
        for h in self.hosts:
            for pid in h.pids():  # a host whose sshd never started may still hold processes
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            _sh("ip", "netns", "delete", h.name, check=False)  # its veth end goes with it
        _sh("ip", "link", "delete", self.bridge, check=False)

    def leftovers(self) -> list[str]:
        """What of these hosts still exists (after close: nothing)."""
        found = []
        names = _sh("ip", "netns", "list", check=False).stdout
        found += [f"netns {h.name}" for h in self.hosts if h.name in names]
        if _sh("ip", "link", "show", self.bridge, check=False).returncode == 0:
            found.append(f"bridge {self.bridge}")
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:
                    continue
                if str(self.base) in cmd or any(h.ip + " " in cmd + " " for h in self.hosts):
                    found.append(f"process {pid}: {cmd.strip()}")
        return found


def _free_subnet() -> str:
    """A /24 that no interface here is on. Hosts left by a run that was killed before its clean-up
    keep their bridge and its route; a new bridge on the same subnet would lose the route to the old
    one, and every connection would reach the old hosts, where no sshd listens (refused)."""
    taken = _sh("ip", "-4", "route", "show", "table", "all").stdout
    for subnet in secrets.SystemRandom().sample(SUBNETS, len(SUBNETS)):
        if f"{subnet}." not in taken:
            return subnet
    raise RuntimeError("every 10.231.x.0/24 is taken: remove the leftover manta-* network namespaces")


def _wait_for_port(ip: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((ip, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
