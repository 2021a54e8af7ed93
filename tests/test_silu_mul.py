"""The SiLU·mul Triton kernel (`workers.layers.silu_mul`) against the CPU path's math
(`fused._silu_and_mul`) on random inputs: odd and model-sized widths, one row to a prompt's
worth, a strided input (a view of a wider buffer), under a CUDA graph, float32/bf16/fp16.
Tolerance: both round SiLU to the dtype and then the product once; only the exponential's last
float32 bit may differ, which moves at most one ulp of the dtype."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from workers.layers import fused  # noqa: E402
from workers.layers.silu_mul import BLOCK, silu_and_mul  # noqa: E402

TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
       torch.float16: dict(atol=1e-3, rtol=1e-3)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,inter", [(1, 14336), (3, 7), (64, BLOCK + 1), (2048, 14336), (5, 3 * BLOCK)])
def test_silu_mul_equals_reference(dtype, rows, inter):
    torch.manual_seed(rows + inter)
    x = torch.randn(rows, 2 * inter, device="cuda", dtype=dtype) * 4
    got = silu_and_mul(x)
    assert got.shape == (rows, inter) and got.dtype == dtype
    torch.testing.assert_close(got, fused._silu_and_mul(x), **TOL[dtype])
    assert torch.equal(fused.silu_and_mul(x), got)  # what the model calls on CUDA


def test_silu_mul_strided_rows_and_leading_dims():
    x = torch.randn(9, 2 * 300 + 40, device="cuda", dtype=torch.bfloat16)[:, : 2 * 300]  # row stride 640
    torch.testing.assert_close(silu_and_mul(x), fused._silu_and_mul(x), **TOL[torch.bfloat16])
    y = torch.randn(2, 5, 2 * 96, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(silu_and_mul(y), fused._silu_and_mul(y), **TOL[torch.bfloat16])
    assert silu_and_mul(torch.empty(0, 64, device="cuda")).shape == (0, 32)


def test_silu_mul_in_cuda_graph():
    x = torch.randn(16, 2 * 1000, device="cuda", dtype=torch.bfloat16)
    silu_and_mul(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = silu_and_mul(x)
    fresh = torch.randn_like(x)
    x.copy_(fresh)
    graph.replay()
    torch.testing.assert_close(out, fused._silu_and_mul(fresh), **TOL[torch.bfloat16])
