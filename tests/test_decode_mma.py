"""The paged decode over an FP8 cache with the keys on the MMA's M side
(`attention.triton_decode_mma`, `MANTA_FP8_KV_MMA=1`).

- Against the float32 reference on the dequantized cache, with queries that e4m3 holds exactly
  per head (e4m3 values at a power-of-two scale, each head's largest at +-448: the kernel's
  quantization gives them back bit for bit, whatever its rounding), so only the products'
  round-off differs: tests/test_gpu_kernels.py's bf16 bounds, plus 2^-11 of the largest |value|
  for the float16 probabilities of O = V^T P^T (`assert_close_p16`). Mixed batches (lengths 1 to
  1,030), GQA groups 1, 4 and 7, head dims 40, 80, 96 and 128, pages of 1 and 16 tokens, split
  counts chosen and 1.
- On a GPU, against the reference with random bf16 queries: the round-off of q's e4m3 (rounded
  to nearest) bounded at 3% of the largest |output| (torch's own rounding of q moved these
  cases' reference by 1.1-2.0%).

Runs on a Hopper GPU, or on CPU under Triton's interpreter (`TRITON_INTERPRET=1`, which loads the
values as elements and rounds to e4m3 its own way, not to nearest: the round-off test is
GPU-only). Skipped elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_gpu_kernels import (
    DECODE_LENS,
    DEVICE,
    INTERPRET,
    TOL,
    gpu_only,
    paged_cache,
    ref_attention,
)

pytestmark = pytest.mark.gpu
if not INTERPRET and torch.cuda.get_device_capability()[0] != 9:  # (test_gpu_kernels skips without CUDA)
    pytest.skip("needs a Hopper GPU (or TRITON_INTERPRET=1)", allow_module_level=True)

from attention import kernel_options, triton_decode_mma  # noqa: E402
from attention.kernel_options import KernelOptions  # noqa: E402
from attention.triton_decode import paged_decode  # noqa: E402
from workers import kv_quant  # noqa: E402

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16


@pytest.fixture
def mma(monkeypatch):
    """The kernel option on at every batch size; yields the calls `mma_applies` answered True
    (so a test that falls back to the other kernel fails)."""
    monkeypatch.setattr(kernel_options, "_current", KernelOptions(fp8_kv_mma=True))
    monkeypatch.setattr(triton_decode_mma, "MIN_PROGRAMS", 1)
    taken = []
    applies = triton_decode_mma.mma_applies
    monkeypatch.setattr(triton_decode_mma, "mma_applies", lambda *a: applies(*a) and (taken.append(a) or True))
    return taken


def _fp8(cache: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    stored = kv_quant.quantize(cache * 3.0, scale)  # values across the FP8 range, some saturated
    return stored, stored.float() * scale


def exact_queries(batch: int, heads: int, dim: int, seed: int) -> torch.Tensor:
    """[batch, heads, dim] bf16 queries whose per-head e4m3 quantization is exact: e4m3 values
    times 2^-5, each head's first element +-448 (its largest)."""
    g = torch.Generator().manual_seed(seed)
    q8 = (torch.randn(batch, heads, dim, generator=g) * 40).clamp(-440, 440).to(FP8).float()
    q8[..., 0] = torch.where(torch.rand(batch, heads, generator=g) < 0.5, -448.0, 448.0)
    return (q8 * 2.0**-5).to(BF16).to(DEVICE)


def _case(heads, kv_heads, dim, page_size, k_spread=3.0):
    kc, vc, pt, tt = paged_cache(DECODE_LENS, kv_heads, dim, dim, page_size, BF16, seed=dim + heads)
    k8, v8 = kv_quant.quantize(kc * k_spread, 0.02), kv_quant.quantize(vc * 3.0, 0.5)  # spread over the FP8 range
    lens = torch.tensor(DECODE_LENS, dtype=torch.int32, device=DEVICE)
    return k8, v8, k8.float() * 0.02, v8.float() * 0.5, pt, tt, lens


def assert_close_p16(got, ref, vmax: float):
    """bf16's bounds (tests/test_gpu_kernels.py), plus what O = V^T P^T in float16 adds: each
    unnormalized probability (<= 1) rounded by up to 2^-11 of itself, so an output moves by at
    most 2^-11 of the largest |value| (the first GPU run, an H100 on 2026-12-07, had one output
    of 4,096 at 0.0223 against bf16's 0.02 where the values reach 224)."""
    assert not torch.isnan(got).any(), "unwritten (NaN-poisoned) or NaN output"
    tol = TOL[BF16]
    torch.testing.assert_close(got.float(), ref.float(), atol=tol["atol"] + 2.0**-11 * vmax, rtol=tol["rtol"])


