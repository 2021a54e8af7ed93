"""`ray up` for real: two hosts on this machine (tests/netns_hosts.py: network namespaces behind
a bridge, each with its own sshd, /root, /tmp and process table, no route out), a cluster brought
up by Ray's own CLI from deploy/ray-cluster.offline.yaml (everything installed from the
wheelhouse), `manta serve --tp 2 --placement-strategy STRICT_SPREAD` started with `ray exec`, a
request from the `openai` client equal to transformers, /metrics scraped, `ray down`, nothing left.
Then the cluster files users get wrong: a broken setup command, a wrong head_ip, a worker that
cannot be reached: Ray's message, and nothing left running.

docs/deploy.md ("On your own machines" and "Air-gapped") is this walk-through for people.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.fixtures import tiny_model_dir
from tests.netns_hosts import Hosts, missing_tools

pytestmark = [pytest.mark.slow, pytest.mark.skipif(missing_tools() is not None, reason=str(missing_tools()))]

ROOT = Path(__file__).resolve().parent.parent
RAY = str(ROOT / ".venv" / "bin" / "ray")
WHEELHOUSE = ROOT / ".wheelhouse"
MODEL = "~/models/tiny-llama"  # where the cluster file mounts the checkpoint on every host
SERVE = (f"nohup manta serve --address auto --host 0.0.0.0 --port 8000 --device cpu --model {MODEL} "
         "--tp 2 --placement-strategy STRICT_SPREAD --nic eth0 > ~/manta-serve.log 2>&1 & "
         "echo $! > ~/manta-serve.pid")
STOP = "kill -TERM $(cat ~/manta-serve.pid)"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    assert WHEELHOUSE.is_dir(), "no .wheelhouse: scripts/setup.sh builds it (scripts/make_wheelhouse.sh)"
    base = tmp_path_factory.mktemp("rayup")
    h = Hosts(base, 2)
    with h as made:
        yield h, made
    assert not h.leftovers(), h.leftovers()
    # Each host holds a venv, uv's cache and a wheelhouse: GBs, tens of thousands of files. They
    # are removed in the background (~25 s on the CI VM), while the next tests run.
    subprocess.Popen(["rm", "-rf", *(str(host.home.parent) for host in made)], start_new_session=True,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class Cluster:
    """One cluster file (deploy/ray-cluster.offline.yaml with this test's hosts, key and model)
    and Ray's CLI on it, run from the repository root as the docs say."""

    def __init__(self, hosts: Hosts, name: str, model_dir: Path, **changes):
        cfg = yaml.safe_load((ROOT / "deploy" / "ray-cluster.offline.yaml").read_text())
        cfg["cluster_name"] = f"{name}-{hosts.tag}"
        cfg["provider"]["head_ip"] = changes.pop("head_ip", hosts.hosts[0].ip)
        cfg["provider"]["worker_ips"] = changes.pop("worker_ips", [h.ip for h in hosts.hosts[1:]])
        cfg["min_workers"] = cfg["max_workers"] = len(cfg["provider"]["worker_ips"])
        cfg["auth"] = {"ssh_user": "root", "ssh_private_key": str(hosts.key)}
        cfg["file_mounts"][MODEL] = str(model_dir)
        cfg["setup_commands"] += changes.pop("extra_setup", [])
        assert not changes, changes
        self.name = cfg["cluster_name"]
        self.path = hosts.base / f"{name}.yaml"
        self.path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.log = ""

    def ray(self, *args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
        cmd = [RAY, args[0], str(self.path), *args[1:]]
        full = {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}", **(env or {})}
        t0 = time.monotonic()
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full)
        took = time.monotonic() - t0
        self.log += f"\n$ ray {' '.join(args[:1])} {self.path.name} {' '.join(args[1:])}  -> {r.returncode} in {took:.1f} s\n"
        print(f"ray {args[0]} {' '.join(args[1:])[:60]}: rc {r.returncode} in {took:.1f} s")
        self.log += r.stdout[-6000:] + r.stderr[-6000:]
        return r

    def exec(self, command: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return self.ray("exec", command, timeout=timeout)

    def up(self, **kw) -> subprocess.CompletedProcess:
        return self.ray("up", "-y", "--no-config-cache", **kw)

    def down(self) -> None:
        r = self.ray("down", "-y", timeout=300)
        assert r.returncode == 0, self.log
        for leftover in (Path("/tmp/ray") / f"cluster-{self.name}.state", Path("/tmp/ray") / f"cluster-{self.name}.lock"):
            leftover.unlink(missing_ok=True)


def _wait(what: str, check, timeout_s: float, every_s: float = 2.0):
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(every_s)


def _ray_json(cluster: Cluster, head, command: str, name: str):
    """A `ray list ...` on the head, as JSON (read from the head's home: the exec's own output
    also carries ssh's chatter)."""
    out = head.home / name
    out.unlink(missing_ok=True)
    r = cluster.exec(f"{command} --format json > ~/{name}")
    assert r.returncode == 0, cluster.log
    return json.loads(out.read_text())


def _head_logs(head) -> Path | None:
    """The logs of the head's Ray session, seen from here (None: no session yet)."""
    link = head.tmp / "ray" / "session_latest"
    if not link.is_symlink():
        return None
    return head.tmp / os.readlink(link).removeprefix("/tmp/") / "logs"  # the link names the host's /tmp


def _monitor_log(head) -> str:
    """The head's autoscaler log (what `ray monitor` tails): the worker updater's output."""
    logs = _head_logs(head)
    if logs is None:
        return "(no Ray session on the head)"
    return "".join(f"--- {p.name}\n{p.read_text(errors='replace')}" for p in sorted(logs.glob("monitor.*")))


def _nothing_running(*hosts, within_s: float = 30) -> dict:
    """Each host's processes but sshd, after waiting up to `within_s` for them to end (empty:
    none)."""
    t0 = time.monotonic()
    while True:
        left = {h.name: h.processes() for h in hosts if h.processes()}
        if not left or time.monotonic() > t0 + within_s:
            print(f"hosts {'not ' if left else ''}empty after {time.monotonic() - t0:.1f} s")
            return left
        time.sleep(1)


def test_ray_up_serves_tp2_across_two_hosts_and_ray_down_leaves_nothing(hosts, tmp_path_factory):
    made, (head, worker) = hosts
    model_dir = tiny_model_dir(tmp_path_factory, "llama")
    cluster = Cluster(made, "manta-up", model_dir)
    try:
        r = cluster.up(timeout=900)
        assert r.returncode == 0, cluster.log

        # The head's autoscaler sets the worker up after `ray up` returns: wait for it to join.
        def both_alive():
            nodes = _ray_json(cluster, head, "ray list nodes", "nodes.json")
            return nodes if sum(x["state"] == "ALIVE" for x in nodes) == 2 else None

        try:
            nodes = _wait("the worker node to join", both_alive, 600, every_s=5)
        except AssertionError as exc:  # the head's autoscaler log says why (it goes with the hosts)
            raise AssertionError(f"{exc}\n{_monitor_log(head)[-8000:]}\n{cluster.log[-4000:]}") from None
        assert {x["node_ip"] for x in nodes if x["state"] == "ALIVE"} == {head.ip, worker.ip}, nodes
        # The autoscaler's own view (`ray status`) lags the GCS's by its update interval: the
        # worker stays `setting-up` there until its updater has finished.
        def both_active():
            status = cluster.exec("ray status")
            return status.stdout if status.returncode == 0 and "Active:\n 2 local.cluster.node" in status.stdout \
                else None

        try:
            print(_wait("ray status to show both nodes active", both_active, 120, every_s=5))
        except AssertionError:
            raise AssertionError(cluster.log[-6000:]) from None

        r = cluster.exec(SERVE)
        assert r.returncode == 0, cluster.log
        url = f"http://{head.ip}:8000"

        def healthy():
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            _wait("manta serve on the head to answer /health", healthy, 300)
        except AssertionError:
            raise AssertionError((head.home / "manta-serve.log").read_text()[-8000:]) from None

        # One rank on each host, found with Ray's own state API.
        ranks = _ray_json(cluster, head, "ray list actors --filter class_name=RankWorker --filter state=ALIVE",
                          "ranks.json")
        ip_of = {x["node_id"]: x["node_ip"] for x in nodes}
        assert sorted(ip_of[a["node_id"]] for a in ranks) == sorted([head.ip, worker.ip]), ranks
        print("ranks:", [(a["name"], ip_of[a["node_id"]]) for a in ranks])

        # A real request from the openai client, greedy, equal to transformers.
        from transformers import AutoTokenizer

        from tests.test_engine import hf_greedy

        tok = AutoTokenizer.from_pretrained(model_dir)
        prompt = "The cluster came up over SSH and the answer is"
        expected = tok.decode(hf_greedy(model_dir, tok(prompt)["input_ids"], MAX_TOKENS))
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == MAX_TOKENS
        assert out.choices[0].text == expected
        print("tokens equal to transformers:", repr(expected))

        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        finished = [line for line in metrics.splitlines()
                    if line.startswith("manta:request_finished_total") and 'reason="length"' in line]
        assert finished and float(finished[0].rsplit(" ", 1)[1]) >= 1, metrics[:3000]

        assert cluster.exec(STOP).returncode == 0, cluster.log
        _wait("manta serve to exit", lambda: not any("manta serve" in c for c in head.processes().values()), 60)
        assert "Traceback" not in (head.home / "manta-serve.log").read_text()
    finally:
        cluster.down()
    left = _nothing_running(head, worker, within_s=60)
    assert not left, left


def test_broken_setup_command_fails_ray_up_and_starts_nothing(hosts, tmp_path_factory):
    made, (head, worker) = hosts
    cluster = Cluster(made, "manta-badsetup", tiny_model_dir(tmp_path_factory, "llama"),
                      extra_setup=["cd ~/manta && .venv/bin/pip install --no-index --find-links ~/wheelhouse "
                                   "no-such-package-in-the-wheelhouse"])
    try:
        r = cluster.up(timeout=900)
        assert r.returncode != 0, cluster.log
        assert "No matching distribution found for no-such-package-in-the-wheelhouse" in cluster.log, cluster.log
        assert "Failed to setup head node" in cluster.log, cluster.log
        assert not _nothing_running(head, worker), _nothing_running(head, worker)
    finally:
        cluster.down()


def test_wrong_head_ip_fails_ray_up_with_rays_message(hosts, tmp_path_factory):
    made, (head, worker) = hosts
    cluster = Cluster(made, "manta-badhead", tiny_model_dir(tmp_path_factory, "llama"), head_ip=made.unused_ip)
    try:
        # Ray waits AUTOSCALER_NODE_START_WAIT_S (900 s by default) for SSH to answer, trying
        # every 5 s: 8 s is two tries.
        r = cluster.up(timeout=300, env={"AUTOSCALER_NODE_START_WAIT_S": "8"})
        assert r.returncode != 0, cluster.log
        assert f"ssh: connect to host {made.unused_ip} port 22" in cluster.log, cluster.log
        assert "Failed to setup head node" in cluster.log, cluster.log
        assert not _nothing_running(head, worker), _nothing_running(head, worker)
    finally:
        cluster.down()


def test_unreachable_worker_shows_in_ray_status_and_ray_down_cleans_up(hosts, tmp_path_factory):
    made, (head, worker) = hosts
    cluster = Cluster(made, "manta-badworker", tiny_model_dir(tmp_path_factory, "llama"), worker_ips=[made.unused_ip])
    try:
        r = cluster.up(timeout=900)
        assert r.returncode == 0, cluster.log  # `ray up` returns once the head is up
        # What `ray monitor` tails on the head (its logs/monitor.*): the updater's SSH errors.
        monitor = _head_logs(head) / "monitor.err"

        def ssh_failures():
            return monitor.exists() and f"ssh: connect to host {made.unused_ip} port 22" in monitor.read_text()

        _wait("the head's autoscaler to report the worker unreachable", ssh_failures, 120)
        status = cluster.exec("ray status")
        print(status.stdout)
        assert "Active:\n 1 local.cluster.node" in status.stdout, cluster.log
        assert f"{made.unused_ip}: local.cluster.node, waiting-for-ssh" in status.stdout, cluster.log
        nodes = _ray_json(cluster, head, "ray list nodes", "nodes.json")
        assert [x["node_ip"] for x in nodes if x["state"] == "ALIVE"] == [head.ip], nodes
    finally:
        cluster.down()
    assert not _nothing_running(head, worker), _nothing_running(head, worker)
