"""The kernel options: one frozen object, read from the environment (or `manta serve`'s flags)
once, when the engine config is made, and installed on the rank that loads the model."""

from __future__ import annotations

import argparse

import pytest

from attention import kernel_options
from attention.kernel_options import KernelOptions
from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from cluster.engine_args import add_engine_args, engine_config_from_args
from tests.fixtures import tiny_model_dir
from workers.layers import one_row


def test_environment_is_read_once_into_a_frozen_object(monkeypatch):
    env = {"MANTA_GEMV": "0", "MANTA_PDL": "0", "MANTA_MIXED_SPLIT": "0", "MANTA_TRITON_PREFILL": "0",
           "MANTA_FP8_ROWS": "0", "MANTA_FP8_KV_WORDS": "0",
           "MANTA_GEMV_CONFIGS": "4096x4096:64,128,2,4;14336x4096:32,256,1,8;6144x4096:16,512,1,8,16"}
    opts = KernelOptions.from_env(env)
    assert (opts.one_row_gemv, opts.pdl, opts.mixed_split, opts.triton_prefill, opts.fp8_rows,
            opts.fp8_kv_words) == (False,) * 6
    assert "MIXED split off" in opts.describe() and "Triton prefill off" in opts.describe()
    assert "FP8 rows off" in opts.describe() and "FP8 rows on" in KernelOptions().describe()
    assert "FP8 KV words off" in opts.describe() and "FP8 KV words on" in KernelOptions().describe()
    assert KernelOptions().fp8_tma and "FP8 TMA on" in KernelOptions().describe()
    assert not KernelOptions.from_env({"MANTA_FP8_TMA": "0"}).fp8_tma
    assert "FP8 TMA off" in KernelOptions.from_env({"MANTA_FP8_TMA": "0"}).describe()
    assert not KernelOptions().fp8_kv_mma and "FP8 KV MMA off" in KernelOptions().describe()  # opt-in
    assert KernelOptions.from_env({"MANTA_FP8_KV_MMA": "1"}).fp8_kv_mma
    assert "Triton prefill on" in KernelOptions().describe()
    assert opts.gemv_launch(4096, 4096) == (64, 128, 2, 4) and opts.gemv_launch(14336, 4096) == (32, 256, 1, 8)
    assert opts.gemv_launch(6144, 4096) == (16, 512, 1, 8, 16)  # with 16-column vectors
    assert opts.gemv_launch(4096, 14336) is None
    assert "PDL off" in opts.describe() and "14336x4096:32,256,1,8" in opts.describe()
    with pytest.raises(AttributeError):
        opts.pdl = True  # type: ignore[misc]
    assert KernelOptions.from_env({}) == KernelOptions()
    # The config reads the environment when it is made, not when a kernel runs.
    monkeypatch.setenv("MANTA_PDL", "0")
    config = EngineConfig(model="m")
    monkeypatch.setenv("MANTA_PDL", "1")
    assert config.kernels.pdl is False


@pytest.mark.parametrize("bad", ["4096x4096:64,128,2", "4096x4096:64,128,2,4,16,1,0", "4096x4096:64,128,2,4,16,2", "4096:64,128,2,4", "axb:1,2,3,4", "4096x4096:64,x,2,4"])
def test_a_bad_launch_list_names_the_item(bad):
    with pytest.raises(ValueError, match="MANTA_GEMV_CONFIGS item"):
        KernelOptions.from_env({"MANTA_GEMV_CONFIGS": bad})


def test_a_sweeps_fastest_launches_read_back_as_overrides():
    """`bench_gemv --emit-configs`: the fastest Triton launch per N x K (not cuBLAS, not the
    split norm + product pair), in the form MANTA_GEMV_CONFIGS parses."""
    from attention import kernel_options
    from workers.layers import gemv_launch
    from workers.layers.gemv_launch import GemvConfig, best_launches

    def row(n, k, kind, us, cfg):
        return dict(n=n, k=k, kind=kind, us=us, config=None if cfg is None else vars(cfg))
    results = [row(6144, 4096, "cublas", 5.0, None),
               row(6144, 4096, "triton-fused-default", 12.0, GemvConfig(16, 512, 1, 8, vec=16)),
               row(6144, 4096, "triton-fused", 11.0, GemvConfig(4, 1024, 2, 4, vec=16)),
               row(6144, 4096, "triton-norm+plain", 9.0, GemvConfig(8, 256, 1, 4)),
               row(4096, 4096, "triton", 8.0, GemvConfig(8, 256, 1, 4)),
               row(4096, 4096, "triton-default", 7.5, GemvConfig(8, 1024, 1, 8, vec=16)),
               row(4096, 14336, "triton-fused", 20.0, GemvConfig(4, 1024, 1, 4, vec=16, prefetch=False)),
               row(4096, 14336, "triton-fused", 21.0, GemvConfig(8, 1024, 1, 4, vec=16))]
    opts = KernelOptions.from_env({"MANTA_GEMV_CONFIGS": best_launches(results)})
    assert opts.gemv_launch(6144, 4096) == (4, 1024, 2, 4, 16, 1)
    assert opts.gemv_launch(4096, 4096) == (8, 1024, 1, 8, 16, 1)
    assert opts.gemv_launch(4096, 14336) == (4, 1024, 1, 4, 16, 0)
    assert best_launches([]) == ""
    # ... and a rank running under them launches exactly those (prefetch included)
    previous = kernel_options.current()
    try:
        kernel_options.install(opts)
        assert gemv_launch._override(4096, 14336) == GemvConfig(4, 1024, 1, 4, 3, vec=16, prefetch=False)
        assert gemv_launch._override(4096, 4096) == GemvConfig(8, 1024, 1, 8, 3, vec=16, prefetch=True)
        assert gemv_launch._override(14336, 4096) is None
    finally:
        kernel_options.install(previous)


def test_serve_flags_turn_options_off_over_the_environment(monkeypatch):
    import os

    for name in [n for n in os.environ if n.startswith("MANTA_")]:  # a benchmark's exported switches
        monkeypatch.delenv(name)
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args([])).kernels == KernelOptions()
    cfg = engine_config_from_args(p.parse_args(["--no-pdl", "--no-one-row-gemv"]))
    assert (cfg.kernels.pdl, cfg.kernels.one_row_gemv) == (False, False)


def test_the_rank_installs_the_engines_options(tmp_path_factory):
    d = tiny_model_dir(tmp_path_factory, "llama")
    try:
        Engine(EngineConfig(model=str(d), kernels=KernelOptions(one_row_gemv=False)))
        assert kernel_options.current() == KernelOptions(one_row_gemv=False)
        assert not one_row.enabled()
        Engine(EngineConfig(model=str(d), kernels=KernelOptions()))
        assert one_row.enabled()
    finally:
        kernel_options.install(KernelOptions())