def _decode(q, k8, v8, pt, lens, page_size, num_splits=None):
    scale = q.shape[-1] ** -0.5
    return paged_decode(q, k8, v8, pt, lens, scale * 0.02, page_size, num_splits=num_splits) * 0.5


def _reference(q, kref, vref, tt):
    return ref_attention(q, kref, vref, tt, [1] * len(DECODE_LENS), DECODE_LENS, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 40), (8, 2, 80), (7, 1, 96), (32, 8, 128)])
@pytest.mark.parametrize("num_splits", [None, 1])
def test_mma_decode_equals_the_reference(mma, heads, kv_heads, dim, page_size, num_splits):
    k8, v8, kref, vref, pt, tt, lens = _case(heads, kv_heads, dim, page_size)
    q = exact_queries(len(DECODE_LENS), heads, dim, seed=heads * dim)
    got = _decode(q, k8, v8, pt, lens, page_size, num_splits)
    assert mma and got.dtype == BF16
    assert_close_p16(got, _reference(q, kref, vref, tt), vref.abs().max().item())


@pytest.mark.parametrize("lens", [[0, 1, 65, 1030], [1030], [64]])
def test_mma_decode_empty_rows_single_rows_and_every_output_written(mma, lens):
    """A request with no keys gets zeros; one request alone (batch 1: on a GPU the loads before
    the PDL wait and the newest row read again after it); every output written (NaN-poisoned)."""
    kc, vc, pt, tt = paged_cache([max(n, 1) for n in lens], 8, 128, 128, 16, BF16, seed=len(lens))
    k8, v8 = kv_quant.quantize(kc * 3.0, 0.02), kv_quant.quantize(vc * 3.0, 0.5)
    q = exact_queries(len(lens), 32, 128, seed=7)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = torch.full((len(lens), 32, 128), float("nan"), dtype=BF16, device=DEVICE)
    paged_decode(q, k8, v8, pt, seqlens, 0.02 / 128**0.5, 16, out=out)
    assert mma and not torch.isnan(out).any()
    live = [i for i, n in enumerate(lens) if n]
    ref = ref_attention(q[live], k8.float() * 0.02, v8.float() * 0.5, tt[live], [1] * len(live),
                        [lens[i] for i in live], 128**-0.5)
    assert_close_p16(out[live].float() * 0.5, ref, v8.float().abs().max().item() * 0.5)
    assert all(out[i].eq(0).all() for i, n in enumerate(lens) if not n)


def test_mma_decode_takes_decode_batches_only(monkeypatch):
    """Below MIN_PROGRAMS (request, KV head) pairs the words launch of `triton_decode` stays."""
    monkeypatch.setattr(kernel_options, "_current", KernelOptions(fp8_kv_mma=True))
    k8 = torch.zeros(16, 8, 128, dtype=FP8, device=DEVICE)
    small, large = (torch.zeros(b, 32, 128, dtype=BF16, device=DEVICE) for b in (8, 9))
    assert not triton_decode_mma.mma_applies(small, k8, k8) and triton_decode_mma.mma_applies(large, k8, k8)


@gpu_only
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 80), (32, 8, 128)])
def test_mma_decode_round_off_of_the_queries(mma, heads, kv_heads, dim):
    k8, v8, kref, vref, pt, tt, lens = _case(heads, kv_heads, dim, 16, k_spread=1.0)
    q = torch.randn(len(DECODE_LENS), heads, dim, generator=torch.Generator().manual_seed(1)).to(BF16).to(DEVICE)
    ref = _reference(q, kref, vref, tt)
    err = (_decode(q, k8, v8, pt, lens, 16).float() - ref).abs().max().item() / ref.abs().max().item()
    assert mma and err < 0.03, f"e4m3 queries moved the output by {err:.4f} of its largest value"


@gpu_only
@pytest.mark.parametrize("batch", [1, 64, 130])
def test_mma_decode_words_equal_elements(mma, batch):
    """The values loaded as 16-bit words and widened in registers (the GPU's load) give the
    element loads' bits (real PTX: GPU-only)."""
    lens = [(37 * i) % 1500 + 1 for i in range(batch)]
    kc, vc, pt, _ = paged_cache(lens, 8, 128, 128, 16, BF16, seed=batch)
    k8, v8 = kv_quant.quantize(kc, 0.02), kv_quant.quantize(vc, 0.5)
    q = exact_queries(batch, 32, 128, seed=batch)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    words = paged_decode(q, k8, v8, pt, seqlens, 0.02 / 128**0.5, 16, words=True)
    elements = paged_decode(q, k8, v8, pt, seqlens, 0.02 / 128**0.5, 16, words=False)
    assert len(mma) == 2 and torch.equal(words, elements)
