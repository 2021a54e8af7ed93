"""Llama-style decoders (MHA/GQA): Llama, Qwen2, Qwen3, Mistral — one parametrised model.

Family differences (`LlamaFamily`): Qwen2 has a bias on q/k/v (not on o); Qwen3 applies a
per-head RMSNorm to q and k before RoPE; Llama follows `attention_bias` / `mlp_bias`; Mistral
has no biases. Sliding-window attention is not implemented: a config whose window is shorter
than its context is refused at load.

Tensor parallelism: q/k/v and gate/up are column-parallel (per-rank heads / intermediate
slices), o/down are row-parallel (all-reduce), embedding and LM head are vocab-parallel.
Every rank must run `forward` and `compute_logits` (both contain collectives at tp > 1).
Parameter names follow the HF checkpoint, except the fused `qkv_proj` and `gate_up_proj`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from attention.base import AttentionLayer
from workers import kv_quant
from workers.layers import fp8, one_row
from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from workers.layers.norm import RMSNorm
from workers.layers.rotary import RopeConfig, RotaryEmbedding
from workers.parallel import TPGroup

if TYPE_CHECKING:
    from workers.forward_batch import ForwardBatch
    from workers.loader import CheckpointReader
    from workers.model_config import ModelConfig


@dataclass(frozen=True)
class LlamaFamily:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False


def llama_family(config: ModelConfig) -> LlamaFamily:
    hf = config.hf_config
    attention_bias = bool(getattr(hf, "attention_bias", False))
    arch = config.architecture
    if arch == "LlamaForCausalLM":
        return LlamaFamily(attention_bias, attention_bias, bool(getattr(hf, "mlp_bias", False)))
    if arch == "Qwen2ForCausalLM":
        return LlamaFamily(qkv_bias=True)
    if arch == "Qwen3ForCausalLM":
        return LlamaFamily(attention_bias, attention_bias, qk_norm=True)
    if arch == "MistralForCausalLM":
        return LlamaFamily()
    raise ValueError(f"{arch!r} is not a Llama-family architecture")


_ACTIVATIONS = {"silu": F.silu, "swish": F.silu}

# Checkpoint tensors that are not parameters here (RoPE tables are recomputed at start-up).
_IGNORED = re.compile(r"rotary_emb\.inv_freq$|rotary_emb\.cos_cached$|rotary_emb\.sin_cached$")

# (checkpoint name part, parameter name part, shard id) of the fused parameters.
_FUSED = (
    (".self_attn.q_proj.", ".self_attn.qkv_proj.", "q"),
    (".self_attn.k_proj.", ".self_attn.qkv_proj.", "k"),
    (".self_attn.v_proj.", ".self_attn.qkv_proj.", "v"),
    (".mlp.gate_proj.", ".mlp.gate_up_proj.", 0),
    (".mlp.up_proj.", ".mlp.gate_up_proj.", 1),
)


def _check_supported(config: ModelConfig, tp: TPGroup) -> None:
    hf = config.hf_config
    window = getattr(hf, "sliding_window", None)
    layer_types = getattr(hf, "layer_types", None)
    uses_window = layer_types is None or "sliding_attention" in layer_types
    if window is not None and window < config.max_context_len and uses_window:
        raise NotImplementedError(
            f"{config.architecture}: sliding-window attention (window {window} < context "
            f"{config.max_context_len}) is not supported yet"
        )
    act = getattr(hf, "hidden_act", "silu")
    if act not in _ACTIVATIONS:
        raise NotImplementedError(f"activation {act!r} is not supported (only {sorted(_ACTIVATIONS)})")
    for what, n in (("attention heads", config.num_heads), ("intermediate size", hf.intermediate_size)):
        if n % tp.size:
            raise ValueError(f"tp={tp.size} does not divide the {what} ({n})")
    kv = config.num_kv_heads
    if (kv % tp.size) if tp.size <= kv else (tp.size % kv):
        raise ValueError(f"tp={tp.size} must divide, or be a multiple of, the kv heads ({kv})")


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, family: LlamaFamily, layer_id: int, tp: TPGroup, dtype, device):
        super().__init__()
        hd = config.head_dim
        self.head_dim = hd
        p = f"model.layers.{layer_id}.self_attn."
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, hd, config.num_heads, config.num_kv_heads, family.qkv_bias, tp, dtype, device,
            quant=config.quant_for(p + "q_proj", p + "k_proj", p + "v_proj"),
        )
        self.o_proj = RowParallelLinear(
            config.num_heads * hd, config.hidden_size, family.o_bias, tp, dtype, device,
            quant=config.quant_for(p + "o_proj"),
        )
        eps = config.hf_config.rms_norm_eps
        self.q_norm = RMSNorm(hd, eps, dtype, device) if family.qk_norm else None
        self.k_norm = RMSNorm(hd, eps, dtype, device) if family.qk_norm else None
        self.attn = AttentionLayer(
            layer_id=layer_id,
            num_heads=self.qkv_proj.num_heads,
            num_kv_heads=self.qkv_proj.num_kv_heads,
            head_dim=hd,
            scaling=hd**-0.5,
        )

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch, rotary: RotaryEmbedding
    ) -> torch.Tensor:
        return self.o_proj(self.attend(positions, self.qkv_proj(x), fb, rotary))

    def rope_kv_target(self, positions: torch.Tensor, fb: ForwardBatch, rotary: RotaryEmbedding,
                       dtype: torch.dtype) -> one_row.RopeKV | None:
        """Where the one-row qkv product may rotate q, k and write k, v itself (None: `attend`
        does); not with a q/k norm, which comes between the product and RoPE."""
        if self.q_norm is not None or fb.attn_backend is None:
            return None
        store = fb.attn_backend.kv_store_target(self.attn, fb)
        return rotary.fused_qkv_target(positions, store, self.attn.num_heads, self.attn.num_kv_heads, self.head_dim,
                                       dtype)

    def attend(
        self, positions: torch.Tensor, qkv: tuple[torch.Tensor, ...] | torch.Tensor, fb: ForwardBatch,
        rotary: RotaryEmbedding, roped: bool = False,
    ) -> torch.Tensor:
        """Attention over the projected q, k, v (`qkv_proj`'s output, split or not): the input of
        o_proj, [T, heads * head_dim]. `roped`: the product already rotated q, k and wrote k, v
        (`rope_kv_target`)."""
        if isinstance(qkv, torch.Tensor):
            qkv = qkv.split(self.qkv_proj.output_sizes, dim=-1)
        q, k, v = qkv
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.attn.num_heads, self.head_dim)
        k = k.view(num_tokens, self.attn.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.attn.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        backend = fb.attn_backend
        assert backend is not None
        if roped:
            return backend.forward(q, k, v, self.attn, fb, save_kv_cache=False)
        # Where the backend would write the new K/V, RoPE writes them (one kernel on CUDA).
        store = backend.kv_store_target(self.attn, fb)
        q, k = rotary.apply(positions, q, k, v, store)
        return backend.forward(q, k, v, self.attn, fb, save_kv_cache=store is None)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, family: LlamaFamily, layer_id: int, tp: TPGroup, dtype, device):
        super().__init__()
        hf = config.hf_config
        inter = hf.intermediate_size
        p = f"model.layers.{layer_id}.mlp."
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [inter, inter], family.mlp_bias, tp, dtype, device,
            quant=config.quant_for(p + "gate_proj", p + "up_proj"),
        )
        self.down_proj = RowParallelLinear(inter, config.hidden_size, family.mlp_bias, tp, dtype, device,
                                           quant=config.quant_for(p + "down_proj"))
        self.act = _ACTIVATIONS[getattr(hf, "hidden_act", "silu")]
        self.local_inter = inter // tp.size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward_silu_mul(self.gate_up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, family: LlamaFamily, layer_id: int, tp: TPGroup, dtype, device):
        super().__init__()
        eps = config.hf_config.rms_norm_eps
        self.self_attn = LlamaAttention(config, family, layer_id, tp, dtype, device)
        self.mlp = LlamaMLP(config, family, layer_id, tp, dtype, device)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor | one_row.Summed, residual: torch.Tensor | None,
        fb: ForwardBatch, rotary: RotaryEmbedding,
    ) -> tuple[torch.Tensor | one_row.Summed, torch.Tensor | None]:
        """Returns (mlp output, residual): the next layer (or the final norm) adds them, fused
        with its RMSNorm. Same sums in the same order as HF's `x + attn(norm(x))` etc. At batch 1
        on CUDA without TP the products add to the residual themselves: (`one_row.Summed`, None)."""
        attn, mlp = self.self_attn, self.mlp
        row = x.row if isinstance(x, one_row.Summed) else x
        if self._one_row(row):  # batch 1 on CUDA: each norm and the SiLU in a product
            norm = self.input_layernorm
            rope = attn.rope_kv_target(positions, fb, rotary, row.dtype)
            qkv_scale = fp8.row_scale(attn.qkv_proj)
            if isinstance(x, one_row.Summed):
                qkv = one_row.norm_linear(x, norm.weight, norm.eps, *_wb(attn.qkv_proj), rope, scale=qkv_scale)
                residual = x.row
            else:
                qkv, residual = one_row.add_rms_norm_linear(x, residual, norm.weight, norm.eps, *_wb(attn.qkv_proj),
                                                            rope, scale=qkv_scale)
            h = attn.o_proj(attn.attend(positions, qkv, fb, rotary, roped=rope is not None))
            norm = self.post_attention_layernorm
            # FP8 weights: silu(gate) * up in the gate/up product's epilogue, not in each down
            # program's prologue (2.86 -> 2.68 ms a batch-1 step; bf16 0.6% slower: BENCHMARKS.md)
            gate_up_scale = fp8.row_scale(mlp.gate_up_proj)
            glu = gate_up_scale is not None
            act, residual = one_row.add_rms_norm_linear(h, residual, norm.weight, norm.eps, *_wb(mlp.gate_up_proj),
                                                        scale=gate_up_scale, glu=glu)
            if self.adds_residual:  # (o_proj's add stays in the norm kernel: measured faster, BENCHMARKS.md)
                return one_row.linear_add(act, *_wb(mlp.down_proj), residual, silu_mul=not glu,
                                          scale=fp8.row_scale(mlp.down_proj)), None
            return (mlp.down_proj(act) if glu else mlp.down_proj.forward_silu_mul(act)), residual
        if isinstance(x, one_row.Summed):
            x, residual = x.row, None
        # (FP8 weights at W8A8 batches: each norm writes its rows quantized for the product)
        h, residual = self.input_layernorm.forward_for(attn.qkv_proj, x, residual)
        h = attn(positions, h, fb, rotary)
        h, residual = self.post_attention_layernorm.forward_for(mlp.gate_up_proj, h, residual)
        return mlp(h), residual

    def _one_row(self, row: torch.Tensor) -> bool:
        """Whether every product of the layer takes the one-row kernels on this row (bf16
        weights, or FP8 with a scale per row; not block-wise FP8)."""
        return all(one_row.applies(row, layer.weight, fp8.row_scale(layer))
                   for layer in (self.self_attn.qkv_proj, self.self_attn.o_proj, self.mlp.gate_up_proj,
                                 self.mlp.down_proj))

    @property
    def adds_residual(self) -> bool:
        """down_proj adds to the residual stream in its kernel and sums its squares for the next
        layer's qkv product (one-row path): only without TP, where a rank's product is the
        whole output."""
        return self.mlp.down_proj.tp.size == 1


def _wb(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    return layer.weight, layer.bias


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, family: LlamaFamily, tp: TPGroup, dtype, device):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, family, i, tp, dtype, device) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.hf_config.rms_norm_eps, dtype, device)


class LlamaForCausalLM(nn.Module):
    supports_fp8 = True  # its linear layers take a QuantSpec (workers/layers/fp8.py)
    # Between two attention calls nothing reads a host value of the batch: prompt batches may
    # run as CUDA graphs cut at each attention call (workers/prompt_graphs.py).
    piecewise_graphs = True

    def __init__(self, config: ModelConfig, tp: TPGroup, device: torch.device | str, dtype: torch.dtype):
        super().__init__()
        _check_supported(config, tp)
        self.config = config
        self.tp = tp
        family = llama_family(config)
        self.model = LlamaModel(config, family, tp, dtype, device)
        tie = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, dtype, device, tie_to=tie)
        rope = RopeConfig.from_hf(config.hf_config, config.head_dim)
        self.rotary_emb = RotaryEmbedding(rope, config.max_context_len, device)

    @property
    def attention_layers(self) -> list[AttentionLayer]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final-normed hidden states [T, hidden] (every rank)."""
        x = self.model.embed_tokens(input_ids)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(positions, x, residual, forward_batch, self.rotary_emb)
        if isinstance(x, one_row.Summed):  # the last layer's products added the residual
            return one_row.rms_norm(x.row, self.model.norm.weight, self.model.norm.eps)
        if residual is None:  # no layers
            return self.model.norm(x)
        return self.model.norm.forward_with_residual(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> [N, vocab] float32, the full vocabulary on every rank."""
        return self.lm_head(hidden)

    def load_weights(self, reader: CheckpointReader) -> set[tuple[str, Any]]:
        """Copy this rank's slices from the checkpoint. Returns the (parameter, shard id) pairs
        loaded; `workers.loader.load_model` checks them against every parameter's shard_ids.
        Unknown checkpoint tensors are an error; RoPE tables (and a tied lm_head) are skipped."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, Any]] = set()
        for name in reader.names():
            if _IGNORED.search(name) or kv_quant.KV_SCALE.search(name):  # (KV-cache scales: the loader's)
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # shares model.embed_tokens.weight
            scale = fp8.SCALE.search(name)  # an FP8 weight's scale: into its layer's weight_scale / input_scale
            target = name if scale is None else name[: scale.start()] + "." + fp8.scale_param(scale)
            shard_id = None
            for ckpt_part, param_part, sid in _FUSED:
                if ckpt_part in name:
                    target, shard_id = target.replace(ckpt_part, param_part), sid
                    break
            if target not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} matches no parameter of {self.config.architecture}"
                )
            param = params[target]
            param.weight_loader(param, reader.get_slice(name), shard_id)
            loaded.add((target, shard_id))
        return loaded
