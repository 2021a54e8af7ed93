"""Encoder-decoder serving on one rank: what the model runner adds to a step for BART-family
models, and the generation rules `transformers.generate` applies to them.

Layout of an encoder-decoder request's row of `req_to_token` (P = page size):

    columns [0, encoder_len)                        the encoder's cross-attention K/V slots
    columns [encoder_len, round_up(encoder_len, P)) unused tail of the last encoder page
    columns [round_up(encoder_len, P), ...)         decoder token t at round_up(encoder_len, P) + t

The scheduler reserves the encoder pages at admission and sends their slots as a table write at
column 0 (`cluster/engine/encoder_decoder.py`); the decoder's positions stay 0-based (they index the
learned position embedding), only their columns are shifted. Every request has its own offset:
`attention.metadata.build_attention_metadata` reads `encoder_lens[i]` per request, in eager
steps and in CUDA-graph replay alike.

The encoder runs once per request, in the step that admits it (a preempted request is admitted
again and re-encoded): `attach` collects the step's new requests into one ragged `EncoderInputs`
batch (each its own length) and the slots their K/V go to.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attention.metadata import round_up

if TYPE_CHECKING:
    from workers.forward_batch import ForwardBatch
    from workers.memory_pool import ReqToTokenPool
    from workers.messages import StepPlan
    from workers.model_config import ModelConfig
    from workers.sampler import RequestSamplingState

# ForwardBatch.extras keys: this step's encoder inputs, and where their K/V are written (read by
# attention.paged.PagedAttentionBackend._cross_attention).
ENCODER_INPUTS = "encoder_inputs"
ENCODER_OUT_CACHE_LOC = "encoder_out_cache_loc"


def row_width(max_context_len: int, page_size: int) -> int:
    """req_to_token columns an encoder-decoder request may need: a whole-page encoder of up
    to max_context_len tokens, then up to max_context_len decoder tokens."""
    return round_up(max_context_len, page_size) + max_context_len


@dataclass
class EncoderInputs:
    """The encoder inputs of the requests admitted this step, concatenated in batch order.

    input_ids, positions: [Te] (positions restart at 0 for each request); lens_cpu: tokens per
    request (sum Te), on cpu; out_cache_loc: [Te] KV slot of each encoder token (its row's
    columns 0..len-1); batch_index: the requests' indices in the step's batch."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    lens_cpu: list[int]
    out_cache_loc: torch.Tensor
    batch_index: list[int]


def decoder_columns(plan: StepPlan, positions: torch.Tensor, extend_lens: torch.Tensor,
                    page_size: int) -> torch.Tensor:
    """[T] req_to_token column of each new decoder token: its position after its own request's
    encoder pages."""
    offsets = torch.tensor([round_up(r.encoder_len, page_size) for r in plan.reqs], dtype=positions.dtype)
    offsets = offsets.to(positions.device).repeat_interleave(extend_lens, output_size=positions.numel())
    return positions + offsets


def attach(fb: ForwardBatch, plan: StepPlan, req_to_token_pool: ReqToTokenPool) -> None:
    """Set the step's per-request encoder lengths and, when it admits requests, their encoder
    inputs. Call after the plan's table writes (the encoder slots) are in req_to_token."""
    dev = fb.input_ids.device
    lens = [r.encoder_len for r in plan.reqs]
    if any(n <= 0 for n in lens):
        raise ValueError(f"every request of an encoder-decoder model needs an encoder input: {lens}")
    fb.encoder_lens_cpu = lens
    fb.encoder_lens = torch.tensor(lens, dtype=torch.int32).to(dev)
    index = {r.rid: i for i, r in enumerate(plan.reqs)}
    new = [(index[nr.rid], nr.encoder_ids) for nr in plan.new_requests if nr.encoder_ids is not None]
    if not new:
        return
    new.sort()
    ids = [t for _, enc in new for t in enc]
    enc_lens = [len(enc) for _, enc in new]
    for i, enc in new:
        if len(enc) != lens[i]:
            raise ValueError(f"request {plan.reqs[i].rid}: {len(enc)} encoder ids, encoder_len {lens[i]}")
    host = torch.tensor(ids + [j for n in enc_lens for j in range(n)]
                        + [plan.reqs[i].req_pool_idx for i, _ in new], dtype=torch.long)
    packed = host.to(dev)
    input_ids, positions, rows = packed.split([len(ids), len(ids), len(new)])
    n = len(ids)
    rows = rows.repeat_interleave(torch.tensor(enc_lens, device=dev), output_size=n)
    loc = req_to_token_pool.req_to_token[rows, positions].long()
    fb.extras[ENCODER_INPUTS] = EncoderInputs(input_ids, positions, enc_lens, loc, [i for i, _ in new])
    fb.extras[ENCODER_OUT_CACHE_LOC] = loc


