"""FP8 KV cache (`--kv-cache-dtype fp8_e4m3`, issue 25) on the CPU: Llama (MHA/GQA) and
DeepSeek (MLA's latent cache), with per-layer scales from the checkpoint.

Oracle: transformers on the same checkpoint with every K and V rounded as an FP8 cache stores
them (x / scale saturated to e4m3, times scale): Llama through its attention function, DeepSeek
through its latent expansion (`expand_kv` gets the rounded latent and k_pe, which is what the
cache holds). Logits within 1e-3 in float32 (the two round K/V computed in a different matmul
order, so an element on an FP8 rounding edge may land one step apart), greedy tokens equal; and
against transformers without the rounding the logits are further off (the cache is FP8).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from attention.flash import FlashAttentionBackend
from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from tests.fixtures import tiny_model_dir
from tests.test_engine import PROMPTS, greedy
from tests.test_llama_model import Cache as MHACache
from tests.test_mla import Cache as MLACache
from workers.loader import load_model
from workers.memory_pool import kv_bytes_per_token, make_kv_pool
from workers.model_config import ModelConfig
from workers.parallel import TPGroup

ATOL = 1e-3
FP8 = torch.float8_e4m3fn
# Per layer (k, v): unequal, so a scale applied to the wrong tensor or layer shows.
# (Dyadic, so that a float32 tensor holds them exactly.)
SCALES = {0: (1 / 64, 1 / 16), 1: (1 / 8, 1 / 128)}


def _round(x: torch.Tensor, scale: float) -> torch.Tensor:
    """An FP8 cache's write then read, written out here independently of workers.kv_quant."""
    return ((x.float() / scale).clamp(-448.0, 448.0).to(FP8).float() * scale).to(x.dtype)


def _with_scales(path, scales=SCALES) -> str:
    """The checkpoint with compressed-tensors' KV-cache scale tensors added (one per layer, K and V)."""
    f = next(path.glob("*.safetensors"))
    tensors = load_file(f)
    for i, (k, v) in scales.items():
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v)
    save_file(tensors, f)
    return str(path)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    src = tiny_model_dir(tmp_path_factory, "llama", layers=2, vocab=513, max_position=64)
    dst = tmp_path_factory.mktemp("kvfp8") / "llama"
    shutil.copytree(src, dst)
    return _with_scales(dst)


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    src = tiny_model_dir(tmp_path_factory, "deepseek_v2", max_position=128)
    dst = tmp_path_factory.mktemp("kvfp8") / "mla"
    shutil.copytree(src, dst)
    return _with_scales(dst, {i: ((i + 1) / 32, 0.5) for i in range(ModelConfig.from_pretrained(str(src)).num_layers)})


