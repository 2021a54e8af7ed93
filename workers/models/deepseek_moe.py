"""DeepSeek V2/V3's feed-forward layers: the dense MLP (and shared experts), the routed experts
as stacked weights (FP8 with their scales when the checkpoint is, or under `--quantization
fp8`: the grouped GEMM dequantizes weight tiles in registers, `workers/layers/fused_moe.py`),
the router, and the MoE layer that joins them with one all-reduce."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.layers import fp8, fused_moe
from workers.layers.fused_moe import ROUTE_MAX_TOKENS, select_moe
from workers.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    TensorSlice,
    check_shape,
    make_param,
)
from workers.parallel import TPGroup, shard_range

if TYPE_CHECKING:
    from workers.model_config import ModelConfig
    from workers.models.deepseek import DeepseekFamily
    from workers.quantization import QuantSpec


def _stored(data: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A checkpoint slice in the parameter's dtype; FP8 weights only into FP8 parameters (as
    stored: their scales load beside them)."""
    if (data.dtype == fp8.FP8) != (param.dtype == fp8.FP8):
        raise ValueError(f"expert weight stored as {data.dtype} for a {param.dtype} parameter: an FP8 checkpoint "
                         "without its quantization_config, or the reverse")
    return data.to(param.dtype)


def _unquantized(data: torch.Tensor) -> torch.Tensor:
    """A 16/32-bit checkpoint slice for `--quantization fp8` to quantize."""
    if not data.dtype.is_floating_point or data.element_size() == 1:
        raise ValueError(f"expert weight stored as {data.dtype}: --quantization fp8 quantizes a 16/32-bit "
                         "checkpoint (an FP8 one says so in its quantization_config)")
    return data


class DeepseekMLP(nn.Module):
    """Dense MLP (and the shared experts). `forward(x, reduce=False)` returns this rank's partial
    sum without the down bias, for the MoE's single all-reduce."""

    def __init__(self, hidden: int, inter: int, bias: bool, tp: TPGroup, dtype, device,
                 quant_for=None):
        """quant_for(*module names) -> QuantSpec | None: the FP8 format of the checkpoint's
        `gate_proj`, `up_proj` and `down_proj` under this MLP's prefix (None: unquantized)."""
        super().__init__()
        quant_for = quant_for or (lambda *names: None)
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias, tp, dtype, device,
                                                       quant=quant_for("gate_proj", "up_proj"))
        self.down_proj = RowParallelLinear(inter, hidden, bias, tp, dtype, device, quant=quant_for("down_proj"))
        self.local_inter = inter // tp.size

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        return self.down_proj.forward_silu_mul(self.gate_up_proj(x), partial=not reduce)


