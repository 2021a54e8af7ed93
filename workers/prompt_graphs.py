"""CUDA graphs for prompt forwards: the model between its attention calls, per token-count bucket.

A prompt piece of T tokens runs eagerly at ~25 kernels a layer; on an H100 an eager 8B forward
of a few hundred tokens costs the host ~50 us a token against ~25 us of GPU time (BENCHMARKS.md,
"MIXED steps as a decode graph and a prefill"), so a MIXED step stalls every running request
for twice what its prompt tokens cost. Here each forward of up to `buckets[-1]` tokens runs as
the graphs of its bucket (the smallest captured size >= T, padded), cut at every attention call:
graph 0 is the embedding and layer 0 up to its attention, graph i the rest of layer i-1 and
layer i up to its attention, the last one the rest through the final norm. Attention, whose
kernels need this step's lengths on the host, runs eagerly between them on the real T tokens,
with this step's metadata (built once, as for an eager forward), and writes into the buffer the
next graph reads. A step then costs the host one graph launch a layer and the attention calls.

Capture runs the model's own forward over static inputs (ids, positions, slots: [3, max]
buffer, padded entries write slot 0 of the reserved page 0, as the decode graphs' do) with an
attention backend whose `forward` ends the graph being captured, notes its q, k, v and starts
the next. The q, k, v a graph leaves for attention are kept as views that do not own their
memory: a later graph of the same pool may reuse it, which is safe because replay runs the
graphs and attention calls in capture order and attention has read them by then (without this
every layer's qkv of every bucket would stay allocated). Graphs share the decode graphs' pool.

Models opt in (`piecewise_graphs = True`: every attention goes through the backend's
`forward`, nothing between two attention calls depends on host values of the batch: the Llama
family, DeepSeek V2/V3); EXTEND
batches only (a MIXED step reaches here split, `workers.pipeline`), not embedding batches or
encoder-decoder models. `use_graphs=False` runs the same static-buffer path eagerly (CPU tests
of the padding and the cut attention calls).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from workers.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from attention.base import AttentionBackend, AttentionLayer
    from workers.pipeline import ModelPipeline

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 768, 896, 1024, 1280, 1536, 2048)


class _Memory:
    """A device range as `__cuda_array_interface__`, for a tensor that does not own it."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


def unowned_view(t: torch.Tensor | None) -> torch.Tensor | None:
    """A view of `t` (same shape, strides, storage) that does not keep its memory allocated."""
    if t is None or not t.is_cuda:
        return t
    storage = t.untyped_storage()
    with torch.cuda.device(t.device):
        base = torch.as_tensor(_Memory(storage.data_ptr(), storage.nbytes()), device=t.device)
    return base.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())


@dataclass
class _Attend:
    """One cut: the attention call between two graphs, on the tensors the first left."""

    q: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    layer: AttentionLayer
    save_kv_cache: bool
    out: torch.Tensor  # what the next graph reads

    def run(self, backend: AttentionBackend, fb: ForwardBatch, n: int) -> None:
        k = None if self.k is None else self.k[:n]
        v = None if self.v is None else self.v[:n]
        self.out[:n].copy_(backend.forward(self.q[:n], k, v, self.layer, fb, save_kv_cache=self.save_kv_cache))


@dataclass
class _Bucket:
    size: int
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    cuts: list[_Attend] = field(default_factory=list)
    hidden: torch.Tensor | None = None  # the last graph's output [size, hidden]


def _abandon(graph: torch.cuda.CUDAGraph) -> None:
    """End `graph`'s capture if it is still open (a capture that raised), so that the stream is
    usable again; the graph is dropped."""
    if torch.cuda.is_current_stream_capturing():
        try:
            graph.capture_end()
        except RuntimeError:
            pass  # (an invalidated capture: ending it reports the original error again)


class _CutBackend:
    """The attention backend a static forward sees: every attribute is the real backend's but
    `forward`, which hands the call to the runner (`PromptGraphRunner._cut`)."""

    def __init__(self, backend: AttentionBackend, runner: PromptGraphRunner):
        self._backend = backend
        self._runner = runner

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return self._runner._cut(q, k, v, layer, save_kv_cache)


