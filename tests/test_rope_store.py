"""The fused RoPE + KV-cache write kernel (`workers.layers.rope_store`) against the unfused
reference (`fused.rope`, then the plain cache write), on random inputs: q/k/v as strided views of
one fused qkv output (as the model produces them), scattered cache slots, random positions, GQA,
MQA and odd head counts, a head dim whose half is no power of two, float32/bf16/fp16.

Skipped without CUDA; `TRITON_INTERPRET=1` runs the kernel on CPU through Triton's interpreter.
Tolerance: the kernel and the reference round once per element from float32 products of the
same (dtype-cast) cos/sin; only the order of two float32 products may differ (one ulp of the
dtype). V and every untouched cache slot must match exactly.
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

from workers.layers.rope_store import can_fuse, rope_and_store_kv, rope_and_store_kv_ref  # noqa: E402
from workers.layers.rotary import RopeConfig, RotaryEmbedding  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens,hq,hk,d", [(1, 32, 8, 128), (7, 12, 4, 64), (33, 5, 1, 80), (3, 4, 4, 128)])
def test_rope_store_equals_reference(dtype, tokens, hq, hk, d):
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
    rope_and_store_kv(positions, q, k, v, rope.cos_cache, rope.sin_cache, loc, k_cache, v_cache)
    torch.testing.assert_close(q, ref_q, **TOL[dtype])  # rotated in place
    torch.testing.assert_close(k, ref_k, **TOL[dtype])
    torch.testing.assert_close(k_cache, ref_kc, **TOL[dtype])
    assert torch.equal(v_cache, ref_vc) and torch.equal(v, v_before)
    untouched = torch.ones(slots, dtype=torch.bool, device=DEVICE)
    untouched[loc] = False
    assert torch.equal(k_cache[untouched], ref_kc[untouched])


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
