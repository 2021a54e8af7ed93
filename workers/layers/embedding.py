"""Vocab-parallel token embedding and LM head.

The vocabulary is padded to a multiple of tp and split in equal contiguous ranges: rank r
holds rows [r * V_pad / tp, (r + 1) * V_pad / tp). Padded rows are zeros and never read:
lookups of ids outside a rank's range are masked, and the LM head slices padded logits off.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.layers import one_row
from workers.layers.linear import TensorSlice, check_shape, make_param
from workers.parallel import TPGroup


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    return (vocab_size + tp_size - 1) // tp_size * tp_size


def _vocab_range(vocab_size: int, tp: TPGroup) -> tuple[int, int]:
    per_rank = padded_vocab_size(vocab_size, tp.size) // tp.size
    return tp.rank * per_rank, (tp.rank + 1) * per_rank


def _load_vocab_rows(param: nn.Parameter, src: TensorSlice, vocab_size: int, start: int, end: int) -> None:
    check_shape("vocab-parallel", src, [vocab_size, param.shape[1]])
    real_end = min(end, vocab_size)
    with torch.no_grad():
        param.data.zero_()
        if real_end > start:
            param.data[: real_end - start].copy_(src[start:real_end].to(param.dtype))


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup, dtype: torch.dtype, device):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.padded_vocab_size = padded_vocab_size(vocab_size, tp.size)
        self.vocab_start, self.vocab_end = _vocab_range(vocab_size, tp)
        per_rank = self.vocab_end - self.vocab_start
        self.weight = make_param((per_rank, hidden_size), dtype, device, self._load_rows)

    def _load_rows(self, param: nn.Parameter, src: TensorSlice, shard_id: Any = None) -> None:
        _load_vocab_rows(param, src, self.vocab_size, self.vocab_start, self.vocab_end)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] -> [T, hidden]. A collective at tp > 1 (all-reduce of the masked
        lookups: each id is found on exactly one rank)."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_range, input_ids - self.vocab_start, torch.zeros_like(input_ids))
        out = F.embedding(local_ids, self.weight)
        out = out * in_range.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """Logits over the full vocabulary on every rank: each rank computes its vocab range, the
    ranges are all-gathered (rank order = vocab order) and padding is sliced off.

    With tied embeddings pass `tie_to`: the head then shares the embedding's (identically
    sharded) parameter and has no weight of its own to load."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tp: TPGroup,
        dtype: torch.dtype,
        device,
        tie_to: VocabParallelEmbedding | None = None,
    ):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.vocab_start, self.vocab_end = _vocab_range(vocab_size, tp)
        if tie_to is not None:
            self.weight = tie_to.weight
        else:
            shape = (self.vocab_end - self.vocab_start, hidden_size)
            self.weight = make_param(shape, dtype, device, self._load_rows)

    def _load_rows(self, param: nn.Parameter, src: TensorSlice, shard_id: Any = None) -> None:
        _load_vocab_rows(param, src, self.vocab_size, self.vocab_start, self.vocab_end)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> [N, vocab] float32, identical on every rank (collective)."""
        if self.tp.size == 1:  # float32 straight from the product (at batch 1: no cast kernel)
            return one_row.linear(hidden, self.weight, out_dtype=torch.float32)[..., : self.vocab_size].contiguous()
        local = one_row.linear(hidden, self.weight)
        logits = self.tp.all_gather_last_dim(local)
        return logits[..., : self.vocab_size].float()
