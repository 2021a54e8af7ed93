"""The one-row linear kernel (`workers.layers.gemv`) against F.linear in float32, and the
per-shape choice between it and cuBLAS: odd sizes (N, K not multiples of any block), bias or
none, bf16 and fp16; the choice is made once, never inside a CUDA-graph capture, and a
captured graph replays whichever path was chosen.

Skipped without CUDA; `TRITON_INTERPRET=1` runs the kernel on CPU through Triton's interpreter
(the choice and graph tests need a device)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not torch.cuda.is_available() and not INTERPRET:
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1 to run the Triton kernel on CPU)", allow_module_level=True)
pytest.importorskip("triton")

from tests.triton_interpreter import install_interpreter_shims  # noqa: E402
from workers.layers import gemv  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
gpu_only = pytest.mark.skipif(INTERPRET, reason="needs a real CUDA device")
if INTERPRET:
    install_interpreter_shims()


def _ref(x, w, b):
    return F.linear(x.float(), w.float(), None if b is None else b.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(1, 64), (37, 1000), (4096, 4096), (6144, 4096), (1000, 14336)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("block", [(8, 256), (16, 512)] + ([] if INTERPRET else [None]))  # None: autotuned
def test_gemv_equals_reference(dtype, n, k, bias, block):
    torch.manual_seed(n + k)
    x = torch.randn(1, k, dtype=dtype, device=DEVICE)
    w = torch.randn(n, k, dtype=dtype, device=DEVICE) / k**0.5
    b = torch.randn(n, dtype=dtype, device=DEVICE) if bias else None
    got = gemv.gemv(x, w, b, block)
    assert got.shape == (1, n) and got.dtype == dtype
    # One rounding of a float32 sum (the reference's order differs): a few units of the dtype.
    torch.testing.assert_close(got.float(), _ref(x, w, b), atol=2e-2, rtol=1e-2)


@gpu_only
def test_choice_is_made_once_and_outside_capture():
    torch.manual_seed(0)
    x = torch.randn(1, 2048, dtype=torch.bfloat16, device=DEVICE)
    w = torch.randn(3000, 2048, dtype=torch.bfloat16, device=DEVICE) / 45
    key = (3000, 2048, torch.bfloat16, False, x.device.index)
    gemv._CHOICE.pop(key, None)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph):
            y = gemv.linear(x, w)  # unmeasured inside a capture: cuBLAS, nothing recorded
    assert key not in gemv._CHOICE
    graph.replay()
    torch.testing.assert_close(y.float(), _ref(x, w, None), atol=2e-2, rtol=1e-2)
    first = gemv.linear(x, w)  # measured here, once
    assert key in gemv._CHOICE
    torch.testing.assert_close(first.float(), _ref(x, w, None), atol=2e-2, rtol=1e-2)
    # Two rows, CPU or float32 inputs: plain F.linear.
    x2 = torch.randn(2, 2048, dtype=torch.bfloat16, device=DEVICE)
    torch.testing.assert_close(gemv.linear(x2, w), F.linear(x2, w))


@gpu_only
def test_chosen_kernel_replays_in_a_graph():
    torch.manual_seed(1)
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device=DEVICE)
    w = torch.randn(6144, 4096, dtype=torch.bfloat16, device=DEVICE) / 64
    gemv.linear(x, w)  # choose (and autotune) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemv.linear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(y.float(), _ref(x, w, None), atol=2e-2, rtol=1e-2)
