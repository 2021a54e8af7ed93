"""BART-family encoder-decoders (`BartForConditionalGeneration`, `MBartForConditionalGeneration`,
`MarianMTModel`), one parametrised model, as transformers defines them.

Family differences (`Seq2SeqFamily`): BART and Marian are post-LN (x = LN(x + f(x))), mBART is
pre-LN (x = x + f(LN(x))) with a final LayerNorm after the encoder and after the decoder. BART
and mBART add learned positions looked up at position + 2 (BART's offset) and normalise the
embeddings (`layernorm_embedding`); Marian adds fixed sinusoidal positions (not in the
checkpoint; computed here as transformers does) and has no embedding norm. `scale_embedding`
multiplies token embeddings by sqrt(d_model). The LM head adds `final_logits_bias`.

How a step runs (see workers/encoder_decoder.py for the request row layout):
- The encoder runs only for the requests admitted this step (`EncoderInputs` in
  forward_batch.extras), once, bidirectionally over each request's own tokens. Nothing of it
  is cached: its self-attention attends over the raw K/V of the batch (ragged, per-request
  lengths), so it needs no paged-cache metadata and does not go through the backend.
- Each decoder layer i has two cached attentions: causal self-attention (pool layer 2i) and
  cross-attention (pool layer 2i+1). In the admitting step the cross-attention's K/V of the new
  requests' encoder outputs are computed and written to their encoder slots by the backend;
  every later step passes k = v = None and the backend attends over the slots with each
  request's own encoder length.

Tensor parallelism as for the decoders: q/k/v, cross-attention k/v and fc1 are
column-parallel (per-rank heads / slices), out_proj and fc2 row-parallel (all-reduce), token
embeddings and the LM head vocab-parallel; positions, norms and final_logits_bias replicated.
Parameter names follow the checkpoint, except the fused `qkv_proj` (self-attention) and
`kv_proj` (cross-attention). Tied embeddings (`tie_word_embeddings`) share one table for the
encoder, the decoder and the LM head; untied checkpoints load each table on its own (a table
the checkpoint leaves out falls back to `model.shared.weight`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from attention.base import AttentionLayer
from attention.torch_ops import ragged_attention_sdpa
from workers.encoder_decoder import ENCODER_INPUTS, EncoderInputs
from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from workers.layers.norm import LayerNorm
from workers.models.bert import ReplicatedEmbedding
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
    "silu": F.silu,
    "swish": F.silu,
}

# (checkpoint name part, parameter name part, shard id)
_FUSED = (
    (".self_attn.q_proj.", ".self_attn.qkv_proj.", "q"),
    (".self_attn.k_proj.", ".self_attn.qkv_proj.", "k"),
    (".self_attn.v_proj.", ".self_attn.qkv_proj.", "v"),
    (".encoder_attn.k_proj.", ".encoder_attn.kv_proj.", 0),
    (".encoder_attn.v_proj.", ".encoder_attn.kv_proj.", 1),
)
_IGNORED = re.compile(r"(^|\.)version$|embed_positions\._float_tensor$")
_TABLES = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight")
_SHARED = "model.shared.weight"


@dataclass(frozen=True)
class Seq2SeqFamily:
    pre_norm: bool = False  # mBART: LN before each sub-layer, final LN after encoder/decoder
    learned_positions: bool = True  # BART/mBART (offset 2); Marian: sinusoidal, offset 0
    layernorm_embedding: bool = True


FAMILIES = {
    "BartForConditionalGeneration": Seq2SeqFamily(),
    "MBartForConditionalGeneration": Seq2SeqFamily(pre_norm=True),
    "MarianMTModel": Seq2SeqFamily(learned_positions=False, layernorm_embedding=False),
}
_POSITION_OFFSET = 2  # BART's learned positions are looked up at position + 2


def _check_supported(config: ModelConfig, tp: TPGroup) -> None:
    hf = config.hf_config
    if hf.encoder_attention_heads != hf.decoder_attention_heads:
        raise NotImplementedError("encoder and decoder with different head counts are not supported")
    if hf.activation_function not in _ACTIVATIONS:
        raise NotImplementedError(f"activation {hf.activation_function!r} is not supported")
    if config.architecture == "MarianMTModel" and not getattr(hf, "share_encoder_decoder_embeddings", True):
        raise NotImplementedError("Marian with separate source/target vocabularies is not supported")
    for what, n in (("attention heads", hf.decoder_attention_heads), ("encoder FFN size", hf.encoder_ffn_dim),
                    ("decoder FFN size", hf.decoder_ffn_dim)):
        if n % tp.size:
            raise ValueError(f"tp={tp.size} does not divide the {what} ({n})")


def sinusoidal_positions(num: int, dim: int) -> torch.Tensor:
    """Marian's fixed table: sin of the even-indexed frequencies in the first half, cos of the
    odd-indexed ones in the second (float64, as transformers computes it)."""
    pos = np.arange(num)[:, None] / np.power(10000, 2 * (np.arange(dim) // 2) / dim)[None, :]
    out = np.empty((num, dim))
    half = dim // 2 + dim % 2
    out[:, :half] = np.sin(pos[:, 0::2])
    out[:, half:] = np.cos(pos[:, 1::2])
    return torch.from_numpy(out).float()


class Embeddings(nn.Module):
    """Token embedding (scaled) + positions (+ LayerNorm): the input of the encoder or decoder."""

    def __init__(self, config: ModelConfig, family: Seq2SeqFamily, tokens: VocabParallelEmbedding, dtype, device):
        super().__init__()
        hf = config.hf_config
        h = config.hidden_size
        self.tokens = [tokens]  # a list: not a submodule (it may be the shared table)
        self.scale = math.sqrt(h) if hf.scale_embedding else 1.0
        self.offset = _POSITION_OFFSET if family.learned_positions else 0
        if family.learned_positions:
            self.embed_positions = ReplicatedEmbedding(hf.max_position_embeddings + self.offset, h, dtype, device)
        else:
            table = sinusoidal_positions(hf.max_position_embeddings, h).to(device=device, dtype=dtype)
            self.register_buffer("sinusoidal", table, persistent=False)
        self.layernorm_embedding = LayerNorm(h, 1e-5, dtype, device) if family.layernorm_embedding else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.tokens[0](input_ids)
        if self.scale != 1.0:
            x = x * self.scale
        if self.offset:
            x = x + self.embed_positions(positions + self.offset)
        else:
            x = x + F.embedding(positions, self.sinusoidal)
        return x if self.layernorm_embedding is None else self.layernorm_embedding(x)


class SelfAttention(nn.Module):
    """Encoder (bidirectional, uncached) or decoder (causal, paged) self-attention."""

    def __init__(self, config: ModelConfig, layer_id: int, causal: bool, tp: TPGroup, dtype, device):
        super().__init__()
        h, heads = config.hidden_size, config.num_heads
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(h, self.head_dim, heads, heads, True, tp, dtype, device)
        self.out_proj = RowParallelLinear(heads * self.head_dim, h, True, tp, dtype, device)
        self.attn = AttentionLayer(layer_id=layer_id, num_heads=self.qkv_proj.num_heads,
                                   num_kv_heads=self.qkv_proj.num_kv_heads, head_dim=self.head_dim,
                                   scaling=self.head_dim**-0.5, is_causal=causal)

    def forward(self, x: torch.Tensor, fb: ForwardBatch | None, lens: list[int] | None = None) -> torch.Tensor:
        """fb: the step's batch (decoder); lens: tokens per request (encoder, fb is None)."""
        t, a = x.shape[0], self.attn
        q, k, v = self.qkv_proj(x)
        q = q.view(t, a.num_heads, self.head_dim)
        k = k.view(t, a.num_kv_heads, self.head_dim)
        v = v.view(t, a.num_kv_heads, self.head_dim)
        if fb is None:
            assert lens is not None
            out = ragged_attention_sdpa(q, k, v, lens, a.scaling, causal=False).reshape(t, -1)
        else:
            assert fb.attn_backend is not None
            out = fb.attn_backend.forward(q, k, v, a, fb)
        return self.out_proj(out)


