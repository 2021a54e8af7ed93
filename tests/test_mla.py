"""DeepSeek-V2/V3 (MLA attention, MoE) against `transformers`, and the MLA backend's own math.

Variants cover: V2 without q LoRA (greedy MoE, YaRN with mscale_all_dim), V2 with q LoRA
(group_limited_greedy MoE), V3 with q LoRA (sigmoid + correction-bias routing, interleaved
RoPE), V3 dense without q LoRA (rotate-half RoPE, YaRN).

Tolerances (float32): logits within 1e-4 of transformers (matmul blocking and summation order
differ), and within 1e-5 between two manta computations of the same quantity (absorbed vs
non-absorbed decode, chunked vs unchunked prefix reads, TP=2 vs TP=1 after an all-reduce).
"""

from __future__ import annotations

import os
import socket
import tempfile

import pytest
import torch

from attention.flash import FlashAttentionBackend
from attention.mla import MLAAttentionLayer
from attention.torch_ops import paged_attention_ref
from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from tests.fixtures import gloo_rank, tiny_model_dir
from tests.test_engine import PROMPTS, check_against_hf, greedy
from workers.forward_batch import ForwardBatch, ForwardMode
from workers.loader import load_model
from workers.memory_pool import MLATokenToKVPool, ReqToTokenPool
from workers.model_config import ModelConfig
from workers.parallel import TPGroup

ATOL_HF = 1e-4
ATOL_SELF = 1e-5
CHUNK = 3  # prefix tokens per request decompressed at once: small, so prefixes span chunks

_YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
}
VARIANTS = {
    "v2_moe": ("deepseek_v2", {"rope_scaling": _YARN}),
    "v2_qlora_grouped": (
        "deepseek_v2",
        {"q_lora_rank": 32, "topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1},
    ),
    "v3_moe": ("deepseek_v3", {}),
    "v3_dense": (
        "deepseek_v3",
        {"moe": False, "q_lora_rank": None, "rope_interleave": False, "rope_scaling": _YARN},
    ),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    def get(name: str) -> str:
        arch, kw = VARIANTS[name]
        return str(tiny_model_dir(tmp_path_factory, arch, max_position=128, **kw))

    return get


def _load(path: str, tp: TPGroup | None = None):
    cfg = ModelConfig.from_pretrained(path, "float32")
    return cfg, load_model(cfg, tp or TPGroup(), "cpu", torch.float32)


class Cache:
    """An MLA pool with req rows 0..B-1; request i's slots are contiguous from its own pages
    (page 0 reserved), in reverse page order so tables are not the identity."""

    def __init__(
        self, cfg: ModelConfig, capacity: int, num_reqs: int, page_size: int = 4, chunk: int = CHUNK
    ):
        pages_per_req = -(-capacity // page_size)
        self.slots = [
            torch.arange(p * page_size, p * page_size + capacity)
            for p in range(num_reqs * pages_per_req + 1 - pages_per_req, 0, -pages_per_req)
        ]
        self.lens = [0] * num_reqs
        self.req_pool = ReqToTokenPool(num_reqs, cfg.max_context_len, "cpu")
        self.pool = MLATokenToKVPool(
            num_reqs * pages_per_req + 1,
            page_size,
            cfg.num_layers,
            cfg.kv_lora_rank,
            cfg.qk_rope_head_dim,
            torch.float32,
            "cpu",
        )
        self.backend = FlashAttentionBackend(page_size, use_mla=True, prefix_chunk_tokens=chunk)

    def step(self, new_tokens: list[torch.Tensor]) -> ForwardBatch:
        """Append new_tokens[i] to request i (an EXTEND, or a DECODE if all have one token)."""
        ext = [t.numel() for t in new_tokens]
        prefix = list(self.lens)
        locs = [s[p : p + n] for s, p, n in zip(self.slots, prefix, ext)]
        for row, (p, loc) in enumerate(zip(prefix, locs)):
            self.req_pool.write(row, p, loc)
        self.lens = [p + n for p, n in zip(prefix, ext)]
        seq = torch.tensor(self.lens)
        decode = all(n == 1 for n in ext) and all(p > 0 for p in prefix)
        extra = (
            {}
            if decode
            else dict(
                extend_seq_lens=torch.tensor(ext),
                extend_seq_lens_cpu=ext,
                extend_prefix_lens=torch.tensor(prefix),
                extend_prefix_lens_cpu=prefix,
                extend_start_loc=torch.nn.functional.pad(torch.cumsum(torch.tensor(ext), 0), (1, 0)),
            )
        )
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            batch_size=len(ext),
            input_ids=torch.cat(new_tokens),
            positions=torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, ext)]),
            req_pool_indices=torch.arange(len(ext)),
            seq_lens=seq,
            seq_lens_cpu=seq.clone(),
            out_cache_loc=torch.cat(locs),
            req_to_token_pool=self.req_pool,
            kv_pool=self.pool,
            attn_backend=self.backend,
            **extra,
        )
        self.backend.init_forward_metadata(fb)
        return fb


