"""The inputs of one model's forward passes on this rank, and the one place that packs them.

Every `ForwardBatch` on a rank is built here (`InputBatch._batch`):
- from a `StepPlan` (`from_plan`): one host buffer, one pinned non-blocking copy, the fields views
  of it; a plain decode that fits a captured graph goes straight into that graph's static inputs
  instead (`stage_decode`: the device's host side is slow, and eight small copies cost more than
  the decode step's attention);
- as the static batch a decode graph is captured over (`static_batch`);
- as one decode row per new token (`decode_rows`: a speculative round's ragged forwards through
  the decode graphs), and for the rest of a round (`workers.spec_inputs`);
- rebound to another model's pools (`rebind`: the draft model follows the target's batch).

The new tokens' slots go into the request table, and overlapped scheduling's placeholders (an
input id < 0: the token its row is still sampling) are resolved from `last_token`, by one rule,
`place`: one Triton kernel on CUDA (`workers.place_tokens_kernel`), torch elsewhere. It runs at
build time for eager batches and inside the graph for staged decodes.

The object owns the persistent device buffers of the pipeline: `last_token` (each row's last
sampled token; the target only) and the decode graphs' static inputs (`GraphInputs`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from workers import encoder_decoder
from workers.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from attention.base import AttentionBackend
    from workers.memory_pool import KVPool, ReqToTokenPool
    from workers.messages import StepPlan

# The per-row inputs of a decode graph, in the order of its static [5, size] buffer.
INPUT_FIELDS = ("input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc")


@dataclass
class GraphInputs:
    """The decode graphs' static inputs: one [5, size] buffer per captured size. A padded entry
    holds `pad_values`: request row `pad_row` (all zeros: slot 0 of the reserved page 0), seq_len
    = the attention backend's fill value, K/V written to slot 0, so it touches no live page."""

    batch_sizes: list[int]
    pad_values: tuple[int, ...]
    pad: torch.Tensor  # [5, max_bs]
    buffers: dict[int, torch.Tensor]  # size -> [5, size]
    arange: torch.Tensor  # [max_bs + 1]
    fill: int
    host_len: int  # the host lengths a static batch shows its metadata builder
    encoder_lens: torch.Tensor | None  # [max_bs] (encoder-decoder models)
    staged: ForwardBatch | None = None  # the batch stage_decode wrote into the buffers

    @property
    def max_bs(self) -> int:
        return self.batch_sizes[-1]

    def padded_size(self, bs: int) -> int:
        return next(b for b in self.batch_sizes if b >= bs)


