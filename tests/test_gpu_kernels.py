"""GPU attention kernels against the naive torch reference on randomly permuted paged caches.

Covers the Triton paged decode (split-K, GQA/MQA, odd head dims, page sizes 1 and 16), the
Triton absorbed MLA decode, the prefill paths of `attention.gpu_prefill` (Triton paged prefill
always; torch varlen_attn / flash_attn where present), the kernel selection, and CUDA-graph
capture and replay of both decodes with new lengths and page tables.

Skipped without CUDA. Off CI, `TRITON_INTERPRET=1 pytest tests/test_gpu_kernels.py` runs the
Triton kernels on CPU through Triton's interpreter (the FlashAttention and CUDA-graph tests
still skip); the shims below work around two interpreter bugs of Triton 3.6 (bf16 tl.dot
multiplies raw bits; loop bounds from loaded scalars fail under NumPy >= 2.3).

Tolerances, against a float32 reference computed on the same (upcast) inputs:
- float32: 1e-4 abs + 1e-4 rel (true fp32 dots; only summation order and exp2 differ);
- bf16: 2e-2 abs + 1e-2 rel (p is rounded to bf16 before the PV product, the output to bf16);
- fp16: 1e-2 abs + 5e-3 rel.
Every output buffer is poisoned with NaN first, so an unwritten element fails.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

pytestmark = pytest.mark.gpu

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not torch.cuda.is_available() and not INTERPRET:
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1 to run the Triton kernels on CPU)", allow_module_level=True)
pytest.importorskip("triton")

from attention import gpu_prefill, kernels, torch_ops  # noqa: E402
from attention.triton_decode import paged_decode  # noqa: E402
from attention.triton_mla_decode import mla_decode  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
ON_GPU = DEVICE == "cuda"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a real CUDA device")

TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=2e-2, rtol=1e-2),
    torch.float16: dict(atol=1e-2, rtol=5e-3),
}


def _install_interpreter_shims() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    create_dot = interp.InterpreterBuilder.create_dot

    def upcast(x):
        if x.dtype == tl.bfloat16:  # stored as uint16: convert the bits, don't multiply them
            data = interp._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return interp.TensorHandle(data, tl.float32)
        return x

    def create_dot_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, upcast(a), upcast(b), d, input_precision, max_num_imprecise_acc)

    patch_tensor = interp._patch_lang_tensor

    def patch_tensor_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interp.InterpreterBuilder.create_dot = create_dot_bf16
    interp._patch_lang_tensor = patch_tensor_index


if INTERPRET:
    _install_interpreter_shims()


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------

DECODE_LENS = [1, 7, 33, 300, 1030]


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def paged_cache(kv_lens, kv_heads, k_dim, v_dim, page_size, dtype, seed, extra_pages=0):
    """K/V caches of randomly permuted pages (page 0 never used) and the page table / token
    table of each request; table columns past a request's pages hold random stale pages."""
    g = torch.Generator().manual_seed(seed)
    used = sum(_cdiv(k, page_size) for k in kv_lens)
    num_pages = used + 1 + extra_pages
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    k_cache = torch.randn(num_pages * page_size, kv_heads, k_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_pages * page_size, kv_heads, v_dim, generator=g).to(dtype)
    width = max(_cdiv(k, page_size) for k in kv_lens)
    page_table = torch.randint(1, num_pages, (len(kv_lens), width), generator=g, dtype=torch.int32)
    for i, kl in enumerate(kv_lens):
        for j in range(_cdiv(kl, page_size)):
            page_table[i, j] = perm.pop()
    token_table = kernels._pages_to_token_table(page_table, page_size)
    return k_cache.to(DEVICE), v_cache.to(DEVICE), page_table.to(DEVICE), token_table.to(DEVICE)


def ref_attention(q, k_cache, v_cache, token_table, q_lens, kv_lens, scaling, causal=True):
    """float32 reference on upcast inputs."""
    return torch_ops.paged_attention_ref(
        q.float(), k_cache.float(), v_cache.float(), token_table, q_lens, kv_lens, scaling, causal
    )