def has_encoder_work(fb: ForwardBatch) -> bool:
    """True when this step runs the encoder (never inside a captured CUDA graph)."""
    return fb.extras.get(ENCODER_INPUTS) is not None


@dataclass(frozen=True)
class GenerationRules:
    """How `transformers.generate` starts and steers an encoder-decoder model's decoder, read
    once from the checkpoint: `generation_config.json` when it sets a field, else config.json
    (as generate falls back to the model config).

    decoder_start_token_id: the decoder's first input (BART: </s>); None falls back to
      bos_token_id, as generate does.
    forced_bos_token_id: the first generated token is forced to it (generate's
      ForcedBOSTokenLogitsProcessor): every other logit of that row becomes -inf.
    forced_eos_token_id: the last token a request may generate (its max_tokens-th) is forced to
      it (ForcedEOSTokenLogitsProcessor at max_length - 1, with max_length = decoder start +
      max_new_tokens). A request stopped earlier by the context limit is not forced.
    """

    decoder_start_token_id: int
    forced_bos_token_id: int | None = None
    forced_eos_token_id: int | None = None

    @classmethod
    def of(cls, mc: ModelConfig) -> GenerationRules:
        hf = mc.hf_config
        gen: dict[str, Any] = {}
        path = os.path.join(mc.model_dir, "generation_config.json")
        if os.path.isfile(path):
            with open(path) as f:
                gen = json.load(f)

        def pick(name: str) -> Any:
            value = gen.get(name)
            return value if value is not None else getattr(hf, name, None)

        start = pick("decoder_start_token_id")
        if start is None:
            start = pick("bos_token_id")
        if start is None:
            raise ValueError(f"{mc.model_dir}: an encoder-decoder model needs decoder_start_token_id or bos_token_id")
        eos = pick("forced_eos_token_id")
        if isinstance(eos, list):  # generate accepts a list; it forces the first
            eos = eos[0] if eos else None
        bos = pick("forced_bos_token_id")
        return cls(int(start), None if bos is None else int(bos), None if eos is None else int(eos))

    @property
    def decoder_prompt(self) -> list[int]:
        return [self.decoder_start_token_id]

    def force(self, logits: torch.Tensor, states: list[RequestSamplingState]) -> torch.Tensor:
        """logits [B, V] for the requests `states` (batch order); rows whose next output
        position is forced keep only the forced token. Returns a new tensor when any row is
        forced (the caller's may be a CUDA graph's output), else `logits` itself."""
        forced: list[tuple[int, int]] = []
        for i, s in enumerate(states):
            pos = len(s.output_ids)
            token = None
            if pos == 0 and self.forced_bos_token_id is not None:
                token = self.forced_bos_token_id
            if pos == s.params.max_tokens - 1 and self.forced_eos_token_id is not None:
                token = self.forced_eos_token_id  # applied after forced bos, as in generate
            if token is not None:
                forced.append((i, token))
        if not forced:
            return logits
        out = logits.clone()
        rows = torch.tensor([i for i, _ in forced], device=logits.device)
        toks = torch.tensor([t for _, t in forced], device=logits.device)
        out[rows] = float("-inf")
        out[rows, toks] = 0.0
        return out
