"""The decode-size MoE kernels (`workers.layers.moe_kernels`) and the MLA rope/norm/store kernel
(`workers.layers.mla_rope_store`) against the torch ops they replace, on random inputs: the
router of each DeepSeek family (V2 greedy, V2 group-limited, V3 with its bias and top-2 groups)
against `DeepseekRouter`, `align` against `moe_align` (exact), `combine` against the float32
sum and the unfused add, the MLA kernel against `_rope`, RMSNorm and `set_mla_kv_buffer`.

On CUDA, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1 with triton installed);
skipped elsewhere (CI has no triton). Tolerances: the router's weights to 1e-5 relative (float32
products in another order) with the same expert sets; align exact; combine and the MLA kernel
to one ulp of the dtype (the same roundings; float32 sums in another order), two under the
interpreter, whose float32 -> bf16 casts truncate where the GPU's round to nearest."""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
ON_GPU = torch.cuda.is_available() and HAS_TRITON
if not (ON_GPU or (INTERPRET and HAS_TRITON)):
    pytest.skip("needs CUDA with triton, or TRITON_INTERPRET=1 with triton installed", allow_module_level=True)
DEVICE = "cuda" if ON_GPU else "cpu"
if not ON_GPU:
    from tests.triton_interpreter import install_interpreter_shims

    install_interpreter_shims()
BF16_ULPS = 1 if ON_GPU else 2

from workers.layers import fused, mla_rope_store, moe_kernels  # noqa: E402
from workers.layers.fused_moe import max_blocks, moe_align  # noqa: E402
from workers.models.deepseek import DeepseekFamily, _rope  # noqa: E402
from workers.models.deepseek_moe import DeepseekRouter  # noqa: E402

FAMILIES = {  # name: (family, experts, top_k)
    "v2_greedy": (DeepseekFamily(2, True, True, False, "greedy", False, 1.0, 1, 1), 64, 6),
    "v2_groups": (DeepseekFamily(2, True, True, False, "group_limited_greedy", False, 16.0, 8, 3), 160, 6),
    "v3": (DeepseekFamily(3, True, False, False, "noaux_tc", True, 2.5, 8, 4), 256, 8),
    "v3_small": (DeepseekFamily(3, True, False, False, "noaux_tc", True, 1.0, 4, 2), 24, 3),
}


def _router(name: str, hidden: int, dtype) -> DeepseekRouter:
    family, experts, k = FAMILIES[name]
    hf = SimpleNamespace(n_routed_experts=experts, num_experts_per_tok=k, hidden_size=hidden)
    r = DeepseekRouter(hf, family, dtype, DEVICE)
    with torch.no_grad():
        r.weight.copy_(torch.randn(experts, hidden) * 0.05)
        if family.version == 3:
            r.e_score_correction_bias.copy_(torch.rand(experts) * 0.1)
    return r


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("tokens", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_route_equals_the_torch_router(name, tokens, dtype):
    torch.manual_seed(tokens)
    hidden = 200 if tokens == 5 else 256
    r = _router(name, hidden, dtype)
    x = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    want_w, want_ids = r.forward_torch(x)
    got_w, got_ids = r.forward_kernel(x)
    if ON_GPU:  # what the model calls at this batch size
        assert torch.equal(r(x)[1], got_ids)
    assert got_ids.dtype == torch.int32
    order_got, order_want = got_ids.long().sort(dim=1), want_ids.sort(dim=1)
    assert torch.equal(order_got.values, order_want.values)
    torch.testing.assert_close(got_w.gather(1, order_got.indices), want_w.gather(1, order_want.indices),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t,k,e,block_m", [(1, 6, 64, 16), (3, 2, 4, 16), (16, 6, 64, 16), (17, 6, 64, 16),
                                          (64, 6, 64, 16), (5, 2, 3, 4), (16, 8, 256, 16),
                                          (85, 6, 64, 16)])  # the last: the most pairs that fit 64 experts
def test_align_equals_moe_align(t, k, e, block_m):
    gen = torch.Generator().manual_seed(t * 100 + e)
    ids = torch.rand(t, e, generator=gen).argsort(dim=1)[:, :k].contiguous().to(DEVICE)
    want_pairs, want_blocks = moe_align(ids, e, block_m)
    assert moe_kernels.align_fits(t * k, e)
    got_pairs, got_blocks = moe_kernels.align(ids.int(), e, block_m, max_blocks(t * k, e, block_m))
    assert torch.equal(got_pairs.long(), want_pairs) and torch.equal(got_blocks.long(), want_blocks)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t,k,n", [(1, 6, 2048), (7, 2, 33), (16, 8, 1500)])
@pytest.mark.parametrize("with_add", [False, True])
def test_combine_equals_the_sum_and_add(dtype, t, k, n, with_add):
    torch.manual_seed(n)
    prod = torch.randn(t * k, n, device=DEVICE).to(dtype)
    add = torch.randn(t, n, device=DEVICE).to(dtype) if with_add else None
    want = prod.view(t, k, n).sum(dim=1, dtype=torch.float32).to(dtype)
    if add is not None:
        want = want + add
    ulp = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-2 * BF16_ULPS, rtol=8e-3 * BF16_ULPS)
    torch.testing.assert_close(moe_kernels.combine(prod, k, add), want, **ulp)


@pytest.mark.parametrize("dtype,fp32", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, True)])
@pytest.mark.parametrize("tokens,heads", [(1, 16), (5, 3), (16, 20)])
def test_mla_rope_store_equals_the_torch_ops(dtype, fp32, tokens, heads):
    torch.manual_seed(tokens * heads)
    nope, rope, lora, eps = 128, 64, 512, 1e-6
    family = SimpleNamespace(rope_interleave=True, rope_fp32=fp32)
    max_pos = 300
    freqs = torch.rand(max_pos, rope // 2) * 6
    rotary = SimpleNamespace(cos_cache=freqs.cos().to(DEVICE) * 1.1, sin_cache=freqs.sin().to(DEVICE) * 1.1)
    q = (torch.randn(tokens, heads, nope + rope + 8, device=DEVICE) * 3).to(dtype)[..., : nope + rope]  # strided
    kv_a = (torch.randn(tokens, lora + rope, device=DEVICE) * 2).to(dtype)
    w = (torch.rand(lora, device=DEVICE) + 0.5).to(dtype)
    positions = torch.randint(0, max_pos, (tokens,), device=DEVICE)
    loc = torch.randperm(40, device=DEVICE)[:tokens]
    cache = torch.zeros(40, 1, lora + rope, dtype=dtype, device=DEVICE)
    assert mla_rope_store.applies(q, kv_a, cache, rotary.cos_cache, rope) or not ON_GPU
    q_pe = mla_rope_store.rope_norm_store(positions, q, kv_a, w, eps, rotary.cos_cache, rotary.sin_cache, cache,
                                          loc, nope, fp32)
    want_q, want_k = _rope(rotary, family, positions, q[..., nope:], kv_a[:, None, lora:])
    want_entry = torch.cat((fused._rms_norm(kv_a[:, :lora], w, eps), want_k[:, 0]), dim=-1)
    ulp = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2 if ON_GPU else 0.25, rtol=8e-3 * BF16_ULPS)
    torch.testing.assert_close(q_pe, want_q, **ulp)
    torch.testing.assert_close(cache[loc, 0], want_entry, **ulp)
    untouched = torch.ones(40, dtype=torch.bool, device=DEVICE)
    untouched[loc] = False
    assert not cache[untouched].any()