def ref_mla(q, kv_cache, token_table, kv_lens, scaling, lora):
    """float64 absorbed MLA: every head over the one latent per token, v = latent."""
    out = []
    for i, kl in enumerate(kv_lens):
        kv = kv_cache[token_table[i, :kl].long(), 0].double()  # [kl, L + R]
        s = q[i].double() @ kv.T * scaling  # [H, kl]
        out.append(torch.softmax(s, dim=-1) @ kv[:, :lora])
    return torch.stack(out).float()


def assert_close(out, ref, dtype):
    assert not torch.isnan(out).any(), "unwritten (NaN-poisoned) or NaN output"
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


# ---------------------------------------------------------------------------------------------
# Triton paged decode
# ---------------------------------------------------------------------------------------------

HEAD_SHAPES = [(4, 4, 40), (8, 2, 80), (7, 1, 96), (32, 8, 128)]


@pytest.mark.parametrize("num_splits", [None, 1, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads,dim", HEAD_SHAPES)
def test_paged_decode(heads, kv_heads, dim, page_size, dtype, num_splits):
    kc, vc, pt, tt = paged_cache(DECODE_LENS, kv_heads, dim, dim, page_size, dtype, seed=dim + page_size)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(len(DECODE_LENS), heads, dim, generator=g).to(dtype).to(DEVICE)
    lens = torch.tensor(DECODE_LENS, dtype=torch.int32, device=DEVICE)
    scale = dim**-0.5
    out = poisoned((len(DECODE_LENS), heads, dim), dtype)
    got = paged_decode(q, kc, vc, pt, lens, scale, page_size, num_splits=num_splits, out=out)
    assert got is out
    ref = ref_attention(q, kc, vc, tt, [1] * len(DECODE_LENS), DECODE_LENS, scale)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_decode_fp16_and_v_dim(page_size):
    # fp16, and a value head dim different from the key head dim.
    lens = [1, 64, 65, 500]
    kc, vc, pt, tt = paged_cache(lens, 2, 64, 48, page_size, torch.float16, seed=7)
    q = torch.randn(len(lens), 6, 64).half().to(DEVICE)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    got = paged_decode(q, kc, vc, pt, seqlens, 0.125, page_size, num_splits=3)
    assert got.shape == (len(lens), 6, 48) and got.dtype == torch.float16
    assert_close(got, ref_attention(q, kc, vc, tt, [1] * len(lens), lens, 0.125), torch.float16)


def test_paged_decode_many_empty_splits():
    # 32 splits over requests of 1..70 tokens: most splits are empty and must not count.
    lens = [1, 2, 63, 64, 65, 70]
    kc, vc, pt, tt = paged_cache(lens, 1, 32, 32, 1, torch.float32, seed=3)
    q = torch.randn(len(lens), 4, 32).to(DEVICE)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    got = paged_decode(q, kc, vc, pt, seqlens, 0.2, 1, num_splits=32)
    assert_close(got, ref_attention(q, kc, vc, tt, [1] * len(lens), lens, 0.2), torch.float32)


@pytest.mark.parametrize("counters", [None, 4])
def test_paged_decode_merges_in_last_program_or_merge_kernel(monkeypatch, counters):
    """Splits merged by the last-arriving program (counters back at zero afterwards, a request of
    length 0 gets zeros), or, with more (request, KV head) pairs than counters, by the merge
    kernel: both equal the reference."""
    from attention import triton_decode
    from attention.arrival import arrival_counters

    if counters is not None:
        monkeypatch.setattr(triton_decode, "COUNTERS", counters)
    lens = [0, 1, 70, 300]
    kc, vc, pt, tt = paged_cache(lens, 2, 64, 64, 16, torch.float32, seed=5)
    q = torch.randn(len(lens), 8, 64).to(DEVICE)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = poisoned((len(lens), 8, 64), torch.float32)
    paged_decode(q, kc, vc, pt, seqlens, 0.125, 16, num_splits=4, out=out)
    assert torch.equal(out[0].cpu(), torch.zeros(8, 64))
    assert_close(out[1:], ref_attention(q[1:], kc, vc, tt[1:], [1] * 3, lens[1:], 0.125), torch.float32)
    assert int(arrival_counters(q.device, 1).abs().sum()) == 0


@pytest.mark.parametrize("requests,launch", [(130, (32, 2, 2)), (80, (32, 2, 3))], ids=["many", "mid"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_decode_many_programs(page_size, requests, launch):
    """Past MANY_PROGRAMS (request, KV head) programs, and within MID_PROGRAMS, stage 1 takes
    its other launches (32-token blocks on two warps; two stages, three): 130 and 80 requests x
    8 KV heads of mixed lengths, bf16."""
    from attention.triton_decode import MANY_PROGRAMS, MID_PROGRAMS, stage1_launch

    lens = [1 + (i * 37) % 300 for i in range(requests)]
    programs = len(lens) * 8
    assert programs >= MANY_PROGRAMS or MID_PROGRAMS[0] <= programs <= MID_PROGRAMS[1]
    assert stage1_launch(programs, torch.bfloat16) == launch
    kc, vc, pt, tt = paged_cache(lens, 8, 128, 128, page_size, torch.bfloat16, seed=11)
    q = torch.randn(len(lens), 32, 128).bfloat16().to(DEVICE)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = poisoned((len(lens), 32, 128), torch.bfloat16)
    paged_decode(q, kc, vc, pt, seqlens, 128**-0.5, page_size, out=out)
    assert_close(out, ref_attention(q, kc, vc, tt, [1] * len(lens), lens, 128**-0.5), torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# Triton MLA decode
# ---------------------------------------------------------------------------------------------

MLA_SHAPES = [(16, 512, 64), (5, 32, 8)]  # (heads, kv_lora_rank, rope)


@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,lora,rope", MLA_SHAPES)
def test_mla_decode(heads, lora, rope, page_size, dtype, num_splits):
    lens = DECODE_LENS
    kv, _, pt, tt = paged_cache(lens, 1, lora + rope, 1, page_size, dtype, seed=lora + page_size)
    g = torch.Generator().manual_seed(2)
    q = (torch.randn(len(lens), heads, lora + rope, generator=g) * 0.3).to(dtype).to(DEVICE)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = (128 + rope) ** -0.5
    out = poisoned((len(lens), heads, lora), dtype)
    got = mla_decode(q, kv, pt, seqlens, scale, page_size, lora, num_splits=num_splits, out=out)
    assert got is out
    assert_close(out, ref_mla(q, kv, tt, lens, scale, lora), dtype)


def test_torch_mla_decode_matches_reference():
    # The CPU/fallback absorbed decode of kernels.py against the float64 reference.
    lens = [1, 9, 40]
    kv, _, pt, tt = paged_cache(lens, 1, 40, 1, 16, torch.float32, seed=11)
    q = torch.randn(len(lens), 3, 40).to(DEVICE)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    got = kernels.torch_mla_decode(q, kv, pt, seqlens, 0.2, 16, 32)
    assert_close(got, ref_mla(q, kv, tt, lens, 0.2, 32), torch.float32)


# ---------------------------------------------------------------------------------------------
# Prefill
# ---------------------------------------------------------------------------------------------

EXTEND_SHAPES = {
    # (q_lens, kv_lens)
    "decode_only": ([1, 1, 1, 1, 1], [1, 7, 33, 64, 5]),
    "prefill_only": ([5, 17, 1, 31, 130], [5, 17, 1, 31, 130]),
    "mixed": ([1, 9, 1, 20], [40, 9, 3, 26]),
    "long_prefix": ([3, 70, 1], [300, 1030, 77]),
}


def extend_case(shape, heads, kv_heads, dim, page_size, dtype, seed=0):
    q_lens, kv_lens = EXTEND_SHAPES[shape]
    kc, vc, _, tt = paged_cache(kv_lens, kv_heads, dim, dim, page_size, dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(q_lens), heads, dim, generator=g).to(dtype).to(DEVICE)
    return q, kc, vc, tt, q_lens, kv_lens


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 40), (7, 1, 96), (32, 8, 128)])
@pytest.mark.parametrize("shape", list(EXTEND_SHAPES))
def test_triton_extend(shape, heads, kv_heads, dim, page_size, dtype, causal):
    q, kc, vc, tt, q_lens, kv_lens = extend_case(shape, heads, kv_heads, dim, page_size, dtype)
    scale = dim**-0.5
    got = gpu_prefill.paged_extend_triton(q, kc, vc, tt, q_lens, kv_lens, scale, causal)
    assert_close(got, ref_attention(q, kc, vc, tt, q_lens, kv_lens, scale, causal), dtype)


def _flash_impls() -> list[str]:
    if not ON_GPU:
        return []
    impls = []
    if gpu_prefill.flash_attn_available():
        impls.append("flash_attn")
    if gpu_prefill.torch_varlen_available():
        impls += ["torch_varlen", "torch_varlen_direct"]
    return impls + (["triton_varlen"] if gpu_prefill.hopper(DEVICE) else [])  # (measured and chosen on Hopper only)


@gpu_only
def test_torch_varlen_alignment_probe_reports():
    # Not a pass/fail of the kernel: record which alignment this torch's varlen_attn has, so a
    # top-left result (and the Triton fallback it causes) is visible in the test log.
    if not gpu_prefill.torch_varlen_available():
        pytest.skip("this torch has no torch.nn.attention.varlen")
    bottom_right = gpu_prefill.torch_varlen_bottom_right(DEVICE)
    print(f"torch varlen_attn causal mask bottom-right aligned: {bottom_right}")


@gpu_only
@pytest.mark.parametrize("impl", _flash_impls() or ["none"])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 64), (8, 2, 80), (32, 8, 128)])
@pytest.mark.parametrize("shape", list(EXTEND_SHAPES))
@pytest.mark.parametrize("strided", [False, True])
def test_flash_extend(impl, shape, heads, kv_heads, dim, strided):
    """torch_varlen: through the wrapper; torch_varlen_direct: ATen's kernel called directly on
    GQA K/V and (strided) q a slice of a wider tensor, as the fused qkv product leaves it."""
    if impl == "none":
        pytest.skip("neither flash_attn nor torch varlen_attn here")
    if impl.startswith("torch_varlen") and not gpu_prefill.torch_varlen_bottom_right(DEVICE):
        pytest.skip("torch varlen_attn's causal mask is not bottom-right aligned here")
    if impl == "torch_varlen_direct" and not gpu_prefill.aten_flash_ok(DEVICE):
        pytest.skip("ATen's FlashAttention called directly failed its probe here")
    q, kc, vc, tt, q_lens, kv_lens = extend_case(shape, heads, kv_heads, dim, 16, torch.bfloat16)
    if strided:
        q = torch.cat([q, torch.randn_like(q[:, :1])], dim=1)[:, :heads]
    scale = dim**-0.5
    ext = (gpu_prefill.RaggedFlashExtend("torch_varlen", direct=impl == "torch_varlen_direct")
           if impl.startswith("torch_varlen") else gpu_prefill.RaggedFlashExtend(impl))
    got = ext(q, kc, vc, tt, q_lens, kv_lens, scale, True)
    assert_close(got, ref_attention(q, kc, vc, tt, q_lens, kv_lens, scale, True), torch.bfloat16)
    got = ext(q, kc, vc, tt, q_lens, kv_lens, scale, False)
    assert_close(got, ref_attention(q, kc, vc, tt, q_lens, kv_lens, scale, False), torch.bfloat16)