class CrossAttention(nn.Module):
    """Decoder queries over each request's encoder K/V in the paged pool."""

    def __init__(self, config: ModelConfig, layer_id: int, tp: TPGroup, dtype, device):
        super().__init__()
        h, heads = config.hidden_size, config.num_heads
        self.head_dim = config.head_dim
        self.q_proj = ColumnParallelLinear(h, heads * self.head_dim, True, tp, dtype, device)
        self.kv_proj = MergedColumnParallelLinear(h, [heads * self.head_dim] * 2, True, tp, dtype, device)
        self.out_proj = RowParallelLinear(heads * self.head_dim, h, True, tp, dtype, device)
        local_heads = heads // tp.size
        self.attn = AttentionLayer(layer_id=layer_id, num_heads=local_heads, num_kv_heads=local_heads,
                                   head_dim=self.head_dim, scaling=self.head_dim**-0.5, is_causal=False,
                                   is_cross_attention=True)

    def forward(self, x: torch.Tensor, encoder_out: torch.Tensor | None, fb: ForwardBatch) -> torch.Tensor:
        """encoder_out: [Te, hidden] of the requests admitted this step, or None."""
        a = self.attn
        q = self.q_proj(x).view(x.shape[0], a.num_heads, self.head_dim)
        k = v = None
        if encoder_out is not None:
            k, v = self.kv_proj(encoder_out).view(encoder_out.shape[0], 2, a.num_kv_heads, self.head_dim).unbind(1)
        assert fb.attn_backend is not None
        return self.out_proj(fb.attn_backend.forward(q, k, v, a, fb))