def _hf(path: str, rounded: bool):
    """transformers on `path`; `rounded`: every K and V as an FP8 cache with the checkpoint's
    scales returns them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    if not rounded:
        return model
    scales = {}
    for name, t in load_file(next(Path(path).glob("*.safetensors"))).items():
        if name.endswith(("k_scale", "v_scale")):
            scales[(int(name.split(".")[2]), name[-7])] = float(t)
    for layer in model.model.layers:
        attn, i = layer.self_attn, layer.self_attn.layer_idx
        if hasattr(attn, "expand_kv"):  # MLA: the cache holds the normed latent and the rotated k_pe
            def expand(kv_nope, k_rot, _orig=attn.expand_kv, _s=scales[(i, "k")]):
                return _orig(_round(kv_nope, _s), _round(k_rot, _s))

            attn.expand_kv = expand
    if not any(hasattr(layer.self_attn, "expand_kv") for layer in model.model.layers):
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
        from transformers.models.llama.modeling_llama import eager_attention_forward

        def attend(module, query, key, value, *args, **kwargs):
            i = module.layer_idx
            return eager_attention_forward(module, query, _round(key, scales[(i, "k")]),
                                           _round(value, scales[(i, "v")]), *args, **kwargs)

        AttentionInterface.register("fp8_kv_test", attend)  # with eager's masks (a causal mask given, not implied)
        AttentionMaskInterface.register("fp8_kv_test", ALL_MASK_ATTENTION_FUNCTIONS["eager"])
        model.config._attn_implementation = "fp8_kv_test"
        model.set_attn_implementation("fp8_kv_test")
    return model


def _load(path: str):
    cfg = ModelConfig.from_pretrained(path, "float32", kv_cache_dtype="fp8_e4m3")
    return cfg, load_model(cfg, TPGroup(), "cpu", torch.float32)


def _prompts(vocab: int, lens=(5, 11, 3), seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lens]


def _check_rows(mine: torch.Tensor, ref_rows: list[torch.Tensor], plain_rows: list[torch.Tensor]) -> None:
    ref, plain = torch.cat(ref_rows), torch.cat(plain_rows)
    err = (mine - ref).abs().max().item()
    assert err < ATOL, err
    assert (mine - plain).abs().max().item() > 10 * max(err, 1e-5)  # the cache is FP8, not the model dtype


@pytest.mark.parametrize("page_size", [1, 4])
def test_llama_prefill_and_decode_match_transformers_with_fp8_kv(llama, page_size):
    cfg, model = _load(llama)
    assert cfg.kv_dtype == FP8 and model.kv_cache_scales == {i: {"k": k, "v": v} for i, (k, v) in SCALES.items()}
    prompts = _prompts(cfg.vocab_size)
    cache = MHACache(cfg, 1, [p.numel() for p in prompts], page_size)
    cache.kv_pool = make_kv_pool(cfg, 1, cache.kv_pool.num_pages, page_size, "cpu", model.kv_cache_scales)
    cache.backend = FlashAttentionBackend(page_size)  # the product's backend (CPU: SDPA kernels)
    assert cache.kv_pool.k_buffer[0].dtype == FP8 and cache.kv_pool.scales(1) == SCALES[1]
    hf, plain = _hf(llama, rounded=True), _hf(llama, rounded=False)
    with torch.no_grad():
        fb = cache.extend(prompts)
        logits = model.compute_logits(model(fb.input_ids, fb.positions, fb))
        _check_rows(logits, [hf(p[None]).logits[0] for p in prompts], [plain(p[None]).logits[0] for p in prompts])
        nxt = [int(logits[sum(q.numel() for q in prompts[: i + 1]) - 1].argmax()) for i in range(len(prompts))]
        fb = cache.decode(torch.tensor(nxt), [p.numel() for p in prompts])
        step = model.compute_logits(model(fb.input_ids, fb.positions, fb))
        full = [torch.cat([p, torch.tensor([t])])[None] for p, t in zip(prompts, nxt)]
        _check_rows(step, [hf(x).logits[0, -1:] for x in full], [plain(x).logits[0, -1:] for x in full])


def test_mla_prefill_chunked_prefix_and_decode_match_transformers_with_fp8_kv(mla):
    """A prefill, a second extend over the cached prefix (read in chunks of 3 tokens from the
    FP8 latent cache), then an absorbed decode step, each against transformers."""
    cfg, model = _load(mla)
    prompts = _prompts(cfg.vocab_size)
    more = _prompts(cfg.vocab_size, lens=(4, 2, 6), seed=1)
    cache = MLACache(cfg, 40, len(prompts))
    cache.pool = make_kv_pool(cfg, 1, cache.pool.num_pages, cache.pool.page_size, "cpu", model.kv_cache_scales)
    assert cache.pool.kv_buffer[0].dtype == FP8 and cache.pool.scales(1) == (1 / 16, 1 / 16)  # MLA: K's scale
    hf, plain = _hf(mla, rounded=True), _hf(mla, rounded=False)
    with torch.no_grad():
        def run(tokens):
            fb = cache.step(tokens)
            return model.compute_logits(model(fb.input_ids, fb.positions, fb))

        logits = run(prompts)
        _check_rows(logits, [hf(p[None]).logits[0] for p in prompts], [plain(p[None]).logits[0] for p in prompts])
        logits = run(more)  # EXTEND over a cached prefix
        seqs = [torch.cat([p, m]) for p, m in zip(prompts, more)]
        _check_rows(logits, [hf(s[None]).logits[0, -m.numel():] for s, m in zip(seqs, more)],
                    [plain(s[None]).logits[0, -m.numel():] for s, m in zip(seqs, more)])
        nxt = [logits[sum(m.numel() for m in more[: i + 1]) - 1].argmax().view(1) for i in range(len(more))]
        step = run(nxt)  # DECODE: the absorbed kernel over the FP8 latents
        seqs = [torch.cat([s, t])[None] for s, t in zip(seqs, nxt)]
        _check_rows(step, [hf(s).logits[0, -1:] for s in seqs], [plain(s).logits[0, -1:] for s in seqs])


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("which", ["llama", "mla"])
def test_engine_greedy_equals_transformers_with_fp8_kv(llama, mla, which):
    """Through the engine: chunked prefill (pieces of 8 tokens), the prefix cache (the second
    round shares the first's prompts) and decodes over the FP8 cache."""
    path = llama if which == "llama" else mla
    engine = Engine(EngineConfig(model=path, page_size=4, kv_cache_dtype="fp8_e4m3", chunked_prefill_size=8))
    hf = _hf(path, rounded=True)
    try:
        for _ in range(2):
            for prompt, res in zip(PROMPTS, engine.generate(PROMPTS, greedy(8))):
                assert res.token_ids == _hf_greedy(hf, engine.tokenize(prompt), 8), prompt
    finally:
        engine.shutdown()


def test_pool_bytes_scales_and_refusals(llama, mla, tmp_path):
    for path in (llama, mla):
        plain = ModelConfig.from_pretrained(path, "bfloat16")
        fp8 = ModelConfig.from_pretrained(path, "bfloat16", kv_cache_dtype="fp8_e4m3")
        assert plain.kv_dtype == torch.bfloat16 and fp8.kv_dtype == FP8
        assert 2 * kv_bytes_per_token(fp8, 1) == kv_bytes_per_token(plain, 1)  # twice the tokens per byte
    # No checkpoint scales: 1.0 per layer (and a model-dtype pool ignores any).
    cfg = ModelConfig.from_pretrained(llama, "float32", kv_cache_dtype="fp8_e4m3")
    assert make_kv_pool(cfg, 1, 4, 4, "cpu").scales(0) == (1.0, 1.0)
    plain = ModelConfig.from_pretrained(llama, "float32")
    assert make_kv_pool(plain, 1, 4, 4, "cpu", {0: {"k": 0.5, "v": 0.5}}).scales(0) == (1.0, 1.0)
    with pytest.raises(ValueError, match="--kv-cache-dtype 'int4'"):
        ModelConfig.from_pretrained(llama, kv_cache_dtype="int4")
    # A scale that is not one positive number is refused at load, naming the tensor.
    bad = tmp_path / "bad"
    shutil.copytree(llama, bad)
    _with_scales(bad, {1: (-0.5, 0.1)})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_scale"):
        _load(str(bad))


def test_values_past_the_fp8_range_saturate(llama):
    """K/V beyond 448 x scale are stored as +-448 x scale (a bare cast would give NaN on a GPU)."""
    cfg = ModelConfig.from_pretrained(llama, "float32", kv_cache_dtype="fp8_e4m3")
    pool = make_kv_pool(cfg, 1, 4, 4, "cpu", {0: {"k": 0.5, "v": 2.0}})
    k = torch.full((1, pool.num_kv_heads, pool.head_dim), 1000.0)
    pool.set_kv_buffer(0, torch.tensor([5]), k, -k)
    assert pool.k_buffer[0][5].float().unique().tolist() == [448.0]  # 1000 / 0.5 saturates
    assert pool.v_buffer[0][5].float().unique().tolist() == [-448.0]  # -1000 / 2 saturates
    assert torch.equal(pool.readback(k, 0), torch.full_like(k, 224.0))



@pytest.mark.parametrize("which", ["llama", "mla"])
def test_store_pages_of_an_fp8_cache_are_their_own(llama, mla, which):
    """The KV store's identity of a replica names the KV dtype: FP8 pages (a quarter of the
    float32 bytes) are never read by a replica whose cache holds float32, or the reverse."""
    from cluster.engine.kv_store_link import _identity

    path = llama if which == "llama" else mla
    plain = _identity(path, "float32", "cpu", 16, 1)
    fp8 = _identity(path, "float32", "cpu", 16, 1, None, "fp8_e4m3")
    assert plain[0] != fp8[0] and plain[1] == fp8[1] and plain[2] == 4 * fp8[2]


@pytest.mark.parametrize("which", ["llama", "mla"])
def test_tp2_equals_tp1_with_fp8_kv(llama, mla, which):
    """Two gloo ranks under torch multiprocessing, each with its share of the kv heads (MHA) or
    the whole latent (MLA), in FP8 with the checkpoint's per-layer scales: TP=1's greedy tokens."""
    path = llama if which == "llama" else mla
    cfg = dict(model=path, page_size=4, kv_cache_dtype="fp8_e4m3")
    want = Engine(EngineConfig(**cfg)).generate(PROMPTS[:3], greedy(8))
    tp2 = Engine(EngineConfig(**cfg, tp_size=2))
    try:
        got = tp2.generate(PROMPTS[:3], greedy(8))
    finally:
        tp2.shutdown()
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


def test_scale_layouts_and_arbitrary_values(llama, tmp_path):
    """ModelOpt's names (`self_attn.k_proj.k_scale`, `self_attn.attn.v_scale`) are read too, and
    a scale that is no power of two is written as x * (1 / scale) in float32 everywhere: the
    oracle rounds x / scale, which lands one FP8 step apart only on a rounding edge."""
    other = tmp_path / "modelopt"
    shutil.copytree(llama, other)
    f = next(other.glob("*.safetensors"))
    tensors = {k: v for k, v in load_file(f).items() if not k.endswith(("k_scale", "v_scale"))}
    tensors["model.layers.0.self_attn.k_proj.k_scale"] = torch.tensor(0.0234)
    tensors["model.layers.0.self_attn.attn.v_scale"] = torch.tensor(0.0371)
    save_file(tensors, f)
    cfg, model = _load(str(other))
    assert model.kv_cache_scales == {0: {"k": pytest.approx(0.0234), "v": pytest.approx(0.0371)}}
    pool = make_kv_pool(cfg, 1, 8, 4, "cpu", model.kv_cache_scales)
    assert pool.scales(1) == (1.0, 1.0)  # a layer without scales
    x = torch.randn(3, pool.num_kv_heads, pool.head_dim)
    pool.set_kv_buffer(0, torch.tensor([4, 5, 6]), x, x)
    oracle = _round(x, pool.scales(0)[0])
    steps = (pool.k_buffer[0][4:7].float() * pool.scales(0)[0] - oracle).abs()
    assert (steps <= oracle.abs() * 0.125 + 2**-9 * 0.0234).all() and (steps > 0).float().mean() < 0.01


def test_store_identity_follows_the_scales(llama, tmp_path, monkeypatch):
    """A copy of the checkpoint recalibrated with other KV scales writes other FP8 bytes: its
    pages are not the original's, even where the weights' identity cannot tell the two apart
    (here the weights' identity is made the same for both)."""
    import kvstore.keys
    from cluster.engine.kv_store_link import _identity

    other = tmp_path / "recalibrated"
    shutil.copytree(llama, other)
    _with_scales(other, {0: (1 / 32, 1 / 16), 1: (1 / 8, 1 / 128)})
    monkeypatch.setattr(kvstore.keys, "weights_identity", lambda path, cache=None: "same weights")
    ident = _identity.__wrapped__  # (not the per-process memo)
    assert ident(llama, "float32", "cpu", 16, 1)[0] == ident(str(other), "float32", "cpu", 16, 1)[0]
    assert ident(llama, "float32", "cpu", 16, 1, None, "fp8_e4m3")[0] != \
        ident(str(other), "float32", "cpu", 16, 1, None, "fp8_e4m3")[0]


def test_the_logits_error_script_reads_each_prompt_s_row_of_a_batched_step(llama):
    """`scripts/kv_fp8_error.py --together` (every prompt in one prefill step and one decode step,
    as serving batches run the decode kernel) maps each step's logits rows back to their
    requests: on the CPU, where a row's math does not depend on its batch, each prompt's rows
    equal those of the prompts run one at a time, in the same order; and the decode rows are not
    the prefill's."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "scripts" / "kv_fp8_error.py"
    spec = importlib.util.spec_from_file_location("kv_fp8_error", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 513, (n,), generator=gen).tolist() for n in (20, 9, 31, 14, 20)]
    one = EngineConfig(model=llama, page_size=4, kv_cache_dtype="fp8_e4m3")
    together = EngineConfig(model=llama, page_size=4, kv_cache_dtype="fp8_e4m3", max_num_batched_tokens=128,
                            chunked_prefill_size=64)
    for decode in (False, True):
        alone = script.first_logits(one, prompts, decode)
        batched = script.first_logits(together, prompts, decode, together=True)
        assert alone.shape == batched.shape == (len(prompts), 513)
        torch.testing.assert_close(batched, alone, atol=1e-4, rtol=1e-4)
        assert (alone.argmax(-1).unique().numel() > 1)  # the rows differ: a permutation would show
    prefill = script.first_logits(together, prompts, False, together=True)
    assert (prefill - batched).abs().max() > 1e-2
    for split in (dict(max_num_batched_tokens=40), dict(max_num_batched_tokens=128, chunked_prefill_size=8)):
        with pytest.raises(RuntimeError, match="max-num-batched-tokens"):  # steps that split the prompts: refused
            script.first_logits(EngineConfig(model=llama, page_size=4, **split), prompts, True, together=True)
