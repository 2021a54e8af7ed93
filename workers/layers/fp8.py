"""FP8 weights of a linear layer: one representation for every checkpoint format
(`workers/quantization.py`), its loaders, and the product.

A quantized layer holds `weight` [rows, cols] `float8_e4m3fn` (this rank's rows and columns, as
the unquantized layer would) and `weight_scale` [rows, ceil(cols / block_k)] float32: the
dequantized weight is `weight[n, k] * weight_scale[n, k // block_k]`. Per-tensor and per-channel
scales are block_k = cols (one scale column); block-wise (DeepSeek-V3, bn x bk blocks) keeps one
scale row per weight row (a bn-row block's scale repeated), so fused layers (q|k|v, gate|up)
and column-parallel shards place scales exactly as they place weight rows, whatever their
sizes. Splitting K over ranks (row-parallel layers) must keep bk-wide blocks whole: a TP size
that cuts one is refused at load with the layer named.

Where a layer's rows and columns come from is the layer's own `_place(shard_id)` -> (first row
in this rank's weight, first row in the checkpoint tensor, rows, first checkpoint column,
columns) — `workers/layers/linear.py` — so weights and scales load through the same map.

The product: on CUDA `workers/layers/fp8_gemm.py` (Triton and FP8 tensor cores); elsewhere the
weight is dequantized to the activations' dtype and multiplied (the reference the kernels are
tested against: transformers on the dequantized weights is the oracle of the CPU tests).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.layers.fp8_rows import Fp8Rows
from workers.quantization import FP8_MAX

if TYPE_CHECKING:
    from workers.quantization import QuantSpec

FP8 = torch.float8_e4m3fn


def is_fp8(weight: torch.Tensor) -> bool:
    return weight.dtype == FP8


def row_scale(layer: nn.Module) -> torch.Tensor | None:
    """`layer.weight_scale` where its weight is FP8 with one scale per row (per-channel and
    per-tensor checkpoints, `--quantization fp8`): what the one-row kernels take
    (`workers.layers.one_row`). None for unquantized and block-wise layers."""
    if not is_fp8(layer.weight) or layer.weight_scale.shape[1] != 1:
        return None
    return layer.weight_scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block_k: int) -> torch.Tensor:
    """float32 [N, K] from an FP8 weight and its [N, ceil(K / block_k)] scales."""
    k = weight.shape[1]
    s = scale if scale.shape[1] == 1 else scale.repeat_interleave(block_k, dim=1)[:, :k]
    return weight.to(torch.float32) * s


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel: (FP8 [N, K], float32 scales [N, 1]) with w ~ fp8 * scale."""
    return quantize_columns(w, w)


