"""The FP8 KV cache on the GPU (`--kv-cache-dtype fp8_e4m3`, issue 25): every kernel that reads
the paged cache (Triton split-K decode, the absorbed MLA decode, the Triton and FlashAttention
prefills) on FP8 caches against the float32 reference on the dequantized cache, with the scales
folded as the backends fold them (K's into the softmax scale, V's into the output); the fused
RoPE + store kernel's FP8 write against the reference write; and the engine (CUDA graphs on)
against the CPU engine with the same FP8 cache. Skipped without CUDA.

Tolerance: the kernels widen the same FP8 values the reference dequantizes, so only the bf16
products differ (tests/test_gpu_kernels.py's bf16 bounds).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from attention import gpu_prefill  # noqa: E402
from attention.triton_decode import paged_decode  # noqa: E402
from attention.triton_mla_decode import mla_decode  # noqa: E402
from tests.test_gpu_kernels import (  # noqa: E402
    DECODE_LENS,
    EXTEND_SHAPES,
    assert_close,
    paged_cache,
    ref_attention,
    ref_mla,
)
from tests.test_kv_fp8 import llama, mla  # noqa: E402,F401 (fixtures: checkpoints with KV scales)
from workers import kv_quant  # noqa: E402

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16


def _fp8(cache: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the FP8 cache of `cache` at `scale`, its float32 dequantization: the reference's input)."""
    stored = kv_quant.quantize(cache * 3.0, scale)  # *3: values across the FP8 range, some saturated
    return stored, stored.float() * scale


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 40), (8, 2, 80), (32, 8, 128)])
@pytest.mark.parametrize("num_splits", [None, 1])
def test_paged_decode_on_fp8(heads, kv_heads, dim, page_size, num_splits):
    kc, vc, pt, tt = paged_cache(DECODE_LENS, kv_heads, dim, dim, page_size, BF16, seed=dim)
    (k8, kref), (v8, vref) = _fp8(kc, 0.02), _fp8(vc, 0.5)
    q = torch.randn(len(DECODE_LENS), heads, dim, device="cuda").to(BF16)
    lens = torch.tensor(DECODE_LENS, dtype=torch.int32, device="cuda")
    scale = dim**-0.5
    got = paged_decode(q, k8, v8, pt, lens, scale * 0.02, page_size, num_splits=num_splits) * 0.5
    assert got.dtype == BF16
    assert_close(got, ref_attention(q, kref, vref, tt, [1] * len(DECODE_LENS), DECODE_LENS, scale), BF16)


@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_decode_on_fp8_many_programs(page_size):
    """A serve-sized batch over an FP8 cache (past the bf16 cache's MANY_PROGRAMS, FP8 keeps its
    one launch): 200 requests x 8 KV heads of mixed lengths, bf16 queries widened to float16 in
    the kernel, against the float32 reference on the dequantized cache."""
    from attention.triton_decode import DECODE_BLOCK_N, MANY_PROGRAMS, decode_dtype, stage1_launch

    lens = [1 + (i * 53) % 400 for i in range(200)]
    assert len(lens) * 8 >= MANY_PROGRAMS and stage1_launch(len(lens) * 8, BF16, FP8) == (DECODE_BLOCK_N, 2, 5)
    kc, vc, pt, tt = paged_cache(lens, 8, 128, 128, page_size, BF16, seed=5)
    (k8, kref), (v8, vref) = _fp8(kc, 0.02), _fp8(vc, 0.5)
    q = torch.randn(len(lens), 32, 128, device="cuda").to(BF16)
    assert decode_dtype(q, k8) == torch.float16
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    got = paged_decode(q, k8, v8, pt, seqlens, 128**-0.5 * 0.02, page_size) * 0.5
    assert got.dtype == BF16
    assert_close(got, ref_attention(q, kref, vref, tt, [1] * len(lens), lens, 128**-0.5), BF16)