class InputBatch:
    def __init__(self, *, device: torch.device, req_to_token_pool: ReqToTokenPool, kv_pool: KVPool,
                 attn_backend: AttentionBackend, page_size: int, is_encoder_decoder: bool = False,
                 last_token: torch.Tensor | None = None):
        self.device = device
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        self.attn_backend = attn_backend
        self.page_size = page_size
        self.is_encoder_decoder = is_encoder_decoder
        # Overlapped scheduling: each row's last sampled token (None: this model reads none).
        self.last_token = last_token
        self.graph: GraphInputs | None = None

    # ---------------- the one constructor ----------------
    def _batch(self, **fields: Any) -> ForwardBatch:
        return ForwardBatch(req_to_token_pool=self.req_to_token_pool, kv_pool=self.kv_pool,
                            attn_backend=self.attn_backend, **fields)

    def rebind(self, fb: ForwardBatch) -> ForwardBatch:
        """`fb` (another model's batch over the same request table) on this model's pools."""
        return dataclasses.replace(fb, kv_pool=self.kv_pool, attn_backend=self.attn_backend, extras={})

    def upload(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        """A host list on the device without waiting for the stream (pinned, non-blocking: a
        copy from pageable memory may wait for the stream to drain, which would stall the host
        behind the step in flight)."""
        host = torch.tensor(values, dtype=dtype)
        return host.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else host

    # ---------------- the one placement rule ----------------
    def place(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor,
              input_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """req_to_token[rows[i], cols[i]] = slots[i] for every new token i, and `input_ids` with
        each placeholder (< 0) replaced by its row's last sampled token."""
        req_to_token = self.req_to_token_pool.req_to_token
        if slots.is_cuda:
            from workers.place_tokens_kernel import place_tokens  # Triton: CUDA only

            return place_tokens(rows, cols, slots, req_to_token, input_ids, self.last_token)
        req_to_token[rows, cols] = slots.to(torch.int32)
        if input_ids is None or self.last_token is None:
            return input_ids
        return torch.where(input_ids < 0, self.last_token[rows], input_ids)

    # ---------------- batches ----------------
    def ragged(self, mode: ForwardMode, *, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
               seq_lens: torch.Tensor, seq_lens_cpu: list[int], slots: torch.Tensor, extend: torch.Tensor,
               extend_cpu: list[int], prefix: torch.Tensor, prefix_cpu: list[int], every_token: bool = False,
               is_embedding: bool = False) -> ForwardBatch:
        """A batch of several new tokens per request (any mode; a DECODE batch built this way
        carries its extend lengths as None). Its logits are read at each request's last new
        token, or at every token (`every_token`: a verify scores them all)."""
        extend = extend.to(torch.int32)
        start_loc = torch.nn.functional.pad(torch.cumsum(extend, 0, dtype=torch.int32), (1, 0))
        ragged = not mode.is_decode()
        return self._batch(
            forward_mode=mode, batch_size=len(seq_lens_cpu), input_ids=input_ids, positions=positions,
            req_pool_indices=rows, seq_lens=seq_lens.to(torch.int32),
            seq_lens_cpu=torch.tensor(seq_lens_cpu, dtype=torch.int32), out_cache_loc=slots,
            extend_seq_lens=extend if ragged else None, extend_seq_lens_cpu=extend_cpu if ragged else None,
            extend_prefix_lens=prefix.to(torch.int32) if ragged else None,
            extend_prefix_lens_cpu=prefix_cpu if ragged else None, extend_start_loc=start_loc,
            is_embedding=is_embedding, logits_indices=None if every_token else start_loc[1:].long() - 1,
        )

    def decode(self, *, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
               seq_lens: torch.Tensor, seq_lens_cpu: list[int], slots: torch.Tensor) -> ForwardBatch:
        """One new token per request (logits of every row)."""
        return self._batch(forward_mode=ForwardMode.DECODE, batch_size=len(seq_lens_cpu), input_ids=input_ids,
                           positions=positions, req_pool_indices=rows, seq_lens=seq_lens.to(torch.int32),
                           seq_lens_cpu=torch.tensor(seq_lens_cpu, dtype=torch.int32), out_cache_loc=slots)

    def from_plan(self, plan: StepPlan, is_embedding: bool = False) -> ForwardBatch:
        """`plan`'s batch on the device, its slots in the request table and its placeholders
        resolved (a staged decode: both left to its graph)."""
        g = self.graph
        # Staged decodes leave the request table and the metadata to their graph: not with an
        # encoder-decoder model, whose metadata is built on the host before each replay.
        if (g is not None and not self.is_encoder_decoder and plan.mode.is_decode() and len(plan.reqs) <= g.max_bs
                and all(len(r.input_ids) == 1 for r in plan.reqs)):
            return self.stage_decode(plan)
        reqs = plan.reqs
        ext = [len(r.input_ids) for r in reqs]
        prefix = [r.prefix_len for r in reqs]
        seq = [p + e for p, e in zip(prefix, ext)]
        bs, n = len(reqs), sum(ext)
        packed = self.upload(
            [t for r in reqs for t in r.input_ids]
            + [p + j for p, e in zip(prefix, ext) for j in range(e)]
            + [s for r in reqs for s in r.out_cache_loc]
            + [r.req_pool_idx for r in reqs] + seq + ext + prefix, torch.long)
        ids, positions, slots, rows, seq_lens, ext_t, prefix_t = packed.split([n, n, n, bs, bs, bs, bs])
        # An encoder-decoder request's decoder columns start after its own encoder pages.
        cols = (encoder_decoder.decoder_columns(plan, positions, ext_t, self.page_size)
                if self.is_encoder_decoder else positions)
        ids = self.place(rows.repeat_interleave(ext_t, output_size=n), cols, slots, ids)
        fb = self.ragged(plan.mode, input_ids=ids, positions=positions, rows=rows, seq_lens=seq_lens,
                         seq_lens_cpu=seq, slots=slots, extend=ext_t, extend_cpu=ext, prefix=prefix_t,
                         prefix_cpu=prefix, is_embedding=is_embedding)
        if self.is_encoder_decoder:
            encoder_decoder.attach(fb, plan, self.req_to_token_pool)
        return fb

    def decode_rows(self, fb: ForwardBatch) -> ForwardBatch:
        """A ragged batch (TARGET_VERIFY, DRAFT_EXTEND_V2) as one DECODE row per new token, for
        the decode graphs. The token at position p reads keys 0..p of its request: p + 1 keys,
        i.e. row j of request i reads prefix_i + j + 1 (the prefix and the rows before it, which
        the same forward writes first); over a request's rows that ends at prefix_i + extend_i,
        the extent `fb.cache_lens_cpu()` gives in every mode."""
        assert fb.extend_seq_lens is not None and fb.extend_seq_lens_cpu is not None
        assert fb.extend_prefix_lens_cpu is not None
        T = fb.num_tokens
        positions_cpu = [p + j for p, e in zip(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu) for j in range(e)]
        return self.decode(input_ids=fb.input_ids, positions=fb.positions,
                           rows=fb.req_pool_indices.repeat_interleave(fb.extend_seq_lens.long(), output_size=T),
                           seq_lens=fb.positions + 1, seq_lens_cpu=[p + 1 for p in positions_cpu],
                           slots=fb.out_cache_loc)

    # ---------------- the decode graphs' static inputs ----------------
    def init_graph_inputs(self, batch_sizes: list[int], fill: int, pad_row: int, host_len: int) -> GraphInputs:
        max_bs = batch_sizes[-1]
        pad_values = (0, 0, pad_row, fill, 0)
        pad = torch.tensor(pad_values, dtype=torch.long, device=self.device)[:, None]
        pad = pad.expand(len(INPUT_FIELDS), max_bs).contiguous()
        # Encoder-decoder: each request's encoder length, per row (contract 4: replay fills the
        # whole batch; padded rows read `fill` encoder tokens of the reserved page 0).
        enc = (torch.full((max_bs,), fill, dtype=torch.int32, device=self.device)
               if self.is_encoder_decoder else None)
        self.graph = GraphInputs(list(batch_sizes), pad_values, pad, {bs: pad[:, :bs].clone() for bs in batch_sizes},
                                 torch.arange(max_bs + 1, device=self.device), fill, host_len, enc)
        return self.graph

    def static_batch(self, bs: int) -> ForwardBatch:
        """The batch a graph of size `bs` runs over: views of its static inputs."""
        g = self.graph
        assert g is not None
        buf = g.buffers[bs]
        return self._batch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, **{name: buf[i] for i, name in enumerate(INPUT_FIELDS)},
            seq_lens_cpu=torch.full((bs,), g.host_len, dtype=torch.int32),
            encoder_lens=None if g.encoder_lens is None else g.encoder_lens[:bs],
            encoder_lens_cpu=None if g.encoder_lens is None else [g.fill] * bs,
        )

    def stage_decode(self, plan: StepPlan) -> ForwardBatch:
        """`plan`'s decode batch written straight into its graph's static inputs, padding
        included: one host tensor, one pinned non-blocking copy. The batch's fields are views of
        the inputs; the graph itself writes the request table and resolves the placeholders."""
        g = self.graph
        assert g is not None
        reqs = plan.reqs
        bs = len(reqs)
        padded = g.padded_size(bs)
        pad = [[v] * (padded - bs) for v in g.pad_values]
        positions = [r.prefix_len for r in reqs]
        host = torch.tensor([
            [r.input_ids[0] for r in reqs] + pad[0],
            positions + pad[1],
            [r.req_pool_idx for r in reqs] + pad[2],
            [p + 1 for p in positions] + pad[3],
            [r.out_cache_loc[0] for r in reqs] + pad[4],
        ], dtype=torch.long)
        buf = g.buffers[padded]
        buf.copy_(host.pin_memory() if buf.is_cuda else host, non_blocking=True)
        fb = self._batch(
            forward_mode=ForwardMode.DECODE, batch_size=bs,
            **{name: buf[i, :bs] for i, name in enumerate(INPUT_FIELDS)},
            seq_lens_cpu=host[3, :bs].to(torch.int32), logits_indices=g.arange[:bs],
        )
        g.staged = fb
        return fb

    def load_graph_inputs(self, fb: ForwardBatch) -> int:
        """Put decode batch `fb` in its graph's static inputs (a staged batch is there already;
        one built elsewhere is copied, padding included). Returns the graph's size."""
        g = self.graph
        assert g is not None
        bs = fb.batch_size
        padded = g.padded_size(bs)
        buf = g.buffers[padded]
        if fb is not g.staged:  # built elsewhere (an eager build, a speculative round, the draft)
            buf[:, :bs].copy_(torch.stack([getattr(fb, name).long() for name in INPUT_FIELDS]))
            if padded > bs:
                buf[:, bs:].copy_(g.pad[:, : padded - bs])
        g.staged = None
        if g.encoder_lens is not None:
            assert fb.encoder_lens is not None
            g.encoder_lens[:bs].copy_(fb.encoder_lens)
            g.encoder_lens[bs:padded].fill_(g.fill)
        return padded

    def host_lengths(self, fb: ForwardBatch, padded: int) -> ForwardBatch:
        """The static batch of size `padded` showing `fb`'s host-side lengths (what a replay
        whose metadata is built outside the graph gives the builder)."""
        g = self.graph
        assert g is not None
        pad = padded - fb.batch_size
        static = dataclasses.replace(self.static_batch(padded), seq_lens_cpu=torch.cat(
            [fb.seq_lens_cpu, torch.full((pad,), g.fill, dtype=torch.int32)]))
        if g.encoder_lens is not None:
            assert fb.encoder_lens_cpu is not None
            static.encoder_lens_cpu = list(fb.encoder_lens_cpu) + [g.fill] * pad
        return static
