"""The fused MoE path (`workers.layers.fused_moe`): `moe_align` always (CPU, no triton needed);
the Triton grouped GEMM against `moe_loop` on CUDA, or on CPU through Triton's interpreter
with TRITON_INTERPRET=1 (float32 only there: Triton 3.6's interpreter multiplies raw bf16 bits
in tl.dot); CUDA-graph capture and replay with new routing on CUDA only.

Tolerances against `moe_loop` on the same inputs: float32 1e-4 abs + 1e-4 rel (true fp32 dots,
only the summation order differs); bf16 3e-2 abs + 2e-2 rel (the loop rounds each expert's
contribution to bf16 and sums in bf16, the fused path sums the k rows in float32).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from workers.layers.fused_moe import fused_moe, max_blocks, moe_align, moe_loop

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
ON_GPU = torch.cuda.is_available() and HAS_TRITON
DEVICE = "cuda" if ON_GPU else "cpu"

needs_kernel = pytest.mark.skipif(
    not (ON_GPU or (INTERPRET and HAS_TRITON)),
    reason="needs CUDA with triton, or TRITON_INTERPRET=1 with triton installed (CPU interpreter)",
)
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a real CUDA device with triton")


def _install_interpreter_shim() -> None:
    """Triton 3.6's interpreter turns a scalar loop bound (`range(0, K, BLOCK_K)`) into a
    1-element array whose int() fails under NumPy >= 2.3: read its one element instead."""
    import numpy as np
    from triton.runtime import interpreter as interp

    if getattr(interp, "_manta_index_shim", False):
        return
    patch_tensor = interp._patch_lang_tensor

    def patch_tensor_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interp._patch_lang_tensor = patch_tensor_index
    interp._manta_index_shim = True


if INTERPRET and HAS_TRITON and not ON_GPU:
    _install_interpreter_shim()

TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
}


# ---------------------------------------------------------------------------------------------
# moe_align (pure torch, no triton)
# ---------------------------------------------------------------------------------------------

ALIGN_CASES = [  # (T, k, E, block_m)
    (1, 1, 4, 16),
    (1, 6, 64, 16),
    (3, 2, 4, 16),
    (37, 2, 8, 16),
    (17, 6, 64, 16),
    (70, 6, 64, 16),
    (200, 8, 16, 64),
    (5, 2, 3, 4),
]


def _random_ids(t: int, k: int, e: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct experts per token, as a top-k router picks them."""
    return torch.rand(t, e, generator=gen).argsort(dim=1)[:, :k].contiguous()


