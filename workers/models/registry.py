"""Architecture name (config.json `architectures[0]`) -> model class.

Every class is built as `cls(model_config, tp, device, dtype)` and offers
`forward(input_ids, positions, forward_batch)` (hidden states [T, hidden], what embeddings
pool), `compute_logits(hidden)` (encoders refuse: no LM head) and
`load_weights(reader) -> set of (parameter name, shard id) loaded`.
"""

from __future__ import annotations

from torch import nn

from workers.models.bailing_hybrid import BailingHybridForCausalLM
from workers.models.bart import BartForConditionalGeneration
from workers.models.bert import BertModel
from workers.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from workers.models.kimi_linear import KimiLinearForCausalLM
from workers.models.llama import LlamaForCausalLM

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "KimiLinearForCausalLM": KimiLinearForCausalLM,
    "BailingHybridForCausalLM": BailingHybridForCausalLM,
    "BertModel": BertModel,
    # Encoder-decoders: one parametrised model (workers/models/bart.py).
    "BartForConditionalGeneration": BartForConditionalGeneration,
    "MBartForConditionalGeneration": BartForConditionalGeneration,
    "MarianMTModel": BartForConditionalGeneration,
}

# Bidirectional encoders without an LM head: embedding models by construction.
ENCODER_ARCHITECTURES = frozenset({"BertModel"})


def is_encoder_architecture(architecture: str) -> bool:
    return architecture in ENCODER_ARCHITECTURES


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(ARCHITECTURES))


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        ) from None