@pytest.mark.parametrize("block_n,warps,stages", [(None, None, None), (32, 2, 1), (128, 4, 2)])
@pytest.mark.parametrize("dim", [40, 128])
def test_paged_decode_fp8_words_equal_elements(dim, block_n, warps, stages):
    """The FP8 cache loaded as 16-bit words and widened in registers against e4m3 elements
    converted where Triton places it: both the float32 reference's output on the dequantized
    cache, from a loop of one block and of many, a head dim that is not a power of two, and one-
    and multi-stage loops. Words are the choice below FP8_WORDS_PROGRAMS with the kernel option
    `fp8_kv_words` on, elements past it or with it off."""
    from attention import kernel_options
    from attention.kernel_options import KernelOptions
    from attention.triton_decode import FP8_WORDS_PROGRAMS, widens_words

    lens = [1, 17, 64, 65, 300, 1000]
    kc, vc, pt, tt = paged_cache(lens, 2, dim, dim, 16, BF16, seed=11)
    (k8, kref), (v8, vref) = _fp8(kc, 0.02), _fp8(vc, 0.5)
    q = torch.randn(len(lens), 8, dim, device="cuda").to(BF16)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    ref = ref_attention(q, kref, vref, tt, [1] * len(lens), lens, dim**-0.5)
    got = {words: paged_decode(q, k8, v8, pt, seqlens, dim**-0.5 * 0.02, 16, block_n=block_n, num_warps=warps,
                               num_stages=stages, words=words) * 0.5 for words in (False, True)}
    for out in got.values():
        assert_close(out, ref, BF16)
    assert_close(got[True], got[False], BF16)
    assert widens_words(q, k8, v8, len(lens) * 2) and not widens_words(q, k8, v8, FP8_WORDS_PROGRAMS)
    try:
        kernel_options.install(KernelOptions(fp8_kv_words=False))
        assert not widens_words(q, k8, v8, len(lens) * 2)
    finally:
        kernel_options.install(KernelOptions())
    assert not widens_words(q.float(), k8, v8, 1)  # float32 products: no float16 widening


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,lora,rope", [(16, 512, 64), (5, 32, 8)])
def test_mla_decode_on_fp8(heads, lora, rope, page_size):
    kv, _, pt, tt = paged_cache(DECODE_LENS, 1, lora + rope, 1, page_size, BF16, seed=lora)
    kv8, kvref = _fp8(kv, 0.05)
    q = (torch.randn(len(DECODE_LENS), heads, lora + rope, device="cuda") * 0.3).to(BF16)
    seqlens = torch.tensor(DECODE_LENS, dtype=torch.int32, device="cuda")
    scale = (128 + rope) ** -0.5
    got = mla_decode(q, kv8, pt, seqlens, scale * 0.05, page_size, lora) * 0.05
    assert_close(got, ref_mla(q, kvref, tt, DECODE_LENS, scale, lora), BF16)


def _extends() -> list[str]:
    impls = ["triton"]
    if gpu_prefill.flash_attn_available():
        impls.append("flash_attn")
    if gpu_prefill.torch_varlen_available() and gpu_prefill.torch_varlen_bottom_right("cuda"):
        impls.append("torch_varlen")
    return impls + (["triton_varlen"] if gpu_prefill.hopper("cuda") else [])


@pytest.mark.parametrize("impl", _extends())
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 64), (7, 1, 96), (32, 8, 128)])
@pytest.mark.parametrize("shape", list(EXTEND_SHAPES))
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_on_fp8(impl, shape, heads, kv_heads, dim, causal):
    q_lens, kv_lens = EXTEND_SHAPES[shape]
    kc, vc, _, tt = paged_cache(kv_lens, kv_heads, dim, dim, 16, BF16, seed=dim)
    (k8, kref), (v8, vref) = _fp8(kc, 0.03), _fp8(vc, 0.25)
    q = torch.randn(sum(q_lens), heads, dim, device="cuda").to(BF16)
    extend = gpu_prefill.TritonExtend() if impl == "triton" else gpu_prefill.RaggedFlashExtend(impl)
    scale = dim**-0.5
    got = extend(q, k8, v8, tt, q_lens, kv_lens, scale * 0.03, causal) * 0.25
    assert got.dtype == BF16
    assert_close(got, ref_attention(q, kref, vref, tt, q_lens, kv_lens, scale, causal), BF16)


