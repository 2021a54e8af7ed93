"""Llama-family decoders (Llama, Qwen2, Qwen3, Mistral; llama3 and yarn RoPE) against
`transformers` on the same tiny checkpoints, plus tensor-parallel sharding at tp=2.

Tolerance: max |logit difference| < 1e-4 in float32 (the two differ only in matmul blocking and
summation order; the TP=2 run also in the order of the all-reduce).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

import pytest
import torch

from attention.reference import TorchReferenceBackend
from tests.fixtures import gloo_rank, tiny_model_dir
from workers.forward_batch import ForwardBatch, ForwardMode
from workers.layers.rotary import RopeConfig, compute_inv_freq
from workers.loader import CheckpointReader, load_model
from workers.memory_pool import MHATokenToKVPool, ReqToTokenPool
from workers.model_config import ModelConfig
from workers.parallel import TPGroup

ATOL = 1e-4
PROMPT_LENS = (5, 11, 3)
VOCAB = 513  # odd: vocab-parallel padding is exercised at tp=2

# name -> (make_model arch, make_model kwargs)
VARIANTS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),  # q/k/v bias
    "qwen3": ("qwen3", {"tie_word_embeddings": True}),  # q/k norm, tied head
    "mistral": ("mistral", {}),
    "llama_rope_llama3": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),
    # transformers 4.x config layout (rope_theta + rope_scaling at top level).
    "llama_rope_yarn": (
        "llama",
        {
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
            "legacy_config": True,
        },
    ),
    "llama_kv1": ("llama", {"kv_heads": 1}),
    "qwen2_kv1": ("qwen2", {"kv_heads": 1}),
}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    def get(name: str) -> str:
        arch, kw = VARIANTS[name]
        return str(tiny_model_dir(tmp_path_factory, arch, vocab=VOCAB, max_position=64, **kw))

    return get


def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _prompts(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in PROMPT_LENS]


class Cache:
    """Req rows 0..B-1, each request's slots contiguous from its own page (page 0 reserved),
    with room for `extra` decode tokens."""

    def __init__(self, cfg: ModelConfig, tp_size: int, lens, page_size: int, extra: int = 1):
        self.page_size = page_size
        self.slots = []
        page = 1
        for n in lens:
            self.slots.append(torch.arange(page * page_size, page * page_size + n + extra))
            page += -(-(n + extra) // page_size)
        self.req_pool = ReqToTokenPool(len(lens), cfg.max_context_len, "cpu")
        self.kv_pool = MHATokenToKVPool(
            page,
            page_size,
            cfg.num_layers,
            cfg.per_rank_kv_heads(tp_size),
            cfg.head_dim,
            torch.float32,
            "cpu",
        )
        self.backend = TorchReferenceBackend(page_size)

    def _batch(self, mode, input_ids, positions, out_loc, seq_lens, **extend) -> ForwardBatch:
        bs = seq_lens.numel()
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=bs,
            input_ids=input_ids,
            positions=positions,
            req_pool_indices=torch.arange(bs),
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens.clone(),
            out_cache_loc=out_loc,
            req_to_token_pool=self.req_pool,
            kv_pool=self.kv_pool,
            attn_backend=self.backend,
            **extend,
        )
        self.backend.init_forward_metadata(fb)
        return fb

    def extend(self, prompts) -> ForwardBatch:
        lens = [p.numel() for p in prompts]
        locs = [s[:n] for s, n in zip(self.slots, lens)]
        for row, loc in enumerate(locs):
            self.req_pool.write(row, 0, loc)
        ext = torch.tensor(lens)
        return self._batch(
            ForwardMode.EXTEND,
            torch.cat(prompts),
            torch.cat([torch.arange(n) for n in lens]),
            torch.cat(locs),
            ext.clone(),
            extend_seq_lens=ext,
            extend_seq_lens_cpu=lens,
            extend_prefix_lens=torch.zeros_like(ext),
            extend_prefix_lens_cpu=[0] * len(lens),
            extend_start_loc=torch.nn.functional.pad(torch.cumsum(ext, 0), (1, 0)),
        )

    def decode(self, tokens: torch.Tensor, lens) -> ForwardBatch:
        loc = torch.stack([s[n] for s, n in zip(self.slots, lens)])
        for row, n in enumerate(lens):
            self.req_pool.write(row, n, loc[row : row + 1])
        pos = torch.tensor(lens)
        return self._batch(ForwardMode.DECODE, tokens, pos, loc, pos + 1)


def run_prefill(model, cfg: ModelConfig, tp_size: int, prompts, page_size: int):
    cache = Cache(cfg, tp_size, [p.numel() for p in prompts], page_size)
    fb = cache.extend(prompts)
    with torch.no_grad():
        logits = model.compute_logits(model(fb.input_ids, fb.positions, fb))
    return logits, cache


def _load(path: str, tp: TPGroup | None = None):
    cfg = ModelConfig.from_pretrained(path, "float32")
    return cfg, load_model(cfg, tp or TPGroup(), "cpu", torch.float32)


# ---- against transformers -------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize(
    "variant", ["llama", "qwen2", "qwen3", "mistral", "llama_rope_llama3", "llama_rope_yarn"]
)
def test_prefill_and_decode_match_transformers(model_dir, variant, page_size):
    path = model_dir(variant)
    cfg, model = _load(path)
    hf = _hf_model(path)
    prompts = _prompts()
    logits, cache = run_prefill(model, cfg, 1, prompts, page_size)
    assert logits.dtype == torch.float32 and logits.shape == (sum(PROMPT_LENS), cfg.vocab_size)

    start, next_tokens = 0, []
    with torch.no_grad():
        for p in prompts:
            ref = hf(p[None]).logits[0]
            mine = logits[start : start + p.numel()]
            assert (mine - ref).abs().max().item() < ATOL, variant
            next_tokens.append(int(mine[-1].argmax()))
            start += p.numel()

        lens = [p.numel() for p in prompts]
        fb = cache.decode(torch.tensor(next_tokens), lens)
        step = model.compute_logits(model(fb.input_ids, fb.positions, fb))
        for i, p in enumerate(prompts):
            ref = hf(torch.cat([p, torch.tensor(next_tokens[i : i + 1])])[None]).logits[0, -1]
            assert (step[i] - ref).abs().max().item() < ATOL, variant


def test_rope_inv_freq_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cases = [
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "mscale": 0.7,
            "mscale_all_dim": 0.5,
            "beta_fast": 16,
            "beta_slow": 2,
        },
    ]
    for params in cases:
        hf = LlamaConfig(
            hidden_size=256,
            num_attention_heads=4,
            max_position_embeddings=512,
            rope_parameters={**params, "rope_theta": 5e5},
        )
        ref, ref_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, "cpu")
        mine, scale = compute_inv_freq(RopeConfig.from_hf(hf, 64))
        assert torch.equal(mine, ref) and scale == pytest.approx(ref_scale, rel=1e-12), params


def test_model_config_fields(model_dir):
    cfg = ModelConfig.from_pretrained(model_dir("qwen3"))
    assert cfg.architecture == "Qwen3ForCausalLM"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        2,
        64,
        4,
        2,
        16,
    )
    assert cfg.vocab_size == VOCAB and cfg.max_context_len == 64 and cfg.dtype == torch.float32
    assert cfg.tie_word_embeddings and not cfg.use_mla and not cfg.is_encoder_decoder
    assert cfg.eos_token_ids == (2, 5)  # config's eos, then generation_config's extra one
    assert cfg.per_rank_kv_heads(1) == 2 and cfg.per_rank_kv_heads(2) == 1 and cfg.per_rank_kv_heads(4) == 1
    assert ModelConfig.from_pretrained(model_dir("qwen3"), "bf16").dtype == torch.bfloat16


def _copy_with_config(src: str, dst: Path, **changes) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_refusals(model_dir, tmp_path):
    bad = _copy_with_config(model_dir("llama"), tmp_path / "bad", architectures=["FooForCausalLM"])
    with pytest.raises(ValueError, match="unsupported architecture 'FooForCausalLM'.*LlamaForCausalLM"):
        ModelConfig.from_pretrained(bad)
    windowed = _copy_with_config(model_dir("mistral"), tmp_path / "sw", sliding_window=16)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        _load(windowed)


def test_quantized_tensors_without_a_config_are_refused(model_dir, tmp_path):
    """FP8 (or packed int) tensors in a checkpoint whose config does not say so: the loader
    names the first such tensor rather than cast it into a float parameter."""
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "fp8"
    shutil.copytree(model_dir("llama"), dst)
    (path,) = dst.glob("*.safetensors")
    tensors = load_file(path)
    name = next(n for n in sorted(tensors) if n.endswith("q_proj.weight"))
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, path)
    with pytest.raises(ValueError, match=re.escape(name) + ".*F8_E4M3"):
        _load(str(dst))


def test_sharded_index_and_missing_tensor(model_dir, tmp_path):
    """The index-json path loads the same weights; a missing tensor is named in the error."""
    from safetensors.torch import save_file

    src = model_dir("llama")
    tensors = {n: CheckpointReader(src).get_tensor(n) for n in CheckpointReader(src).names()}
    names = sorted(tensors)
    half = len(names) // 2
    out = Path(shutil.copytree(src, tmp_path / "split", ignore=shutil.ignore_patterns("*.safetensors")))
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(out / fname))
        weight_map.update({n: fname for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _, full = _load(src)
    _, split = _load(str(out))
    for (n, a), (_, b) in zip(full.named_parameters(), split.named_parameters()):
        assert torch.equal(a, b), n

    missing = Path(shutil.copytree(src, tmp_path / "missing"))
    save_file(
        {n: t for n, t in tensors.items() if ".1.self_attn.k_proj." not in n},
        str(missing / "model.safetensors"),
    )
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight\[k\]"):
        _load(str(missing))


# ---- tensor parallelism ---------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["llama", "qwen2_kv1"])
def test_tp2_shards_concatenate_to_full_weights(model_dir, variant):
    """Load rank 0 and rank 1 of tp=2 without processes (no collective runs at load)."""
    path = model_dir(variant)
    cfg = ModelConfig.from_pretrained(path, "float32")
    ranks = [_load(path, TPGroup(rank=r, size=2))[1] for r in range(2)]
    p = [dict(m.named_parameters()) for m in ranks]
    ref = CheckpointReader(path)
    hd, heads, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        qkv = [m[pre + "self_attn.qkv_proj.weight"] for m in p]
        q_rows, kv_rows = heads // 2 * hd, max(kv // 2, 1) * hd
        parts = [x.split([q_rows, kv_rows, kv_rows]) for x in qkv]
        for j, proj in enumerate("qkv"):
            full_w = ref.get_tensor(pre + f"self_attn.{proj}_proj.weight")
            if proj != "q" and kv == 1:  # tp > kv heads: the one kv head is replicated
                assert all(torch.equal(part[j], full_w) for part in parts)
            else:
                assert torch.equal(torch.cat([part[j] for part in parts]), full_w), (pre, proj)
        if cfg.architecture == "Qwen2ForCausalLM":
            bias = [m[pre + "self_attn.qkv_proj.bias"].split([q_rows, kv_rows, kv_rows]) for m in p]
            assert torch.equal(torch.cat([b[0] for b in bias]), ref.get_tensor(pre + "self_attn.q_proj.bias"))
            assert torch.equal(bias[1][2], ref.get_tensor(pre + "self_attn.v_proj.bias"))
        inter = cfg.hf_config.intermediate_size // 2
        gate_up = [m[pre + "mlp.gate_up_proj.weight"].split(inter) for m in p]
        for j, proj in enumerate(("gate", "up")):
            full_w = ref.get_tensor(pre + f"mlp.{proj}_proj.weight")
            assert torch.equal(torch.cat([g[j] for g in gate_up]), full_w)
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            assert torch.equal(torch.cat([m[pre + name] for m in p], dim=1), ref.get_tensor(pre + name))
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            assert all(torch.equal(m[pre + name], ref.get_tensor(pre + name)) for m in p)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        cat = torch.cat([m[name] for m in p])
        assert cat.shape[0] == VOCAB + 1  # padded to a multiple of tp
        assert torch.equal(cat[:VOCAB], ref.get_tensor(name)) and not cat[VOCAB:].any()
    assert ranks[0].model.layers[0].self_attn.attn.num_heads == heads // 2
    assert ranks[0].model.layers[0].self_attn.attn.num_kv_heads == max(kv // 2, 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_worker(rank: int, port: int, paths: list[str], out_dir: str) -> None:
    with gloo_rank(rank, port, 2):
        tp = TPGroup(rank=rank, size=2)
        for i, path in enumerate(paths):
            cfg, model = _load(path, tp)
            logits, _ = run_prefill(model, cfg, 2, _prompts(), page_size=4)
            torch.save(logits, os.path.join(out_dir, f"logits-{i}-rank{rank}.pt"))


def test_tp2_logits_equal_tp1(model_dir):
    """One spawn of two gloo ranks runs kv_heads=2 (tp divides) and kv_heads=1 (tp > kv heads)."""
    import torch.multiprocessing as mp

    paths = [model_dir("llama"), model_dir("qwen2_kv1")]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_tp_worker, args=(_free_port(), paths, out), nprocs=2, join=True)
        for i, path in enumerate(paths):
            cfg, model = _load(path)
            ref, _ = run_prefill(model, cfg, 1, _prompts(), page_size=4)
            got = [torch.load(os.path.join(out, f"logits-{i}-rank{r}.pt")) for r in range(2)]
            assert torch.equal(got[0], got[1])  # every rank returns the full, identical logits
            assert got[0].shape == ref.shape
            assert (got[0] - ref).abs().max().item() < ATOL, path