class PromptGraphRunner:
    def __init__(self, pipeline: ModelPipeline, buckets: tuple[int, ...] = DEFAULT_BUCKETS, *, pad_row: int,
                 pool=None, use_graphs: bool = True):
        self.pipeline = pipeline
        self.pad_row = pad_row  # the request row a static batch names (all zeros: the reserved page 0)
        self.use_graphs = use_graphs
        self.buckets = sorted(buckets)
        self.pool = pool
        device = pipeline.inputs.device
        # ids, positions, slots of the bucket being run, padded with zeros.
        self.static = torch.zeros(3, self.buckets[-1], dtype=torch.long, device=device)
        self.by_size: dict[int, _Bucket] = {}
        self._outs: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # attention outputs by (width, dtype)
        # What `_cut` does with an attention call: during capture, end one graph and begin the
        # next; eagerly, attend (the real batch `_fb`, `_n` tokens) or, warming up, nothing.
        self._capturing: _Bucket | None = None
        self._fb: ForwardBatch | None = None
        self._n = 0

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def can_run(self, fb: ForwardBatch) -> bool:
        return (fb.forward_mode == ForwardMode.EXTEND and not fb.is_embedding and fb.encoder_lens is None
                and 0 < fb.num_tokens <= self.max_tokens and (not self.use_graphs or bool(self.by_size)))

    def padded_size(self, n: int) -> int:
        """The bucket an n-token prompt batch runs as (its matrix products see this many rows)."""
        return next(b for b in self.buckets if b >= n)

    def _static_batch(self, size: int) -> ForwardBatch:
        """The batch a bucket's forward runs over: its static inputs as one prompt of `size`
        tokens on the pad row, with the attention backend that cuts (`_CutBackend`)."""
        p = self.pipeline
        ids, positions, slots = self.static[:, :size]
        one = torch.ones(1, dtype=torch.long, device=ids.device)
        fb = p.inputs.ragged(ForwardMode.EXTEND, input_ids=ids, positions=positions, rows=one * self.pad_row,
                             seq_lens=one * size, seq_lens_cpu=[size], slots=slots, extend=one * size,
                             extend_cpu=[size], prefix=one * 0, prefix_cpu=[0])
        return dataclasses.replace(fb, attn_backend=_CutBackend(p.attn_backend, self))

    def _out(self, q: torch.Tensor, layer: AttentionLayer, size: int) -> torch.Tensor:
        """The attention output the next graph reads: one buffer per width, shared by every
        layer and bucket (they run one at a time)."""
        key = (layer.num_heads * layer.out_head_dim, q.dtype)
        if key not in self._outs:
            self._outs[key] = torch.zeros(self.max_tokens, key[0], dtype=q.dtype, device=q.device)
        return self._outs[key][:size]

    def _cut(self, q, k, v, layer: AttentionLayer, save_kv_cache: bool) -> torch.Tensor:
        size = q.shape[0]
        bucket = self._capturing
        if bucket is not None:
            bucket.graphs[-1].capture_end()
            out = self._out(q, layer, size)
            bucket.cuts.append(_Attend(unowned_view(q), unowned_view(k), unowned_view(v), layer, save_kv_cache, out))
            graph = torch.cuda.CUDAGraph()
            bucket.graphs.append(graph)
            graph.capture_begin(pool=self.pool)
            return out
        out = self._out(q, layer, size)
        if self._fb is not None:  # eager static-buffer path: attend over the real tokens
            _Attend(q, k, v, layer, save_kv_cache, out).run(self.pipeline.attn_backend, self._fb, self._n)
        return out

    # ---------------- capture ----------------
    @torch.inference_mode()
    def capture(self) -> None:
        if not self.use_graphs:
            return
        p = self.pipeline
        t0, reserved = time.perf_counter(), torch.cuda.memory_reserved()
        stream = torch.cuda.Stream()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()  # every piece of every bucket captures into it
        for size in reversed(self.buckets):  # largest first: smaller ones reuse its memory
            fb = self._static_batch(size)
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up (compilation, autotuning, cuBLAS) outside any graph
                    p.model(fb.input_ids, fb.positions, fb)
            torch.cuda.synchronize()
            gc.collect()
            bucket = _Bucket(size, graphs=[torch.cuda.CUDAGraph()])
            self._capturing = bucket
            with torch.cuda.stream(stream):
                try:
                    bucket.graphs[0].capture_begin(pool=self.pool)
                    hidden = p.model(fb.input_ids, fb.positions, fb)
                    bucket.graphs[-1].capture_end()
                except Exception as e:
                    _abandon(bucket.graphs[-1])  # (on the capturing stream)
                    raise RuntimeError(f"capturing the prompt graphs of {size} tokens failed ({e}); "
                                       "MANTA_PROMPT_GRAPHS=0 runs prompt batches eagerly") from e
                finally:
                    self._capturing = None
            bucket.hidden = hidden
            self.by_size[size] = bucket
        torch.cuda.synchronize()
        p.kv_pool.write_count = 0  # capture wrote to the reserved page 0
        logger.info("captured prompt CUDA graphs for %s tokens (%d graphs each) in %.1f s, %.0f MiB more reserved",
                    self.buckets, len(self.by_size[self.buckets[0]].graphs), time.perf_counter() - t0,
                    (torch.cuda.memory_reserved() - reserved) / 2**20)

    # ---------------- replay ----------------
    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, hidden] of an EXTEND batch (`can_run`), whose attention metadata the
        backend has built."""
        n = fb.num_tokens
        size = self.padded_size(n)
        self.static[:, :n].copy_(torch.stack([fb.input_ids, fb.positions, fb.out_cache_loc.long()]))
        if size > n:
            self.static[:, n:size].zero_()
        if not self.use_graphs:
            self._fb, self._n = fb, n
            try:
                static = self._static_batch(size)
                return self.pipeline.model(static.input_ids, static.positions, static)[:n]
            finally:
                self._fb = None
        bucket = self.by_size[size]
        backend = self.pipeline.attn_backend
        for graph, cut in zip(bucket.graphs, bucket.cuts):
            graph.replay()
            cut.run(backend, fb, n)
        bucket.graphs[-1].replay()
        assert bucket.hidden is not None
        return bucket.hidden[:n]
