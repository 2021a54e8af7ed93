"""CUDA graphs for decode: capture the model's forward once per batch size, replay per step.

The executor half of a rank's step pipeline (`workers.pipeline`): a batch of size b runs in the
graph of the smallest captured size >= b, padded. The graphs read their inputs from the static
buffers the pipeline's `InputBatch` owns (`GraphInputs`: one [5, size] buffer per size, padded
entries on the reserved page 0), which it fills when it stages a decode plan.

Metadata in the graph (every model but encoder-decoder ones): the graph itself records the new
tokens' slots in the request table and resolves overlapped-scheduling placeholders (the input
batch's one placement rule, `InputBatch.place`: on CUDA one kernel), and fills the attention
backend's static metadata buffers with the one builder (`build_attention_metadata`, as in eager
mode, which on CUDA writes them in one kernel; the backend's capture hook is called inside the
capture). A decode step then costs the host one pinned copy of its [5, size] inputs and one
graph launch: on a slow host the ~30 small copies and gathers a step needed before ran longer
than the GPU's work at batch 1.

Encoder-decoder models keep the host-side fill: their builder needs each request's encoder
length on the host, so it runs before each replay (`init_forward_metadata_replay_cuda_graph`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from workers.encoder_decoder import has_encoder_work
from workers.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from workers.pipeline import ModelPipeline

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


class CudaGraphRunner:
    def __init__(self, pipeline: ModelPipeline, max_rows: int, batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
                 pad_row: int = 0, use_graphs: bool = True):
        """use_graphs=False runs the same static-buffer path eagerly (CPU tests of padding, the
        in-graph preparation and replay metadata; no torch.cuda.CUDAGraph involved)."""
        self.pipeline = pipeline
        self.use_graphs = use_graphs
        self.max_bs = max(b for b in batch_sizes if b <= max_rows)
        self.batch_sizes = sorted(b for b in batch_sizes if b <= self.max_bs)
        backend = pipeline.attn_backend
        self.metadata_in_graph = not pipeline.is_encoder_decoder
        backend.init_cuda_graph_state(self.max_bs, self.max_bs, metadata_in_graph=self.metadata_in_graph)
        self.fill = backend.get_cuda_graph_seq_len_fill_value()
        # The host lengths the builder sees: in the graph, every row's whole width (the kernels
        # mask by the device lengths); outside it, the fill value until replay sets them.
        host_len = pipeline.req_to_token_pool.max_context_len if self.metadata_in_graph else self.fill
        self.inputs = pipeline.inputs.init_graph_inputs(self.batch_sizes, self.fill, pad_row, host_len)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Per batch size: (hidden [bs, H], logits [bs, vocab]); the LM head runs in the graph.
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pool = None
        if not use_graphs and not self.metadata_in_graph:  # eager replay needs the buffers to exist
            backend.init_forward_metadata_capture_cuda_graph(self.max_bs, self.max_bs,
                                                             pipeline.inputs.static_batch(self.max_bs))

    @property
    def encoder_lens(self) -> torch.Tensor | None:
        return self.inputs.encoder_lens

    def _forward(self, bs: int, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """What a graph of size `bs` runs, over its static batch `fb`."""
        p = self.pipeline
        input_ids = fb.input_ids
        if self.metadata_in_graph:
            # The new tokens' slots and the placeholders, before the attention reads the table
            # (a batch built elsewhere wrote the slots already: the same values again).
            input_ids = p.inputs.place(fb.req_pool_indices, fb.positions, fb.out_cache_loc, input_ids)
            p.attn_backend.init_forward_metadata_capture_cuda_graph(bs, bs, fb)
        hidden = p.model(input_ids, fb.positions, fb)
        return hidden, p.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        p = self.pipeline
        if not self.use_graphs:
            return
        stream = torch.cuda.Stream()
        for bs in reversed(self.batch_sizes):  # largest first: smaller graphs reuse its pool
            fb = p.inputs.static_batch(bs)
            if not self.metadata_in_graph:
                p.attn_backend.init_forward_metadata_capture_cuda_graph(bs, bs, fb)
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
        p.kv_pool.write_count = 0  # capture writes went to the reserved page 0
        logger.info("captured decode CUDA graphs for batch sizes %s (metadata %s the graph)", self.batch_sizes,
                    "inside" if self.metadata_in_graph else "outside")

    def can_run(self, fb: ForwardBatch) -> bool:
        # A step that admits encoder-decoder requests runs their encoder first: eager.
        return fb.forward_mode.is_decode() and fb.batch_size <= self.max_bs and not has_encoder_work(fb)

    def replay(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [bs, H], logits [bs, vocab]) of a decode batch."""
        p = self.pipeline
        padded = p.inputs.load_graph_inputs(fb)
        if not self.metadata_in_graph:
            p.attn_backend.init_forward_metadata_replay_cuda_graph(padded, p.inputs.host_lengths(fb, padded))
        if not self.use_graphs:
            hidden, logits = self._forward(padded, p.inputs.static_batch(padded))
        else:
            self.graphs[padded].replay()
            hidden, logits = self.outputs[padded]
        bs = fb.batch_size
        return hidden[:bs], logits[:bs]
