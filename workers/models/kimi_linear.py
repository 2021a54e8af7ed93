"""Hybrid linear/full-attention decoders: Kimi-Linear, and (through `HybridFamily`) the Bailing
hybrid of `workers.models.bailing_hybrid` — one parametrised model.

Layer i is a KDA linear-attention layer (`workers.models.kda`) when the config's
`layer_types[i]` is "linear_attention", else an MLA full-attention layer (the DeepSeek module
of `workers.models.deepseek`, over the MLA backend); its MLP is dense or a DeepSeek-V3-style
MoE (sigmoid router with correction bias and expert groups, always with shared experts) by
`mlp_layer_types[i]`.

Family differences (`HybridFamily`), as transformers defines them:
- Kimi-Linear's MLA has no RoPE at all ("NoPE": the rope part of q and k is used as is), may
  have a q LoRA, and scales by qk_head_dim^-0.5. Its KDA gates are low-rank pairs.
- The Bailing hybrid's MLA rotates the rope part with interleaved RoPE (rope_parameters), has
  no q LoRA, multiplies each head's output by sigmoid(g_proj(x)) before o_proj, and scales as
  DeepSeek-V3 does (YaRN mscale). Its KDA gates are full projections, the forget gate bounded.

The layers' attention goes through `attention.hybrid_linear.HybridLinearAttnBackend`, which
sends MLA layers to the MLA backend (KV pool of the full-attention layers only) and KDA layers
to `attention.linear_attn` (per-request state in `workers.state_pool`).

Checkpoint names: transformers writes Kimi-Linear checkpoints in the original layout (MoE under
`block_sparse_moe`, experts `w1`/`w3`/`w2`, separate q/k/v convolutions); `canonical_name`
maps them onto the DeepSeek names the shared modules load from. Layers past num_hidden_layers
(multi-token prediction) are skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.layers.linear import ColumnParallelLinear
from workers.layers.norm import RMSNorm
from workers.layers.rotary import RopeConfig, RotaryEmbedding
from workers.models.deepseek import (
    _IGNORED,
    _LAYER,
    DeepseekAttention,
    DeepseekFamily,
    _param_target,
    _rope,
    softmax_scale,
)
from workers.models.deepseek_moe import DeepseekMLP, DeepseekMoE
from workers.models.kda import KDAFamily, KimiDeltaAttention, kda_param_target
from workers.parallel import TPGroup

if TYPE_CHECKING:
    from workers.forward_batch import ForwardBatch
    from workers.loader import CheckpointReader
    from workers.model_config import ModelConfig


@dataclass(frozen=True)
class HybridFamily:
    kda: KDAFamily
    mla_rope: bool  # False: NoPE (Kimi-Linear)
    mla_head_gate: bool  # sigmoid(g_proj(x)) per head on the MLA output (Bailing)
    router: DeepseekFamily  # the V3 router and, with mla_rope, the interleaved RoPE layout


def _router_family(hf: Any, rope_interleave: bool) -> DeepseekFamily:
    return DeepseekFamily(
        version=3,
        rope_interleave=rope_interleave,
        rope_fp32=False,
        mlp_bias=False,
        topk_method="noaux_tc",
        norm_topk_prob=bool(hf.norm_topk_prob),
        routed_scaling_factor=float(hf.routed_scaling_factor),
        n_group=int(hf.n_group or 1),
        topk_group=int(hf.topk_group or 1),
    )


def _moe_view(config: ModelConfig) -> Any:
    """The DeepSeek field names `DeepseekMoE` reads, from these configs' names (num_local_experts
    for n_routed_experts)."""
    hf = config.hf_config
    fields = SimpleNamespace(
        hidden_size=config.hidden_size,
        moe_intermediate_size=int(hf.moe_intermediate_size),
        n_routed_experts=int(hf.num_local_experts),
        num_experts_per_tok=int(hf.num_experts_per_tok),
        n_shared_experts=int(hf.n_shared_experts or 0),
    )
    return SimpleNamespace(hidden_size=config.hidden_size, hf_config=fields)


def check_supported(config: ModelConfig, family: HybridFamily, tp: TPGroup) -> None:
    hf = config.hf_config
    if getattr(hf, "hidden_act", "silu") not in ("silu", "swish"):
        raise NotImplementedError(f"activation {hf.hidden_act!r} is not supported (only silu)")
    if config.num_kv_heads != config.num_heads:
        raise ValueError("hybrid MLA layers need num_key_value_heads == num_attention_heads "
                         f"({config.num_kv_heads} != {config.num_heads})")
    if int(hf.num_local_experts) % family.router.n_group:
        raise ValueError(f"n_group={family.router.n_group} does not divide {hf.num_local_experts} experts")
    for what, n in [("attention heads", config.num_heads), ("linear-attention heads", hf.linear_num_heads),
                    ("intermediate size", hf.intermediate_size), ("moe intermediate size", hf.moe_intermediate_size)]:
        if int(n) % tp.size:
            raise ValueError(f"tp={tp.size} does not divide the {what} ({n})")
    kinds = set(hf.layer_types) | set(hf.mlp_layer_types)
    if not kinds <= {"linear_attention", "full_attention", "dense", "sparse"}:
        raise NotImplementedError(f"layer types {sorted(kinds)}")


class HybridMLAttention(DeepseekAttention):
    """DeepSeek MLA with optional RoPE and an optional per-head sigmoid output gate."""

    def __init__(self, config: ModelConfig, family: HybridFamily, layer_id: int, tp: TPGroup,
                 scaling: float, dtype, device):
        super().__init__(config, layer_id, tp, scaling, dtype, device)
        self.family = family
        self.g_proj = (
            ColumnParallelLinear(config.hidden_size, config.num_heads, False, tp, dtype, device)
            if family.mla_head_gate else None
        )

    def forward(self, positions, x, fb: ForwardBatch, rotary: RotaryEmbedding | None, family: Any = None):
        t = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, self.heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.lora, self.rope], dim=-1)
        k_pe = k_pe.unsqueeze(1)
        if rotary is not None:
            q_pe, k_pe = _rope(rotary, self.family.router, positions, q_pe, k_pe)
        entry = torch.cat((self.kv_a_layernorm(latent).unsqueeze(1), k_pe), dim=-1)  # [T, 1, C + R]
        backend = fb.attn_backend
        assert backend is not None
        if fb.forward_mode.is_decode():
            q_lat = self.absorb_query(q_nope)
            out = backend.forward(torch.cat((q_lat, q_pe), dim=-1), entry, None, self.attn, fb)
            out = self.absorb_output(out.view(t, self.heads, self.lora))
        else:
            out = backend.forward(torch.cat((q_nope, q_pe), dim=-1), entry, None, self.attn, fb)
        out = out.reshape(t, self.heads, self.v_dim)
        if self.g_proj is not None:
            out = out * torch.sigmoid(self.g_proj(x).float()).to(x.dtype).unsqueeze(-1)
        return self.o_proj(out.reshape(t, self.heads * self.v_dim))


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, family: HybridFamily, layer_id: int, tp: TPGroup,
                 scaling: float, dtype, device):
        super().__init__()
        hf = config.hf_config
        self.is_linear = layer_id in config.linear_attn_layers
        self.self_attn: nn.Module
        if self.is_linear:
            self.self_attn = KimiDeltaAttention(config, family.kda, layer_id, tp, dtype, device)
        else:
            self.self_attn = HybridMLAttention(config, family, layer_id, tp, scaling, dtype, device)
        self.mlp: nn.Module
        if hf.mlp_layer_types[layer_id] == "sparse":
            self.mlp = DeepseekMoE(_moe_view(config), family.router, tp, dtype, device)  # type: ignore[arg-type]
        else:
            self.mlp = DeepseekMLP(config.hidden_size, hf.intermediate_size, False, tp, dtype, device)
        self.input_layernorm = RMSNorm(config.hidden_size, hf.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, hf.rms_norm_eps, dtype, device)

    def forward(self, positions, x, fb: ForwardBatch, rotary: RotaryEmbedding | None):
        h = self.input_layernorm(x)
        if self.is_linear:
            x = x + self.self_attn(positions, h, fb)
        else:
            x = x + self.self_attn(positions, h, fb, rotary)
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridModel(nn.Module):
    def __init__(self, config: ModelConfig, family: HybridFamily, tp: TPGroup, scaling: float, dtype, device):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype, device)
        self.layers = nn.ModuleList(
            HybridDecoderLayer(config, family, i, tp, scaling, dtype, device) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.hf_config.rms_norm_eps, dtype, device)


_KIMI_RENAMES = (
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"\.experts\.(\d+)\.w1\."), r".experts.\1.gate_proj."),
    (re.compile(r"\.experts\.(\d+)\.w3\."), r".experts.\1.up_proj."),
    (re.compile(r"\.experts\.(\d+)\.w2\."), r".experts.\1.down_proj."),
)


class KimiLinearForCausalLM(nn.Module):
    """Kimi-Linear; subclasses change `family_of` and `RENAMES` (see the module docstring)."""

    RENAMES: tuple[tuple[re.Pattern, str], ...] = _KIMI_RENAMES

    def __init__(self, config: ModelConfig, tp: TPGroup, device: torch.device | str, dtype: torch.dtype):
        super().__init__()
        self.family = self.family_of(config)
        check_supported(config, self.family, tp)
        self.config = config
        self.tp = tp
        rope = RopeConfig.from_hf(config.hf_config, config.qk_rope_head_dim)
        self.rotary_emb = RotaryEmbedding(rope, config.max_context_len, device) if self.family.mla_rope else None
        scaling = softmax_scale(config, rope) if self.family.mla_rope else config.qk_head_dim**-0.5
        self.model = HybridModel(config, self.family, tp, scaling, dtype, device)
        tie = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, dtype, device, tie_to=tie)

    @staticmethod
    def family_of(config: ModelConfig) -> HybridFamily:
        hf = config.hf_config
        return HybridFamily(
            kda=KDAFamily(forget_gate="kimi", low_rank_gates=True),
            mla_rope=False,
            mla_head_gate=False,
            router=_router_family(hf, rope_interleave=True),
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """input_ids, positions: [T] -> final-normed hidden states [T, hidden] (every rank)."""
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(positions, x, forward_batch, self.rotary_emb)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> [N, vocab] float32, the full vocabulary on every rank."""
        return self.lm_head(hidden)

    def canonical_name(self, name: str) -> str:
        for pattern, repl in self.RENAMES:
            name = pattern.sub(repl, name)
        return name

    def _target(self, name: str) -> tuple[str, Any]:
        m = re.match(r"^(model\.layers\.(\d+)\.self_attn\.)(.*)$", name)
        if m and int(m.group(2)) in self.config.linear_attn_layers:
            rest, shard_id = kda_param_target(m.group(3))
            return m.group(1) + rest, shard_id
        return _param_target(name)

    def load_weights(self, reader: CheckpointReader) -> set[tuple[str, Any]]:
        """Copy this rank's slices; returns the (parameter, shard id) pairs loaded. Unknown
        tensors are an error; RoPE tables, a tied lm_head and layers past num_hidden_layers are
        skipped."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, Any]] = set()
        for ckpt_name in reader.names():
            name = self.canonical_name(ckpt_name)
            layer = _LAYER.match(name)
            if _IGNORED.search(name) or (layer and int(layer.group(1)) >= self.config.num_layers):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, shard_id = self._target(name)
            if target not in params:
                raise ValueError(
                    f"checkpoint tensor {ckpt_name!r} matches no parameter of {self.config.architecture}"
                )
            param = params[target]
            param.weight_loader(param, reader.get_slice(ckpt_name), shard_id)
            loaded.add((target, shard_id))
        return loaded
