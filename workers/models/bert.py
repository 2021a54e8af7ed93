"""BERT-family encoders (`BertModel`, e.g. sentence-transformers' all-MiniLM-L6-v2) for
embeddings, as transformers defines them.

Embeddings: word + token type + absolute position, then LayerNorm. Every input is one segment
(token type 0), as sentence-transformers encodes a single text. Each layer is post-LN:
x = LN(x + attention(x)); x = LN(x + W_out act(W_in x)). Attention is bidirectional and runs
through the same backends as the decoders (`AttentionLayer(is_causal=False)`); the engine
computes every prompt whole and never shares its K/V (`workers.model_config.serving_mode`).

Tensor parallelism as for the decoders: q/k/v and the intermediate projection are
column-parallel (per-rank heads / slices), the attention output and the output projection are
row-parallel (all-reduce), the word embedding is vocab-parallel; position and token-type
embeddings and the LayerNorms are replicated.

The model returns the last layer's hidden states (sentence-transformers' token embeddings);
pooling is `workers.pooling`'s job. There is no LM head: `compute_logits` refuses. The
checkpoint's pooler (`pooler.dense`, the NSP/classification head) is not used and not loaded.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from attention.base import AttentionLayer
from workers.layers.embedding import VocabParallelEmbedding
from workers.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, make_param
from workers.layers.norm import LayerNorm
from workers.parallel import TPGroup

if TYPE_CHECKING:
    from workers.forward_batch import ForwardBatch
    from workers.loader import CheckpointReader
    from workers.model_config import ModelConfig

_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}

# Checkpoint tensors that are not parameters here.
_IGNORED = re.compile(r"^pooler\.|embeddings\.position_ids$|embeddings\.token_type_ids$")

# (checkpoint name part, parameter name part, shard id); the first match wins, so
# "attention.output.dense" is tried before "output.dense".
_RENAMES = (
    (".attention.self.query.", ".attention.qkv_proj.", "q"),
    (".attention.self.key.", ".attention.qkv_proj.", "k"),
    (".attention.self.value.", ".attention.qkv_proj.", "v"),
    (".attention.output.dense.", ".attention.o_proj.", None),
    (".attention.output.LayerNorm.", ".attention_norm.", None),
    (".intermediate.dense.", ".intermediate.", None),
    (".output.dense.", ".output.", None),
    (".output.LayerNorm.", ".output_norm.", None),
)


def _check_supported(config: ModelConfig, tp: TPGroup) -> None:
    hf = config.hf_config
    if getattr(hf, "position_embedding_type", "absolute") != "absolute":
        raise NotImplementedError(f"BERT position_embedding_type {hf.position_embedding_type!r} is not supported")
    if hf.hidden_act not in _ACTIVATIONS:
        raise NotImplementedError(f"activation {hf.hidden_act!r} is not supported (only {sorted(_ACTIVATIONS)})")
    for what, n in (("attention heads", config.num_heads), ("intermediate size", hf.intermediate_size)):
        if n % tp.size:
            raise ValueError(f"tp={tp.size} does not divide the {what} ({n})")


class ReplicatedEmbedding(nn.Module):
    """A lookup table every rank holds whole (position and token-type embeddings)."""

    def __init__(self, num: int, dim: int, dtype: torch.dtype, device):
        super().__init__()
        self.weight = make_param((num, dim), dtype, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class BertEmbeddings(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, dtype, device):
        super().__init__()
        hf = config.hf_config
        h = config.hidden_size
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, h, tp, dtype, device)
        self.position_embeddings = ReplicatedEmbedding(hf.max_position_embeddings, h, dtype, device)
        self.token_type_embeddings = ReplicatedEmbedding(hf.type_vocab_size, h, dtype, device)
        self.LayerNorm = LayerNorm(h, hf.layer_norm_eps, dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Summed in transformers' order: (word + token type) + position.
        x = self.word_embeddings(input_ids) + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x + self.position_embeddings(positions))


class BertAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TPGroup, dtype, device):
        super().__init__()
        h, heads = config.hidden_size, config.num_heads
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(h, self.head_dim, heads, heads, True, tp, dtype, device)
        self.o_proj = RowParallelLinear(heads * self.head_dim, h, True, tp, dtype, device)
        self.attn = AttentionLayer(
            layer_id=layer_id,
            num_heads=self.qkv_proj.num_heads,
            num_kv_heads=self.qkv_proj.num_kv_heads,
            head_dim=self.head_dim,
            scaling=self.head_dim**-0.5,
            is_causal=False,
        )

    def forward(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x)
        heads, kv_heads = self.attn.num_heads, self.attn.num_kv_heads
        q = q.view(t, heads, self.head_dim)
        k = k.view(t, kv_heads, self.head_dim)
        v = v.view(t, kv_heads, self.head_dim)
        assert fb.attn_backend is not None
        return self.o_proj(fb.attn_backend.forward(q, k, v, self.attn, fb))


class BertLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TPGroup, dtype, device):
        super().__init__()
        hf = config.hf_config
        h, inter, eps = config.hidden_size, hf.intermediate_size, hf.layer_norm_eps
        self.attention = BertAttention(config, layer_id, tp, dtype, device)
        self.attention_norm = LayerNorm(h, eps, dtype, device)
        self.intermediate = ColumnParallelLinear(h, inter, True, tp, dtype, device)
        self.output = RowParallelLinear(inter, h, True, tp, dtype, device)
        self.output_norm = LayerNorm(h, eps, dtype, device)
        self.act = _ACTIVATIONS[hf.hidden_act]

    def forward(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        x = self.attention_norm(x + self.attention(x, fb))
        return self.output_norm(x + self.output(self.act(self.intermediate(x))))


class BertEncoder(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, dtype, device):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, i, tp, dtype, device) for i in range(config.num_layers))


class BertModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, device: torch.device | str, dtype: torch.dtype):
        super().__init__()
        _check_supported(config, tp)
        self.config = config
        self.tp = tp
        self.embeddings = BertEmbeddings(config, tp, dtype, device)
        self.encoder = BertEncoder(config, tp, dtype, device)

    @property
    def attention_layers(self) -> list[AttentionLayer]:
        return [layer.attention.attn for layer in self.encoder.layer]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> the last layer's hidden states [T, hidden] (every rank)."""
        x = self.embeddings(input_ids, positions)
        for layer in self.encoder.layer:
            x = layer(x, forward_batch)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{self.config.architecture} has no LM head: it serves embeddings only")

    def load_weights(self, reader: CheckpointReader) -> set[tuple[str, Any]]:
        """Copy this rank's slices; returns the (parameter, shard id) pairs loaded. Names may
        carry a `bert.` prefix (checkpoints saved from a task model). The pooler and buffers
        are skipped; any other unknown tensor is an error."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, Any]] = set()
        for name in reader.names():
            local = name.removeprefix("bert.")
            if _IGNORED.search(local):
                continue
            target, shard_id = local, None
            for ckpt_part, param_part, sid in _RENAMES:
                if ckpt_part in local:
                    target, shard_id = local.replace(ckpt_part, param_part), sid
                    break
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {self.config.architecture}")
            param = params[target]
            param.weight_loader(param, reader.get_slice(name), shard_id)
            loaded.add((target, shard_id))
        return loaded
