"""Decode-batch products through cuBLASLt's bias epilogue with a zero bias
(`workers.layers.lt_bias`): which shapes and row counts take it, that the product equals a
float32 reference as the plain one does, that the model's entry points (`linear.matmul`,
`one_row`) take it, and that a zero bias is never made inside a CUDA graph capture."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("m,n,k,takes", [(64, 512, 8192, True), (32, 300, 8200, True), (31, 300, 8200, False), (96, 512, 8192, True),
                                         (97, 512, 8192, False), (1, 512, 8192, False), (48, 16384, 256, True),
                                         (32, 16384, 256, False), (65, 16384, 256, False), (64, 4096, 4096, False),
                                         (96, 4096, 4096, True), (81, 300, 1000, True), (96, 6144, 4096, False),
                                         (128, 4096, 4096, False)])
def test_which_products_take_a_zero_bias_and_what_they_give(m, n, k, takes, monkeypatch):
    from attention import kernel_options
    from workers.layers import lt_bias, one_row

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    assert lt_bias.applies(x, w) == takes and not lt_bias.applies(x.cpu(), w.cpu())
    ref = x.float() @ w.float().T
    y = lt_bias.linear(x, w)
    assert _rel(y, ref) < 1e-2 and _rel(F.linear(x, w), ref) < 1e-2
    if m > 1:  # (one row goes to the one-row GEMV)
        assert torch.equal(one_row.linear(x, w), y)  # the model's entry point takes the same path
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(lt_bias.linear(x, w, bias), F.linear(x, w, bias))  # a real bias is left alone
    monkeypatch.setattr(kernel_options, "_current", kernel_options.KernelOptions.from_env({"MANTA_ZERO_BIAS": "0"}))
    assert not lt_bias.applies(x, w) and torch.equal(lt_bias.linear(x, w), F.linear(x, w))


def test_no_zero_bias_is_made_inside_a_capture():
    from workers.layers import lt_bias

    n, k = 24, 9000  # a width no other test makes a zero bias for
    x = torch.randn(40, k, device="cuda", dtype=torch.float16)
    w = torch.randn(n, k, device="cuda", dtype=torch.float16) / k**0.5
    assert lt_bias.applies(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = lt_bias.linear(x, w)  # no zero bias yet: the plain product is captured
    assert (n, torch.float16, w.device) not in lt_bias._ZEROS
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, F.linear(x, w))
    eager = lt_bias.linear(x, w)  # made now, outside the capture
    assert (n, torch.float16, w.device) in lt_bias._ZEROS
    torch.testing.assert_close(eager, F.linear(x, w), rtol=1e-2, atol=1e-2)
