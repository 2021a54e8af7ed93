"""The split row argmax kernel (`workers.argmax_kernel`) against torch.argmax on the same tensor:
random rows of many shapes, exact ties of the maximum in different programs' chunks (the lowest
index wins), -inf, +inf and NaN (the first NaN wins), -0.0 against 0.0, bf16 and fp16 input, a
strided row, and splits with several tiles per program. The arrival counters are back at zero
after every launch, so a CUDA graph can replay one with no memset.

Skipped without CUDA; `TRITON_INTERPRET=1` runs the kernel on CPU through Triton's interpreter.
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

from attention.arrival import arrival_counters  # noqa: E402
from tests.triton_interpreter import install_interpreter_shims  # noqa: E402
from workers.argmax_kernel import argmax_rows  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
if INTERPRET:
    install_interpreter_shims()
INF, NAN = float("inf"), float("nan")
LLAMA3_VOCAB = 128256


def _check(x: torch.Tensor, **split) -> torch.Tensor:
    """argmax_rows(x) equals torch.argmax(x) and leaves the arrival counters at zero."""
    got = argmax_rows(x, **split)
    assert got.dtype == torch.long and got.shape == (x.shape[0],)
    assert torch.equal(got.cpu(), x.argmax(dim=-1).cpu())
    assert arrival_counters(x.device, 1).abs().sum().item() == 0
    return got


def _randn(b: int, v: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("b", [1, 3, 70])
@pytest.mark.parametrize("v", [1, 17, 4096, 5000, LLAMA3_VOCAB])
def test_random_rows(b, v):
    # b = 70 over the full vocabulary: 2 programs a row, 16 tiles each (~4 s interpreted)
    _check(_randn(b, v, seed=b * 7 + v))


@pytest.mark.parametrize("b,v,block,max_programs", [(1, 1000, 64, 8), (3, 1000, 64, 4), (5, 300, 32, 1000)])
def test_small_tiles_several_per_program(b, v, block, max_programs):
    """Small tiles: programs loop over several tiles, and rows split into up to 16 programs."""
    x = _randn(b, v, seed=v)
    x[:, ::97] = x.max() + 1.0  # ties of the maximum in many tiles and programs
    _check(x, block=block, max_programs=max_programs)
    _check(_randn(b, v, seed=v + 1), block=block, max_programs=max_programs)


@pytest.mark.parametrize("first", [5000, 40000, 128000])
def test_ties_in_different_chunks_go_to_the_lowest_index(first):
    """The maximum at `first` and at later columns in other programs' chunks (4096 columns
    each at batch 1) and in the same chunk: the lowest index wins."""
    v = LLAMA3_VOCAB
    x = _randn(2, v)
    first = min(first, v - 4096 - 2)
    for row, cols in enumerate([[first, first + 1, first + 4096, v - 1], [v - 1, first + 200, first]]):
        x[row, cols] = 10.0
    assert x.argmax(dim=-1).tolist() == [first, first]
    _check(x)
    _check(x[:1])  # batch 1: the widest split


def test_all_equal_row():
    _check(torch.full((2, 9000), 0.5, device=DEVICE))


def test_infinities():
    v = 10000
    x = torch.full((4, v), -INF, device=DEVICE)
    x[0, 7777] = -1e30  # -inf everywhere but one
    x[1, 4095] = 0.0
    # row 2: all -inf, torch says 0
    x[3, 6000] = INF
    x[3, 9000] = INF
    x[3, 100] = 3e38
    got = _check(x)
    assert got.tolist() == [7777, 4095, 0, 6000]


def test_nan_is_larger_than_everything():
    v = 9000
    x = _randn(4, v)
    x[0, 5000] = NAN  # a NaN alone
    x[1, [4500, 8000]] = NAN  # the first NaN wins, in another chunk than the second
    x[1, 100] = INF
    x[2, 8999] = NAN  # NaN after +inf
    x[2, 3] = INF
    x[3, 4100] = -NAN  # a negative NaN is a NaN too
    x[3, 4099] = INF
    got = _check(x)
    assert got.tolist() == [5000, 4500, 8999, 4100]


def test_all_nan_row():
    _check(torch.full((1, 5000), NAN, device=DEVICE))


def test_negative_zero_equals_zero():
    x = torch.full((2, 5000), -1.0, device=DEVICE)
    x[0, [10, 4500]] = torch.tensor([-0.0, 0.0], device=DEVICE)
    x[1, [10, 4500]] = torch.tensor([0.0, -0.0], device=DEVICE)
    assert _check(x).tolist() == [10, 10]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    x = _randn(3, 5000).to(dtype)  # bf16 rounding makes ties among the largest values likely
    x[1, 4200] = x[1].max()
    x[2, 100] = NAN
    _check(x)


def test_strided_rows():
    """A slice of a wider tensor (the sampler's `logits[:, :V]` of a padded vocabulary)."""
    wide = _randn(3, 5000 + 64)
    wide[:, 5000:] = 100.0  # the padding's columns must not be read
    x = wide[:, :5000]
    assert not x.is_contiguous()
    _check(x)


def test_empty_batch():
    assert argmax_rows(torch.empty(0, 5000, device=DEVICE)).shape == (0,)


@pytest.mark.parametrize("cols", [128256, 102400, 1000, 5])
def test_warm_up_covers_every_launch_variant(cols):
    """Every row count up to the bound launches a variant `warm_up` compiled: the same SPLIT and
    power-of-two split count as one of `variant_rows`'s row counts."""
    import triton

    from workers.argmax_kernel import BLOCK, MAX_PROGRAMS, _split, variant_rows

    def variant(rows):
        s = _split(rows, cols, BLOCK, MAX_PROGRAMS)[1]
        return s > 1, triton.next_power_of_2(s)

    warmed = variant_rows(300, cols)
    assert warmed == sorted(set(warmed)) and warmed[0] == 1
    assert {variant(r) for r in range(1, 301)} == {variant(r) for r in warmed}