@pytest.mark.parametrize("scales", [(0.125, 0.0625), (0.0234, 0.0371)], ids=["dyadic", "arbitrary"])
@pytest.mark.parametrize("tokens,hq,hk,d", [(1, 32, 8, 128), (7, 12, 4, 64), (33, 5, 1, 80)])
def test_rope_store_writes_fp8(tokens, hq, hk, d, scales):
    """The fused write stores exactly the FP8 bytes the pool's write would store for the rotated
    k (which the kernel also leaves in k) and for v, saturated, no NaN; other slots untouched.
    (The rotation itself: tests/test_rope_store.py.)"""
    from workers.layers.rope_store import can_fuse, rope_and_store_kv
    from workers.layers.rotary import RopeConfig, RotaryEmbedding

    torch.manual_seed(tokens)
    rope = RotaryEmbedding(RopeConfig(head_dim=d, base=500000.0), 4096, "cuda")
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, dtype=BF16, device="cuda") * 40
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(tokens, hq, d), k.view(tokens, hk, d), v.view(tokens, hk, d)
    positions = torch.randint(0, 4096, (tokens,), device="cuda")
    loc = torch.randperm(256, device="cuda")[:tokens]
    kc, vc = torch.zeros(256, hk, d, dtype=FP8, device="cuda"), torch.zeros(256, hk, d, dtype=FP8, device="cuda")
    assert can_fuse(q, k, v, kc, vc, rope.cos_cache)
    rope_and_store_kv(positions, q, k, v, rope.cos_cache, rope.sin_cache, loc, kc, vc, *scales)
    for cache, x, scale in ((kc, k, scales[0]), (vc, v, scales[1])):
        assert torch.equal(cache[loc].view(torch.uint8), kv_quant.quantize(x, scale).view(torch.uint8))
        assert cache.float().abs().max().item() == 448.0 and not cache.float().isnan().any()  # saturated
        untouched = torch.ones(256, dtype=torch.bool, device="cuda")
        untouched[loc] = False
        assert not cache[untouched].view(torch.uint8).any()


# ---- the engine ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from tests.fixtures import tiny_model_dir

    return {arch: tiny_model_dir(tmp_path_factory, arch) for arch in ("llama", "deepseek_v2")}


@pytest.fixture(scope="module")
def scaled(llama, mla):  # noqa: F811
    """The CPU tests' checkpoints with per-layer KV scales: the engine folds them (under CUDA
    graphs too) and the fused RoPE + store kernel writes with them."""
    return {"llama": llama, "deepseek_v2": mla}


@pytest.mark.parametrize("arch", ["llama", "deepseek_v2"])
def test_gpu_float32_greedy_with_fp8_kv_equals_cpu(scaled, arch):
    """float32 activations, the FP8 cache with the checkpoint's per-layer scales, CUDA graphs and
    page 16 on the GPU: the CPU engine's greedy tokens (both read the same FP8 values through
    their own kernels)."""
    from cluster.engine.config import EngineConfig
    from cluster.engine.loop import Engine
    from tests.test_engine import PROMPTS, greedy, run_staggered

    def tokens(**kw):
        engine = Engine(EngineConfig(model=str(scaled[arch]), page_size=16, kv_cache_dtype="fp8_e4m3", **kw))
        try:
            return [r.token_ids for r in run_staggered(engine, PROMPTS, greedy())]
        finally:
            engine.shutdown()

    assert tokens(device="cuda", dtype="float32", max_running_requests=32) == tokens()


@pytest.mark.parametrize("arch", ["llama", "deepseek_v2"])
def test_gpu_bf16_fp8_kv_logits_close_to_bf16_kv(dirs, arch):
    """The logits error an FP8 cache adds to a bf16 model (first step, over the cache the
    prefill wrote): recorded (the 8B shape's: scripts/kv_fp8_error.py, BENCHMARKS.md). These
    tiny random models are sensitive (bf16 weights quantized to FP8 move them 10-13%,
    tests/test_gpu_fp8.py); DeepSeek-V2's moved 12.8% (H100, 2026-11-25): bound 25%, which a
    wrong scale or a misread page exceeds."""
    from cluster.engine.config import EngineConfig
    from cluster.engine.loop import Engine
    from tests.test_engine import PROMPTS, greedy

    def first_logits(kv: str) -> torch.Tensor:
        engine = Engine(EngineConfig(model=str(dirs[arch]), device="cuda", dtype="bfloat16", page_size=16,
                                     kv_cache_dtype=kv))
        try:
            runner = engine.workers.runner
            assert runner.kv_pool.dtype == (FP8 if kv != "auto" else BF16)
            captured = []
            original = runner.model.compute_logits
            runner.model.compute_logits = lambda h, o=original, c=captured: c.append(o(h)) or c[-1]
            engine.generate(PROMPTS, greedy(4))
            return captured[0].float().cpu()
        finally:
            engine.shutdown()

    ref, got = first_logits("auto"), first_logits("fp8_e4m3")
    rel = (got - ref).abs().max().item() / ref.abs().max().item()
    print(f"{arch}: FP8 KV cache moves the first logits by {rel:.2%} of the largest |logit|")
    assert 0 < rel < 0.25
