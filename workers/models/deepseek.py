"""DeepSeek-V2 / DeepSeek-V3 (MLA attention, dense or MoE MLP) — one parametrised model.

Family differences (`DeepseekFamily`), as transformers defines them:
- RoPE: on the qk_rope_head_dim part only. V2 rotates interleaved pairs (x0, x1), (x2, x3), ...
  (complex multiplication, in float32); V3 does the same when `rope_interleave` (the default),
  else rotate-half. The interleaved result is stored de-interleaved ([rotated evens, rotated
  odds], as V3's transformers code does; V2's transformers code keeps the pairs interleaved).
  q_pe and k_pe get the same permutation, and k_pe only ever meets q_pe in a dot product, so
  the scores are identical; the cached k_pe uses this layout.
- Router: V2 takes softmax scores, top-k greedy or group_limited_greedy (best groups by their
  max score), weights times routed_scaling_factor; V3 takes sigmoid scores, chooses with
  `scores + e_score_correction_bias` inside the topk_group best groups (a group scores the sum
  of its top-2), weights are the unbiased scores, normalised when norm_topk_prob, times
  routed_scaling_factor. transformers' V2 ignores norm_topk_prob (the reference code instead
  normalises and drops the scaling): such a V2 config is refused rather than guessed.
- MLP bias: V2 follows `mlp_bias` (dense and shared experts); V3 has none.
Layer i is MoE when n_routed_experts is set, i >= first_k_dense_replace and i % moe_layer_freq
== 0 (transformers ignores moe_layer_freq; every published checkpoint has 1).
The softmax scale is qk_head_dim^-0.5, times yarn_mscale(factor, mscale_all_dim)^2 for a scaled
RoPE with mscale_all_dim (the cos/sin carry mscale / mscale_all_dim, as in transformers).

Attention: see `attention.mla` for the split of work with the backend. The model decides the
form by the forward mode: DECODE runs the absorbed form (q_nope through W_UK into latent space,
output through W_UV), every other mode the MHA form (the backend decompresses with `expand_kv`).

Tensor parallelism: q_proj / q_b_proj / kv_b_proj are column-parallel by heads, o_proj is
row-parallel; q_a_proj, kv_a_proj_with_mqa and their norms are replicated, so every rank
computes (and caches) the same latent. Each routed expert's gate/up are column-parallel and its
down row-parallel (the expert intermediate is split over ranks); the router is replicated. An
MoE layer all-reduces once: routed and shared-expert partial sums together. Checkpoint layers
past num_hidden_layers (V3's multi-token-prediction layers) are skipped.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from attention.mla import MLAAttentionLayer
from workers import kv_quant
from workers.layers import fp8, fp8_heads
from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from workers.layers.norm import RMSNorm
from workers.layers.rotary import RopeConfig, RotaryEmbedding
from workers.models.deepseek_moe import DeepseekMLP, DeepseekMoE
from workers.parallel import TPGroup, divide

if TYPE_CHECKING:
    from workers.forward_batch import ForwardBatch
    from workers.loader import CheckpointReader
    from workers.model_config import ModelConfig

# q_a_layernorm and kv_a_layernorm use the RMSNorm default eps in transformers and the reference
# code, not config.rms_norm_eps.
LORA_NORM_EPS = 1e-6


@dataclass(frozen=True)
class DeepseekFamily:
    version: int  # 2 or 3
    rope_interleave: bool
    rope_fp32: bool  # V2 rotates in float32 and casts back; V3 in the activation dtype
    mlp_bias: bool
    topk_method: str  # greedy | group_limited_greedy (V2) | noaux_tc (V3)
    norm_topk_prob: bool
    routed_scaling_factor: float
    n_group: int
    topk_group: int


def deepseek_family(config: ModelConfig) -> DeepseekFamily:
    hf = config.hf_config
    if config.architecture not in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        raise ValueError(f"{config.architecture!r} is not a DeepSeek MLA architecture")
    v2 = config.architecture == "DeepseekV2ForCausalLM"
    method = (getattr(hf, "topk_method", None) or "greedy") if v2 else "noaux_tc"
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise NotImplementedError(f"DeepSeek-V2 topk_method {method!r} is not supported")
    if v2 and getattr(hf, "norm_topk_prob", False) and (getattr(hf, "num_experts_per_tok", 1) or 1) > 1:
        raise NotImplementedError(
            "DeepSeek-V2 with norm_topk_prob=True: transformers and the reference code disagree"
        )
    return DeepseekFamily(
        version=2 if v2 else 3,
        rope_interleave=v2 or bool(getattr(hf, "rope_interleave", True)),
        rope_fp32=v2,
        mlp_bias=v2 and bool(getattr(hf, "mlp_bias", False)),
        topk_method=method,
        norm_topk_prob=not v2 and bool(hf.norm_topk_prob),
        routed_scaling_factor=float(hf.routed_scaling_factor),
        n_group=int(hf.n_group or 1),
        topk_group=int(hf.topk_group or 1),
    )


def _check_supported(config: ModelConfig, family: DeepseekFamily, tp: TPGroup) -> None:
    hf = config.hf_config
    if getattr(hf, "hidden_act", "silu") not in ("silu", "swish"):
        raise NotImplementedError(f"activation {hf.hidden_act!r} is not supported (only silu)")
    sizes = [("attention heads", config.num_heads), ("intermediate size", hf.intermediate_size)]
    if getattr(hf, "n_routed_experts", None):
        sizes.append(("moe intermediate size", hf.moe_intermediate_size))
        if hf.n_routed_experts % family.n_group:
            raise ValueError(f"n_group={family.n_group} does not divide {hf.n_routed_experts} experts")
    for what, n in sizes:
        if n % tp.size:
            raise ValueError(f"tp={tp.size} does not divide the {what} ({n})")


def is_moe_layer(hf: Any, layer_id: int) -> bool:
    return (
        bool(getattr(hf, "n_routed_experts", None))
        and layer_id >= (hf.first_k_dense_replace or 0)
        and layer_id % (getattr(hf, "moe_layer_freq", 1) or 1) == 0
    )


def softmax_scale(config: ModelConfig, rope: RopeConfig) -> float:
    """qk_head_dim^-0.5, times yarn_mscale(factor, mscale_all_dim)^2 for a scaled RoPE."""
    scale = config.qk_head_dim**-0.5
    if rope.rope_type != "default" and rope.mscale_all_dim and rope.factor and rope.factor > 1:
        m = 0.1 * float(rope.mscale_all_dim) * math.log(rope.factor) + 1.0
        scale *= m * m
    return scale


def _rope(rotary: RotaryEmbedding, family: DeepseekFamily, positions, q, k):
    """q: [T, H, R], k: [T, 1, R] -> rotated q, k (see the module docstring for the layout)."""
    if not family.rope_interleave:
        return rotary.apply(positions, q, k)
    dtype = torch.float32 if family.rope_fp32 else q.dtype
    cos = rotary.cos_cache[positions].unsqueeze(1).to(dtype)
    sin = rotary.sin_cache[positions].unsqueeze(1).to(dtype)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x = x.to(dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rotate(q).to(q.dtype), rotate(k).to(k.dtype)


class DeepseekAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TPGroup, scaling: float, dtype, device):
        super().__init__()
        hf = config.hf_config
        hidden, heads = config.hidden_size, config.num_heads
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.lora, self.v_dim = config.kv_lora_rank, config.v_head_dim
        self.heads = divide(heads, tp.size)
        qk = self.nope + self.rope
        bias = bool(getattr(hf, "attention_bias", False))
        self.q_lora_rank = getattr(hf, "q_lora_rank", None)
        p = f"model.layers.{layer_id}.self_attn."
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk, False, tp, dtype, device,
                                               quant=config.quant_for(p + "q_proj"))
        else:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias, dtype, device,
                                             quant=config.quant_for(p + "q_a_proj"))
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LORA_NORM_EPS, dtype, device)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * qk, False, tp, dtype, device,
                                                 quant=config.quant_for(p + "q_b_proj"))
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.lora + self.rope, bias, dtype, device,
                                                   quant=config.quant_for(p + "kv_a_proj_with_mqa"))
        self.kv_a_layernorm = RMSNorm(self.lora, LORA_NORM_EPS, dtype, device)
        # (Its weight is also the absorbed projections of decode: `absorb_query`, `absorb_output`.)
        self.kv_b_proj = ColumnParallelLinear(
            self.lora, heads * (self.nope + self.v_dim), False, tp, dtype, device,
            quant=config.quant_for(p + "kv_b_proj"),
        )
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, bias, tp, dtype, device,
                                        quant=config.quant_for(p + "o_proj"))
        self.attn = MLAAttentionLayer(
            layer_id=layer_id,
            num_heads=self.heads,
            num_kv_heads=1,
            head_dim=qk,
            scaling=scaling,
            v_head_dim=self.v_dim,
            kv_lora_rank=self.lora,
            qk_rope_head_dim=self.rope,
            expand_kv=self.expand_kv,
        )

    def _kv_b(self) -> tuple[torch.Tensor | None, int]:
        """kv_b_proj's (scales, block_k) for `fp8_heads`: (None, 0) for a 16-bit weight."""
        b = self.kv_b_proj
        return (b.weight_scale, b.block_k) if fp8.is_fp8(b.weight) else (None, 0)

    def absorb_query(self, q_nope: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """q_nope [T, H, N] -> `out` (or a new tensor) [T, H, C]: each head's query through its
        W_UK (kv_b_proj's first N rows of the head), into the latent space the cache holds."""
        return fp8_heads.into_latent(q_nope, self.kv_b_proj.weight, *self._kv_b(), self.v_dim, out=out)

    def absorb_output(self, out: torch.Tensor) -> torch.Tensor:
        """Attention's latent output [T, H, C] -> [T, H, V] through each head's W_UV. A 16-bit
        weight stays on cuBLAS's batched product: 3.96 us a layer at batch 1 on an H200, against
        5.15 us for the per-head kernel (BENCHMARKS.md, DeepSeek decode 2026-11-27)."""
        b = self.kv_b_proj
        if fp8.is_fp8(b.weight):
            return fp8_heads.out_of_latent(out, b.weight, b.weight_scale, b.block_k, self.nope)
        w_uv = b.weight.view(self.heads, self.nope + self.v_dim, self.lora)[:, self.nope :]
        return torch.einsum("thc,hvc->thv", out, w_uv)

    def expand_kv(self, entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache entries [n, C + R] -> k [n, H, N + R] (k_pe shared by the heads), v [n, H, V]."""
        n = entries.shape[0]
        kv = self.kv_b_proj(entries[:, : self.lora]).view(n, self.heads, self.nope + self.v_dim)
        k_pe = entries[:, None, self.lora :].expand(n, self.heads, self.rope)
        return torch.cat((kv[..., : self.nope], k_pe), dim=-1), kv[..., self.nope :]

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        fb: ForwardBatch,
        rotary: RotaryEmbedding,
        family: DeepseekFamily,
    ) -> torch.Tensor:
        t = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.heads, self.nope + self.rope)
        q_nope = q[..., : self.nope]
        kv_a = self.kv_a_proj_with_mqa(x)
        backend = fb.attn_backend
        assert backend is not None
        if fb.forward_mode.is_decode():  # the absorbed query [T, H, C + R] filled in place
            q_abs = q.new_empty(t, self.heads, self.lora + self.rope)
            entry = self._rope_norm_store(positions, q, kv_a, fb, rotary, family, q_abs[..., self.lora :])
            self.absorb_query(q_nope, out=q_abs[..., : self.lora])
            out = backend.forward(q_abs, entry, None, self.attn, fb, save_kv_cache=entry is not None)
            return self.o_proj(self.absorb_output(out.view(t, self.heads, self.lora)).reshape(t, -1))
        q_pe, entry = self._rope_entry(positions, q, kv_a, rotary, family)
        out = backend.forward(torch.cat((q_nope, q_pe), dim=-1), entry, None, self.attn, fb)
        return self.o_proj(out.reshape(t, self.heads * self.v_dim))

    def _rope_norm_store(self, positions, q, kv_a, fb: ForwardBatch, rotary: RotaryEmbedding,
                         family: DeepseekFamily, q_pe: torch.Tensor) -> torch.Tensor | None:
        """Decode's rotated q_pe, written into `q_pe` [T, H, R], and the cache entry [T, 1, C + R]
        to write; on CUDA (a cache of the activations' dtype, interleaved RoPE) one kernel that
        writes the entry itself (`workers.layers.mla_rope_store`): the entry comes back None."""
        pool = fb.kv_pool
        if q.is_cuda and family.rope_interleave and pool is not None and not pool.quantized:
            from workers.layers import mla_rope_store  # Triton, imported on the first CUDA call

            cache = pool.get_key_buffer(self.attn.layer_id)
            if mla_rope_store.applies(q, kv_a, cache, rotary.cos_cache, self.rope):
                norm = self.kv_a_layernorm
                mla_rope_store.rope_norm_store(positions, q, kv_a, norm.weight, norm.eps, rotary.cos_cache,
                                               rotary.sin_cache, cache, fb.out_cache_loc, self.nope, family.rope_fp32,
                                               out=q_pe)
                pool.write_count += 1
                return None
        rotated, entry = self._rope_entry(positions, q, kv_a, rotary, family)
        q_pe.copy_(rotated)
        return entry

    def _rope_entry(self, positions, q, kv_a, rotary: RotaryEmbedding,
                    family: DeepseekFamily) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated q_pe [T, H, R] and the cache entry [T, 1, C + R] (normalised latent, rotated
        k_pe), as torch ops."""
        latent, k_pe = kv_a.split([self.lora, self.rope], dim=-1)
        q_pe, k_pe = _rope(rotary, family, positions, q[..., self.nope :], k_pe.unsqueeze(1))
        return q_pe, torch.cat((self.kv_a_layernorm(latent).unsqueeze(1), k_pe), dim=-1)


class DeepseekDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        family: DeepseekFamily,
        layer_id: int,
        tp: TPGroup,
        scaling: float,
        dtype,
        device,
    ):
        super().__init__()
        hf = config.hf_config
        eps = hf.rms_norm_eps
        self.self_attn = DeepseekAttention(config, layer_id, tp, scaling, dtype, device)
        self.mlp: nn.Module
        if is_moe_layer(hf, layer_id):
            self.mlp = DeepseekMoE(config, family, tp, dtype, device, layer_id=layer_id)
        else:
            p = f"model.layers.{layer_id}.mlp."
            self.mlp = DeepseekMLP(
                config.hidden_size, hf.intermediate_size, family.mlp_bias, tp, dtype, device,
                quant_for=lambda *names: config.quant_for(*(p + n for n in names)),
            )
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)

    def forward(self, positions, x, residual, fb: ForwardBatch, rotary: RotaryEmbedding,
                family: DeepseekFamily) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): each residual add runs in
        the next norm's kernel (`RMSNorm.forward_with_residual`); residual None: the first layer."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.forward_with_residual(x, residual)
        h, residual = self.post_attention_layernorm.forward_with_residual(
            self.self_attn(positions, h, fb, rotary, family), residual)
        return self.mlp(h), residual


