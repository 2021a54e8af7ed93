"""What one forward pass computes: the mode and the tensors that describe the batch.

A `ForwardBatch` is built by the model runner from a `StepPlan` (see `workers.messages`) and
lives on the worker's device. The attention backend reads it to build its metadata once per
step (`AttentionBackend.init_forward_metadata`); layers read `positions` and call the backend.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from attention.base import AttentionBackend
    from workers.memory_pool import KVPool, ReqToTokenPool


class ForwardMode(enum.IntEnum):
    # Prefill of new tokens, possibly after a prefix already in the KV cache (radix hit or an
    # earlier chunk of a chunked prefill).
    EXTEND = 1
    # One new token per request, attending over everything cached before it.
    DECODE = 2
    # Prefill chunks and decodes in one batch (decodes are extends of length 1).
    MIXED = 3
    # Nothing to run on this rank this step (keeps collective calls of TP ranks in step).
    IDLE = 4
    # Speculative decoding: the target scores the draft's proposal, an extend of K+1 tokens
    # per request.
    TARGET_VERIFY = 5
    # The draft model catches up on the accepted tokens. Here `seq_lens` is the prefix length
    # *before* the new tokens are written: the attention reads prefix + extend per request.
    DRAFT_EXTEND_V2 = 6

    def is_extend(self) -> bool:
        """Any mode whose new tokens per request may exceed one (runs the ragged path)."""
        return self in (
            ForwardMode.EXTEND,
            ForwardMode.MIXED,
            ForwardMode.TARGET_VERIFY,
            ForwardMode.DRAFT_EXTEND_V2,
        )

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_mixed(self) -> bool:
        return self == ForwardMode.MIXED

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_draft_extend_v2(self) -> bool:
        return self == ForwardMode.DRAFT_EXTEND_V2

    def seq_lens_include_extend(self) -> bool:
        """True when `seq_lens` already counts this step's new tokens.

        Every mode but DRAFT_EXTEND_V2: there `seq_lens` is the prefix before the write.
        """
        return self != ForwardMode.DRAFT_EXTEND_V2


@dataclass
class ForwardBatch:
    """Tensors of one forward pass. Shapes use B = batch size, T = new tokens this step.

    Field meaning per mode (all on the worker's device unless marked `# on cpu`):
    """

    forward_mode: ForwardMode
    batch_size: int
    # [T] token ids to embed, requests concatenated in batch order.
    input_ids: torch.Tensor
    # [T] absolute position of each new token within its sequence.
    positions: torch.Tensor
    # [B] row of each request in ReqToTokenPool.req_to_token.
    req_pool_indices: torch.Tensor
    # [B] cached length the attention reads *after* this step's write, i.e.
    #   EXTEND / MIXED / TARGET_VERIFY: prefix + extend;  DECODE: previous length + 1;
    #   DRAFT_EXTEND_V2: the prefix length *before* the new tokens (reads prefix + extend).
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor  # on cpu, same values as seq_lens
    # [T] KV-pool slot each new token's K/V is written to.
    out_cache_loc: torch.Tensor
    # [B] new tokens per request (1 for DECODE). Ragged modes only; None for DECODE.
    extend_seq_lens: torch.Tensor | None = None
    extend_seq_lens_cpu: list[int] | None = None  # on cpu
    # [B] tokens already cached before this step's new tokens (ragged modes only).
    extend_prefix_lens: torch.Tensor | None = None
    extend_prefix_lens_cpu: list[int] | None = None  # on cpu
    # [B+1] exclusive prefix sum of extend_seq_lens (ragged modes only).
    extend_start_loc: torch.Tensor | None = None
    # [B] encoder length per request (encoder-decoder models only; None otherwise). The
    # cross-attention K/V of request i occupies its first encoder_lens[i] req_to_token columns.
    encoder_lens: torch.Tensor | None = None
    encoder_lens_cpu: list[int] | None = None  # on cpu
    # Embedding requests: run the encoder/decoder and pool; no sampling.
    is_embedding: bool = False
    # [B] index into T of the token whose logits are needed per request (last new token by
    # default; None means "every token", as in TARGET_VERIFY).
    logits_indices: torch.Tensor | None = None
    # Speculative decoding payload (draft tokens, tree info); None outside spec modes.
    spec_info: Any = None

    # Set by the model runner before the forward.
    req_to_token_pool: ReqToTokenPool | None = None
    kv_pool: KVPool | None = None
    attn_backend: AttentionBackend | None = None
    # Per-model extras a layer may need (e.g. linear-attention state slots).
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def cache_lens_cpu(self) -> list[int]:
        """Per-request number of cached tokens the attention reads (prefix + extend)."""
        lens = self.seq_lens_cpu.tolist()
        if self.forward_mode.seq_lens_include_extend():
            return lens
        assert self.extend_seq_lens_cpu is not None
        return [s + e for s, e in zip(lens, self.extend_seq_lens_cpu)]
