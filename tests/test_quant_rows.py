"""The elementwise kernels that write an FP8 product's input already quantized per row
(`workers.layers.quant_rows`), against the unfused ops they replace: the op in torch (or its
Triton kernel), then `fp8_gemm.quantize_rows`. And the products that take such rows
(`fp8_rows.Fp8Rows`): the same output as from the 16-bit rows. Odd widths (a partial last block or
chunk), 1 to 130 rows, bf16 and fp16, strided inputs. Skipped without CUDA (Triton)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def qr():
    pytest.importorskip("triton")
    from workers.layers import quant_rows

    return quant_rows


def _same_quantization(q, scale, ref_q, ref_scale):
    """Equal up to the last float32 place of a norm's 1/rms (its sum is reduced in another order):
    that may move a rounded element one bf16 step, so the row's scale by up to 2^-8 and a few
    elements one e4m3 step."""
    torch.testing.assert_close(scale, ref_scale, rtol=2**-8, atol=0)
    a, b = q.float() * scale, ref_q.float() * ref_scale
    assert (q.view(torch.uint8) != ref_q.view(torch.uint8)).float().mean().item() < 1e-3
    assert ((a - b).abs() <= b.abs() / 8 + 2**-9 * ref_scale).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, k", [(1, 4096), (64, 4096), (77, 328), (130, 2056)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_rows_are_the_norm_then_quantize_rows(qr, dtype, m, k, with_residual):
    from workers.layers import fused
    from workers.layers.fp8_gemm import quantize_rows

    g = torch.Generator(device="cuda").manual_seed(m + k)
    wide = torch.randn(m, k + 8, device="cuda", generator=g).to(dtype)
    x = wide[:, 3 : 3 + k]  # rows with a stride of their own
    residual = torch.randn(m, k, device="cuda", generator=g).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).to(dtype)
    x[0, 5] = 40.0  # an outlier sets row 0's scale
    rows, s = qr.add_rms_norm(x, residual, weight, 1e-5)
    if with_residual:
        h, ref_s = fused._add_rms_norm(x, residual, weight, 1e-5)  # the plain torch ops
        assert torch.equal(s, ref_s)
    else:
        h, ref_s = fused._rms_norm(x, weight, 1e-5), x
        assert s is x
    ref_q, ref_scale = quantize_rows(h.contiguous())
    assert rows.q.dtype == torch.float8_e4m3fn and rows.scale.shape == (m, 1) and rows.dtype == dtype
    _same_quantization(rows.q, rows.scale, ref_q, ref_scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, inter", [(1, 14336), (64, 14336), (130, 2049), (3, 40)])
def test_silu_rows_are_silu_mul_then_quantize_rows(qr, dtype, m, inter):
    """silu(gate) * up as `silu_mul`'s kernel rounds it, quantized as `quantize_rows` does: the
    same bits (one pass finds the amax, the next recomputes the row)."""
    from workers.layers import silu_mul
    from workers.layers.fp8_gemm import quantize_rows

    g = torch.Generator(device="cuda").manual_seed(m + inter)
    x = (2 * torch.randn(m, 2 * inter, device="cuda", generator=g)).to(dtype)
    x[-1, inter + 1] = 60.0  # a large `up` sets the last row's scale
    rows = qr.silu_and_mul(x)
    ref_q, ref_scale = quantize_rows(silu_mul.silu_and_mul(x))
    assert rows.q.shape == (m, inter) and rows.dtype == dtype
    assert torch.equal(rows.scale, ref_scale)
    assert torch.equal(rows.q.view(torch.uint8), ref_q.view(torch.uint8))


@pytest.mark.parametrize("tma", [False, True], ids=["no_tma", "tma"])
@pytest.mark.parametrize("m, n, k", [(17, 528, 4160), (64, 528, 8208), (100, 528, 8208), (300, 272, 4160),
                                     (64, 200, 328)])
def test_products_take_quantized_rows(m, n, k, tma, monkeypatch):
    """`fp8_linear` of `Fp8Rows` is the product of the 16-bit rows they were quantized from, bit
    for bit, on each kernel that quantizes per token: with the TMA option off, the Triton W8A8
    kernel with K split (decode batches, long K), cuBLAS's (`torch._scaled_mm`), the Triton one for
    shapes cuBLAS refuses; with it on, the TMA kernel where it takes the shape (Hopper)."""
    pytest.importorskip("triton")
    from attention import kernel_options
    from workers.layers import fp8_gemm
    from workers.layers.fp8 import quantize_rows
    from workers.layers.fp8_rows import Fp8Rows

    monkeypatch.setattr(kernel_options, "_current", kernel_options.KernelOptions(fp8_tma=tma))
    g = torch.Generator(device="cuda").manual_seed(m * n)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w, s = quantize_rows(torch.randn(n, k, device="cuda", generator=g) / k**0.5)
    bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    kernel = fp8_gemm.kernel_for(m, n, k, 1, k, x.device)
    if tma and kernel is not fp8_gemm.Kernel.TMA:
        pytest.skip("the TMA kernel takes this shape only on a Hopper GPU")
    if not tma and m < fp8_gemm.A8_MIN_M:
        pytest.skip("below A8_MIN_M rows only the TMA kernel quantizes per token")
    assert kernel in fp8_gemm.PER_TOKEN_A8 and (kernel is fp8_gemm.Kernel.TMA) == tma
    q, sx = fp8_gemm.quantize_rows(x)
    got = fp8_gemm.fp8_linear(Fp8Rows(q, sx, x.dtype), w, s, k, bias)
    assert got.dtype == x.dtype and torch.equal(got, fp8_gemm.fp8_linear(x, w, s, k, bias))


def test_quantized_rows_for_a_product_that_does_not_take_them(monkeypatch):
    """Rows where the product would not quantize per token (W8A16 under A8_MIN_M rows with the
    TMA kernel off, block scales) are refused with the reason, not multiplied wrong."""
    pytest.importorskip("triton")
    from attention import kernel_options
    from workers.layers import fp8_gemm

    monkeypatch.setattr(kernel_options, "_current", kernel_options.KernelOptions(fp8_tma=False))
    from workers.layers.fp8 import quantize_rows
    from workers.layers.fp8_rows import Fp8Rows

    x = torch.randn(16, 256, device="cuda").to(torch.bfloat16)
    w, s = quantize_rows(torch.randn(64, 256, device="cuda"))
    q, sx = fp8_gemm.quantize_rows(x)
    with pytest.raises(ValueError, match="runs w8a16"):
        fp8_gemm.fp8_linear(Fp8Rows(q, sx, x.dtype), w, s, 256)
    x = torch.randn(64, 256, device="cuda").to(torch.bfloat16)
    q, sx = fp8_gemm.quantize_rows(x)
    with pytest.raises(ValueError, match="per-channel"):
        fp8_gemm.fp8_linear(Fp8Rows(q, sx, x.dtype), w, s.repeat(1, 2), 128)
