"""The fused RoPE + KV-cache write kernel (`workers.layers.rope_store`) against the unfused
reference (`fused.rope`, then the plain cache write), on random inputs: q/k/v as strided views of
one fused qkv output (as the model produces them), scattered cache slots, random positions, GQA,
MQA and odd head counts, a head dim whose half is no power of two, float32/bf16/fp16.

Skipped without CUDA; `TRITON_INTERPRET=1` runs the kernel on CPU through Triton's interpreter.
Tolerance: the kernel and the reference (compiled on CUDA) round once per element from float32
products of the same (dtype-cast) cos/sin; only the order of two float32 products may differ (one
ulp of the dtype). Under the interpreter the reference is eager torch, which rounds each product
and then the sum in a 16-bit dtype: up to two ulps there. V and every untouched cache slot must
match exactly, and so must a launch of several heads a program against one head a program.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not torch.cuda.is_available() and not INTERPRET:
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1 to run the Triton kernel on CPU)", allow_module_level=True)
pytest.importorskip("triton")

from workers.layers import rope_store  # noqa: E402
from workers.layers.rope_store import (  # noqa: E402
    WIDE_FROM_TOKENS,
    can_fuse,
    heads_per_program,
    rope_and_store_kv,
    rope_and_store_kv_ref,
)
from workers.layers.rotary import RopeConfig, RotaryEmbedding  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5),
       torch.bfloat16: dict(atol=4e-2, rtol=2e-2) if INTERPRET else dict(atol=2e-2, rtol=1e-2),
       torch.float16: dict(atol=2e-3, rtol=4e-3) if INTERPRET else dict(atol=2e-3, rtol=2e-3)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
# Below WIDE_FROM_TOKENS a program takes one head; from it on, several (8, 4, 2; or 1 for 5/1 heads).
@pytest.mark.parametrize("tokens,hq,hk,d", [(1, 32, 8, 128), (7, 12, 4, 64), (33, 5, 1, 80), (3, 4, 4, 128),
                                            (300, 32, 8, 128), (40, 12, 4, 64), (77, 6, 2, 80), (32, 16, 16, 128)])
def test_rope_store_equals_reference(dtype, tokens, hq, hk, d, monkeypatch):
    torch.manual_seed(tokens * 1000 + hq)
    max_pos, slots = 4096, 512
    rope = RotaryEmbedding(RopeConfig(head_dim=d, base=500000.0), max_pos, DEVICE)
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, dtype=dtype, device=DEVICE)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(tokens, hq, d), k.view(tokens, hk, d), v.view(tokens, hk, d)
    positions = torch.randint(0, max_pos, (tokens,), device=DEVICE)
    loc = torch.randperm(slots, device=DEVICE)[:tokens]
    k_cache = torch.randn(slots, hk, d, dtype=dtype, device=DEVICE)
    v_cache = torch.randn(slots, hk, d, dtype=dtype, device=DEVICE)
    ref_kc, ref_vc = k_cache.clone(), v_cache.clone()
    ref_q, ref_k = rope_and_store_kv_ref(positions, q.clone(), k.clone(), v, rope.cos_cache, rope.sin_cache, loc,
                                         ref_kc, ref_vc)
    if not INTERPRET:
        assert can_fuse(q, k, v, k_cache, v_cache, rope.cos_cache)
    v_before = v.clone()
    q_in, k_in, kc_in, vc_in = q.clone(), k.clone(), k_cache.clone(), v_cache.clone()
    rope_and_store_kv(positions, q, k, v, rope.cos_cache, rope.sin_cache, loc, k_cache, v_cache)
    torch.testing.assert_close(q, ref_q, **TOL[dtype])  # rotated in place
    torch.testing.assert_close(k, ref_k, **TOL[dtype])
    torch.testing.assert_close(k_cache, ref_kc, **TOL[dtype])
    assert torch.equal(v_cache, ref_vc) and torch.equal(v, v_before)
    untouched = torch.ones(slots, dtype=torch.bool, device=DEVICE)
    untouched[loc] = False
    assert torch.equal(k_cache[untouched], ref_kc[untouched])
    if heads_per_program(tokens, hq, hk) > 1:  # the same math, one head a program: bit for bit
        monkeypatch.setattr(rope_store, "WIDE_FROM_TOKENS", tokens + 1)
        assert heads_per_program(tokens, hq, hk) == 1
        q1, k1 = q_in.clone(), k_in.clone()
        kc1, vc1 = kc_in.clone(), vc_in.clone()
        rope_and_store_kv(positions, q1, k1, v, rope.cos_cache, rope.sin_cache, loc, kc1, vc1)
        assert torch.equal(q1, q) and torch.equal(k1, k) and torch.equal(kc1, k_cache) and torch.equal(vc1, v_cache)


def test_heads_per_program_divides_both_head_counts():
    assert heads_per_program(WIDE_FROM_TOKENS - 1, 32, 8) == 1
    assert [heads_per_program(WIDE_FROM_TOKENS, hq, hk) for hq, hk in [(32, 8), (12, 4), (6, 2), (5, 1), (64, 64)]] \
        == [8, 4, 2, 1, 8]


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs")
def test_rope_store_in_cuda_graph():
    """Captured once, replayed with new positions and slots in the same static tensors."""
    dtype, tokens, hq, hk, d = torch.bfloat16, 4, 8, 2, 128
    rope = RotaryEmbedding(RopeConfig(head_dim=d, base=10000.0), 1024, DEVICE)
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, dtype=dtype, device=DEVICE)
    positions = torch.zeros(tokens, dtype=torch.long, device=DEVICE)
    loc = torch.arange(tokens, device=DEVICE)
    k_cache = torch.zeros(64, hk, d, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros(64, hk, d, dtype=dtype, device=DEVICE)

    def run():
        q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        rope_and_store_kv(positions, q.view(tokens, hq, d), k.view(tokens, hk, d), v.view(tokens, hk, d),
                          rope.cos_cache, rope.sin_cache, loc, k_cache, v_cache)

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    fresh = torch.randn_like(qkv)
    qkv.copy_(fresh)
    positions.copy_(torch.tensor([5, 900, 17, 3], device=DEVICE))
    loc.copy_(torch.tensor([40, 2, 63, 11], device=DEVICE))
    k_cache.zero_()
    v_cache.zero_()
    graph.replay()
    q, k, v = fresh.split([hq * d, hk * d, hk * d], dim=-1)
    ref_kc, ref_vc = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    rope_and_store_kv_ref(positions, q.reshape(tokens, hq, d), k.reshape(tokens, hk, d), v.reshape(tokens, hk, d),
                          rope.cos_cache, rope.sin_cache, loc, ref_kc, ref_vc)
    torch.testing.assert_close(k_cache, ref_kc, **TOL[dtype])
    assert torch.equal(v_cache, ref_vc)