def quantize_columns(data: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`data`, some columns of the weight rows `rows` (a row-parallel rank's share) or all of
    them, in FP8 with one scale per row taken from the whole row, as at TP=1: (FP8 data,
    float32 scales [N, 1])."""
    amax = rows.abs().amax(dim=1, keepdim=True).to(torch.float32).clamp(min=1e-12)
    scale = amax / FP8_MAX
    return (data.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_blocks(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 style: (FP8 [N, K], float32 `weight_scale_inv` [ceil(N/bn), ceil(K/bk)])."""
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.to(torch.float32)
    blocks = padded.view(nb, bn, kb, bk)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(nb * bn, kb * bk)[:n, :k]
    return q.to(FP8), scale


# A checkpoint's scale tensors, named for the weight they belong to.
SCALE = re.compile(r"\.(weight_scale_inv|weight_scale|input_scale)$")


def scale_param(match: re.Match) -> str:
    """The layer parameter a scale tensor loads into (`SCALE` matched its name)."""
    return "input_scale" if match.group(1) == "input_scale" else "weight_scale"


def takes_rows(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether `layer`'s product of x's rows (x [M, K'], any width: a gate/up output for a
    down product) quantizes them to e4m3 per row before its FP8 tensor cores: a per-channel
    FP8 weight on CUDA, 16-bit activations, a W8A8 product for its rows (`fp8_gemm.kernel_for`),
    and the kernel options' `fp8_rows` on. Then the elementwise op before it may hand it
    `Fp8Rows` instead."""
    if (row_scale(layer) is None or not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16)
            or x.dim() != 2):  # (the rows are [M, K]: a product of them returns [M, N])
        return False
    from attention import kernel_options
    from workers.layers import fp8_gemm

    if not kernel_options.current().fp8_rows:
        return False
    n, k = layer.weight.shape
    return fp8_gemm.kernel_for(x.shape[0], n, k, 1, k, x.device) in fp8_gemm.PER_TOKEN_A8


def linear(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, scale: torch.Tensor, block_k: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequantize(weight, scale).T (+ bias), in x's dtype (`Fp8Rows`: CUDA, per-channel
    weights, where `takes_rows` said so)."""
    if isinstance(x, Fp8Rows):
        from workers.layers import fp8_gemm

        return fp8_gemm.fp8_linear(x, weight, scale, block_k, bias)
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
        from workers.layers import fp8_gemm

        flat = x.reshape(-1, x.shape[-1])
        y = fp8_gemm.fp8_linear(flat if flat.is_contiguous() else flat.contiguous(), weight, scale, block_k, bias)
        return y.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, dequantize(weight, scale, block_k).to(x.dtype), bias)


# ---------------------------------------------------------------------------------------------
# parameters and loaders


def refuse_k_split(owner: str, k_start: int, cols: int, block_k: int, full_k: int) -> None:
    """A row-parallel shard [k_start, k_start + cols) of a block-wise FP8 weight's K (`full_k`
    columns) must start on a block edge, and end on one unless it is the last: its scales are
    per block. ValueError naming `owner` otherwise."""
    if k_start % block_k or (cols % block_k and k_start + cols < full_k):
        cut = k_start if k_start % block_k else k_start + cols
        raise ValueError(f"{owner}: tensor parallelism cuts K at column {cut} (a rank holds columns {k_start}-"
                         f"{k_start + cols - 1} of {full_k}), inside a {block_k}-wide FP8 block of the checkpoint: "
                         f"use a TP size that splits K into whole {block_k}-column blocks")


def make_weight(layer: nn.Module, rows: int, cols: int, device, shard_ids: tuple, spec: QuantSpec,
                k_start: int = 0) -> nn.Parameter:
    """The FP8 `weight` of `layer` (returned), with `layer.weight_scale` (and for static
    activations `layer.input_scale`) registered beside it. `k_start`: this rank's first column
    of the checkpoint's K (row-parallel layers), which must start a block."""
    if spec.method == "block":
        block_k = spec.block[1]
        refuse_k_split(type(layer).__name__, k_start, cols, block_k, getattr(layer, "in_features", cols))
    else:
        block_k = cols
    layer.block_k = block_k
    weight = nn.Parameter(torch.empty(rows, cols, dtype=FP8, device=device), requires_grad=False)
    weight.weight_loader = lambda p, src, sid=None: _load_weight(layer, spec, p, src, sid)
    weight.shard_ids = shard_ids
    scale = nn.Parameter(torch.ones(rows, -(-cols // block_k), dtype=torch.float32, device=device),
                         requires_grad=False)
    scale.weight_loader = lambda p, src, sid=None: _load_scale(layer, spec, p, src, sid)
    scale.shard_ids = () if spec.quantize_at_load else shard_ids  # (set with the weight)
    layer.weight_scale = scale
    if spec.static_activations:
        inp = nn.Parameter(torch.zeros(1, dtype=torch.float32, device=device), requires_grad=False)
        inp.weight_loader = _load_input_scale
        inp.shard_ids = shard_ids
        layer.input_scale = inp
    return weight


def _load_weight(layer: nn.Module, spec: QuantSpec, param: nn.Parameter, src: Any, shard_id: Any) -> None:
    dst, r0, n, c0, nc = layer._place(shard_id)
    _check(layer, "weight", src, shard_id)
    data = src[r0 : r0 + n, c0 : c0 + nc]
    if data.dtype == FP8:
        param.data[dst : dst + n].copy_(data.to(param.device))
        return
    if data.dtype == torch.float8_e5m2 or not data.dtype.is_floating_point or data.element_size() == 1:
        raise ValueError(f"{type(layer).__name__}: checkpoint weight stored as {data.dtype}; FP8 weights are e4m3")
    if not spec.quantize_at_load:
        raise ValueError(f"{type(layer).__name__}: the checkpoint's quantization_config says FP8, but this "
                         f"weight is stored as {data.dtype}")
    # One scale per whole output row, as at TP=1: a row-parallel rank holds part of each row.
    rows = data if nc == _checkpoint_shape(layer, shard_id)[1] else src[r0 : r0 + n]
    q, s = quantize_columns(data.to(param.device), rows.to(param.device))
    param.data[dst : dst + n].copy_(q)
    layer.weight_scale.data[dst : dst + n].copy_(s.expand(-1, layer.weight_scale.shape[1]))


def _load_scale(layer: nn.Module, spec: QuantSpec, param: nn.Parameter, src: Any, shard_id: Any) -> None:
    dst, r0, n, c0, nc = layer._place(shard_id)
    rows = scale_rows(src, spec, r0, n, c0, nc, _checkpoint_shape(layer, shard_id), type(layer).__name__)
    param.data[dst : dst + n].copy_(rows.to(param.device))


def scale_rows(src: Any, spec: QuantSpec, r0: int, n: int, c0: int, nc: int, weight_shape: tuple[int, int],
               what: str) -> torch.Tensor:
    """This rank's scales [n, ceil(nc / block_k)] float32 for rows r0.. and columns c0.. of a
    checkpoint weight of `weight_shape`, from its scale tensor `src` (per tensor, per channel or
    `weight_scale_inv` blocks, one row per weight row)."""
    shape = list(src.get_shape())
    if spec.method == "block":
        bn, bk = spec.block
        want = [-(-weight_shape[0] // bn), -(-weight_shape[1] // bk)]
        if shape != want:
            raise ValueError(f"{what}: weight_scale_inv of shape {shape}, expected {want} for a "
                             f"{list(weight_shape)} weight in {bn}x{bk} blocks")
        blocks = src[r0 // bn : (r0 + n - 1) // bn + 1, c0 // bk : -(-(c0 + nc) // bk)].to(torch.float32)
        return blocks.repeat_interleave(bn, dim=0)[r0 % bn : r0 % bn + n]
    if not shape or shape in ([1], [1, 1]):  # per tensor
        value = (src[...] if not shape else src[:]).reshape(-1)[0].to(torch.float32)
        return value.expand(n, 1)
    return src[r0 : r0 + n].to(torch.float32).reshape(n, 1)  # per channel: [N, 1] (or [N])


def _load_input_scale(param: nn.Parameter, src: Any, shard_id: Any = None) -> None:
    """A static activation scale per layer (one per fused part: the largest is kept)."""
    shape = list(src.get_shape())
    value = (src[...] if not shape else src[:]).reshape(-1)
    if value.numel() != 1:
        raise ValueError(f"input_scale of shape {shape}: only per-tensor static activation scales are supported")
    param.data.copy_(torch.maximum(param.data, value.to(torch.float32).to(param.device)))


def _check(layer: nn.Module, what: str, src: Any, shard_id: Any) -> None:
    want = list(_checkpoint_shape(layer, shard_id))
    if list(src.get_shape()) != want:
        raise ValueError(f"{type(layer).__name__} {what}{'' if shard_id is None else f' [{shard_id}]'}: checkpoint "
                         f"tensor has shape {list(src.get_shape())}, expected {want}")


def _checkpoint_shape(layer: nn.Module, shard_id: Any) -> tuple[int, int]:
    return layer._checkpoint_shape(shard_id)
