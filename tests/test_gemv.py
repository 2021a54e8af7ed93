"""The one-row linear kernel (`workers.layers.gemv`) against the unfused torch ops it replaces,
computed in float32 from the same inputs: plain, add + RMSNorm prologue (with and without a
residual) and SiLU-and-mul prologue; odd sizes (N, K multiples of no block), bias or none,
bf16 and fp16, K split over 1-4 programs with the last-arriving program reducing, FMA and
tensor-core inner products. The arrival counters are back at zero after every launch, so a
CUDA graph replays the split launch with no memset (checked by replaying one on a device).

Skipped without CUDA; `TRITON_INTERPRET=1` runs the kernel on CPU through Triton's interpreter.
Tolerance: the kernel's float32 sum differs from the reference's only in order and in not
rounding the normalised row to the dtype before the product (a few units of the dtype).
"""

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

from attention.arrival import arrival_counters  # noqa: E402
from tests.triton_interpreter import install_interpreter_shims  # noqa: E402
from workers.layers import fp8, fused, gemv, gemv_launch, one_row  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
gpu_only = pytest.mark.skipif(INTERPRET, reason="needs a real CUDA device")
if INTERPRET:
    install_interpreter_shims()
TOL = dict(atol=3e-2, rtol=2e-2)


def _reference(mode, x, w, b, r, nw, eps):
    """(y, residual sum) by the unfused ops, the product in float32."""
    s = None
    if mode == gemv.SILU_MUL:
        h = fused._silu_and_mul(x)
    elif mode == gemv.ADD_RMS:
        if r is not None:
            h, s = fused._add_rms_norm(x, r, nw, eps)
        else:
            h = fused._rms_norm(x, nw, eps)
    else:
        h = x
    return F.linear(h.float(), w.float(), None if b is None else b.float()), s


def _inputs(mode, n, k, dtype, bias, residual, seed):
    g = torch.Generator().manual_seed(seed)
    width = 2 * k if mode == gemv.SILU_MUL else k
    x = torch.randn(1, width, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    r = torch.randn(1, k, generator=g).to(dtype).to(DEVICE) if residual else None
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(DEVICE)
    return x, w, b, r, nw


def _assert_same_rounded_sum(got, want):
    """The residual sum is the unfused add, rounded the same way (Triton 3.6's interpreter
    truncates float32 -> bf16 casts: one unit of the last place there)."""
    if INTERPRET:
        torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2**-7)
    else:
        assert torch.equal(got, want)


CASES = [  # (mode, residual)
    (gemv.PLAIN, False), (gemv.ADD_RMS, True), (gemv.ADD_RMS, False), (gemv.SILU_MUL, False),
]
CONFIGS = [
    gemv.GemvConfig(8, 128, 1), gemv.GemvConfig(4, 256, 2), gemv.GemvConfig(16, 64, 4),
    gemv.GemvConfig(32, 128, 2, use_dot=True), gemv.GemvConfig(16, 64, 1, use_dot=True),
    gemv.GemvConfig(8, 128, 2, vec=8),  # 8-column vectors summed per thread
    gemv.GemvConfig(8, 128, 2, prefetch=False),  # each iteration loading its own tile
]


@pytest.mark.parametrize("mode,residual", CASES)
@pytest.mark.parametrize("n,k", [(1, 64), (37, 1000), (96, 512), (130, 768)])
@pytest.mark.parametrize("config", CONFIGS,
                         ids=lambda c: f"{c.block_n}x{c.block_k}s{c.split_k}{'d' if c.use_dot else ''}v{c.vec}"
                                       f"{'' if c.prefetch else 'np'}")
def test_gemv_equals_unfused_ops(mode, residual, n, k, config):
    dtype = torch.bfloat16
    x, w, b, r, nw = _inputs(mode, n, k, dtype, bias=n % 2 == 1, residual=residual, seed=n * k + mode)
    y, s = gemv.gemv(x, w, b, mode=mode, residual=r, norm_weight=nw, eps=1e-5, config=config)
    want, want_s = _reference(mode, x, w, b, r, nw, 1e-5)
    assert y.shape == (1, n) and y.dtype == dtype
    torch.testing.assert_close(y.float(), want, **TOL)
    if want_s is None:
        assert s is None
    else:
        _assert_same_rounded_sum(s, want_s)
    counters = arrival_counters(x.device, 1)
    assert int(counters.abs().sum()) == 0  # every split launch leaves its counters at zero


