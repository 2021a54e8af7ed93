"""16-bit products of decode batches on the tile kernel (`workers.layers.decode_tiles`) against a
float32 reference: odd sizes (N = 200, K = 328: multiples of no tile), 2 to 64 rows, bf16 and
fp16, with and without bias, K split and swapped operands, and the SiLU·up prologue against
`silu_and_mul` then the product (the prologue rounds as that kernel rounds, so both multiply
the same 16-bit input). The model's entry points (`one_row`) take the path only for shapes with
a launch, and under a CUDA graph. Tolerance, ||y - ref|| / ||ref||: only the output is rounded
to the dtype: 1e-2 in bf16, 3e-3 in fp16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3}
LAUNCHES = [(32, 64, 4, 3, 1, False), (64, 128, 4, 2, 2, True), (32, 256, 4, 2, 4, False), (128, 64, 8, 3, 1, True)]


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [2, 5, 17, 64])
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("launch", LAUNCHES)
def test_tile_product_equals_float32_reference(dtype, m, silu, launch):
    from workers.layers import decode_tiles
    from workers.layers.silu_mul import silu_and_mul

    torch.manual_seed(m + launch[0])
    n, k = 200, 328
    x = torch.randn(m, 2 * k if silu else k, device="cuda", dtype=dtype) * 2
    w = (torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5).contiguous()
    for bias in (None, torch.randn(n, device="cuda", dtype=dtype)):
        y = decode_tiles.linear(x, w, bias, silu_mul=silu, config=launch)
        assert y.shape == (m, n) and y.dtype == dtype
        h = silu_and_mul(x) if silu else x
        ref = F.linear(h.float(), w.float(), None if bias is None else bias.float())
        assert _rel(y, ref) < TOL[dtype], (launch, bias is None)


def test_model_entry_points_take_the_tiles_for_shapes_with_a_launch(monkeypatch):
    """`one_row.linear` / `silu_mul_linear` at 64 rows run the tile kernel for a shape with a
    launch (the same result as `decode_tiles.linear`, bit for bit) and cuBLAS otherwise, and
    the kernel replays in a CUDA graph."""
    from attention import kernel_options
    from workers.layers import decode_tiles, one_row

    n, k = 256, 512
    opts = kernel_options.KernelOptions.from_env({"MANTA_TILE_CONFIGS": f"{n}x{k}:32,128,4,3,2,0;{n}x{k}s:64,64,4,3,1,1"})
    monkeypatch.setattr(kernel_options, "_current", opts)
    x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(64, 2 * k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    assert decode_tiles.applies(x, w) and decode_tiles.applies(gate_up, w, silu_mul=True)
    assert not decode_tiles.applies(x[:1], w) and not decode_tiles.applies(torch.cat([x, x]), w)
    assert torch.equal(one_row.linear(x, w), decode_tiles.linear(x, w))
    assert torch.equal(one_row.silu_mul_linear(gate_up, w, None), decode_tiles.linear(gate_up, w, silu_mul=True))
    other = torch.randn(n + 16, k, device="cuda", dtype=torch.bfloat16)
    assert not decode_tiles.applies(x, other) and torch.equal(one_row.linear(x, other), F.linear(x, other))

    graph = torch.cuda.CUDAGraph()
    out = one_row.silu_mul_linear(gate_up, w, None)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = one_row.silu_mul_linear(gate_up, w, None)
    gate_up.copy_(torch.randn_like(gate_up))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, decode_tiles.linear(gate_up, w, silu_mul=True))

    monkeypatch.setattr(kernel_options, "_current", kernel_options.KernelOptions.from_env(
        {"MANTA_DECODE_TILES": "0", "MANTA_TILE_CONFIGS": f"{n}x{k}:32,128,4,3,2,0"}))
    assert not decode_tiles.applies(x, w)