def _logits(model, fb: ForwardBatch) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(fb.input_ids, fb.positions, fb))


def _prompts(vocab: int, lens=(5, 11, 3), seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lens]


# ---- the model against transformers -----------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_logits_match_transformers(model_dir, variant):
    from transformers import AutoModelForCausalLM

    path = model_dir(variant)
    cfg, model = _load(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    check_prefill_and_decode(cfg, model, hf, variant)


def check_prefill_and_decode(cfg: ModelConfig, model, hf, variant: str) -> None:
    """A prefill of three prompts and one decode step (the absorbed path) against `hf`."""
    prompts = _prompts(cfg.vocab_size)
    cache = Cache(cfg, 32, len(prompts))
    logits = _logits(model, cache.step(prompts))
    start, nxt = 0, []
    with torch.no_grad():
        for p in prompts:
            ref = hf(p[None]).logits[0]
            assert (logits[start : start + p.numel()] - ref).abs().max().item() < ATOL_HF, variant
            nxt.append(logits[start + p.numel() - 1].argmax().view(1))
            start += p.numel()
        step = _logits(model, cache.step(nxt))  # DECODE: the absorbed path
        for i, p in enumerate(prompts):
            ref = hf(torch.cat([p, nxt[i]])[None]).logits[0, -1]
            assert (step[i] - ref).abs().max().item() < ATOL_HF, variant


def _engine(path: str, **kw) -> Engine:
    """The FA backend in MLA mode (the default, and what attention_backend="mla" names)."""
    engine = Engine(EngineConfig(model=path, **kw))
    backend = engine.workers.runner.attn_backend
    assert isinstance(backend, FlashAttentionBackend) and backend.use_mla
    backend.prefix_chunk_tokens = CHUNK  # read cached prefixes in several chunks
    return engine


@pytest.mark.parametrize(
    "variant,options",
    [
        ("v2_moe", dict(page_size=4)),
        ("v2_qlora_grouped", dict(page_size=4, chunked_prefill_size=3, max_num_batched_tokens=7)),
        ("v3_moe", dict(page_size=1, chunked_prefill_size=5, max_num_batched_tokens=9)),
        ("v3_dense", dict(page_size=4)),
        # attention_backend="mla": the same backend, checked to serve an MLA model.
        ("v2_qlora_grouped", dict(page_size=4, chunked_prefill_size=3, max_num_batched_tokens=7,
                                  attention_backend="mla")),
    ],
)
def test_engine_greedy_equals_transformers(model_dir, variant, options):
    """Staggered mixed-length batches through the real Engine (decodes, extends, and with
    chunked prefill MIXED steps whose later chunks read earlier ones from the cache)."""
    path = model_dir(variant)
    check_against_hf(_engine(path, **options), path, PROMPTS[:4])


def test_engine_prefix_cache_hits(model_dir):
    path = model_dir("v3_moe")
    engine = _engine(path, page_size=4)
    shared = PROMPTS[2] + " and then"
    engine.generate([shared], greedy(2))
    check_against_hf(engine, path, [shared + " the king", shared + " a dragon came"])
    assert engine.scheduler.stats.prefix_hit_tokens >= 4 * CHUNK


# ---- the backend's own math ---------------------------------------------------------------------


def test_absorbed_decode_equals_non_absorbed():
    """Random latents, mixed lengths: the absorbed decode, the MHA-form extend (one new token
    per request, prefix read in chunks) and naive per-head attention over decompressed K/V agree."""
    g = torch.Generator().manual_seed(0)
    heads, nope, rope, lora, v_dim, ps = 3, 8, 4, 16, 6, 4
    lens = [1, 5, 17, 8]
    w = torch.randn(heads, nope + v_dim, lora, generator=g) / lora**0.5
    w_uk, w_uv = w[:, :nope], w[:, nope:]

    def expand_kv(entries):
        kv = torch.einsum("nc,hdc->nhd", entries[:, :lora], w)
        k_pe = entries[:, None, lora:].expand(-1, heads, -1)
        return torch.cat((kv[..., :nope], k_pe), -1), kv[..., nope:]

    layer = MLAAttentionLayer(
        layer_id=0,
        num_heads=heads,
        num_kv_heads=1,
        head_dim=nope + rope,
        scaling=0.3,
        v_head_dim=v_dim,
        kv_lora_rank=lora,
        qk_rope_head_dim=rope,
        expand_kv=expand_kv,
    )
    pool = MLATokenToKVPool(40, ps, 1, lora, rope, torch.float32, "cpu")
    req_pool = ReqToTokenPool(len(lens), 64, "cpu")
    # Scattered pages (never page 0), each request's tokens filling its pages in order.
    pages = (torch.randperm(pool.num_pages - 1, generator=g) + 1).tolist()
    tables = []
    for n in lens:
        own = [pages.pop() for _ in range((n + ps - 1) // ps)]
        tables.append(torch.tensor([own[t // ps] * ps + t % ps for t in range(n)]))
    perm = torch.cat(tables)
    for i, t in enumerate(tables):
        req_pool.write(i, 0, t)
    entries = torch.randn(sum(lens), 1, lora + rope, generator=g)
    pool.set_mla_kv_buffer(0, perm, entries[:, 0, :lora], entries[:, 0, lora:])
    last = torch.stack([t[-1] for t in tables])  # each request's newest token is written now
    new_entries = pool.kv_buffer[0][last].clone()
    q_nope = torch.randn(len(lens), heads, nope, generator=g)
    q_pe = torch.randn(len(lens), heads, rope, generator=g)
    seq = torch.tensor(lens)

    def batch(mode, **kw):
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=len(lens),
            input_ids=torch.zeros(len(lens), dtype=torch.long),
            positions=seq - 1,
            req_pool_indices=torch.arange(len(lens)),
            seq_lens=seq,
            seq_lens_cpu=seq.clone(),
            out_cache_loc=last,
            req_to_token_pool=req_pool,
            kv_pool=pool,
            **kw,
        )
        backend.init_forward_metadata(fb)
        return fb

    backend = FlashAttentionBackend(ps, use_mla=True, prefix_chunk_tokens=4)
    fb = batch(ForwardMode.DECODE)
    q_lat = torch.einsum("bhn,hnc->bhc", q_nope, w_uk)
    lat_out = backend.forward_decode(torch.cat((q_lat, q_pe), -1), new_entries, None, layer, fb)
    absorbed = torch.einsum("bhc,hvc->bhv", lat_out.view(len(lens), heads, lora), w_uv)

    ones = [1] * len(lens)
    fb = batch(
        ForwardMode.EXTEND,
        extend_seq_lens=torch.ones(len(lens), dtype=torch.long),
        extend_seq_lens_cpu=ones,
        extend_prefix_lens=seq - 1,
        extend_prefix_lens_cpu=[n - 1 for n in lens],
    )
    assert len(backend.chunk_plan.chunks) == 4  # the longest prefix, 16 tokens, in chunks of 4
    mha = backend.forward_extend(torch.cat((q_nope, q_pe), -1), new_entries, None, layer, fb)

    k_all, v_all = expand_kv(pool.kv_buffer[0][:, 0])
    naive = paged_attention_ref(
        torch.cat((q_nope, q_pe), -1), k_all, v_all, req_pool.req_to_token, ones, lens, layer.scaling
    )
    assert (absorbed - naive).abs().max().item() < ATOL_SELF
    assert (mha.view_as(naive) - naive).abs().max().item() < ATOL_SELF


@pytest.mark.parametrize("variant", ["v2_moe", "v3_moe"])
def test_prefill_over_chunked_prefix_equals_uncached(model_dir, variant):
    """Prefill in two steps (the second reads prefixes of 9, 2 and 14 tokens in chunks of 2)
    gives the logits of one prefill without a cache, and the same cached latents."""
    cfg, model = _load(model_dir(variant))
    full = _prompts(cfg.vocab_size, lens=(15, 12, 20), seed=1)
    split = (9, 2, 14)
    one = Cache(cfg, 32, 3)
    ref = _logits(model, one.step(full)).split([t.numel() for t in full])
    two = Cache(cfg, 32, 3, chunk=2)
    _logits(model, two.step([t[:s] for t, s in zip(full, split)]))
    second = [t[s:] for t, s in zip(full, split)]
    got = _logits(model, two.step(second)).split([t.numel() for t in second])
    assert len(two.backend.chunk_plan.chunks) == 7
    for r, g, t in zip(ref, got, second):
        assert (r[-t.numel() :] - g).abs().max().item() < ATOL_SELF
    for layer in range(cfg.num_layers):
        a, b = one.pool.kv_buffer[layer], two.pool.kv_buffer[layer]
        for s1, s2, t in zip(one.slots, two.slots, full):
            assert (a[s1[: t.numel()]] - b[s2[: t.numel()]]).abs().max().item() < ATOL_SELF


@pytest.mark.parametrize("dtype,size", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_mla_pool_bytes_per_token(dtype, size):
    pool = MLATokenToKVPool(3, 4, 5, 32, 8, dtype, "cpu")
    assert pool.bytes_per_token() == (32 + 8) * size * 5
    assert pool.kv_buffer[0].shape == (12, 1, 40)


def test_runner_uses_mla_pool_and_backend(model_dir):
    from workers.model_runner import ModelRunner, RunnerOptions

    runner = ModelRunner(RunnerOptions(model=model_dir("v3_moe"), kv_cache_tokens=64, page_size=4))
    cfg = runner.model_config
    assert cfg.use_mla and isinstance(runner.attn_backend, FlashAttentionBackend) and runner.attn_backend.use_mla
    assert not runner.attn_backend.skip_kv_cache
    assert isinstance(runner.kv_pool, MLATokenToKVPool)
    per_layer = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    assert runner.kv_pool.bytes_per_token() == per_layer * cfg.num_layers


# ---- tensor parallelism -------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_run(model, cfg, out_dir: str, tag: str) -> None:
    prompts = _prompts(cfg.vocab_size)
    cache = Cache(cfg, 32, len(prompts))
    logits = [_logits(model, cache.step(prompts))]
    logits.append(_logits(model, cache.step([t[-1].argmax().view(1) for t in logits[0].split([5, 11, 3])])))
    torch.save({"logits": logits, "pool": cache.pool.kv_buffer}, os.path.join(out_dir, f"{tag}.pt"))


def _tp_worker(rank: int, port: int, paths: list[str], out_dir: str) -> None:
    with gloo_rank(rank, port, 2):
        for i, path in enumerate(paths):
            cfg, model = _load(path, TPGroup(rank=rank, size=2))
            _tp_run(model, cfg, out_dir, f"{i}-rank{rank}")


def test_tp2_logits_and_latents_equal_tp1(model_dir):
    """Heads and every expert's intermediate split over two gloo ranks: prefill and one decode
    give the TP=1 logits, and both ranks' MLA pools hold identical latents."""
    import torch.multiprocessing as mp

    paths = [model_dir("v2_moe"), model_dir("v3_moe")]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_tp_worker, args=(_free_port(), paths, out), nprocs=2, join=True)
        for i, path in enumerate(paths):
            cfg, model = _load(path)
            _tp_run(model, cfg, out, f"{i}-tp1")
            ref, r0, r1 = (torch.load(os.path.join(out, f"{i}-{t}.pt")) for t in ("tp1", "rank0", "rank1"))
            for a, b, c in zip(ref["logits"], r0["logits"], r1["logits"]):
                assert torch.equal(b, c)
                assert (a - b).abs().max().item() < ATOL_SELF, path
            for a, b, c in zip(ref["pool"], r0["pool"], r1["pool"]):
                assert torch.equal(b, c)  # contract 5: the latent is the same on every rank
                assert (a - b).abs().max().item() < ATOL_SELF
