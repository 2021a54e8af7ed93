"""Tensor-parallel linear layers and the weight-loading protocol every layer follows.

Every parameter of a manta model carries
    `weight_loader(param, src, shard_id=None)`: copies this rank's part of the checkpoint
        tensor `src` into `param` (for a fused parameter, the part named by `shard_id`);
    `shard_ids`: the shard ids the loader must see before the parameter is complete
        ((None,) for an unfused parameter).
`src` is a lazy slice (`TensorSlice`): safetensors' `get_slice` object, so a rank reads only
its rows/columns from disk and never materialises the full tensor of a sharded parameter.

Weights are stored as in `nn.Linear`: [out_features, in_features]. With a `QuantSpec`
(`workers/quantization.py`) a layer's weight is FP8 with a `weight_scale` beside it
(`workers/layers/fp8.py`), loaded through the layer's `_place(shard_id)`: which rows and columns
of the checkpoint tensor go where in this rank's weight.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from workers.layers import fp8, fused, lt_bias, one_row
from workers.parallel import TPGroup, divide, kv_head_placement, shard_range

if TYPE_CHECKING:
    from workers.quantization import QuantSpec


class TensorSlice(Protocol):
    """What safetensors' `safe_open(...).get_slice(name)` returns."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


class InMemorySlice:
    """A `TensorSlice` over a tensor already in memory (tests, converted weights)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.tensor[index]


WeightLoader = Callable[..., None]


def check_shape(name: str, src: TensorSlice, expected: Sequence[int]) -> None:
    shape = list(src.get_shape())
    if shape != list(expected):
        raise ValueError(f"{name}: checkpoint tensor has shape {shape}, expected {list(expected)}")


def _copy(dst: torch.Tensor, data: torch.Tensor) -> None:
    if dst.shape != data.shape:
        raise ValueError(f"shard of shape {tuple(data.shape)} does not fit {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(data.to(dtype=dst.dtype))


def default_weight_loader(param: nn.Parameter, src: TensorSlice, shard_id: Any = None) -> None:
    """A replicated parameter: every rank copies the whole tensor."""
    check_shape("replicated parameter", src, param.shape)
    _copy(param.data, src[:])


def make_param(
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str,
    loader: WeightLoader = default_weight_loader,
    shard_ids: tuple[Any, ...] = (None,),
) -> nn.Parameter:
    """An uninitialised parameter with its loader; `load_model` fails if it stays unloaded."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    param.shard_ids = shard_ids  # type: ignore[attr-defined]
    return param