class DeepseekModel(nn.Module):
    def __init__(
        self, config: ModelConfig, family: DeepseekFamily, tp: TPGroup, scaling: float, dtype, device
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype, device)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(config, family, i, tp, scaling, dtype, device)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.hf_config.rms_norm_eps, dtype, device)


_IGNORED = re.compile(r"rotary_emb\.inv_freq$|rotary_emb\.cos_cached$|rotary_emb\.sin_cached$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
# (checkpoint name part, parameter name part, shard id) of the fused gate/up parameters.
_FUSED = (
    (".mlp.gate_proj.", ".mlp.gate_up_proj.", 0),
    (".mlp.up_proj.", ".mlp.gate_up_proj.", 1),
    (".shared_experts.gate_proj.", ".shared_experts.gate_up_proj.", 0),
    (".shared_experts.up_proj.", ".shared_experts.gate_up_proj.", 1),
)


def _param_target(name: str) -> tuple[str, Any]:
    """(parameter name, shard id) that checkpoint tensor `name` loads into."""
    m = _EXPERT.match(name)
    if m:
        prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
        if proj == "down":
            return f"{prefix}.w2", e
        return f"{prefix}.w13", (e, 0 if proj == "gate" else 1)
    for ckpt_part, param_part, sid in _FUSED:
        if ckpt_part in name:
            return name.replace(ckpt_part, param_part), sid
    return name, None


class DeepseekV2ForCausalLM(nn.Module):
    """DeepSeek-V2 and -V3 (the family is read from the config's architecture)."""

    supports_fp8 = True  # FP8 linear layers, routed experts and kv_b_proj (workers/layers/fp8*.py)
    # Between two attention calls nothing reads a host value of the batch (the routed experts
    # run as `fused_moe` on CUDA; MLA's prefill expands its latent inside the backend): prompt
    # batches may run as CUDA graphs cut at each attention call (workers/prompt_graphs.py).
    piecewise_graphs = True

    def __init__(self, config: ModelConfig, tp: TPGroup, device: torch.device | str, dtype: torch.dtype):
        super().__init__()
        self.family = deepseek_family(config)
        _check_supported(config, self.family, tp)
        self.config = config
        self.tp = tp
        rope = RopeConfig.from_hf(config.hf_config, config.qk_rope_head_dim)
        self.rotary_emb = RotaryEmbedding(rope, config.max_context_len, device)
        self.model = DeepseekModel(config, self.family, tp, softmax_scale(config, rope), dtype, device)
        tie = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, dtype, device, tie_to=tie)

    @property
    def attention_layers(self) -> list[MLAAttentionLayer]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final-normed hidden states [T, hidden] (every rank)."""
        x = self.model.embed_tokens(input_ids)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(positions, x, residual, forward_batch, self.rotary_emb, self.family)
        return self.model.norm.forward_with_residual(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> [N, vocab] float32, the full vocabulary on every rank."""
        return self.lm_head(hidden)

    def load_weights(self, reader: CheckpointReader) -> set[tuple[str, Any]]:
        """Copy this rank's slices from the checkpoint; returns the (parameter, shard id) pairs
        loaded. Unknown tensors are an error; RoPE tables, a tied lm_head and layers past
        num_hidden_layers (multi-token prediction) are skipped."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, Any]] = set()
        for name in reader.names():
            layer = _LAYER.match(name)
            if _IGNORED.search(name) or (layer and int(layer.group(1)) >= self.config.num_layers):
                continue
            if kv_quant.KV_SCALE.search(name):
                continue  # an FP8 KV cache's scales: read by the loader (workers/kv_quant.py)
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            scale = fp8.SCALE.search(name)
            target, shard_id = _param_target(name if scale is None else name[: scale.start()] + ".weight")
            if scale is not None:
                if not target.endswith(".weight"):  # stacked experts: w13_scale, w2_scale
                    if scale.group(1) == "input_scale":
                        continue  # (static activation scales are not needed: workers/quantization.py)
                    target += "_scale"
                else:
                    target = target[: -len("weight")] + fp8.scale_param(scale)
            src = reader.get_slice(name)
            if target not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} matches no parameter of {self.config.architecture}"
                )
            param = params[target]
            param.weight_loader(param, src, shard_id)
            loaded.add((target, shard_id))
        return loaded


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """Same model; the family (router, RoPE layout) comes from the architecture name."""
