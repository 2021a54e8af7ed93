"""The `manta` command line: make-model then generate, as a user runs them (a python process
each), and `manta serve`'s and `manta bench`'s refusals through `cluster.cli.main` in this
process (the same code from argv on; a process per refusal costs seconds of imports), with
tripwires on Ray and the cluster starting."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cluster.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture
def tripwires(monkeypatch):
    """For `manta serve` refusals run in this process through `cluster.cli.main` (a python
    process per refusal costs seconds of imports): starting Ray or the cluster fails the test."""
    import ray

    from cluster.launch import ServingCluster

    def started(*args, **kwargs):
        raise AssertionError("Ray or the cluster started before the refusal")

    monkeypatch.setattr(ServingCluster, "start", started)
    monkeypatch.setattr(ray, "init", started)


def _tiny_copy(tmp_path):
    """A copy of the shared tiny Llama checkpoint, to edit."""
    import shutil

    from tests.fixtures import tiny_model_dir

    return shutil.copytree(tiny_model_dir(None, "llama"), tmp_path / "m")


def test_make_model_then_generate_json(tmp_path):
    out = tmp_path / "m"
    made = run("make-model", str(out), "--arch", "qwen3", "--layers", "1")
    assert made.returncode == 0, made.stderr
    assert (out / "config.json").exists()
    gen = run("generate", "--model", str(out), "--prompt", "Hello there", "--prompt", "Hi",
              "--max-tokens", "5", "--temperature", "0", "--json", "--ignore-eos")
    assert gen.returncode == 0, gen.stderr
    rows = [json.loads(line) for line in gen.stdout.strip().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert set(row) == {"text", "token_ids", "finish_reason"}
        assert len(row["token_ids"]) == 5 and row["finish_reason"] == "length"


def test_generate_rejects_bad_parameter_with_its_name(tmp_path_factory, monkeypatch, capsys):
    """A sampling parameter out of range: exit 2 naming it, before the model loads."""
    from cluster.cli import main
    from cluster.engine.loop import Engine
    from tests.fixtures import tiny_model_dir

    def loaded(*args, **kwargs):
        raise AssertionError("the engine started before the refusal")

    monkeypatch.setattr(Engine, "__init__", loaded)
    rc = main(["generate", "--model", str(tiny_model_dir(tmp_path_factory, "llama")), "--prompt", "x", "--top-p", "1.5"])
    err = capsys.readouterr().err
    assert rc == 2 and "manta generate: invalid request: top_p" in err, err
    assert "Traceback" not in err


def test_gpus_per_rank_reaches_the_engine_config_and_is_checked():
    import argparse

    from cluster.engine_args import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args(["--gpus-per-rank", "0.5"])).gpus_per_rank == 0.5
    for bad in ("0", "1.5"):
        with pytest.raises(ValueError, match="gpus_per_rank"):
            engine_config_from_args(p.parse_args(["--gpus-per-rank", bad]))


def test_each_pd_side_takes_its_own_gpu_share():
    """`--prefill-gpus-per-rank` / `--decode-gpus-per-rank` reach each side's engine config (what
    its ranks ask Ray for and size their memory by), and so do `--prefill-sm-percent` /
    `--decode-sm-percent` (the SMs CUDA MPS lets their ranks occupy); mixed replicas and unset
    sides keep `--gpus-per-rank` / `--sm-percent`."""
    import argparse

    from cluster.serve_cli import add_serve_parser, cluster_options_from_args

    p = argparse.ArgumentParser()
    add_serve_parser(p.add_subparsers())
    args = p.parse_args(["serve", "--gpus-per-rank", "0.5", "--replicas", "1", "--prefill-replicas", "1",
                         "--decode-replicas", "1", "--decode-tp", "2", "--decode-gpus-per-rank", "0.6"])
    opts = cluster_options_from_args(args)
    assert opts.engine_for("prefill").gpus_per_rank == 0.5 and opts.engine_for("mixed").gpus_per_rank == 0.5
    decode = opts.engine_for("decode")
    assert (decode.gpus_per_rank, decode.tp_size) == (0.6, 2)
    args = p.parse_args(["serve", "--sm-percent", "80", "--prefill-replicas", "1", "--decode-replicas", "1",
                         "--prefill-sm-percent", "30"])
    opts = cluster_options_from_args(args)
    assert [opts.engine_for(r).sm_percent for r in ("prefill", "decode", "mixed")] == [30, 80, 80]


def test_an_sm_limit_on_an_in_process_engine_is_refused(tmp_path_factory):
    """CUDA reads MPS's SM limit once, as a process starts: an engine in this process cannot take
    one (only `manta serve`'s rank actors start with it), so asking is an error naming the field."""
    from cluster.engine.config import ConfigError, EngineConfig
    from cluster.engine.ranks import make_worker_group
    from tests.fixtures import tiny_model_dir

    with pytest.raises(ConfigError, match="sm_percent.*CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
        make_worker_group(EngineConfig(model=str(tiny_model_dir(tmp_path_factory, "llama")), sm_percent=50))


def test_serve_refuses_a_quantized_checkpoint_before_starting(tmp_path, tripwires, capsys):
    """`manta serve` on a checkpoint in a quantized format it cannot load (GPTQ) exits at once
    (no Ray, no replica) naming the format."""
    out = _tiny_copy(tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (out / "config.json").write_text(json.dumps(cfg))
    from cluster.cli import main

    assert main(["serve", "--model", str(out), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "quantized checkpoint manta cannot load" in err and "'gptq', bits 4" in err, err


@pytest.mark.parametrize("sides", [["--tp", "2"], ["--prefill-replicas", "1", "--decode-replicas", "1", "--decode-tp", "2"]])
def test_serve_refuses_a_tp_size_that_cuts_fp8_blocks_before_starting(tmp_path, tripwires, capsys, sides):
    """A block-FP8 checkpoint whose down_proj K (intermediate 96) a TP size of 2 would cut inside a
    32-wide block: refused at once by the flag of the side that asks it, before Ray starts."""
    from cluster.cli import main
    from workers.make_fp8 import quantize_checkpoint
    from workers.make_model import make_model

    d = make_model(tmp_path / "m", "llama", dtype="float32", hidden=128, heads=4, kv_heads=2, intermediate=96,
                   layers=2, vocab=513, max_position=64)
    quantize_checkpoint(d, "fp8-block", (32, 32))
    assert main(["serve", "--model", str(d), "--port", "0", *sides]) == 2
    err = capsys.readouterr().err
    flag = "--tp" if sides[0] == "--tp" else "--decode-tp"
    assert f"manta serve: error: {flag}: RowParallelLinear: tensor parallelism cuts K at column 48" in err, err
    assert "32-wide FP8 block" in err and "Traceback" not in err


@pytest.mark.parametrize("args,flag,says", [
    (["--page-size", "0"], "--page-size", "must be >= 1"),
    (["--ttft-target-ms", "300"], "--ttft-target-ms", "goes with itl_target_ms"),
    (["--itl-target-ms", "30", "--chunked-prefill-size", "-1"], "--itl-target-ms", "needs chunked prefill"),
    (["--max-waiting", "-1"], "--max-waiting", "must be >= 0"),
    (["--kv-store-disk-gb", "0"], "--kv-store-disk-gb", "must be > 0"),
    (["--replicas", "0"], "--replicas", "must be >= 1"),  # (the cluster's options)
    (["--prefill-replicas", "1"], "--decode-replicas", "go together"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--decode-gpus-per-rank", "1.5"], "--decode-gpus-per-rank",
     "must be in (0, 1]"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--decode-sm-percent", "0"], "--decode-sm-percent",
     "must be in [1, 100]"),
    (["--sm-percent", "101"], "--sm-percent", "must be in [1, 100]"),
    (["--request-timeout", "-5"], "--request-timeout", "must be > 0"),  # (the HTTP server's)
    (["--model", "/nonexistent/ckpt"], "--model", "/nonexistent/ckpt is not a checkpoint directory"),
])
def test_serve_refuses_an_option_out_of_range_by_its_flag(args, flag, says, tripwires, capsys):
    """An option out of range (the engine's, the cluster's, the server's) or a model directory
    that is not there ends `manta serve` at once with a usage error naming the flag the user
    typed (exit 2, no traceback, no Ray)."""
    from cluster.cli import main

    assert main(["serve", "--port", "0", *args]) == 2
    err = capsys.readouterr().err
    assert f"manta serve: error: {flag}: " in err and says in err, err


def test_generate_refuses_a_model_that_is_not_there(capsys):
    from cluster.cli import main

    assert main(["generate", "--model", "/nonexistent/ckpt", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "manta generate: error: --model: /nonexistent/ckpt" in err and "Traceback" not in err, err


def test_bench_against_no_server_says_so(tmp_path_factory, capsys):
    """`manta bench serve --url` where nothing listens: exit 1 naming the URL, no traceback."""
    import socket

    from cluster.cli import main
    from tests.fixtures import tiny_model_dir

    with socket.socket() as s:  # a port nothing listens on once it is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    rc = main(["bench", "serve", "--model", str(tiny_model_dir(tmp_path_factory, "llama")), "--url", url,
               "--num-prompts", "2", "--input-len", "8"])
    err = capsys.readouterr().err
    assert rc == 1 and f"manta bench serve: error: the warm-up requests to {url} failed" in err, err
    assert "Traceback" not in err


def test_serve_on_a_port_in_use_says_so_before_starting(tripwires, capsys):
    """Another process listens on the port: `manta serve` exits 2 naming it, before Ray and the
    replicas start (it used to start them all, then fail to bind)."""
    import socket

    from cluster.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc = main(["serve", "--port", str(port)])
    err = capsys.readouterr().err
    assert rc == 2 and f"manta serve: error: --port: cannot listen on 127.0.0.1:{port}" in err, err
    assert "Traceback" not in err


