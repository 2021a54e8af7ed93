"""The Bailing hybrid (Ling/Ring 3.x: `BailingHybridForCausalLM` in transformers): the hybrid
model of `workers.models.kimi_linear` with Bailing's family differences.

- KDA forget gate from a full projection f_proj, bounded ("safe": kda_lower_bound *
  sigmoid(exp(A_log) * (f_proj(x) + dt_bias))) unless kda_safe_gate is false; output gate from
  g_proj; the log decay is cast to the activation dtype.
- MLA with interleaved RoPE on the rope part (DeepSeek-V3 layout, `rope_parameters`), no q LoRA,
  and a per-head output gate sigmoid(g_proj(x)); softmax scale as DeepSeek-V3 (YaRN mscale).
- Layer types: by default the last layer of every `layer_group_size` layers is full attention
  (transformers resolves `layer_types` in the config).

Checkpoint names (the original Ling layout, which transformers writes back on save):
`model.word_embeddings` -> embed_tokens, `.attention.` -> self_attn, `self_attn.dense` ->
o_proj, `mlp.gate.expert_bias` -> e_score_correction_bias; experts are already
`mlp.experts.{e}.{gate,up,down}_proj`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from workers.models.kda import KDAFamily
from workers.models.kimi_linear import HybridFamily, KimiLinearForCausalLM, _router_family

if TYPE_CHECKING:
    from workers.model_config import ModelConfig

_BAILING_RENAMES = (
    (re.compile(r"^model\.word_embeddings\."), "model.embed_tokens."),
    (re.compile(r"\.attention\."), ".self_attn."),
    (re.compile(r"\.self_attn\.dense\."), ".self_attn.o_proj."),
    (re.compile(r"\.mlp\.gate\.expert_bias$"), ".mlp.gate.e_score_correction_bias"),
)


class BailingHybridForCausalLM(KimiLinearForCausalLM):
    RENAMES = _BAILING_RENAMES

    @staticmethod
    def family_of(config: ModelConfig) -> HybridFamily:
        hf = config.hf_config
        safe = bool(getattr(hf, "kda_safe_gate", True))
        return HybridFamily(
            kda=KDAFamily(
                forget_gate="safe" if safe else "softplus",
                low_rank_gates=False,
                lower_bound=float(getattr(hf, "kda_lower_bound", -5.0)),
                gate_in_float32=False,
            ),
            mla_rope=True,
            mla_head_gate=True,
            router=_router_family(hf, rope_interleave=True),
        )