class DeepseekExperts(nn.Module):
    """Routed experts as stacked weights: w13 [E, 2 * I/tp, hidden] (this rank's gate rows, then
    up rows, of each expert), w2 [E, hidden, I/tp]. Shard ids: (expert, 0 | 1) for gate/up and
    expert for down."""

    def __init__(self, num_experts: int, hidden: int, inter: int, tp: TPGroup, dtype, device,
                 quant: QuantSpec | None = None):
        super().__init__()
        self.inter, self.hidden = inter, hidden
        self.start, self.end = shard_range(inter, tp.rank, tp.size)
        local = self.end - self.start
        # FP8 experts: an FP8 checkpoint's as stored, a 16/32-bit one's quantized here per
        # output channel (`--quantization fp8`: each scale from the whole row, as at TP=1).
        self.quant = quant
        self.at_load = quant is not None and quant.quantize_at_load
        w13_ids = tuple((e, j) for e in range(num_experts) for j in (0, 1))
        w2_ids = tuple(range(num_experts))
        wdtype = fp8.FP8 if self.quant else dtype
        self.w13 = make_param((num_experts, 2 * local, hidden), wdtype, device, self._load_w13, w13_ids)
        self.w2 = make_param((num_experts, hidden, local), wdtype, device, self._load_w2, w2_ids)
        self.scales: dict | None = None  # the grouped GEMM's FP8 arguments
        if self.quant is not None:
            bk = self.quant.block[1] if self.quant.method == "block" else None
            if bk:
                fp8.refuse_k_split("DeepseekExperts (down_proj)", self.start, local, bk, inter)
            self.block_k13, self.block_k2 = bk or hidden, bk or local
            # (quantized at load: the scales come with the weights, none from the checkpoint)
            self.w13_scale = make_param((num_experts, 2 * local, -(-hidden // self.block_k13)), torch.float32, device,
                                        self._load_w13_scale, () if self.at_load else w13_ids)
            self.w2_scale = make_param((num_experts, hidden, -(-local // self.block_k2)), torch.float32, device,
                                       self._load_w2_scale, () if self.at_load else w2_ids)
            self.scales = dict(w13_scale=self.w13_scale, w2_scale=self.w2_scale, block_k13=self.block_k13,
                               block_k2=self.block_k2)
        self._moe = select_moe(torch.device(device).type)

    def _load_w13(self, param: nn.Parameter, src: TensorSlice, shard_id: Any = None) -> None:
        e, j = shard_id
        local = self.end - self.start
        check_shape(f"expert {e} gate/up", src, [self.inter, param.shape[2]])
        rows = slice(j * local, (j + 1) * local)
        with torch.no_grad():
            if self.at_load:  # whole rows on every rank (column-parallel)
                q, scale = fp8.quantize_rows(_unquantized(src[self.start : self.end]).to(param.device))
                param.data[e, rows].copy_(q)
                self.w13_scale.data[e, rows].copy_(scale)
            else:
                param.data[e, rows].copy_(_stored(src[self.start : self.end], param))

    def _load_w2(self, param: nn.Parameter, src: TensorSlice, shard_id: Any = None) -> None:
        check_shape(f"expert {shard_id} down", src, [param.shape[1], self.inter])
        with torch.no_grad():
            if self.at_load:  # row-parallel: this rank's columns, each row's scale from all of it
                full = _unquantized(src[:, :]).to(param.device)
                q, scale = fp8.quantize_columns(full[:, self.start : self.end], full)
                param.data[shard_id].copy_(q)
                self.w2_scale.data[shard_id].copy_(scale)
            else:
                param.data[shard_id].copy_(_stored(src[:, self.start : self.end], param))

    def _load_w13_scale(self, param: nn.Parameter, src: TensorSlice, shard_id: Any = None) -> None:
        e, j = shard_id
        local = self.end - self.start
        rows = fp8.scale_rows(src, self.quant, self.start, local, 0, self.hidden, (self.inter, self.hidden),
                              f"expert {e} gate/up")
        param.data[e, j * local : (j + 1) * local].copy_(rows.expand(-1, param.shape[2]).to(param.device))

    def _load_w2_scale(self, param: nn.Parameter, src: TensorSlice, shard_id: Any = None) -> None:
        rows = fp8.scale_rows(src, self.quant, 0, self.hidden, self.start, self.end - self.start,
                              (self.hidden, self.inter), f"expert {shard_id} down")
        param.data[shard_id].copy_(rows.expand(-1, param.shape[2]).to(param.device))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                add: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden], weights [T, k] float32, ids [T, k] -> this rank's partial sum [T, hidden]
        (plus `add`, the shared experts' partial sum). `fused_moe` (Triton grouped GEMM,
        graph-capturable) on CUDA with triton, else `moe_loop` (a loop over the experts hit, in
        ascending order, as transformers sums them)."""
        return self._moe(x, self.w13, self.w2, weights, ids, add=add, **(self.scales or {}))


class DeepseekRouter(nn.Module):
    """Replicated router: `weight` [E, hidden] and (V3) `e_score_correction_bias` [E] (float32)."""

    def __init__(self, hf: Any, family: DeepseekFamily, dtype, device):
        super().__init__()
        self.family = family
        self.num_experts = hf.n_routed_experts
        self.top_k = hf.num_experts_per_tok
        self.weight = make_param((self.num_experts, hf.hidden_size), dtype, device)
        if family.version == 3:
            self.e_score_correction_bias = make_param((self.num_experts,), torch.float32, device)

    def _group_mask(self, choice: torch.Tensor, group_scores: torch.Tensor) -> torch.Tensor:
        f = self.family
        groups = torch.topk(group_scores, k=f.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, groups, 1.0).bool()
        return mask.unsqueeze(-1).expand(-1, f.n_group, self.num_experts // f.n_group).reshape(choice.shape)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] float32, expert ids [T, k]): one Triton kernel for
        a decode-sized batch on CUDA (`workers.layers.moe_kernels.route`), else torch ops."""
        if x.is_cuda and fused_moe.triton is not None and x.shape[0] <= ROUTE_MAX_TOKENS:
            return self.forward_kernel(x)
        return self.forward_torch(x)

    def forward_kernel(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward_torch`'s routing in one kernel (ids int32)."""
        from workers.layers import moe_kernels

        f = self.family
        v3 = f.version == 3
        grouped = v3 or f.topk_method == "group_limited_greedy"
        return moe_kernels.route(
            x, self.weight, self.top_k, sigmoid=v3, bias=self.e_score_correction_bias if v3 else None,
            n_group=f.n_group if grouped else 1, topk_group=f.topk_group if grouped else 1, top2_groups=v3,
            norm=f.norm_topk_prob, scale=f.routed_scaling_factor,
        )

    def forward_torch(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.family
        logits = F.linear(x.float(), self.weight.float())
        per_group = self.num_experts // f.n_group
        if f.version == 2:
            scores = logits.softmax(dim=-1)
            if f.topk_method == "group_limited_greedy":
                group_scores = scores.view(-1, f.n_group, per_group).max(dim=-1).values
                scores = scores.masked_fill(~self._group_mask(scores, group_scores), 0.0)
            weights, ids = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        else:
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
            group_scores = choice.view(-1, f.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
            choice = choice.masked_fill(~self._group_mask(choice, group_scores), float("-inf"))
            ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
        if f.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * f.routed_scaling_factor, ids


class DeepseekMoE(nn.Module):
    def __init__(self, config: ModelConfig, family: DeepseekFamily, tp: TPGroup, dtype, device,
                 layer_id: int | None = None):
        """layer_id: for the FP8 format's names (None: no FP8 layers)."""
        super().__init__()
        hf = config.hf_config
        self.tp = tp
        inter = hf.moe_intermediate_size
        self.gate = DeepseekRouter(hf, family, dtype, device)
        p = f"model.layers.{layer_id}.mlp."
        quant = config.quant_for if layer_id is not None else lambda *names: None
        self.experts = DeepseekExperts(hf.n_routed_experts, config.hidden_size, inter, tp, dtype, device,
                                       quant=quant(p + "experts.0.gate_proj"))
        n_shared = getattr(hf, "n_shared_experts", None) or 0
        p += "shared_experts."
        self.shared_experts = (
            DeepseekMLP(config.hidden_size, inter * n_shared, family.mlp_bias, tp, dtype, device,
                        quant_for=lambda *names: quant(*(p + n for n in names)))
            if n_shared
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        shared = self.shared_experts(x, reduce=False) if self.shared_experts is not None else None
        out = self.tp.all_reduce(self.experts(x, weights, ids, add=shared))
        bias = self.shared_experts.down_proj.bias if self.shared_experts is not None else None
        return out if bias is None else out + bias