@gpu_only
@pytest.mark.parametrize("dim", [80, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_triton_varlen_reads_only_its_own_columns(dim, causal):
    """q, K and V as slices of wider rows whose other columns are NaN (the other heads of a
    fused product; for 80 a head dim the kernel pads to 128), and a NaN-poisoned output: any read
    outside a head's own columns, or an unwritten output row, shows as NaN. Prompts of odd
    lengths, with and without a cached prefix, several query blocks each (Hopper: what the
    kernel's launch was sized for)."""
    from attention.triton_varlen import varlen_attention

    if not gpu_prefill.hopper(DEVICE):
        pytest.skip("the Triton varlen kernel runs on Hopper GPUs")

    q_lens, kv_lens, heads, kv_heads = [1, 300, 129, 7], [40, 300, 1000, 7], 8, 2
    g = torch.Generator().manual_seed(dim)

    def wide(tokens, h):
        x = torch.full((tokens, h + 1, 128 + dim), float("nan"))
        x[:, :h, :dim] = torch.randn(tokens, h, dim, generator=g)
        return x.to(torch.bfloat16).to(DEVICE)[:, :h, :dim]

    q, k, v = wide(sum(q_lens), heads), wide(sum(kv_lens), kv_heads), wide(sum(kv_lens), kv_heads)
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)  # noqa: E731
    got = varlen_attention(q, k, v, cu(q_lens), cu(kv_lens), max(q_lens), max(kv_lens), dim**-0.5, causal,
                           out=poisoned(q.shape, torch.bfloat16))
    table = torch.zeros(len(kv_lens), max(kv_lens), dtype=torch.long, device=DEVICE)
    for i, (start, n) in enumerate(zip(cu(kv_lens)[:-1].tolist(), kv_lens)):
        table[i, :n] = torch.arange(start, start + n, device=DEVICE)
    want = torch_ops.paged_attention_ref(q, k, v, table, q_lens, kv_lens, dim**-0.5, causal)
    assert_close(got, want, torch.bfloat16)


@gpu_only
def test_triton_varlen_extend_sends_wide_heads_elsewhere():
    """Head dims past what the Triton varlen kernel was measured on (256: Qwen3-Next) go to the
    extend the device would use without it; the kernel itself refuses them."""
    from attention.triton_varlen import varlen_attention

    q, kc, vc, tt, q_lens, kv_lens = extend_case("long_prefix", 4, 2, 256, 16, torch.bfloat16)
    ext = gpu_prefill.RaggedFlashExtend("triton_varlen", wide=gpu_prefill.select_prefill(DEVICE, False)[1])
    for causal in (True, False):
        got = ext(q, kc, vc, tt, q_lens, kv_lens, 256**-0.5, causal)
        assert_close(got, ref_attention(q, kc, vc, tt, q_lens, kv_lens, 256**-0.5, causal), torch.bfloat16)
    cu = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="head dim 256"):
        varlen_attention(q[:3], kc[:3], vc[:3], cu, cu, 3, 3, 1.0, True)


