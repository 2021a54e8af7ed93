"""MLA's absorbed projections on an FP8 kv_b_proj (`workers.layers.fp8_heads`): per head, x
through the first N rows of the head's slice (into the latent space) or through the V rows after
them, transposed (out of it). On the CPU against a loop over heads on the dequantized weight; on
the GPU (skipped without CUDA) the Triton kernel against the CPU path: odd sizes, several
token counts, block-wise and per-channel scales, bf16 / fp16 / float32, strided inputs."""

from __future__ import annotations

import pytest
import torch

from workers.layers import fp8, fp8_heads

H, N, V, C = 3, 40, 24, 72


def _weight(block: int | None, seed: int = 0):
    """(FP8 weight [H * (N + V), C], scales as the layer holds them, block_k, dequantized float32)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(H * (N + V), C, generator=g) / C**0.5
    if block is None:
        q, s = fp8.quantize_rows(w)
        block_k = C
    else:
        q, s = fp8.quantize_blocks(w, block, block)
        s = s.repeat_interleave(block, 0)[: w.shape[0]]  # one scale row per weight row, as loaded
        block_k = block
    return q, s, block_k, fp8.dequantize(q, s, block_k)


def _loop(x: torch.Tensor, wd: torch.Tensor, uv: bool) -> torch.Tensor:
    """The products head by head, float32."""
    out = []
    for h in range(H):
        rows = wd[h * (N + V) : (h + 1) * (N + V)]
        out.append(x[:, h].float() @ (rows[N:].T if uv else rows[:N]))
    return torch.stack(out, 1)


@pytest.mark.parametrize("block", [16, None], ids=["block16", "channel"])
def test_cpu_products_equal_a_loop_over_heads(block):
    q, s, bk, wd = _weight(block)
    g = torch.Generator().manual_seed(1)
    x, o = torch.randn(5, H, N, generator=g), torch.randn(5, H, C, generator=g)
    torch.testing.assert_close(fp8_heads.into_latent(x, q, s, bk, V), _loop(x, wd, uv=False))
    torch.testing.assert_close(fp8_heads.out_of_latent(o, q, s, bk, N), _loop(o, wd, uv=True))


def test_mismatched_shapes_are_refused():
    q, s, bk, _ = _weight(16)
    with pytest.raises(ValueError, match="fp8_heads"):
        fp8_heads.into_latent(torch.zeros(2, H, N + 1), q, s, bk, V)
    with pytest.raises(ValueError, match="fp8_heads"):
        fp8_heads.out_of_latent(torch.zeros(2, 5, C), q, s, bk, N)  # 192 rows are not 5 heads


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block", [16, None], ids=["block16", "channel"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 5, 33, 70])
def test_gpu_kernel_equals_the_cpu_products(block, dtype, tokens):
    pytest.importorskip("triton")
    q, s, bk, wd = _weight(block, seed=tokens)
    g = torch.Generator().manual_seed(tokens)
    # q_nope arrives as a strided view of the q projection ([T, H, N + R] split)
    x = torch.randn(tokens, H, N + 8, generator=g).to(dtype)[:, :, :N]
    o = torch.randn(tokens, H, C, generator=g).to(dtype)
    qc, sc = q.cuda(), s.cuda()
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    wq = wd.to(dtype).float()  # the kernel multiplies weights dequantized to x's dtype
    got = fp8_heads.into_latent(x.cuda(), qc, sc, bk, V)
    assert got.shape == (tokens, H, C) and got.dtype == dtype
    torch.testing.assert_close(got.float().cpu(), _loop(x.float(), wq, uv=False), **tol)
    got = fp8_heads.out_of_latent(o.cuda(), qc, sc, bk, N)
    assert got.shape == (tokens, H, V) and got.dtype == dtype
    torch.testing.assert_close(got.float().cpu(), _loop(o.float(), wq, uv=True), **tol)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 16, 70])
def test_a_16bit_weight_into_a_slice_of_the_absorbed_query(device, dtype, tokens):
    """A 16-bit kv_b_proj (no scales): the products equal the loop, and into_latent fills the
    latent part of a [T, H, C + R] buffer without touching the rest (decode's absorbed query)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(tokens)
    w = (torch.randn(H * (N + V), C, generator=g) / C**0.5).to(dtype)
    x = torch.randn(tokens, H, N + 8, generator=g).to(dtype)[:, :, :N]
    o = torch.randn(tokens, H, C, generator=g).to(dtype)
    buf = torch.full((tokens, H, C + 8), 7.0, dtype=dtype, device=device)
    got = fp8_heads.into_latent(x.to(device), w.to(device), None, 0, V, out=buf[..., :C])
    assert got.data_ptr() == buf.data_ptr() and (buf[..., C:] == 7).all()
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(buf[..., :C].float().cpu(), _loop(x.float(), w.float(), uv=False), **tol)
    got = fp8_heads.out_of_latent(o.to(device), w.to(device), None, 0, N)
    torch.testing.assert_close(got.float().cpu(), _loop(o.float(), w.float(), uv=True), **tol)