@pytest.mark.parametrize("t,k,e,block_m", ALIGN_CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_moe_align(t, k, e, block_m, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = _random_ids(t, k, e, gen)
    p = t * k
    sorted_pairs, block_expert = moe_align(ids, e, block_m)
    nb = max_blocks(p, e, block_m)
    assert nb <= triton_cdiv(p, block_m) + e
    assert sorted_pairs.shape == (nb * block_m,) and block_expert.shape == (nb,)

    real = sorted_pairs[sorted_pairs != p]
    assert torch.equal(real.sort().values, torch.arange(p)), "every pair exactly once"
    assert int((sorted_pairs == p).sum()) == nb * block_m - p, "the rest is the sentinel"

    flat = ids.reshape(-1)
    blocks = sorted_pairs.view(nb, block_m)
    used = block_expert >= 0
    assert torch.equal(block_expert[~used], torch.full_like(block_expert[~used], -1))
    n_used = int(used.sum())
    assert bool(used[:n_used].all()), "used blocks come first"
    for b in range(n_used):
        row = blocks[b][blocks[b] != p]
        assert row.numel() > 0, "a used block holds at least one pair"
        assert bool((flat[row] == block_expert[b]).all()), "a block holds only its expert's pairs"
    for b in range(n_used, nb):
        assert bool((blocks[b] == p).all()), "unused blocks are all sentinel"
    # Each expert's pairs fill cdiv(count, block_m) blocks.
    counts = torch.bincount(flat, minlength=e)
    assert n_used == int(((counts + block_m - 1) // block_m).sum())


@pytest.mark.parametrize("t,k,e,block_m", [(37, 2, 8, 16), (1, 6, 64, 16)])
def test_moe_align_shapes_static(t, k, e, block_m):
    """Shapes depend only on (P, E, block_m): all tokens on one expert or spread out."""
    gen = torch.Generator().manual_seed(3)
    spread = _random_ids(t, k, e, gen)
    same = torch.arange(k).repeat(t, 1)
    a, b = moe_align(spread, e, block_m), moe_align(same, e, block_m)
    assert a[0].shape == b[0].shape and a[1].shape == b[1].shape


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


# ---------------------------------------------------------------------------------------------
# Kernel against moe_loop
# ---------------------------------------------------------------------------------------------


def _inputs(t, k, e, hidden, inter, dtype, seed, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=gen)
    w13 = torch.randn(e, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(e, hidden, inter, generator=gen) / inter**0.5
    weights = torch.rand(t, k, generator=gen)
    ids = _random_ids(t, k, e, gen)
    return (
        x.to(device, dtype),
        w13.to(device, dtype),
        w2.to(device, dtype),
        weights.to(device),
        ids.to(device),
    )


DTYPES = [torch.float32, torch.bfloat16] if ON_GPU else [torch.float32]


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden,inter", [(40, 24), (72, 100)])
@pytest.mark.parametrize("e,k", [(4, 1), (4, 2), (64, 6)])
@pytest.mark.parametrize("t", [1, 3, 17, 70])
def test_fused_moe_matches_loop(t, e, k, hidden, inter, dtype):
    x, w13, w2, weights, ids = _inputs(t, k, e, hidden, inter, dtype, seed=t * 131 + e + k)
    got = fused_moe(x, w13, w2, weights, ids)
    want = moe_loop(x, w13, w2, weights, ids)
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("block_m", [16, 64])
def test_fused_moe_block_m_and_strides(block_m):
    """Larger BLOCK_M (the prefill config) and a non-contiguous x."""
    x, w13, w2, weights, ids = _inputs(70, 2, 8, 72, 100, torch.float32, seed=7)
    xt = torch.empty(72, 70, device=x.device).t()  # non-contiguous, same values
    xt.copy_(x)
    got = fused_moe(xt, w13, w2, weights, ids, block_m=block_m)
    torch.testing.assert_close(got, moe_loop(x, w13, w2, weights, ids), **TOL[torch.float32])


def _fp8_experts(w: torch.Tensor, block: int | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """[E, N, K] -> (FP8 weights, scales [E, N, ceil(K / block_k)], block_k): per 128x128-style
    blocks of `block`, or per channel (block None)."""
    from workers.layers.fp8 import quantize_blocks, quantize_rows

    qs, ss = [], []
    for we in w.float().cpu():
        if block:
            q, s = quantize_blocks(we, block, block)
            s = s.repeat_interleave(block, dim=0)[: we.shape[0]]
        else:
            q, s = quantize_rows(we)
        qs.append(q)
        ss.append(s)
    return torch.stack(qs).to(w.device), torch.stack(ss).to(w.device), block or w.shape[2]


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("block", [None, 32, 128], ids=["channel", "block32", "block128"])
@pytest.mark.parametrize("t", [1, 17, 300])
def test_fused_moe_on_fp8_experts_matches_the_loop_on_their_dequantized_weights(t, block):
    """FP8 experts (an FP8 checkpoint's): the kernel dequantizes weight tiles in registers; the
    reference is the loop on the dequantized weights, in bf16 (same tolerance as bf16 above)."""
    from workers.layers.fp8 import dequantize

    x, w13, w2, weights, ids = _inputs(t, 6, 64, 200, 136, torch.bfloat16, seed=t + 5)
    q13, s13, bk13 = _fp8_experts(w13, block)
    q2, s2, bk2 = _fp8_experts(w2, block)
    got = fused_moe(x, q13, q2, weights, ids, s13, s2, bk13, bk2)
    d13 = torch.stack([dequantize(q13[e], s13[e], bk13) for e in range(64)]).to(torch.bfloat16)
    d2 = torch.stack([dequantize(q2[e], s2[e], bk2) for e in range(64)]).to(torch.bfloat16)
    torch.testing.assert_close(got.float(), moe_loop(x, d13, d2, weights, ids).float(), **TOL[torch.bfloat16])
    # The CPU path (the loop given FP8 experts) computes the same.
    loop = moe_loop(x, q13, q2, weights, ids, s13, s2, bk13, bk2)
    torch.testing.assert_close(loop.float(), moe_loop(x, d13, d2, weights, ids).float(), rtol=0, atol=0)


@pytest.mark.gpu
@gpu_only
def test_fused_moe_cuda_graph_replay():
    t, k, e, hidden, inter = 17, 6, 64, 72, 100
    x, w13, w2, weights, ids = _inputs(t, k, e, hidden, inter, torch.bfloat16, seed=11)
    fused_moe(x, w13, w2, weights, ids)  # compile the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    for seed in (12, 13):
        x2, _, _, weights2, ids2 = _inputs(t, k, e, hidden, inter, torch.bfloat16, seed=seed)
        x.copy_(x2)
        weights.copy_(weights2)
        ids.copy_(ids2)
        graph.replay()
        torch.cuda.synchronize()
        want = moe_loop(x, w13, w2, weights, ids)
        torch.testing.assert_close(out.float(), want.float(), **TOL[torch.bfloat16])


def test_experts_module_selects_loop_on_cpu():
    from workers.layers import fused_moe as fm

    assert fm.select_moe("cpu") is moe_loop
    expected = fused_moe if fm.triton is not None else moe_loop
    assert fm.select_moe("cuda") is expected
