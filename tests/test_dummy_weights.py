"""`--load-format dummy`: random weights at a checkpoint's names and shapes, from a directory that
holds only its config and tokenizer (`manta make-model --no-weights`). The oracle: the same
tensors written out as a safetensors checkpoint load into transformers and into manta (load
format auto) and give the same greedy tokens as the dummy load; the values are the same on
every start and at every TP size."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.engine.config import ConfigError, EngineConfig
from cluster.engine.loop import Engine
from tests.test_engine import greedy, hf_greedy
from tests.test_kvstore_serving import prompt_ids
from workers.make_model import make_model

ARCHS = {"llama": {}, "deepseek_v2": {}}  # a dense model, and MLA with MoE experts (reverted names)
PROMPTS = [prompt_ids(9 + 7 * i, seed=i) for i in range(3)]


def written_copy(src: Path, dst: Path) -> Path:
    """The dummy reader's tensors saved as a checkpoint beside a copy of src's config."""
    from safetensors.torch import save_file

    from workers.dummy_weights import DummyReader

    shutil.copytree(src, dst)
    reader = DummyReader(str(src), "cpu")
    save_file({n: reader.get_tensor(n).contiguous() for n in reader.names()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module", params=sorted(ARCHS))
def no_weights(request, tmp_path_factory) -> tuple[str, Path]:
    d = make_model(tmp_path_factory.mktemp("dummy") / request.param, request.param, weights=False,
                   **ARCHS[request.param])
    assert not list(d.glob("*.safetensors"))
    return request.param, d


def tokens(model: Path, **kw) -> list[list[int]]:
    eng = Engine(EngineConfig(model=str(model), **kw))
    try:
        return [o.token_ids for o in eng.generate(PROMPTS, greedy())]
    finally:
        eng.shutdown()


def test_dummy_weights_are_a_checkpoints_weights(no_weights, tmp_path):
    """The dummy load equals loading the same values from files, in manta and in transformers,
    and a second start draws the same model."""
    _, d = no_weights
    dummy = tokens(d, load_format="dummy")
    assert dummy == tokens(d, load_format="dummy")
    copy = written_copy(d, tmp_path / "written")
    assert tokens(copy) == dummy
    assert [hf_greedy(copy, p, len(t)) for p, t in zip(PROMPTS, dummy)] == dummy


def test_dummy_weights_at_tp2_equal_tp1(no_weights):
    arch, d = no_weights
    if arch != "llama":
        pytest.skip("one family is enough for the slicing")
    assert tokens(d, load_format="dummy", tp_size=2) == tokens(d, load_format="dummy")


def test_a_directory_without_weights_needs_the_dummy_format(no_weights, tmp_path):
    _, d = no_weights
    with pytest.raises(ConfigError) as err:
        EngineConfig(model=str(d), load_format="random")
    assert err.value.field == "load_format"
    cli = [sys.executable, "-m", "cluster.cli", "generate", "--model", str(d), "--prompt", "hi", "--max-tokens", "2"]
    out = subprocess.run(cli, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "--model:" in out.stderr and "--load-format dummy" in out.stderr, out.stderr
    out = subprocess.run(cli + ["--load-format", "dummy"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


def test_the_kv_store_shares_dummy_pages_like_a_checkpoints(no_weights, tmp_path):
    """Dummy weights are the same on every start: replicas of one dummy model share store
    pages (a fingerprint without weight files), and never with the checkpoint of other values."""
    from cluster.engine.kv_store_link import replica_identity

    _, d = no_weights
    cfg = EngineConfig(model=str(d), load_format="dummy", page_size=16, kv_store=str(tmp_path / "kv"))
    ident = replica_identity(cfg)
    assert ident is not None and replica_identity(cfg.replace(seed=7)) == ident
    seeded = make_model(tmp_path / "with-weights", "llama")  # files of other random values
    assert replica_identity(cfg.replace(model=str(seeded), load_format="auto"))[0] != ident[0]


def test_dummy_values_have_make_models_spread(no_weights):
    """Weights spread with the config's initializer_range, norm weights around 1, and no two
    tensors alike (each is its own ordering of the hash, not a shifted copy of another's)."""
    import torch

    from workers.dummy_weights import DummyReader

    _, d = no_weights
    reader = DummyReader(str(d), "cpu")
    norm = next(n for n in reader.names() if n.endswith("norm.weight"))
    embed = reader.get_tensor("model.embed_tokens.weight").float()
    assert abs(embed.mean().item()) < 0.01 * reader.std
    assert embed.std().item() == pytest.approx(reader.std, rel=0.05)
    assert reader.get_tensor(norm).float().mean().item() == pytest.approx(1.0, abs=0.05)
    mats = [reader.get_tensor(n).float().reshape(-1)[:1024] for n in reader.names() if n.endswith("proj.weight")][:6]
    corr = torch.corrcoef(torch.stack(mats)) - torch.eye(len(mats))
    assert corr.abs().max().item() < 0.1

