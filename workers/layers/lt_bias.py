"""16-bit products of decode batches through cuBLASLt's bias epilogue, with a zero bias, where
its heuristic picks a better kernel than the plain product's.

`F.linear` without a bias takes cuBLAS's heuristic; with one, cuBLASLt's (the bias in the
epilogue). On an H200 (2026-11-29, `scripts/decode_gemm_kernels_probe.py`, each product in a
CUDA graph over weight copies larger than L2) the 8B shape's down product (4,096 x 14,336) ran
as a split-K kernel plus a reduce without a bias, 32.9 / 35.5 us at 32 / 64 rows, and as one
kernel with a zero bias, 31.2 / 32.1 us; gate/up (28,672 x 4,096) at 64 rows 62.8 against 60.8
us, but 62.7 against 63.3 at 32 rows. At 128 rows, and for qkv and o, the plain product was as
fast or faster. The whole decode step (`manta bench latency`, same day, off / on / on / off, p50):
batch 64 6.183 / 6.014 / 6.015 / 6.227 ms (-2.9%), batch 32 5.533 / 5.475 / 5.477 / 5.544 ms
(-1.1%), but batch 8 4.901 / 4.985 / 4.960 / 4.891 ms (+1.5%) with the first rule (long K from 2
rows). So: long-K products (K >= 8,192) at 32-64 rows, and wide ones (N >= 16,384) at 33-64
rows, take a zero bias. With that rule batch 64 went 6.137 / 6.173 -> 5.948 / 5.961 ms (74.5 ->
77.0% of its roofline), batch 32 -1.2%, batch 1 and 8 unchanged (BENCHMARKS.md, 2026-11-29).

Batches of 65-96 requests replay the 96-row decode graph (`workers/cuda_graph.py`'s sizes). At
96 rows (same probe, 2026-11-29, later session) down ran split-K 37.3 us plain and 33.2 with a
zero bias (72 / 80 rows: 35.7 / 36.2 against 32.7 / 32.5), and o (4,096 x 4,096) 15.8 us plain, a
128 x 32 tile, against 12.3 (at 72 / 80 rows the plain product picks a faster tile, 12.1 / 12.3,
and the bias costs 0.0-0.3 us); gate/up and qkv were as fast or faster plain at 72-96. At 128
rows down and o were faster plain (37.0 / 14.1 against 38.9 / 14.3 us). So long-K products also
take it up to 96 rows, and products of at most 4,096 x 4,096 at 81-96 rows.

Adding 0 in the epilogue changes no value; only the kernel, and so the order of the sums,
differs. Prompt pieces of 32-64 tokens take it too (same shapes). A zero bias first asked for
inside a CUDA graph capture is not made there: that graph keeps the plain product.
`decode_zero_bias` (`MANTA_ZERO_BIAS=0`) turns it off.

Imports no Triton; CPU products never take it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attention import kernel_options

_ZEROS: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}  # kept: captured graphs read them by address


def _zeros(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """A zero bias made outside any CUDA graph capture (made inside one, its memset would run
    only when that graph replays). The decode graphs run each batch size eagerly first."""
    key = (n, dtype, device)
    t = _ZEROS.get(key)
    if t is None and not torch.cuda.is_current_stream_capturing():
        t = _ZEROS[key] = torch.zeros(n, dtype=dtype, device=device)
    return t


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if not (x.is_cuda and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype):
        return False
    m = x.shape[0]
    n, k = weight.shape
    fits = (k >= 8192 and 32 <= m <= 96) or (n >= 16384 and 33 <= m <= 64) or (max(n, k) <= 4096 and 81 <= m <= 96)
    return fits and kernel_options.current().decode_zero_bias


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with a zero bias where `applies` (and no bias was given)."""
    if bias is None and applies(x, weight):
        bias = _zeros(weight.shape[0], weight.dtype, weight.device)
    return F.linear(x, weight, bias)