def matmul(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ layer.weight.T (+ bias): F.linear (with cuBLASLt's zero bias where `lt_bias` applies),
    or the FP8 product of a quantized layer."""
    w = layer.weight
    if fp8.is_fp8(w):
        return fp8.linear(x, w, layer.weight_scale, layer.block_k, bias)
    return lt_bias.linear(x, w, bias)


def product(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`matmul`, through the one-row GEMV kernel at batch 1 on CUDA where it applies
    (`one_row.applies`: not block-wise FP8). cuBLAS's one-row products of the DeepSeek-V2-Lite
    shape took 1.5-10x their bytes' time (BENCHMARKS.md)."""
    if isinstance(x, fp8.Fp8Rows):  # rows quantized by the op before (`fp8.takes_rows`)
        return matmul(layer, x, bias)
    scale = fp8.row_scale(layer)
    if one_row.applies(x, layer.weight, scale):
        return one_row.linear(x, layer.weight, bias, scale=scale)
    return matmul(layer, x, bias)


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A's output rows split over ranks; each rank returns its own
    [.., out / tp] columns (no gather: the next layer is row-parallel or per-head)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp: TPGroup, dtype: torch.dtype, device,
        quant: QuantSpec | None = None,
    ):
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.out_features = out_features
        self.start, self.end = shard_range(out_features, tp.rank, tp.size)
        local = self.end - self.start
        self.weight = (make_param((local, in_features), dtype, device, self._load_rows) if quant is None
                       else fp8.make_weight(self, local, in_features, device, (None,), quant))
        self.bias = make_param((local,), dtype, device, self._load_rows) if bias else None

    def _place(self, shard_id: Any = None) -> tuple[int, int, int, int, int]:
        return 0, self.start, self.end - self.start, 0, self.in_features

    def _checkpoint_shape(self, shard_id: Any = None) -> tuple[int, int]:
        return self.out_features, self.in_features

    def _load_rows(self, param: nn.Parameter, src: TensorSlice, shard_id: Any = None) -> None:
        check_shape("column-parallel", src, [self.out_features, *param.shape[1:]])
        _copy(param.data, src[self.start : self.end])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return product(self, x, self.bias)


class MergedColumnParallelLinear(nn.Module):
    """Several column-parallel outputs fused in one weight (gate_up: output_sizes [I, I]).

    Rank r holds, for each part i, rows [r*s_i/tp, (r+1)*s_i/tp) of that part, laid out part
    after part; `shard_id` is the part's index."""

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        device,
        quant: QuantSpec | None = None,
    ):
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.local_sizes = [divide(s, tp.size) for s in self.output_sizes]
        local = sum(self.local_sizes)
        ids = tuple(range(len(self.output_sizes)))
        self.weight = (make_param((local, in_features), dtype, device, self._load_part, ids) if quant is None
                       else fp8.make_weight(self, local, in_features, device, ids, quant))
        self.bias = make_param((local,), dtype, device, self._load_part, ids) if bias else None

    def _place(self, shard_id: Any = None) -> tuple[int, int, int, int, int]:
        i = int(shard_id)
        start, end = shard_range(self.output_sizes[i], self.tp.rank, self.tp.size)
        return sum(self.local_sizes[:i]), start, end - start, 0, self.in_features

    def _checkpoint_shape(self, shard_id: Any = None) -> tuple[int, int]:
        return self.output_sizes[int(shard_id)], self.in_features

    def _load_part(self, param: nn.Parameter, src: TensorSlice, shard_id: Any = None) -> None:
        i = int(shard_id)
        check_shape(f"merged part {i}", src, [self.output_sizes[i], *param.shape[1:]])
        start, end = shard_range(self.output_sizes[i], self.tp.rank, self.tp.size)
        offset = sum(self.local_sizes[:i])
        _copy(param.data[offset : offset + self.local_sizes[i]], src[start:end])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return product(self, x, self.bias)


