"""One model's step pipeline on a rank: input batch -> executor -> logits.

A `ModelPipeline` holds one model shard with its KV pool and attention backend, the
`InputBatch` that packs every batch it runs (and owns its persistent device buffers), and the
executor choice, made here once: a decode batch that fits a captured graph replays it
(`workers.cuda_graph`), a speculative round's ragged batch replays the decode graphs as one row
per token when its tokens fit, everything else runs eagerly over the same buffers.

A MIXED step (prompt pieces beside decodes) runs as two forwards (`forward_mixed`): its
one-token rows replay the decode graph of their batch size, then its prompt pieces run eagerly
as an EXTEND batch. Profiled on an H100 (BENCHMARKS.md, "MIXED steps as a decode graph and a
prefill"), one eager forward of 192 decodes + a 1,024-token prompt kept the GPU busy 42 ms of a
60 ms span: the host, launching ~700 kernels and the decode rows' attention metadata, was the
bottleneck, while the graph of those 192 decodes alone replays in 16.7 ms. Split, the prompt's
launches overlap the graph's execution on the device; the price is one more pass over the
weights (~5 ms of an 8B model's bf16 weights on an H100), paid only when prompts arrive.

The target model is one instance (`workers.model_runner.ModelRunner.pipeline`); the draft model
of speculative decoding is a second instance over the same request table
(`workers.spec_runner.DraftRunner.pipeline`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from attention import kernel_options
from workers.cuda_graph import DEFAULT_BATCH_SIZES, CudaGraphRunner
from workers.forward_batch import ForwardBatch, ForwardMode
from workers.input_batch import InputBatch
from workers.prompt_graphs import DEFAULT_BUCKETS, PromptGraphRunner

if TYPE_CHECKING:
    from attention.base import AttentionBackend
    from workers.memory_pool import KVPool, ReqToTokenPool
    from workers.messages import StepPlan

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
        self.prompt_graphs: PromptGraphRunner | None = None

    def use_graphs(self, max_rows: int, pad_row: int, batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
                   capture: bool = True) -> CudaGraphRunner:
        """Run decode batches of up to `max_rows` rows through graphs: captured (`capture`), or
        the same static-buffer path run eagerly (CPU tests)."""
        self.graphs = CudaGraphRunner(self, max_rows, batch_sizes, pad_row=pad_row, use_graphs=capture)
        self.graphs.capture()
        return self.graphs

    def use_prompt_graphs(self, max_tokens: int, pad_row: int, capture: bool = True) -> PromptGraphRunner:
        """Run prompt (EXTEND) batches of up to `max_tokens` tokens through piecewise graphs
        (`workers.prompt_graphs`), in the decode graphs' memory pool; `capture` False: the same
        static-buffer path eagerly (CPU tests)."""
        buckets = tuple(b for b in DEFAULT_BUCKETS if b <= max_tokens) or DEFAULT_BUCKETS[:1]
        pool = self.graphs.pool if self.graphs is not None else None
        self.prompt_graphs = PromptGraphRunner(self, buckets, pad_row=pad_row, pool=pool, use_graphs=capture)
        self.prompt_graphs.capture()
        return self.prompt_graphs

    def forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states [T, hidden] of every new token and, when a graph ran the batch (it
        computes them inside), the logits of every token ([T, vocab]). After a graph (decode or
        prompt) they are views of its static outputs: read them before the next forward."""
        g = self.graphs
        if g is not None:
            if g.can_run(fb):
                return g.replay(fb)
            if fb.forward_mode in _AS_DECODE_ROWS and fb.num_tokens <= g.max_bs:
                return g.replay(self.inputs.decode_rows(fb))
        self.attn_backend.init_forward_metadata(fb)
        pg = self.prompt_graphs
        if pg is not None and pg.can_run(fb):
            return pg.replay(fb), None
        return self.model(fb.input_ids, fb.positions, fb), None

    def split_mixed(self, plan: StepPlan) -> tuple[StepPlan, StepPlan] | None:
        """A MIXED plan as (its one-token rows as a DECODE plan, its prompt pieces as an EXTEND
        plan) when the one-token rows fit a decode graph; None: run it as one batch. A one-token
        piece attends to its prefix and itself, as a decode does, whether or not it is sampled."""
        g = self.graphs
        if (g is None or self.is_encoder_decoder or not plan.mode.is_mixed()
                or not kernel_options.current().mixed_split):
            return None
        rows = [r for r in plan.reqs if len(r.input_ids) == 1]
        if not rows or len(rows) > g.max_bs or len(rows) == len(plan.reqs):
            return None
        prompts = [r for r in plan.reqs if len(r.input_ids) > 1]
        return (dataclasses.replace(plan, mode=ForwardMode.DECODE, reqs=rows),
                dataclasses.replace(plan, mode=ForwardMode.EXTEND, reqs=prompts))

    def forward_mixed(self, decodes: StepPlan, prompts: StepPlan) -> tuple[ForwardBatch, torch.Tensor]:
        """`split_mixed`'s two plans, the graph first (its launch is one call: the prompt's
        batch is built and launched while the device runs it): (a batch of one row per request,
        decode rows then prompt pieces, that `logits` reads as a decode batch; its logits)."""
        fb_d = self.inputs.from_plan(decodes)
        hidden_d, logits_d = self.forward(fb_d)
        if logits_d is None:  # (ran eagerly: never expected, a staged decode fits its graph)
            logits_d = self.model.compute_logits(hidden_d)
        fb_p = self.inputs.from_plan(prompts)
        hidden_p, _ = self.forward(fb_p)
        assert fb_p.logits_indices is not None
        logits = torch.cat([logits_d, self.model.compute_logits(hidden_p[fb_p.logits_indices])])
        last = fb_p.logits_indices  # each prompt piece's last token stands for its request
        seq_lens_cpu = torch.cat([fb_d.seq_lens_cpu, fb_p.seq_lens_cpu])
        joined = self.inputs.decode(
            input_ids=torch.cat([fb_d.input_ids, fb_p.input_ids[last]]),
            positions=torch.cat([fb_d.positions, fb_p.positions[last]]),
            rows=torch.cat([fb_d.req_pool_indices, fb_p.req_pool_indices]),
            seq_lens=torch.cat([fb_d.seq_lens, fb_p.seq_lens]), seq_lens_cpu=seq_lens_cpu.tolist(),
            slots=torch.cat([fb_d.out_cache_loc, fb_p.out_cache_loc[last]]))
        joined.logits_indices = torch.arange(joined.batch_size, device=logits.device)
        return joined, logits

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