class Seq2SeqLayer(nn.Module):
    """An encoder layer (self-attention, FFN) or a decoder layer (+ cross-attention)."""

    def __init__(self, config: ModelConfig, family: Seq2SeqFamily, index: int, decoder: bool, tp: TPGroup,
                 dtype, device):
        super().__init__()
        h, cfg = config.hidden_size, config.hf_config
        ffn = cfg.decoder_ffn_dim if decoder else cfg.encoder_ffn_dim
        self.pre_norm = family.pre_norm
        # Pool layer ids: decoder layer i caches self-attention as 2i and cross-attention as 2i+1.
        self.self_attn = SelfAttention(config, 2 * index, decoder, tp, dtype, device)
        self.self_attn_layer_norm = LayerNorm(h, 1e-5, dtype, device)
        if decoder:
            self.encoder_attn = CrossAttention(config, 2 * index + 1, tp, dtype, device)
            self.encoder_attn_layer_norm = LayerNorm(h, 1e-5, dtype, device)
        self.fc1 = ColumnParallelLinear(h, ffn, True, tp, dtype, device)
        self.fc2 = RowParallelLinear(ffn, h, True, tp, dtype, device)
        self.final_layer_norm = LayerNorm(h, 1e-5, dtype, device)
        self.act = _ACTIVATIONS[cfg.activation_function]

    def _sub(self, x: torch.Tensor, norm: LayerNorm, fn) -> torch.Tensor:
        return x + fn(norm(x)) if self.pre_norm else norm(x + fn(x))

    def forward(self, x: torch.Tensor, fb: ForwardBatch | None, lens: list[int] | None = None,
                encoder_out: torch.Tensor | None = None) -> torch.Tensor:
        x = self._sub(x, self.self_attn_layer_norm, lambda y: self.self_attn(y, fb, lens))
        if fb is not None:  # decoder
            x = self._sub(x, self.encoder_attn_layer_norm, lambda y: self.encoder_attn(y, encoder_out, fb))
        return self._sub(x, self.final_layer_norm, lambda y: self.fc2(self.act(self.fc1(y))))


class Stack(nn.Module):
    """The encoder or the decoder: embeddings, layers, and mBART's final LayerNorm."""

    def __init__(self, config: ModelConfig, family: Seq2SeqFamily, tokens: VocabParallelEmbedding,
                 decoder: bool, tp: TPGroup, dtype, device):
        super().__init__()
        hf = config.hf_config
        n = hf.decoder_layers if decoder else hf.encoder_layers
        self.embed = Embeddings(config, family, tokens, dtype, device)
        self.layers = nn.ModuleList(Seq2SeqLayer(config, family, i, decoder, tp, dtype, device) for i in range(n))
        self.layer_norm = LayerNorm(config.hidden_size, 1e-5, dtype, device) if family.pre_norm else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch | None,
                lens: list[int] | None = None, encoder_out: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids, positions)
        for layer in self.layers:
            x = layer(x, fb, lens, encoder_out)
        return x if self.layer_norm is None else self.layer_norm(x)


