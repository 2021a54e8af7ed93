"""FP8-weight linear layers (`workers.layers.fp8_gemm`) against a float32 reference: the weight
dequantized (w * its row's or block's scale) and multiplied in float32 with the same x.

Weights are random bf16 quantized per row (block_k = K) or per b x b block (expanded to one scale
row per output row, block_k = b); odd sizes (N = 200, K = 328: multiples of no tile, a partial
last k-block), M from 1 to 300, bf16 and fp16, with and without bias, through `fp8_linear`'s
own choice and through each kernel forced (the one-row GEMV, the W8A16 tile kernel with K split
and with swapped operands, the W8A8 tile kernel, torch._scaled_mm).

Tolerances, as ||y - ref|| / ||ref||: W8A16 paths round only the output (and, for block scales,
the scaled weight) to x's dtype: 1e-2 in bf16, 3e-3 in fp16. W8A8 paths also round x to e4m3
per token: ~2.6% on Gaussian rows, so 5e-2; against a reference that quantizes x the same way
they agree to 1e-2. Skipped without CUDA (the kernel module needs Triton and is imported inside
the tests).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

W8A16_TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3}
W8A8_TOL = 5e-2


@pytest.fixture(scope="module")
def fp8():
    pytest.importorskip("triton")
    from workers.layers import fp8_gemm

    return fp8_gemm


def quantize_weight(w: torch.Tensor, block: int | None, rows: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(e4m3 [N, K], float32 scales [N, KB], block_k): per row (block None) or per `rows` x block
    tile (rows = block unless given), the tile scales repeated for each of its rows."""
    n, k = w.shape
    w = w.float()
    if block is None:
        s = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 448
        return (w / s).to(torch.float8_e4m3fn), s, k
    bn = rows or block
    nb, kb = -(-n // bn), -(-k // block)
    padded = torch.zeros(nb * bn, kb * block, device=w.device)
    padded[:n, :k] = w
    tiles = padded.reshape(nb, bn, kb, block)
    s = tiles.abs().amax((1, 3)).clamp(min=1e-12) / 448
    q = (tiles / s[:, None, :, None]).reshape(nb * bn, kb * block)[:n, :k].to(torch.float8_e4m3fn)
    return q.contiguous(), s.repeat_interleave(bn, 0)[:n].contiguous(), block


def reference(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block_k: int, bias: torch.Tensor | None):
    k = q.shape[1]
    w = q.float() * s.repeat_interleave(block_k, 1)[:, :k]
    y = x.float() @ w.T
    return y if bias is None else y + bias.float()


def quantized_x(x: torch.Tensor, group: int) -> torch.Tensor:
    """x rounded to e4m3 as the W8A8 paths do (per token, or per token and group of columns)."""
    m, k = x.shape
    g = -(-k // group)
    xp = torch.zeros(m, g * group, device=x.device)
    xp[:, :k] = x.float()
    t = xp.reshape(m, g, group)
    s = t.abs().amax(2, keepdim=True).clamp(min=1e-12) / 448
    return ((t / s).to(torch.float8_e4m3fn).float() * s).reshape(m, -1)[:, :k]


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def make(n, k, m, dtype, block, bias, seed=0, rows=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
    q, s, block_k = quantize_weight(w.to(torch.bfloat16), block, rows)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    b = torch.randn(n, device="cuda", generator=g).to(dtype) if bias else None
    return x, q, s, block_k, b


def check(fp8, y, x, q, s, block_k, b, a8):
    ref = reference(x, q, s, block_k, b)
    assert y.dtype == x.dtype and y.shape == ref.shape
    if not a8:
        assert rel_err(y, ref) < W8A16_TOL[x.dtype]
        return
    assert rel_err(y, ref) < W8A8_TOL
    group = x.shape[1] if s.shape[1] == 1 else block_k
    assert rel_err(y, reference(quantized_x(x, group), q, s, block_k, b)) < 1e-2


BLOCKS = {"channel": None, "block128": 128, "block32": 32}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("scales", list(BLOCKS))
@pytest.mark.parametrize("m", [1, 3, 17, 64, 300])
def test_fp8_linear_odd_sizes(fp8, m, scales, dtype):
    bias = (dtype == torch.bfloat16) != (scales == "block128")  # each (M, scales) with and without
    x, q, s, block_k, b = make(200, 328, m, dtype, BLOCKS[scales], bias, seed=m)
    kernel = fp8.choose_kernel(m, 200, 328, s.shape[1], block_k)
    y = fp8.fp8_linear(x, q, s, block_k, b)
    check(fp8, y, x, q, s, block_k, b, a8=kernel not in (fp8.Kernel.GEMV, fp8.Kernel.W8A16))


@pytest.mark.parametrize("scales", ["channel", "block128"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_each_kernel(fp8, scales, bias):
    """N = 272, K = 4160 (16-aligned, a half last 128-block): every path on the same weight."""
    from attention.arrival import arrival_counters

    n, k = 272, 4160
    x, q, s, block_k, b = make(n, k, 300, torch.bfloat16, BLOCKS[scales], bias, seed=7)
    dev = x.device
    check(fp8, fp8.gemv(x[:1], q, s, block_k, b), x[:1], q, s, block_k, b, a8=False)
    for m in (2, 17, 64):
        cfg = fp8.choose_tile(m, n, k, s.shape[1], False, dev)
        assert cfg.split_k > 1  # 5 column tiles: K split over programs
        check(fp8, fp8.gemm(x[:m], q, s, block_k, b), x[:m], q, s, block_k, b, a8=False)
        assert int(arrival_counters(dev, 1).count_nonzero()) == 0  # the last program reset them
        swapped = fp8.TileConfig(max(16, 1 << (m - 1).bit_length()), 64, 128, 4, 3, split_k=2, swap=True)
        check(fp8, fp8.gemm(x[:m], q, s, block_k, b, config=swapped), x[:m], q, s, block_k, b, a8=False)
    check(fp8, fp8.gemm(x, q, s, block_k, b), x, q, s, block_k, b, a8=False)
    check(fp8, fp8.gemm(x, q, s, block_k, b, a8=True), x, q, s, block_k, b, a8=True)
    if scales == "channel":
        check(fp8, fp8.scaled_mm(x, q, s, b), x, q, s, block_k, b, a8=True)
    check(fp8, fp8.fp8_linear(x, q, s, block_k, b), x, q, s, block_k, b, a8=True)


@pytest.mark.parametrize("m", [64, 100, 128])
def test_decode_batches_split_k_on_narrow_per_channel_weights(fp8, m):
    """A decode batch's per-channel W8A8 product on a long-K weight of few 128-row tiles: the
    Triton kernel with K split (cuBLAS would leave most SMs idle), M not always a multiple of
    the tile; against the reference, and the arrival counters left at zero."""
    from attention.arrival import arrival_counters

    n, k = 528, 8208  # a partial last k-step
    x, q, s, block_k, b = make(n, k, m, torch.bfloat16, None, m == 100, seed=m)
    assert fp8.choose_kernel(m, n, k, 1, block_k, fp8.num_sms(x.device)) is fp8.Kernel.W8A8
    cfg = fp8.choose_tile(m, n, k, 1, True, x.device)
    assert cfg.block_m == 64 and cfg.split_k > 1
    check(fp8, fp8.fp8_linear(x, q, s, block_k, b), x, q, s, block_k, b, a8=True)
    assert int(arrival_counters(x.device, 64).count_nonzero()) == 0


@pytest.mark.parametrize("m", [2, 17, 48, 64, 100, 128])
def test_tma_decode_batches(fp8, m, monkeypatch):
    """Per-channel products of decode batches on the TMA kernel (Hopper): rows padded to the
    token tile, N a multiple of no weight tile (N = 200), a partial last K step (K = 4,160), with
    and without bias; `fp8_linear`'s own choice, quantized rows handed over, and K split in three
    (the arrival counters left at zero)."""
    from attention import kernel_options
    from attention.arrival import arrival_counters
    from workers.layers import fp8_tma
    from workers.layers.fp8_rows import Fp8Rows

    monkeypatch.setattr(kernel_options, "_current", kernel_options.KernelOptions(fp8_tma=True))
    x, q, s, block_k, b = make(200, 4160, m, torch.bfloat16, None, m % 2 == 0, seed=m)
    if not fp8_tma.available(x.device):
        pytest.skip("TMA products need a Hopper GPU")
    assert fp8.kernel_for(m, 200, 4160, 1, block_k, x.device) is fp8.Kernel.TMA
    check(fp8, fp8.fp8_linear(x, q, s, block_k, b), x, q, s, block_k, b, a8=True)
    rows = Fp8Rows(*fp8.quantize_rows(x), x.dtype)
    check(fp8, fp8.fp8_linear(rows, q, s, block_k, b), x, q, s, block_k, b, a8=True)
    y = fp8_tma.linear(rows.q, rows.scale, q, s, x.dtype, b, (64, 128, 4, 3, 3))
    check(fp8, y, x, q, s, block_k, b, a8=True)
    assert int(arrival_counters(x.device, 64).count_nonzero()) == 0


@pytest.mark.parametrize("m", [300, 301])
def test_blockwise(fp8, m):
    """cuBLAS's 1 x 128 / 128 x 128 product where `choose_kernel` takes it (N = 272: a partial
    last 128-row block; M = 301: x padded to a multiple of 4 rows)."""
    x, q, s, block_k, b = make(272, 4608, m, torch.bfloat16, 128, True, seed=m)
    assert fp8.choose_kernel(m, 272, 4608, s.shape[1], block_k) is fp8.Kernel.BLOCKWISE
    check(fp8, fp8.fp8_linear(x, q, s, block_k, b), x, q, s, block_k, b, a8=True)


@pytest.mark.parametrize("m", [64, 300])
def test_block_scales_not_in_128_row_blocks(fp8, m):
    """block_k = 128 whose 64-row halves differ (a shard or fused part starting mid-block):
    cuBLAS's 128 x 128 scales cannot express them, so `fp8_linear` takes a Triton kernel."""
    x, q, s, block_k, b = make(272, 4608, m, torch.bfloat16, 128, False, seed=5, rows=64)
    assert fp8.choose_kernel(m, 272, 4608, s.shape[1], block_k) is fp8.Kernel.BLOCKWISE  # by shape
    assert not fp8.scales_in_128_row_blocks(s)
    check(fp8, fp8.fp8_linear(x, q, s, block_k, b), x, q, s, block_k, b, a8=m >= 256)
    x, q, s, block_k, b = make(272, 4608, m, torch.bfloat16, 128, False, seed=5)
    assert fp8.scales_in_128_row_blocks(s)


@pytest.mark.parametrize("group", [0, 128])
def test_quantize_rows(fp8, group):
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(37, 4160, device="cuda", generator=g).to(torch.bfloat16)
    x[5, 17] = 300.0  # an outlier sets its row's (or group's) scale
    q, s = fp8.quantize_rows(x, group)
    cols = x.shape[1] if group == 0 else group
    assert q.dtype == torch.float8_e4m3fn and s.shape == (37, -(-4160 // cols))
    t = torch.zeros(37, s.shape[1] * cols, device="cuda")
    t[:, :4160] = x.float()
    amax = t.reshape(37, s.shape[1], cols).abs().amax(2)
    torch.testing.assert_close(s, amax / 448, rtol=1e-6, atol=0)
    dq = q.float() * s.repeat_interleave(cols, 1)[:, :4160]
    assert q.float().abs().max() <= 448 and rel_err(dq, x.float()) < 3e-2
    # rounded to nearest as torch's cast, but of x * (448 / amax), which may differ from x / scale
    # in the last bit: a few values land one e4m3 step away
    expected = (x.float() / s.repeat_interleave(cols, 1)[:, :4160]).to(torch.float8_e4m3fn).float()
    assert (q.float() != expected).float().mean() < 1e-2
    assert ((q.float() - expected).abs() <= expected.abs() / 8 + 2**-9).all()


def test_graph_replay(fp8):
    """A captured product (one row; a K-split tile launch) replays with new inputs."""
    x, q, s, block_k, _ = make(272, 4160, 17, torch.bfloat16, 128, False, seed=11)
    outs = []
    fp8.fp8_linear(x[:1], q, s, block_k), fp8.fp8_linear(x, q, s, block_k)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fp8.fp8_linear(x[:1], q, s, block_k), fp8.fp8_linear(x, q, s, block_k)]
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        check(fp8, outs[0], x[:1], q, s, block_k, None, a8=False)
        check(fp8, outs[1], x, q, s, block_k, None, a8=False)


def test_choose_kernel(fp8):
    K = fp8.Kernel
    big = fp8.A8_MIN_M
    assert fp8.choose_kernel(1, 4096, 4096, 1, 4096) is K.GEMV
    assert fp8.choose_kernel(1, 4096, 4096, 32, 128) is K.GEMV
    assert fp8.choose_kernel(big - 1, 4096, 4096, 1, 4096) is K.W8A16
    assert fp8.choose_kernel(big, 4096, 4096, 1, 4096) is K.SCALED_MM
    assert fp8.choose_kernel(big, 4096, 14336, 1, 14336) is K.W8A8  # down: 32 tiles, long K: split on Triton
    assert fp8.choose_kernel(big, 28672, 14336, 1, 14336) is K.SCALED_MM  # 224 tiles fill the SMs
    assert fp8.choose_kernel(big, 4096, 14336, 1, 14336, sms=16) is K.SCALED_MM  # 32 tiles fill 16
    assert fp8.choose_kernel(fp8.DECODE_A8_MAX_M + 1, 4096, 14336, 1, 14336) is K.SCALED_MM
    assert fp8.choose_kernel(big, 200, 328, 1, 328) is K.W8A8  # not 16-aligned: no cuBLAS
    assert fp8.choose_kernel(big, 4096, 4096, 32, 128) is K.BLOCKWISE
    assert fp8.choose_kernel(big, 200, 328, 3, 128) is K.W8A8
    assert fp8.choose_kernel(big, 272, 4160, 33, 128) is K.W8A8  # cuBLAS's block scales: K % 512
    assert fp8.choose_kernel(big, 272, 4608, 36, 128) is K.BLOCKWISE
    assert fp8.choose_kernel(big, 4096, 4096, 64, 64) is K.W8A8
    assert fp8.choose_kernel(big, 4096, 4096, 256, 16) is K.W8A16  # fp8 dots take k-steps of 32
    from workers.layers.fp8_tma import MAX_M

    # on Hopper: per-channel products of 2-128 rows on the TMA kernel, but for wide ones past 64
    assert fp8.choose_kernel(2, 4096, 4096, 1, 4096, tma=True) is K.TMA
    assert fp8.choose_kernel(1, 4096, 4096, 1, 4096, tma=True) is K.GEMV
    assert fp8.choose_kernel(big, 28672, 4096, 1, 4096, tma=True) is K.TMA
    assert fp8.choose_kernel(big + 1, 28672, 4096, 1, 4096, tma=True) is K.SCALED_MM
    assert fp8.choose_kernel(MAX_M, 4096, 14336, 1, 14336, tma=True) is K.TMA
    assert fp8.choose_kernel(MAX_M + 1, 4096, 4096, 1, 4096, tma=True) is K.SCALED_MM
    assert fp8.choose_kernel(17, 4096, 4104, 1, 4104, tma=True) is K.W8A16  # K: TMA's 16-byte row stride
    assert fp8.choose_kernel(17, 4096, 4096, 32, 128, tma=True) is K.W8A16  # block scales


def test_rejects_bad_scales(fp8):
    x, q, s, block_k, _ = make(64, 256, 2, torch.bfloat16, 128, False)
    with pytest.raises(ValueError):
        fp8.fp8_linear(x, q, s[:, :1], block_k)
    with pytest.raises(ValueError):
        fp8.fp8_linear(x, q, torch.ones(64, 6, device="cuda"), 48)  # block_k: a power of two or K
