"""CUDA graphs for decode: capture the model's forward once per batch size, replay per step.

A batch of size b runs in the graph of the smallest captured size >= b, padded. Each captured
size has its inputs in one static [5, size] buffer (token ids, positions, request rows, sequence
lengths, KV slots: `INPUT_FIELDS`). Padded entries use request row `pad_row` (all zeros: slot 0
of the reserved page 0), seq_len = the backend's fill value and write their K/V to slot 0, so
they touch no live page.

Metadata in the graph (every model but encoder-decoder ones): the graph itself records the new
tokens' slots in the request table, resolves overlapped-scheduling placeholders from the
runner's `last_token` (on CUDA one kernel, `workers.decode_inputs_kernel`), and fills the
attention backend's static metadata buffers with the one builder (`build_attention_metadata`,
as in eager mode, which on CUDA writes them in one kernel; the backend's capture hook is called
inside the capture). A decode step then costs the host one pinned copy of its [5, size] inputs
(`stage_decode`, built straight from the plan) and one graph launch: on a slow host the ~30
small copies and gathers a step needed before ran longer than the GPU's work at batch 1.

Encoder-decoder models keep the host-side fill: their builder needs each request's encoder
length on the host, so it runs before each replay (`init_forward_metadata_replay_cuda_graph`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from workers.encoder_decoder import has_encoder_work
from workers.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from workers.messages import StepPlan

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
INPUT_FIELDS = ("input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc")


class CudaGraphRunner:
    def __init__(self, runner, batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES, pad_row: int = 0,
                 use_graphs: bool = True):
        """use_graphs=False runs the same static-buffer path eagerly (CPU tests of padding, the
        in-graph preparation and replay metadata; no torch.cuda.CUDAGraph involved)."""
        self.runner = runner
        self.use_graphs = use_graphs
        self.max_bs = max(b for b in batch_sizes if b <= self.most_rows(runner.opts))
        self.batch_sizes = sorted(b for b in batch_sizes if b <= self.max_bs)
        self.pad_row = pad_row
        dev = runner.device
        backend = runner.attn_backend
        self.metadata_in_graph = not runner.model_config.is_encoder_decoder
        backend.init_cuda_graph_state(self.max_bs, self.max_bs, metadata_in_graph=self.metadata_in_graph)
        self.fill = backend.get_cuda_graph_seq_len_fill_value()
        # What a padded entry holds, per input field.
        self.pad_values = (0, 0, pad_row, self.fill, 0)
        pad = torch.tensor(self.pad_values, dtype=torch.long, device=dev)[:, None]
        self.pad = pad.expand(len(INPUT_FIELDS), self.max_bs).contiguous()
        self.inputs = {bs: self.pad[:, :bs].clone() for bs in self.batch_sizes}
        self.arange = torch.arange(self.max_bs + 1, device=dev)
        # Encoder-decoder: each request's encoder length, per row (contract 4: replay fills the
        # whole batch; padded rows read `fill` encoder tokens of the reserved page 0).
        self.encoder_lens = (torch.full((self.max_bs,), self.fill, dtype=torch.int32, device=dev)
                             if runner.model_config.is_encoder_decoder else None)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Per batch size: (hidden [bs, H], logits [bs, vocab]); the LM head runs in the graph.
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pool = None
        self._staged: ForwardBatch | None = None  # the batch stage_decode wrote into the inputs
        if not use_graphs and not self.metadata_in_graph:  # eager replay needs the buffers to exist
            backend.init_forward_metadata_capture_cuda_graph(self.max_bs, self.max_bs,
                                                             self._static_batch(self.max_bs))

    @staticmethod
    def most_rows(opts) -> int:
        """The most rows a replay can have: one per running request, or with a draft model
        K + 1 per request (a speculative round's verify runs each of its tokens as a row)."""
        per_request = 1 + opts.speculative_num_tokens if opts.speculative_draft_model else 1
        return opts.max_running_requests * per_request

    def padded_size(self, bs: int) -> int:
        return next(b for b in self.batch_sizes if b >= bs)

    def _static_batch(self, bs: int) -> ForwardBatch:
        r = self.runner
        buf = self.inputs[bs]
        # The host lengths the builder sees: in the graph, every row's whole width (the kernels
        # mask by the device lengths); outside it, the fill value until replay sets them.
        host_len = r.req_to_token_pool.max_context_len if self.metadata_in_graph else self.fill
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            **{name: buf[i] for i, name in enumerate(INPUT_FIELDS)},
            seq_lens_cpu=torch.full((bs,), host_len, dtype=torch.int32),
            encoder_lens=None if self.encoder_lens is None else self.encoder_lens[:bs],
            encoder_lens_cpu=None if self.encoder_lens is None else [self.fill] * bs,
            req_to_token_pool=r.req_to_token_pool,
            kv_pool=r.kv_pool,
            attn_backend=r.attn_backend,
        )

    def _forward(self, bs: int, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """What a graph of size `bs` runs, over its static batch `fb`."""
        r = self.runner
        input_ids = fb.input_ids
        if self.metadata_in_graph:
            # The new tokens' slots in the request table, before the attention reads it (a
            # batch built elsewhere wrote them already: the same values again); overlapped
            # scheduling: a decode planned before its input was sampled reads its row's last
            # sampled token (cluster/engine/scheduler.py's placeholder). The draft model has none.
            req_to_token = r.req_to_token_pool.req_to_token
            last_token = getattr(r, "last_token", None)
            if input_ids.is_cuda and os.environ.get("MANTA_DECODE_PREP") != "0":  # one kernel, the five torch ops below
                from workers.decode_inputs_kernel import prepare_decode_inputs  # Triton: CUDA only

                input_ids = prepare_decode_inputs(input_ids, fb.positions, fb.req_pool_indices, fb.out_cache_loc,
                                                  req_to_token, last_token)
            else:
                req_to_token[fb.req_pool_indices, fb.positions] = fb.out_cache_loc.to(torch.int32)
                if last_token is not None:
                    input_ids = torch.where(input_ids < 0, last_token[fb.req_pool_indices], input_ids)
            r.attn_backend.init_forward_metadata_capture_cuda_graph(bs, bs, fb)
        hidden = r.model(input_ids, fb.positions, fb)
        return hidden, r.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        r = self.runner
        if not self.use_graphs:
            return
        stream = torch.cuda.Stream()
        for bs in reversed(self.batch_sizes):  # largest first: smaller graphs reuse its pool
            fb = self._static_batch(bs)
            if not self.metadata_in_graph:
                r.attn_backend.init_forward_metadata_capture_cuda_graph(bs, bs, fb)
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up (autotuning, compilation, static buffers) outside the graph
                    self._forward(bs, fb)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                out = self._forward(bs, fb)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
            self.outputs[bs] = out
        torch.cuda.synchronize()
        r.kv_pool.write_count = 0  # capture writes went to the reserved page 0
        logger.info("captured decode CUDA graphs for batch sizes %s (metadata %s the graph)", self.batch_sizes,
                    "inside" if self.metadata_in_graph else "outside")

    def can_run(self, fb: ForwardBatch) -> bool:
        # A step that admits encoder-decoder requests runs their encoder first: eager.
        return fb.forward_mode.is_decode() and fb.batch_size <= self.max_bs and not has_encoder_work(fb)

    def can_stage(self, plan: StepPlan) -> bool:
        return (self.metadata_in_graph and plan.mode.is_decode() and len(plan.reqs) <= self.max_bs
                and all(len(r.input_ids) == 1 for r in plan.reqs))

    def stage_decode(self, plan: StepPlan) -> ForwardBatch:
        """`plan`'s decode batch written straight into its graph's static inputs, padding
        included: one host tensor, one pinned non-blocking copy (see the module docstring).
        The batch's fields are views of the inputs; `replay` of it copies nothing more."""
        reqs = plan.reqs
        bs = len(reqs)
        padded = self.padded_size(bs)
        pad = [[v] * (padded - bs) for v in self.pad_values]
        positions = [r.prefix_len for r in reqs]
        host = torch.tensor([
            [r.input_ids[0] for r in reqs] + pad[0],
            positions + pad[1],
            [r.req_pool_idx for r in reqs] + pad[2],
            [p + 1 for p in positions] + pad[3],
            [r.out_cache_loc[0] for r in reqs] + pad[4],
        ], dtype=torch.long)
        buf = self.inputs[padded]
        buf.copy_(host.pin_memory() if buf.is_cuda else host, non_blocking=True)
        r = self.runner
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            **{name: buf[i, :bs] for i, name in enumerate(INPUT_FIELDS)},
            seq_lens_cpu=host[3, :bs].to(torch.int32),
            logits_indices=self.arange[:bs],
            req_to_token_pool=r.req_to_token_pool,
            kv_pool=r.kv_pool,
            attn_backend=r.attn_backend,
        )
        self._staged = fb
        return fb

    def replay(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [bs, H], logits [bs, vocab]) of a decode batch."""
        bs = fb.batch_size
        padded = self.padded_size(bs)
        buf = self.inputs[padded]
        if fb is not self._staged:  # built elsewhere (eager build, speculative rounds, the draft)
            buf[:, :bs].copy_(torch.stack([getattr(fb, name).long() for name in INPUT_FIELDS]))
            if padded > bs:
                buf[:, bs:].copy_(self.pad[:, : padded - bs])
        self._staged = None
        r = self.runner
        if not self.metadata_in_graph:
            pad_cpu = torch.full((padded - bs,), self.fill, dtype=torch.int32)
            static = replace(self._static_batch(padded), seq_lens_cpu=torch.cat([fb.seq_lens_cpu, pad_cpu]))
            if self.encoder_lens is not None:
                assert fb.encoder_lens is not None and fb.encoder_lens_cpu is not None
                self.encoder_lens[:bs].copy_(fb.encoder_lens)
                self.encoder_lens[bs:padded].fill_(self.fill)
                static.encoder_lens_cpu = list(fb.encoder_lens_cpu) + [self.fill] * (padded - bs)
            r.attn_backend.init_forward_metadata_replay_cuda_graph(padded, static)
        if not self.use_graphs:
            hidden, logits = self._forward(padded, self._static_batch(padded))
        else:
            self.graphs[padded].replay()
            hidden, logits = self.outputs[padded]
        return hidden[:bs], logits[:bs]