class BartForConditionalGeneration(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, device: torch.device | str, dtype: torch.dtype):
        super().__init__()
        _check_supported(config, tp)
        self.config = config
        self.tp = tp
        self.family = FAMILIES[config.architecture]
        h, vocab = config.hidden_size, config.vocab_size
        self.tied = config.tie_word_embeddings
        if self.tied:
            self.shared = VocabParallelEmbedding(vocab, h, tp, dtype, device)
            enc_tokens = dec_tokens = self.shared
        else:  # each table loaded on its own (model.shared is then unused, as in transformers)
            self.encoder_embed_tokens = enc_tokens = VocabParallelEmbedding(vocab, h, tp, dtype, device)
            self.decoder_embed_tokens = dec_tokens = VocabParallelEmbedding(vocab, h, tp, dtype, device)
        self.encoder = Stack(config, self.family, enc_tokens, False, tp, dtype, device)
        self.decoder = Stack(config, self.family, dec_tokens, True, tp, dtype, device)
        self.lm_head = ParallelLMHead(vocab, h, tp, dtype, device, tie_to=self.shared if self.tied else None)
        self.register_buffer("final_logits_bias", torch.zeros(vocab, dtype=torch.float32, device=device))

    @property
    def attention_layers(self) -> list[AttentionLayer]:
        """The cached attention layers (decoder self and cross), in pool-layer order."""
        return [a for layer in self.decoder.layers for a in (layer.self_attn.attn, layer.encoder_attn.attn)]

    def encode(self, enc: EncoderInputs) -> torch.Tensor:
        """[Te, hidden] encoder output of the requests admitted this step (every rank)."""
        return self.encoder(enc.input_ids, enc.positions, None, enc.lens_cpu)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """input_ids, positions: [T] decoder tokens (positions 0-based in the decoder) ->
        decoder hidden states [T, hidden] (every rank)."""
        enc = forward_batch.extras.get(ENCODER_INPUTS)
        encoder_out = self.encode(enc) if enc is not None else None
        return self.decoder(input_ids, positions, forward_batch, None, encoder_out)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> [N, vocab] float32 (+ final_logits_bias), every rank."""
        return self.lm_head(hidden) + self.final_logits_bias

    # ---------------- weights ----------------
    def _target(self, name: str) -> tuple[str, Any]:
        """Checkpoint name -> (parameter name, shard id)."""
        local = name.removeprefix("model.")
        if name in _TABLES or name == _SHARED:
            if self.tied:
                return "shared.weight", None
            return {"model.encoder.embed_tokens.weight": "encoder_embed_tokens.weight",
                    "model.decoder.embed_tokens.weight": "decoder_embed_tokens.weight",
                    "lm_head.weight": "lm_head.weight"}.get(name, ""), None
        local = re.sub(r"^(encoder|decoder)\.(embed_positions|layernorm_embedding)\.", r"\1.embed.\2.", local)
        for ckpt_part, param_part, sid in _FUSED:
            if ckpt_part in local:
                return local.replace(ckpt_part, param_part), sid
        return local, None

    def load_weights(self, reader: CheckpointReader) -> set[tuple[str, Any]]:
        """Copy this rank's slices; returns the (parameter, shard id) pairs loaded. Unknown
        checkpoint tensors are an error."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, Any]] = set()
        names = reader.names()
        for name in names:
            if _IGNORED.search(name) or name.endswith("embed_positions.weight") and not self.family.learned_positions:
                continue
            if name == "final_logits_bias":
                self.final_logits_bias.copy_(reader.get_tensor(name).reshape(-1).float())
                continue
            target, shard_id = self._target(name)
            if target == "":  # model.shared of an untied checkpoint: a fallback source only
                continue
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {self.config.architecture}")
            param = params[target]
            param.weight_loader(param, reader.get_slice(name), shard_id)
            loaded.add((target, shard_id))
        if not self.tied and _SHARED in names:
            # An untied checkpoint may still leave a table out (stored once as model.shared).
            for name in _TABLES:
                target = self._target(name)[0]
                if (target, None) not in loaded:
                    params[target].weight_loader(params[target], reader.get_slice(_SHARED), None)
                    loaded.add((target, None))
        return loaded