def _glu_reference(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """silu(gate) * up of a [gate | up] product computed in float32, rounded as the unfused ops."""
    return fused._silu_and_mul(y.to(dtype)).float()


@pytest.mark.parametrize("mode,residual", [(gemv.PLAIN, False), (gemv.ADD_RMS, True)])
@pytest.mark.parametrize("n,k", [(2, 64), (74, 1000), (260, 768)])
@pytest.mark.parametrize("config", CONFIGS,
                         ids=lambda c: f"{c.block_n}x{c.block_k}s{c.split_k}{'d' if c.use_dot else ''}v{c.vec}"
                                       f"{'' if c.prefetch else 'np'}")
def test_gate_up_product_with_the_activation_in_its_epilogue(mode, residual, n, k, config):
    """`glu`: a [gate | up] product whose programs take gate row j beside up row j and write
    silu(gate) * up: the unfused product then `silu_and_mul`, for half-widths that no block of
    rows divides (37, 130 rows of each), bias or none, split K and tensor-core launches."""
    dtype = torch.bfloat16
    x, w, b, r, nw = _inputs(mode, n, k, dtype, bias=n % 4 == 2, residual=residual, seed=n * k + 11)
    y, s = gemv.gemv(x, w, b, mode=mode, residual=r, norm_weight=nw, eps=1e-5, glu=True, config=config)
    want, want_s = _reference(mode, x, w, b, r, nw, 1e-5)
    assert y.shape == (1, n // 2) and y.dtype == dtype
    torch.testing.assert_close(y.float(), _glu_reference(want, dtype), **TOL)
    if want_s is not None:
        _assert_same_rounded_sum(s, want_s)
    assert int(arrival_counters(x.device, 1).abs().sum()) == 0


def test_glu_arguments_are_checked():
    x, w, *_ = _inputs(gemv.PLAIN, 9, 64, torch.bfloat16, False, False, 0)
    with pytest.raises(ValueError, match="even number of rows"):
        gemv.gemv(x, w, glu=True)
    with pytest.raises(ValueError, match="out_dtype"):
        gemv.gemv(x, w[:8], glu=True, out_dtype=torch.float32)


@pytest.mark.parametrize("k", [64, 1000, 4096])
@pytest.mark.parametrize("residual", [True, False])
def test_one_row_norm_kernel_equals_unfused(k, residual):
    x, _, _, r, nw = _inputs(gemv.ADD_RMS, 1, k, torch.bfloat16, False, residual, seed=k)
    h, s = gemv.add_rms_norm(x, r, nw, 1e-6)
    if residual:
        want_h, want_s = fused._add_rms_norm(x, r, nw, 1e-6)
        _assert_same_rounded_sum(s, want_s)
    else:
        want_h, want_s = fused._rms_norm(x, nw, 1e-6), None
        assert s is None
    torch.testing.assert_close(h.float(), want_h.float(), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("wide", [False, True])
def test_norm_then_product_entry_point(wide):
    """`one_row.add_rms_norm_linear` on CUDA: fused prologue, or (wide outputs) the norm kernel and a
    plain product; both equal the unfused ops (under the interpreter: the gemv calls directly)."""
    n = 16384 if wide else 96
    assert gemv_launch.fuse_norm(n, 256) is not wide
    x, w, b, r, nw = _inputs(gemv.ADD_RMS, n, 256, torch.bfloat16, False, True, seed=n)
    if INTERPRET:
        h, s = gemv.add_rms_norm(x, r, nw, 1e-6)
        y = gemv.gemv(h, w)[0]
    else:
        y, s = one_row.add_rms_norm_linear(x, r, nw, 1e-6, w, None)
    want, want_s = _reference(gemv.ADD_RMS, x, w, None, r, nw, 1e-6)
    torch.testing.assert_close(y.float(), want, **TOL)
    _assert_same_rounded_sum(s, want_s)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_default_config_on_model_shapes(dtype):
    """The chosen launch on a Llama-like layer's shapes (scaled down under the interpreter)."""
    scale = 8 if INTERPRET else 1
    hidden, inter = 4096 // scale, 14336 // scale
    for mode, n, k in [(gemv.ADD_RMS, 6144 // scale, hidden), (gemv.PLAIN, hidden, hidden),
                       (gemv.ADD_RMS, 2 * inter, hidden), (gemv.SILU_MUL, hidden, inter)]:
        x, w, b, r, nw = _inputs(mode, n, k, dtype, bias=False, residual=mode == gemv.ADD_RMS, seed=n + k)
        y, _ = gemv.gemv(x, w, b, mode=mode, residual=r, norm_weight=nw, eps=1e-6)
        torch.testing.assert_close(y.float(), _reference(mode, x, w, b, r, nw, 1e-6)[0], **TOL)


def test_applies_only_to_one_half_precision_row():
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    assert not one_row.applies(torch.zeros(1, 16, dtype=torch.bfloat16), w)  # CPU tensors
    if not INTERPRET:
        wc = w.cuda()
        assert one_row.applies(torch.zeros(1, 16, dtype=torch.bfloat16, device="cuda"), wc)
        assert not one_row.applies(torch.zeros(2, 16, dtype=torch.bfloat16, device="cuda"), wc)
        assert not one_row.applies(torch.zeros(1, 16, device="cuda"), wc.float())


def test_mismatched_width_is_refused():
    x, w, *_ = _inputs(gemv.PLAIN, 8, 64, torch.bfloat16, False, False, 0)
    with pytest.raises(ValueError, match="width"):
        gemv.gemv(x, w, mode=gemv.SILU_MUL)


@gpu_only
def test_split_launch_replays_in_a_graph():
    x, w, b, r, nw = _inputs(gemv.ADD_RMS, 4096, 4096, torch.bfloat16, True, True, 3)
    cfg = gemv.GemvConfig(8, 512, 4)
    gemv.gemv(x, w, b, mode=gemv.ADD_RMS, residual=r, norm_weight=nw, eps=1e-6, config=cfg)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, s = gemv.gemv(x, w, b, mode=gemv.ADD_RMS, residual=r, norm_weight=nw, eps=1e-6, config=cfg)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x))
        graph.replay()
        want, want_s = _reference(gemv.ADD_RMS, x, w, b, r, nw, 1e-6)
        torch.testing.assert_close(y.float(), want, **TOL)
        _assert_same_rounded_sum(s, want_s)


ADD_CONFIGS = [gemv.GemvConfig(8, 128, 1), gemv.GemvConfig(4, 256, 2), gemv.GemvConfig(16, 64, 4)]


@pytest.mark.parametrize("mode", [gemv.PLAIN, gemv.SILU_MUL])
@pytest.mark.parametrize("n,k", [(37, 1000), (96, 512)])
@pytest.mark.parametrize("config", ADD_CONFIGS, ids=lambda c: f"{c.block_n}x{c.block_k}s{c.split_k}")
def test_product_added_to_the_residual_then_normed_product(mode, n, k, config):
    """`gemv_add` (o_proj / down_proj writing the residual stream and its squares' block sums)
    then a `NORM` product (the next qkv / gate_up) equal the unfused add, RMSNorm and product."""
    dtype = torch.bfloat16
    x, w, b, _, _ = _inputs(mode, n, k, dtype, bias=n % 2 == 1, residual=False, seed=n + k + mode)
    g = torch.Generator().manual_seed(n)
    res = torch.randn(1, n, generator=g).to(dtype).to(DEVICE)
    s, sq = gemv.gemv_add(x, w, b, res, mode=mode, config=config)
    y_ref = _reference(mode, x, w, b, None, None, 0.0)[0].to(dtype)
    want_s = (y_ref.float() + res.float()).to(dtype)
    assert s.shape == (1, n) and s.dtype == dtype
    torch.testing.assert_close(s.float(), want_s.float(), **TOL)
    assert sq.shape == (-(-n // config.block_n),) and sq.dtype == torch.float32
    torch.testing.assert_close(sq.sum(), s.float().pow(2).sum(), rtol=1e-5, atol=1e-4)  # sums of what it wrote
    w2 = (torch.randn(2 * n + 3, n, generator=g) / n**0.5).to(dtype).to(DEVICE)
    nw = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype).to(DEVICE)
    for cfg in ADD_CONFIGS:
        y, none = gemv.gemv(s, w2, mode=gemv.NORM, norm_weight=nw, eps=1e-5, square_sums=sq, config=cfg)
        assert none is None
        torch.testing.assert_close(y.float(), F.linear(fused._rms_norm(s, nw, 1e-5).float(), w2.float()), **TOL)
    assert int(arrival_counters(x.device, 1).abs().sum()) == 0


def test_norm_and_add_arguments_are_checked():
    x, w, *_ = _inputs(gemv.PLAIN, 8, 64, torch.bfloat16, False, False, 0)
    with pytest.raises(ValueError, match="square sums"):
        gemv.gemv(x, w, mode=gemv.NORM, norm_weight=x[0])
    with pytest.raises(ValueError, match="residual of 3"):
        gemv.gemv_add(x, w, None, x[:, :3])
    with pytest.raises(ValueError, match="PLAIN or SILU_MUL"):
        gemv.gemv_add(x, w, None, x[:, :8], mode=gemv.ADD_RMS)


def test_residual_entry_points_off_the_kernel():
    """`one_row.linear_add` / `norm_linear` / `rms_norm` where `gemv` does not apply (CPU, float32):
    the unfused ops, with the row's square sums for the next norm."""
    g = torch.Generator().manual_seed(5)
    x, res = torch.randn(1, 2 * 24, generator=g), torch.randn(1, 16, generator=g)
    w, w2, nw = torch.randn(16, 24, generator=g), torch.randn(8, 16, generator=g), torch.rand(16, generator=g) + 0.5
    summed = one_row.linear_add(x, w, None, res, silu_mul=True)
    torch.testing.assert_close(summed.row, res + F.linear(fused._silu_and_mul(x), w))
    torch.testing.assert_close(summed.square_sums.sum(), summed.row.pow(2).sum())
    y = one_row.norm_linear(summed, nw, 1e-6, w2, None)
    torch.testing.assert_close(y, F.linear(fused._rms_norm(summed.row, nw, 1e-6), w2))
    torch.testing.assert_close(one_row.rms_norm(summed.row, nw, 1e-6), fused._rms_norm(summed.row, nw, 1e-6))


ROPE_CONFIGS = [gemv.GemvConfig(4, 64, 1), gemv.GemvConfig(8, 32, 2), gemv.GemvConfig(32, 64, 1),
                gemv.GemvConfig(16, 32, 4, use_dot=True)]


@pytest.mark.parametrize("mode", [gemv.PLAIN, gemv.ADD_RMS, gemv.NORM])
@pytest.mark.parametrize("head_dim", [16, 32])
@pytest.mark.parametrize("config", ROPE_CONFIGS, ids=lambda c: f"{c.block_n}x{c.block_k}s{c.split_k}{'d' if c.use_dot else ''}")
def test_qkv_product_with_rope_and_cache_write(mode, head_dim, config):
    """The RoPE epilogue of a qkv product (q and k heads rotated, k and v written to the caches
    at the one slot) equals the product, `fused.rope` and the plain cache write; the caches'
    other slots are untouched. Block sizes whose pairs would cross a head are lowered."""
    dtype, hq, hk, k = torch.bfloat16, 4, 2, 96
    n = (hq + 2 * hk) * head_dim
    g = torch.Generator().manual_seed(head_dim + mode + config.block_n)
    x = torch.randn(1, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE)
    r = torch.randn(1, k, generator=g).to(dtype).to(DEVICE) if mode == gemv.ADD_RMS else None
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(DEVICE)
    freqs = torch.arange(64, dtype=torch.float32)[:, None] * (1e4 ** (-torch.arange(head_dim // 2) / (head_dim // 2)))
    cos, sin = freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)
    caches = [torch.randn(40, hk, head_dim, generator=g).to(dtype).to(DEVICE) for _ in range(2)]
    want_caches = [c.clone() for c in caches]
    pos = torch.tensor([37], device=DEVICE)
    loc = torch.tensor([13], device=DEVICE, dtype=torch.int32)
    rope = one_row.RopeKV(pos, loc, cos, sin, *caches, hq, hk, head_dim)
    sq = None
    if mode == gemv.NORM:  # the row's squares as a previous product leaves them, in 3 blocks
        sq = torch.stack([x[0, i::3].float().pow(2).sum() for i in range(3)])
    y, _ = gemv.gemv(x, w, b, mode=mode, residual=r, norm_weight=nw, eps=1e-5, square_sums=sq, rope=rope,
                     config=config)
    plain = _reference(gemv.ADD_RMS if mode == gemv.NORM else mode, x, w, b, r, nw, 1e-5)[0].to(dtype)
    want = one_row._rope_kv(plain, one_row.RopeKV(pos, loc.long(), cos, sin, *want_caches, hq, hk, head_dim))
    torch.testing.assert_close(y.float(), want.float(), **TOL)
    for got_c, want_c in zip(caches, want_caches):
        torch.testing.assert_close(got_c.float(), want_c.float(), **TOL)
        mask = torch.ones(40, dtype=torch.bool)
        mask[13] = False
        assert torch.equal(got_c[mask.to(DEVICE)], want_c[mask.to(DEVICE)])


def test_rope_epilogue_shapes_are_checked():
    x, w, *_ = _inputs(gemv.PLAIN, 8 * 16, 64, torch.bfloat16, False, False, 0)
    kc = torch.zeros(4, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    cos = torch.zeros(8, 8, device=DEVICE)
    pos = torch.zeros(1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="RoPE epilogue over 128 rows"):
        gemv.gemv(x, w, rope=one_row.RopeKV(pos, pos, cos, cos, kc, kc, 5, 2, 16))
    with pytest.raises(ValueError, match="caches"):
        gemv.gemv(x, w, rope=one_row.RopeKV(pos, pos, cos, cos, kc.float(), kc, 4, 2, 16))


def test_float32_output_is_the_rounded_product():
    """`out_dtype=float32` (the LM head's logits): the product rounded to the input's dtype, stored
    as float32, as F.linear(...).float(); refused for prologue products."""
    x, w, b, _, _ = _inputs(gemv.PLAIN, 37, 1000, torch.bfloat16, bias=True, residual=False, seed=11)
    y, _ = gemv.gemv(x, w, b, out_dtype=torch.float32, config=gemv.GemvConfig(8, 128, 2))
    assert y.dtype == torch.float32
    assert torch.equal(y, y.to(torch.bfloat16).float())  # values of the input's dtype
    torch.testing.assert_close(y, F.linear(x.float(), w.float(), b.float()), **TOL)
    with pytest.raises(ValueError, match="plain"):
        gemv.gemv(x[:, :500].repeat(1, 4), w, mode=gemv.SILU_MUL, out_dtype=torch.float32)


def test_launch_configs_are_checked():
    for bad in [dict(block_n=1, block_k=64), dict(block_n=6, block_k=64), dict(block_n=4, block_k=100),
                dict(block_n=4, block_k=64, split_k=3), dict(block_n=4, block_k=64, vec=12),
                dict(block_n=4, block_k=16, vec=32), dict(block_n=16, block_k=64, vec=16, use_dot=True)]:
        with pytest.raises(ValueError, match="power of two"):
            gemv.GemvConfig(**bad)


# FP8 weights with one scale per row (`--quantization fp8`, per-channel / per-tensor checkpoints):
# the same kernel widens each element and scales each row's sum; the reference is the unfused ops
# on the dequantized weight (`fp8.dequantize`). Real devices only (the interpreter has no FP8).


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(FP8 weight, per-row scales [N, 1], the dequantized weight in float32)."""
    q, s = fp8.quantize_rows(w.float())
    return q, s, fp8.dequantize(q, s, q.shape[1])


@gpu_only
@pytest.mark.parametrize("mode,residual", CASES)
@pytest.mark.parametrize("n,k", [(1, 64), (37, 1000), (130, 768)])
@pytest.mark.parametrize("config", [CONFIGS[1], CONFIGS[4], gemv.GemvConfig(4, 1024, 1, vec=16),
                                    gemv.GemvConfig(8, 64, 2, vec=16), gemv.GemvConfig(32, 32, 1, vec=16),
                                    gemv.GemvConfig(4, 1024, 1, vec=16, prefetch=False),
                                    gemv.GemvConfig(8, 64, 2, vec=16, prefetch=False)],
                         ids=lambda c: f"{c.block_n}x{c.block_k}s{c.split_k}{'d' if c.use_dot else ''}v{c.vec}"
                                       f"{'' if c.prefetch else 'np'}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_fp8_weight_equals_dequantized_product(mode, residual, n, k, config, dtype):
    if config.use_dot and dtype == torch.float16 and mode == gemv.ADD_RMS:
        pytest.skip("refused: the tensor-core path would overflow float16 (test_gemv_equals_unfused_ops)")
    x, w, b, r, nw = _inputs(mode, n, k, dtype, bias=n % 2 == 1, residual=residual, seed=n * k + mode + 7)
    q, s, wd = _fp8(w)
    y, res_sum = gemv.gemv(x, q, b, mode=mode, residual=r, norm_weight=nw, eps=1e-5, scale=s, config=config)
    want, want_s = _reference(mode, x, wd, b, r, nw, 1e-5)
    assert y.shape == (1, n) and y.dtype == dtype
    torch.testing.assert_close(y.float(), want, **TOL)
    if want_s is not None:
        _assert_same_rounded_sum(res_sum, want_s)
    assert int(arrival_counters(x.device, 1).abs().sum()) == 0


@gpu_only
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("config", [None, gemv.GemvConfig(4, 1024, 1, vec=16, prefetch=False),
                                    gemv.GemvConfig(8, 64, 2, vec=16)],
                         ids=lambda c: "default" if c is None else f"{c.block_n}x{c.block_k}s{c.split_k}")
def test_fp8_gate_up_with_the_activation_in_its_epilogue(wide, config):
    """An FP8 [gate | up] weight with row scales, `glu`: each row's scale is applied before the
    activation (the dequantized product, then `silu_and_mul`); through `one_row`'s entry point
    (the norm kernel, then the product, for wide outputs) with the default launch."""
    n, k, dtype = (2 * 8200 if wide else 2 * 37), 512, torch.bfloat16
    x, w, b, r, nw = _inputs(gemv.ADD_RMS, n, k, dtype, bias=False, residual=True, seed=n + 3)
    q, s, wd = _fp8(w)
    if config is None:
        y, res_sum = one_row.add_rms_norm_linear(x, r, nw, 1e-5, q, None, scale=s, glu=True)
    else:
        y, res_sum = gemv.gemv(x, q, mode=gemv.ADD_RMS, residual=r, norm_weight=nw, eps=1e-5, scale=s, glu=True,
                               config=config)
    want, want_s = _reference(gemv.ADD_RMS, x, wd, None, r, nw, 1e-5)
    assert y.shape == (1, n // 2)
    torch.testing.assert_close(y.float(), _glu_reference(want, dtype), **TOL)
    _assert_same_rounded_sum(res_sum, want_s)
    off = one_row.add_rms_norm_linear(x.cpu(), r.cpu(), nw.cpu(), 1e-5, q.cpu(), None, scale=s.cpu(), glu=True)[0]
    torch.testing.assert_close(off.float(), _glu_reference(want, dtype).cpu(), **TOL)  # the unfused path


@gpu_only
@pytest.mark.parametrize("mode", [gemv.PLAIN, gemv.SILU_MUL])
@pytest.mark.parametrize("config", [ADD_CONFIGS[1], gemv.GemvConfig(4, 64, 1, vec=16), gemv.GemvConfig(16, 32, 2, vec=16),
                                    gemv.GemvConfig(16, 32, 2, vec=16, prefetch=False)],
                         ids=lambda c: f"{c.block_n}x{c.block_k}s{c.split_k}v{c.vec}{'' if c.prefetch else 'np'}")
def test_fp8_product_added_to_the_residual_then_normed_fp8_product(mode, config):
    """The batch-1 layer's chain on FP8 weights: `gemv_add` (down_proj) then a `NORM` product (the
    next qkv) with its RoPE epilogue, against the dequantized unfused ops."""
    dtype, n, k, hq, hk, d = torch.bfloat16, 96, 520, 4, 2, 16
    x, w, b, _, _ = _inputs(mode, n, k, dtype, bias=True, residual=False, seed=mode + config.split_k)
    q, s, wd = _fp8(w)
    g = torch.Generator().manual_seed(3)
    res = torch.randn(1, n, generator=g).to(dtype).to(DEVICE)
    summed, sq = gemv.gemv_add(x, q, b, res, mode=mode, scale=s, config=config)
    want_s = (_reference(mode, x, wd, b, None, None, 0.0)[0].to(dtype).float() + res.float()).to(dtype)
    torch.testing.assert_close(summed.float(), want_s.float(), **TOL)
    torch.testing.assert_close(sq.sum(), summed.float().pow(2).sum(), rtol=1e-5, atol=1e-4)
    w2 = (torch.randn((hq + 2 * hk) * d, n, generator=g) / n**0.5).to(dtype).to(DEVICE)
    q2, s2, wd2 = _fp8(w2)
    nw = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype).to(DEVICE)
    freqs = torch.arange(16, dtype=torch.float32)[:, None] * (1e4 ** (-torch.arange(d // 2) / (d // 2)))
    cos, sin = freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)
    caches = [torch.zeros(8, hk, d, dtype=dtype, device=DEVICE) for _ in range(2)]
    want_caches = [c.clone() for c in caches]
    pos, loc = torch.tensor([5], device=DEVICE), torch.tensor([3], device=DEVICE, dtype=torch.int32)
    y, _ = gemv.gemv(summed, q2, mode=gemv.NORM, norm_weight=nw, eps=1e-5, square_sums=sq, scale=s2,
                     rope=one_row.RopeKV(pos, loc, cos, sin, *caches, hq, hk, d), config=config)
    plain = F.linear(fused._rms_norm(summed, nw, 1e-5).float(), wd2).to(dtype)
    want = one_row._rope_kv(plain, one_row.RopeKV(pos, loc.long(), cos, sin, *want_caches, hq, hk, d))
    torch.testing.assert_close(y.float(), want.float(), **TOL)
    for got_c, want_c in zip(caches, want_caches):
        torch.testing.assert_close(got_c.float(), want_c.float(), **TOL)


def test_fp8_weight_arguments_are_checked():
    x, w, *_ = _inputs(gemv.PLAIN, 8, 64, torch.bfloat16, False, False, 0)
    q, s, _ = _fp8(w.cpu())
    q, s = q.to(DEVICE), s.to(DEVICE)
    with pytest.raises(ValueError, match="needs float32 scales"):
        gemv.gemv(x, q)
    with pytest.raises(ValueError, match="needs float32 scales"):
        gemv.gemv(x, q, scale=s.expand(8, 2).contiguous())  # block scales: not this kernel's
    with pytest.raises(ValueError, match="scales are for float8"):
        gemv.gemv(x, w, scale=s)
    with pytest.raises(ValueError, match="a torch.float32 weight"):
        gemv.gemv(x, w.float())


def test_applies_to_fp8_weights_with_row_scales():
    q, s, _ = _fp8(torch.randn(8, 16))
    row = torch.zeros(1, 16, dtype=torch.bfloat16)
    assert not one_row.applies(row, q, s)  # CPU tensors
    if not INTERPRET:
        q, s, row = q.cuda(), s.cuda(), row.cuda()
        assert one_row.applies(row, q, s) and one_row.applies(row.half(), q, s)
        assert not one_row.applies(row, q, None)  # no scale
        assert not one_row.applies(row, q, s.expand(8, 2))  # block-wise
        assert not one_row.applies(row.float(), q, s)
        assert not one_row.applies(row.expand(2, 16), q, s)
