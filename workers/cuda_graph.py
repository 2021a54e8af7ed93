"""CUDA graphs for decode: capture the model's forward once per batch size, replay per step.

Inputs live in static buffers; a batch of size b runs in the graph of the smallest captured
size >= b, padded. Padded entries use request row `pad_row` (all zeros: slot 0 of the reserved
page 0), seq_len = the backend's fill value and write their K/V to slot 0, so they touch no
live page. The attention metadata for replay is built by the same function as in eager mode
(`build_attention_metadata`) and copied into the backend's static buffers by
`init_forward_metadata_replay_cuda_graph`.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from workers.encoder_decoder import has_encoder_work
from workers.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


class CudaGraphRunner:
    def __init__(self, runner, batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES, pad_row: int = 0,
                 use_graphs: bool = True):
        """use_graphs=False runs the same static-buffer path eagerly (CPU tests of padding and
        replay metadata; no torch.cuda.CUDAGraph involved)."""
        self.runner = runner
        self.use_graphs = use_graphs
        self.max_bs = max(b for b in batch_sizes if b <= runner.opts.max_running_requests)
        self.batch_sizes = sorted(b for b in batch_sizes if b <= self.max_bs)
        self.pad_row = pad_row
        dev = runner.device
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.long, device=dev)
        self.positions = torch.zeros(self.max_bs, dtype=torch.long, device=dev)
        self.req_pool_indices = torch.full((self.max_bs,), pad_row, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(self.max_bs, dtype=torch.int32, device=dev)
        self.out_cache_loc = torch.zeros(self.max_bs, dtype=torch.long, device=dev)
        self.fill = runner.attn_backend.get_cuda_graph_seq_len_fill_value()
        # Encoder-decoder: each request's encoder length, per row (contract 4: replay fills the
        # whole batch; padded rows read `fill` encoder tokens of the reserved page 0).
        self.encoder_lens = (torch.full((self.max_bs,), self.fill, dtype=torch.int32, device=dev)
                             if runner.model_config.is_encoder_decoder else None)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Per batch size: (hidden [bs, H], logits [bs, vocab]); the LM head runs in the graph.
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pool = None
        backend = runner.attn_backend
        backend.init_cuda_graph_state(self.max_bs, self.max_bs)
        self.fill = backend.get_cuda_graph_seq_len_fill_value()
        if not use_graphs:  # eager replay needs the static metadata buffers to exist
            backend.init_forward_metadata_capture_cuda_graph(self.max_bs, self.max_bs,
                                                             self._static_batch(self.max_bs))

    def _static_batch(self, bs: int) -> ForwardBatch:
        r = self.runner
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=torch.full((bs,), self.fill, dtype=torch.int32),
            out_cache_loc=self.out_cache_loc[:bs],
            encoder_lens=None if self.encoder_lens is None else self.encoder_lens[:bs],
            encoder_lens_cpu=None if self.encoder_lens is None else [self.fill] * bs,
            req_to_token_pool=r.req_to_token_pool,
            kv_pool=r.kv_pool,
            attn_backend=r.attn_backend,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        r = self.runner
        if not self.use_graphs:
            return
        stream = torch.cuda.Stream()
        for bs in reversed(self.batch_sizes):  # largest first: smaller graphs reuse its pool
            fb = self._static_batch(bs)
            r.attn_backend.init_forward_metadata_capture_cuda_graph(bs, bs, fb)
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up (autotuning, compilation) outside the graph
                    r.model.compute_logits(r.model(fb.input_ids, fb.positions, fb))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                hidden = r.model(fb.input_ids, fb.positions, fb)
                out = (hidden, r.model.compute_logits(hidden))
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
            self.outputs[bs] = out
        torch.cuda.synchronize()
        r.kv_pool.write_count = 0  # capture writes went to the reserved page 0
        logger.info("captured decode CUDA graphs for batch sizes %s", self.batch_sizes)

    def can_run(self, fb: ForwardBatch) -> bool:
        # A step that admits encoder-decoder requests runs their encoder first: eager.
        return fb.forward_mode.is_decode() and fb.batch_size <= self.max_bs and not has_encoder_work(fb)

    def replay(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [bs, H], logits [bs, vocab]) of a decode batch."""
        bs = fb.batch_size
        padded = next(b for b in self.batch_sizes if b >= bs)
        self.input_ids[:bs].copy_(fb.input_ids)
        self.positions[:bs].copy_(fb.positions)
        self.req_pool_indices[:bs].copy_(fb.req_pool_indices)
        self.seq_lens[:bs].copy_(fb.seq_lens)
        self.out_cache_loc[:bs].copy_(fb.out_cache_loc)
        if padded > bs:
            self.input_ids[bs:padded].zero_()
            self.positions[bs:padded].zero_()
            self.req_pool_indices[bs:padded].fill_(self.pad_row)
            self.seq_lens[bs:padded].fill_(self.fill)
            self.out_cache_loc[bs:padded].zero_()
        pad_cpu = torch.full((padded - bs,), self.fill, dtype=torch.int32)
        static = replace(
            self._static_batch(padded),
            seq_lens_cpu=torch.cat([fb.seq_lens_cpu, pad_cpu]),
        )
        if self.encoder_lens is not None:
            assert fb.encoder_lens is not None and fb.encoder_lens_cpu is not None
            self.encoder_lens[:bs].copy_(fb.encoder_lens)
            self.encoder_lens[bs:padded].fill_(self.fill)
            static.encoder_lens_cpu = list(fb.encoder_lens_cpu) + [self.fill] * (padded - bs)
        r = self.runner
        r.attn_backend.init_forward_metadata_replay_cuda_graph(padded, static)
        if not self.use_graphs:
            hidden = r.model(static.input_ids, static.positions, static)[:bs]
            return hidden, r.model.compute_logits(hidden)
        self.graphs[padded].replay()
        hidden, logits = self.outputs[padded]
        return hidden[:bs], logits[:bs]