@gpu_only
def test_aten_flash_probe_passes_where_torch_varlen_does():
    """On a GPU whose varlen_attn passed its probe, the direct call must too (the prefill's
    three copies a layer depend on it); a failure here says the fallback is in use."""
    if not (gpu_prefill.torch_varlen_available() and gpu_prefill.torch_varlen_bottom_right(DEVICE)):
        pytest.skip("no usable torch varlen_attn here")
    assert gpu_prefill.aten_flash_ok(DEVICE)


def test_ragged_plan_gathers_each_request_in_order():
    q_lens, kv_lens = [2, 1, 3], [5, 1, 3]
    table = torch.arange(30, device=DEVICE).reshape(3, 10) * 7
    plan = gpu_prefill.build_ragged_plan(table, q_lens, kv_lens)
    want = torch.cat([table[i, :k] for i, k in enumerate(kv_lens)])
    assert torch.equal(plan.kv_slots.cpu(), want.long().cpu())
    assert plan.cu_q.tolist() == [0, 2, 3, 6] and plan.cu_k.tolist() == [0, 5, 6, 9]
    assert (plan.max_q, plan.max_k) == (3, 5)


# ---------------------------------------------------------------------------------------------
# Selection: the fields a backend calls, with their signatures
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
def test_selected_kernels_match_reference(page_size):
    ks = kernels.select_kernels(DEVICE, page_size=page_size)
    print(ks.description)
    dtype = torch.bfloat16
    q, kc, vc, tt, q_lens, kv_lens = extend_case("long_prefix", 8, 2, 64, page_size, dtype, seed=5)
    got = ks.extend(q, kc, vc, tt, q_lens, kv_lens, 0.125, True)
    assert_close(got, ref_attention(q, kc, vc, tt, q_lens, kv_lens, 0.125), dtype)

    lens = [1, 33, 1030]
    kc, vc, pt, tt = paged_cache(lens, 2, 64, 64, page_size, dtype, seed=6)
    q = torch.randn(len(lens), 8, 64).to(dtype).to(DEVICE)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    ref = ref_attention(q, kc, vc, tt, [1] * len(lens), lens, 0.125)
    assert_close(ks.decode(q, kc, vc, tt, seqlens, max(lens), 0.125), ref, dtype)
    assert_close(ks.decode_paged(q, kc, vc, pt, seqlens, 0.125, page_size), ref, dtype)

    kv, _, pt, tt = paged_cache(lens, 1, 40, 1, page_size, dtype, seed=8)
    q = torch.randn(len(lens), 4, 40).to(dtype).to(DEVICE)
    got = ks.mla_decode(q, kv, pt, seqlens, 0.15, page_size, 32)
    assert_close(got, ref_mla(q, kv, tt, lens, 0.15, 32), dtype)