class QKVParallelLinear(nn.Module):
    """q, k and v projections fused: output [.., (q_heads + 2 * kv_heads) * head_dim] with this
    rank's heads only. Query heads are split evenly; kv heads follow `kv_head_placement`
    (when tp > num_kv_heads each rank holds one kv head, replicated over tp / num_kv_heads
    ranks). `shard_id` is "q", "k" or "v"."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        device,
        quant: QuantSpec | None = None,
    ):
        super().__init__()
        self.tp = tp
        self.in_features = hidden_size
        self.head_dim = head_dim
        self.total_heads = {"q": num_heads, "k": num_kv_heads, "v": num_kv_heads}
        self.num_heads = divide(num_heads, tp.size)
        kv_start, self.num_kv_heads = kv_head_placement(num_kv_heads, tp.size, tp.rank)
        # (first head, heads, row offset in the fused weight) per shard id
        q_rows = self.num_heads * head_dim
        kv_rows = self.num_kv_heads * head_dim
        self.layout = {
            "q": (tp.rank * self.num_heads, self.num_heads, 0),
            "k": (kv_start, self.num_kv_heads, q_rows),
            "v": (kv_start, self.num_kv_heads, q_rows + kv_rows),
        }
        self.output_sizes = [q_rows, kv_rows, kv_rows]
        local = q_rows + 2 * kv_rows
        ids = ("q", "k", "v")
        self.weight = (make_param((local, hidden_size), dtype, device, self._load_part, ids) if quant is None
                       else fp8.make_weight(self, local, hidden_size, device, ids, quant))
        self.bias = make_param((local,), dtype, device, self._load_part, ids) if bias else None

    def _place(self, shard_id: Any = None) -> tuple[int, int, int, int, int]:
        first, heads, offset = self.layout[shard_id]
        return offset, first * self.head_dim, heads * self.head_dim, 0, self.in_features

    def _checkpoint_shape(self, shard_id: Any = None) -> tuple[int, int]:
        return self.total_heads[shard_id] * self.head_dim, self.in_features

    def _load_part(self, param: nn.Parameter, src: TensorSlice, shard_id: Any = None) -> None:
        first, heads, offset = self.layout[shard_id]
        hd = self.head_dim
        check_shape(f"{shard_id}_proj", src, [self.total_heads[shard_id] * hd, *param.shape[1:]])
        rows = heads * hd
        _copy(param.data[offset : offset + rows], src[first * hd : first * hd + rows])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> q [T, heads * hd], k and v [T, kv_heads * hd] (this rank's)."""
        q, k, v = matmul(self, x, self.bias).split(self.output_sizes, dim=-1)
        return q, k, v


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A's input columns split over ranks: each rank multiplies its slice
    of x (the output of a column-parallel layer), the partial sums are all-reduced, and the
    bias (replicated) is added once, after the reduce."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp: TPGroup, dtype: torch.dtype, device,
        quant: QuantSpec | None = None,
    ):
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.out_features = out_features
        self.start, self.end = shard_range(in_features, tp.rank, tp.size)
        self.weight = (make_param((out_features, self.end - self.start), dtype, device, self._load_cols)
                       if quant is None else
                       fp8.make_weight(self, out_features, self.end - self.start, device, (None,), quant, self.start))
        self.bias = make_param((out_features,), dtype, device) if bias else None

    def _place(self, shard_id: Any = None) -> tuple[int, int, int, int, int]:
        return 0, 0, self.out_features, self.start, self.end - self.start

    def _checkpoint_shape(self, shard_id: Any = None) -> tuple[int, int]:
        return self.out_features, self.in_features

    def _load_cols(self, param: nn.Parameter, src: TensorSlice, shard_id: Any = None) -> None:
        check_shape("row-parallel", src, [param.shape[0], self.in_features])
        _copy(param.data, src[:, self.start : self.end])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank calls this (it is a collective at tp > 1)."""
        scale = fp8.row_scale(self)
        if fp8.is_fp8(self.weight) and scale is None:  # block-wise FP8: no one-row fusions
            y = matmul(self, x, self.bias if self.tp.size == 1 else None)
            return y if self.tp.size == 1 else self._reduce(y)
        if self.tp.size == 1:
            return one_row.linear(x, self.weight, self.bias, scale=scale)
        return self._reduce(one_row.linear(x, self.weight, scale=scale))

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def forward_silu_mul(self, gate_up: torch.Tensor, partial: bool = False) -> torch.Tensor:
        """forward(silu(gate) * up) for gate_up = [gate | up] (this rank's slices): the
        activation fused into the product at batch 1 on CUDA. `partial`: this rank's sum
        alone, without the all-reduce and the bias (for a caller that reduces it with more).
        Where the FP8 product would quantize the activation per token, it comes out of the
        SiLU kernel quantized (`fp8.takes_rows`, `workers.layers.quant_rows`)."""
        if fp8.takes_rows(self, gate_up):
            from workers.layers import quant_rows

            y = matmul(self, quant_rows.silu_and_mul(gate_up), self.bias if self.tp.size == 1 and not partial else None)
            return y if partial or self.tp.size == 1 else self._reduce(y)
        scale = fp8.row_scale(self)
        if fp8.is_fp8(self.weight) and scale is None:
            h = fused.silu_and_mul(gate_up)
            return matmul(self, h, None) if partial else self.forward(h)
        if partial:
            return one_row.silu_mul_linear(gate_up, self.weight, None, scale=scale)
        if self.tp.size == 1:
            return one_row.silu_mul_linear(gate_up, self.weight, self.bias, scale=scale)
        return self._reduce(one_row.silu_mul_linear(gate_up, self.weight, None, scale=scale))


class ReplicatedLinear(nn.Module):
    """A linear layer every rank holds whole (e.g. the low-rank down projections of MLA)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device,
                 quant: QuantSpec | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = (make_param((out_features, in_features), dtype, device) if quant is None
                       else fp8.make_weight(self, out_features, in_features, device, (None,), quant))
        self.bias = make_param((out_features,), dtype, device) if bias else None

    def _place(self, shard_id: Any = None) -> tuple[int, int, int, int, int]:
        return 0, 0, self.out_features, 0, self.in_features

    def _checkpoint_shape(self, shard_id: Any = None) -> tuple[int, int]:
        return self.out_features, self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return product(self, x, self.bias)
