"""One model's step pipeline on a rank: input batch -> executor -> logits.

A `ModelPipeline` holds one model shard with its KV pool and attention backend, the
`InputBatch` that packs every batch it runs (and owns its persistent device buffers), and the
executor choice, made here once: a decode batch that fits a captured graph replays it
(`workers.cuda_graph`), a speculative round's ragged batch replays the decode graphs as one row
per token when its tokens fit, everything else runs eagerly over the same buffers.

The target model is one instance (`workers.model_runner.ModelRunner.pipeline`); the draft model
of speculative decoding is a second instance over the same request table
(`workers.spec_runner.DraftRunner.pipeline`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from workers.cuda_graph import DEFAULT_BATCH_SIZES, CudaGraphRunner
from workers.forward_batch import ForwardBatch, ForwardMode
from workers.input_batch import InputBatch

if TYPE_CHECKING:
    from attention.base import AttentionBackend
    from workers.memory_pool import KVPool, ReqToTokenPool

# Ragged modes that may run through the decode graphs as one row per token.
_AS_DECODE_ROWS = (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2)


class ModelPipeline:
    def __init__(self, model: torch.nn.Module, *, kv_pool: KVPool, attn_backend: AttentionBackend,
                 req_to_token_pool: ReqToTokenPool, device: torch.device, page_size: int,
                 is_encoder_decoder: bool = False, last_token: torch.Tensor | None = None):
        self.model = model
        self.kv_pool = kv_pool
        self.attn_backend = attn_backend
        self.req_to_token_pool = req_to_token_pool
        self.is_encoder_decoder = is_encoder_decoder
        self.inputs = InputBatch(device=device, req_to_token_pool=req_to_token_pool, kv_pool=kv_pool,
                                 attn_backend=attn_backend, page_size=page_size,
                                 is_encoder_decoder=is_encoder_decoder, last_token=last_token)
        self.graphs: CudaGraphRunner | None = None

    def use_graphs(self, max_rows: int, pad_row: int, batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
                   capture: bool = True) -> CudaGraphRunner:
        """Run decode batches of up to `max_rows` rows through graphs: captured (`capture`), or
        the same static-buffer path run eagerly (CPU tests)."""
        self.graphs = CudaGraphRunner(self, max_rows, batch_sizes, pad_row=pad_row, use_graphs=capture)
        self.graphs.capture()
        return self.graphs

    def forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states [T, hidden] of every new token and, when a graph ran the batch (it
        computes them inside), the logits of every token ([T, vocab])."""
        g = self.graphs
        if g is not None:
            if g.can_run(fb):
                return g.replay(fb)
            if fb.forward_mode in _AS_DECODE_ROWS and fb.num_tokens <= g.max_bs:
                return g.replay(self.inputs.decode_rows(fb))
        self.attn_backend.init_forward_metadata(fb)
        return self.model(fb.input_ids, fb.positions, fb), None

    def logits(self, fb: ForwardBatch, hidden: torch.Tensor, logits: torch.Tensor | None,
               rows: torch.Tensor | None = None) -> torch.Tensor:
        """The logits `fb` asks for (`logits_indices`: one token per request, or every token
        when None) of its requests `rows` (None: all), from `forward`'s output. Every rank must
        call it (the LM head gathers over the TP group)."""
        at = fb.logits_indices
        if at is not None and rows is not None:
            at = at[rows]
        if logits is not None:  # a graph computed every token's
            if at is None or (rows is None and fb.forward_mode.is_decode()):  # one token per row
                return logits
            return logits[at]
        return self.model.compute_logits(hidden if at is None else hidden[at])

    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """`forward` and `logits` of every request of `fb`."""
        return self.logits(fb, *self.forward(fb))
