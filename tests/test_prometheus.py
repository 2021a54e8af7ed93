"""A real Prometheus (Debian's `prometheus` package, which scripts/setup.sh installs when run as
root) scrapes a live `manta serve` with the project's deploy/prometheus.yml: the test queries
Prometheus' HTTP API and finds TTFT histogram samples and per-replica series. The server's
start-up log names the cluster, each replica's and rank's placement, the kernels and the KV store."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from cluster.bench.ports import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS = shutil.which("prometheus")
REPLICAS = 2 if (os.cpu_count() or 1) >= 2 else 1


def _wait(what: str, check, timeout_s: float, proc: subprocess.Popen | None = None):
    """Poll `check()` until it returns something truthy; fail naming `what` on timeout."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"{what}: the process exited with {proc.returncode}")
        try:
            last = check()
            if last:
                return last
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            last = exc
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what} (last: {last!r})")


def _stop(proc: subprocess.Popen, timeout_s: float = 60) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def prometheus_config(server_port: int, ray_sd_file: Path) -> dict:
    """deploy/prometheus.yml for this test: its manta job aimed at the test's server, scraped
    every second; Ray's file_sd job kept, reading a file of the test's (no Ray targets here)."""
    cfg = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    jobs["manta"]["static_configs"] = [{"targets": [f"127.0.0.1:{server_port}"]}]
    jobs["manta"]["scrape_timeout"] = "1s"
    jobs["ray"]["file_sd_configs"] = [{"files": [str(ray_sd_file)]}]
    return cfg


@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (Debian package `prometheus`; "
                    "scripts/setup.sh installs it when run as root)")
def test_prometheus_scrapes_manta_serve(tmp_path):
    import ray

    if ray.is_initialized():
        ray.shutdown()
    port, prom_port = free_port(), free_port()  # not a bind(0) port: Ray may take it first
    env = {**os.environ, "MANTA_CACHE_DIR": str(tmp_path / "cache"), "RAY_ADDRESS": ""}
    serve_log = open(tmp_path / "serve.log", "w+")
    serve = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "--port", str(port), "--replicas", str(REPLICAS),
         "--router-policy", "round_robin"],
        cwd=ROOT, env=env, stdout=serve_log, stderr=subprocess.STDOUT, text=True)
    prom = None
    try:
        base = f"http://127.0.0.1:{port}"
        _wait("manta serve /health", lambda: httpx.get(f"{base}/health", timeout=2).status_code == 200, 300, serve)
        model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]

        # Ray's own metrics: the node's exporter that `manta serve` names in its start-up log, in
        # the file format of Ray's service discovery (what the `ray` job reads on a cluster).
        serve_log.flush()
        ray_targets = re.findall(r"Ray metrics at (\S+:\d+)", (tmp_path / "serve.log").read_text())
        assert ray_targets, (tmp_path / "serve.log").read_text()
        sd = tmp_path / "ray_sd.json"
        sd.write_text(json.dumps([{"labels": {"job": "ray"}, "targets": ray_targets}]))
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(prometheus_config(port, sd)))
        prom = subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        api = f"http://127.0.0.1:{prom_port}/api/v1"
        _wait("prometheus ready", lambda: httpx.get(f"http://127.0.0.1:{prom_port}/-/ready", timeout=2)
              .status_code == 200, 60, prom)

        def send(n: int) -> None:
            # The router goes round robin: n requests per replica, one of them streamed.
            for i in range(n * REPLICAS):
                r = httpx.post(f"{base}/v1/completions", timeout=120,
                               json={"model": model, "prompt": f"Prometheus test {i}", "max_tokens": 4,
                                     "stream": i == 0})
                assert r.status_code == 200, r.text

        send(1)

        def query(q: str) -> list[dict]:
            body = httpx.get(f"{api}/query", params={"query": q}, timeout=5).json()
            assert body["status"] == "success", body
            return body["data"]["result"]

        def series_of(replica: str):
            return query(f'manta:time_to_first_token_seconds_bucket{{job="manta",replica="{replica}"}}')

        replicas = [f"replica-{i}" for i in range(REPLICAS)]
        for replica in replicas:
            buckets = _wait(f"TTFT buckets of {replica} in prometheus", lambda r=replica: series_of(r), 60, prom)
            les = {b["metric"]["le"] for b in buckets}
            assert "+Inf" in les and len(les) > 10
            inf = next(b for b in buckets if b["metric"]["le"] == "+Inf")
            assert float(inf["value"][1]) >= 1  # at least one request of this replica counted
        healthy = _wait("replica health series", lambda: query('manta:replica_healthy{job="manta"} == 1'), 30, prom)
        assert sorted(s["metric"]["replica"] for s in healthy) == replicas
        targets = httpx.get(f"{api}/targets", timeout=5).json()["data"]["activeTargets"]
        manta = [t for t in targets if t["labels"]["job"] == "manta"]
        assert len(manta) == 1 and manta[0]["health"] == "up", json.dumps(targets)
        ray_up = _wait("Ray's exporter scraped", lambda: query('up{job="ray"} == 1'), 60, prom)
        assert len(ray_up) == len(ray_targets)
        assert query('count({job="ray", __name__=~"ray_.+"})'), "no ray_* series from Ray's exporter"
        # A dashboard query, evaluated by Prometheus itself: rate() needs the counters to grow
        # after their first scrape, so more requests first.
        send(2)
        p99 = "histogram_quantile(0.99, sum by (le) (rate(manta:time_to_first_token_seconds_bucket[1m])))"
        value = _wait("a TTFT p99 from prometheus", lambda: [float(v["value"][1]) for v in query(p99)
                                                            if v["value"][1] != "NaN"], 30, prom)
        assert 0 < value[0] < 80
    finally:
        if prom is not None:
            assert _stop(prom) == 0, prom.stdout.read()
        rc = _stop(serve)
        serve_log.seek(0)
        log = serve_log.read()
        serve_log.close()
    assert rc == 0, log

    # What `manta serve` says at start: the cluster, each replica's ranks and kernels, the KV store.
    assert re.search(r"Ray cluster: started a local Ray instance \(gcs \S+, namespace manta\): 1 node\(s\)", log), log
    for replica in replicas:
        assert re.search(rf"replica {replica} ready: tp=1, placement PACK, step channel \w+, "
                         r"attention flash_attention: torch-sdpa \(cpu\) \(one-row GEMV on, PDL on, MIXED split on, prompt graphs on, decode zero bias on, Triton prefill on, FP8 rows on, FP8 KV words on, FP8 TMA on, FP8 KV MMA off\), "
                         r"KV cache \d+ tokens", log), log
        assert re.search(rf"{replica} rank 0: node [0-9a-f]{{12}} ip [\d.]+ pid \d+ gpus none", log), log
    assert re.search(r"KV store: \S", log), log