def test_cpu_selection_is_sdpa():
    ks = kernels.select_kernels("cpu")
    assert ks.extend is torch_ops.paged_extend_sdpa and ks.decode is torch_ops.paged_decode_sdpa
    assert ks.mla_decode is kernels.torch_mla_decode


# ---------------------------------------------------------------------------------------------
# CUDA graphs: capture once on static buffers, replay with new lengths and page tables
# ---------------------------------------------------------------------------------------------


def _graph_inputs(lens, max_pages, page_size, num_pages, seed):
    g = torch.Generator().manual_seed(seed)
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    table = torch.randint(1, num_pages, (len(lens), max_pages), generator=g, dtype=torch.int32)
    for i, kl in enumerate(lens):
        for j in range(_cdiv(kl, page_size)):
            table[i, j] = perm.pop()
    return table


@gpu_only
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_decode_cuda_graph_replay(kind):
    bs, page_size, max_pages, num_splits = 8, 16, 80, 6
    max_len = max_pages * page_size
    num_pages = bs * max_pages + 1
    dtype = torch.bfloat16
    if kind == "mha":
        heads, kv_heads, dim, v_dim = 32, 8, 128, 128
    else:
        heads, kv_heads, dim, v_dim = 16, 1, 576, 512
    kc = torch.randn(num_pages * page_size, kv_heads, dim, device=DEVICE, dtype=dtype)
    vc = torch.randn(num_pages * page_size, kv_heads, v_dim, device=DEVICE, dtype=dtype)
    s_q = torch.randn(bs, heads, dim, device=DEVICE, dtype=dtype)
    s_table = torch.ones(bs, max_pages, dtype=torch.int32, device=DEVICE)
    s_lens = torch.ones(bs, dtype=torch.int32, device=DEVICE)
    s_out = torch.empty(bs, heads, v_dim, device=DEVICE, dtype=dtype)
    scale = dim**-0.5

    def run():
        if kind == "mha":
            paged_decode(s_q, kc, vc, s_table, s_lens, scale, page_size, num_splits=num_splits, out=s_out)
        else:
            mla_decode(s_q, kc, s_table, s_lens, scale, page_size, v_dim, num_splits=num_splits, out=s_out)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()

    for trial, lens in enumerate([[1] * bs, [1, 7, 33, 300, 1030, max_len, 16, 17], [max_len] * bs]):
        table = _graph_inputs(lens, max_pages, page_size, num_pages, seed=trial)
        s_table.copy_(table)
        s_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        s_q.copy_(torch.randn(bs, heads, dim, dtype=dtype))
        s_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        tt = kernels._pages_to_token_table(s_table, page_size)
        if kind == "mha":
            ref = ref_attention(s_q, kc, vc, tt, [1] * bs, lens, scale)
        else:
            ref = ref_mla(s_q, kc, tt, lens, scale, v_dim)
        assert_close(s_out, ref, dtype)


def test_num_splits_is_host_only():
    from attention.triton_decode import MAX_SPLITS, choose_num_splits

    dev = torch.device(DEVICE)
    assert choose_num_splits(1, 1, dev) == 1
    assert choose_num_splits(10_000, 1 << 20, dev) == 1
    assert 1 < choose_num_splits(8, 4096, dev) <= MAX_SPLITS
    assert math.isfinite(choose_num_splits(1, 1 << 20, dev))
