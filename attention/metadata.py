"""Per-step attention metadata, built by one function for the eager path and graph replay, and
every view of it (a CUDA graph's static buffers and their per-batch view, the decodes of a MIXED
batch, the encoder view of cross-attention) by the methods of `AttentionMetadata`.

Cache extents follow the forward mode: in DRAFT_EXTEND_V2 `seq_lens` is the prefix before
this step's write, so the attention reads prefix + extend per request and
max_seqlen_k = max_i(prefix_i + extend_i) — never max(prefix) + max(extend).

Encoder-decoder requests keep their cross-attention K/V in the first `encoder_lens[i]`
req_to_token columns of their own row (rounded up to a whole page), so the self-attention
columns of request i start at its own offset, never at request 0's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from workers.forward_batch import ForwardBatch


def round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


@dataclass
class AttentionMetadata:
    # [B] tokens of KV each request's new tokens attend over (prefix + extend).
    cache_seqlens_int32: torch.Tensor
    # [B+1] offsets of each request's new tokens in the flattened batch.
    cu_seqlens_q: torch.Tensor
    # [B+1] offsets of each request's cached tokens (prefix + extend).
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    # [B, max_seqlen_k] KV slot of each cached token (columns past a request's length are
    # stale and must be masked by cache_seqlens_int32). None where the builder was asked for
    # the page table alone (decode graphs whose metadata is filled inside the graph).
    token_table: torch.Tensor | None
    # [B, ceil(max_seqlen_k / P)] page ids: column j holds tokens [j*P, (j+1)*P).
    page_table: torch.Tensor
    # [B] new tokens per request and their prefix lengths (all 1 / seq_len-1 for decode).
    extend_seq_lens_cpu: list[int]
    cache_seqlens_cpu: list[int]
    # Encoder-decoder only (None otherwise).
    encoder_lens_int32: torch.Tensor | None = None
    encoder_cu_seqlens_k: torch.Tensor | None = None
    encoder_max_seqlen_k: int = 0
    encoder_token_table: torch.Tensor | None = None
    encoder_page_table: torch.Tensor | None = None
    encoder_lens_cpu: list[int] | None = None

    @classmethod
    def static(cls, n: int, width: int, page_size: int, device, *, token_table: bool, encoder: bool) -> AttentionMetadata:
        """Static buffers for up to `n` decode rows of `width` cached tokens (CUDA-graph replay:
        `attention.graph_buffers`); `graph_view` gives a batch's view of them."""
        i32 = dict(dtype=torch.int32, device=device)
        pages = (width + page_size - 1) // page_size
        enc: dict = {}
        if encoder:  # encoder-decoder: per-request encoder fields
            enc = dict(encoder_lens_int32=torch.ones(n, **i32), encoder_cu_seqlens_k=torch.arange(n + 1, **i32),
                       encoder_max_seqlen_k=width, encoder_token_table=torch.zeros(n, width, **i32),
                       encoder_page_table=torch.zeros(n, pages, **i32), encoder_lens_cpu=[width] * n)
        return cls(cache_seqlens_int32=torch.ones(n, **i32), cu_seqlens_q=torch.arange(n + 1, **i32),
                   cu_seqlens_k=torch.zeros(n + 1, **i32), max_seqlen_q=1, max_seqlen_k=width,
                   token_table=torch.zeros(n, width, **i32) if token_table else None,
                   page_table=torch.zeros(n, pages, **i32), extend_seq_lens_cpu=[1] * n, cache_seqlens_cpu=[width] * n,
                   **enc)

    def graph_view(self, bs: int, max_seqlen_k: int | None = None, cache_seqlens_cpu: list[int] | None = None,
                   pages: int | None = None) -> AttentionMetadata:
        """The first `bs` decode rows of static buffers (`static`). Their host-side lengths are
        the buffers' whole width unless given (kernels mask by `cache_seqlens_int32`)."""
        enc: dict = {}
        if self.encoder_lens_int32 is not None:
            assert self.encoder_cu_seqlens_k is not None and self.encoder_token_table is not None
            assert self.encoder_page_table is not None
            enc = dict(encoder_lens_int32=self.encoder_lens_int32[:bs],
                       encoder_cu_seqlens_k=self.encoder_cu_seqlens_k[: bs + 1],
                       encoder_max_seqlen_k=self.encoder_max_seqlen_k,  # static: masked by encoder_lens_int32
                       encoder_token_table=self.encoder_token_table[:bs],
                       encoder_page_table=self.encoder_page_table[:bs],
                       encoder_lens_cpu=[self.encoder_max_seqlen_k] * bs)
        return AttentionMetadata(
            cache_seqlens_int32=self.cache_seqlens_int32[:bs], cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            cu_seqlens_k=self.cu_seqlens_k[: bs + 1], max_seqlen_q=1 if bs else 0,
            max_seqlen_k=self.max_seqlen_k if max_seqlen_k is None else max_seqlen_k,
            token_table=None if self.token_table is None else self.token_table[:bs],
            page_table=self.page_table[:bs] if pages is None else self.page_table[:bs, :pages],
            extend_seq_lens_cpu=[1] * bs,
            cache_seqlens_cpu=[self.max_seqlen_k] * bs if cache_seqlens_cpu is None else cache_seqlens_cpu, **enc)

    def decode_rows(self, rows: list[int]) -> AttentionMetadata:
        """Requests `rows` (one new token each: the decodes of a MIXED batch) as a batch of
        their own."""
        dev = self.cache_seqlens_int32.device
        idx = torch.tensor(rows, device=dev)
        lens = self.cache_seqlens_int32[idx]
        return AttentionMetadata(
            cache_seqlens_int32=lens, cu_seqlens_q=torch.arange(len(rows) + 1, device=dev, dtype=torch.int32),
            cu_seqlens_k=_pad_cumsum(lens), max_seqlen_q=1,
            max_seqlen_k=max(self.cache_seqlens_cpu[i] for i in rows),
            token_table=None if self.token_table is None else self.token_table[idx], page_table=self.page_table[idx],
            extend_seq_lens_cpu=[1] * len(rows), cache_seqlens_cpu=[self.cache_seqlens_cpu[i] for i in rows])

    def encoder_view(self) -> AttentionMetadata:
        """The step's metadata as cross-attention reads it: each request's encoder K/V (its own
        encoder_lens[i] keys at the start of its row) in place of its self-attention cache."""
        assert self.encoder_lens_int32 is not None and self.encoder_token_table is not None
        assert self.encoder_page_table is not None and self.encoder_cu_seqlens_k is not None
        assert self.encoder_lens_cpu is not None
        return AttentionMetadata(
            cache_seqlens_int32=self.encoder_lens_int32, cu_seqlens_q=self.cu_seqlens_q,
            cu_seqlens_k=self.encoder_cu_seqlens_k, max_seqlen_q=self.max_seqlen_q,
            max_seqlen_k=self.encoder_max_seqlen_k, token_table=self.encoder_token_table,
            page_table=self.encoder_page_table, extend_seq_lens_cpu=self.extend_seq_lens_cpu,
            cache_seqlens_cpu=self.encoder_lens_cpu)


def _pad_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(torch.cumsum(x, dim=0, dtype=torch.int32), (1, 0))


def encoder_columns(encoder_lens_cpu: list[int], page_size: int) -> list[int]:
    """req_to_token columns reserved for each request's encoder K/V (whole pages)."""
    return [round_up(e, page_size) for e in encoder_lens_cpu]


def build_attention_metadata(fb: ForwardBatch, page_size: int, *, with_token_table: bool = True,
                             into: AttentionMetadata | None = None) -> AttentionMetadata:
    """The one builder of attention metadata for every mode, eager or graph replay.

    `with_token_table=False` builds the page table straight from the request table's page columns
    and no token table: what a decode graph reads, at 1/page_size of the gather (a decode graph
    whose metadata is filled inside the graph gathers its whole static width every step).

    `into` (a graph's static buffers, `attention.graph_buffers`): where a decode batch without a
    token table on CUDA is written in place by one kernel (`attention.decode_metadata_kernel`);
    the result then holds `into`'s tensors. Elsewhere the caller copies the result into them."""
    assert fb.req_to_token_pool is not None
    device = fb.seq_lens.device
    bs = fb.batch_size
    if (into is not None and not with_token_table and fb.forward_mode.is_decode() and fb.encoder_lens is None
            and device.type == "cuda"):
        return _decode_in_place(fb, page_size, into)
    if fb.forward_mode.is_decode():
        extend_cpu = [1] * bs
        extend = torch.ones(bs, dtype=torch.int32, device=device)
    else:
        assert fb.extend_seq_lens is not None and fb.extend_seq_lens_cpu is not None
        extend_cpu = list(fb.extend_seq_lens_cpu)
        extend = fb.extend_seq_lens.to(torch.int32)
    seq_lens = fb.seq_lens.to(torch.int32)
    seq_lens_cpu = fb.seq_lens_cpu.tolist()
    if fb.forward_mode.seq_lens_include_extend():
        cache_lens = seq_lens
        cache_cpu = seq_lens_cpu
    else:
        # DRAFT_EXTEND_V2: seq_lens is the prefix; the rows just written are read too.
        cache_lens = seq_lens + extend
        cache_cpu = [s + e for s, e in zip(seq_lens_cpu, extend_cpu)]
    max_k = max(cache_cpu) if cache_cpu else 0
    max_q = max(extend_cpu) if extend_cpu else 0

    req_to_token = fb.req_to_token_pool.req_to_token
    row_idx = fb.req_pool_indices.long()
    width = max(max_k, 1)
    enc_fields: dict = {}
    token_table: torch.Tensor | None = None
    if fb.encoder_lens is not None:
        assert fb.encoder_lens_cpu is not None and with_token_table, "encoder-decoder metadata needs the token table"
        rows = req_to_token[row_idx]
        enc_cpu = list(fb.encoder_lens_cpu)
        enc_cols = torch.tensor(encoder_columns(enc_cpu, page_size), device=device, dtype=torch.long)
        max_enc = max(enc_cpu) if enc_cpu else 0
        enc_lens = fb.encoder_lens.to(torch.int32)
        enc_table = rows[:, : max(round_up(max_enc, page_size), page_size)]
        enc_fields = dict(
            encoder_lens_int32=enc_lens,
            encoder_cu_seqlens_k=_pad_cumsum(enc_lens),
            encoder_max_seqlen_k=max_enc,
            encoder_token_table=enc_table,
            encoder_page_table=(enc_table[:, ::page_size] // page_size),
            encoder_lens_cpu=enc_cpu,
        )
        # Per-request offset: request i's self-attention starts after its own encoder pages.
        cols = torch.arange(width, device=device)
        col_idx = (enc_cols[:, None] + cols[None, :]).clamp_(max=rows.shape[1] - 1)
        token_table = torch.gather(rows, 1, col_idx)
        page_table = token_table[:, ::page_size] // page_size
    elif with_token_table:  # gather only the columns read, not each row's whole width
        token_table = req_to_token[:, :width][row_idx]
        page_table = token_table[:, ::page_size] // page_size
    else:
        pages = (width + page_size - 1) // page_size
        page_table = req_to_token[:, ::page_size][:, :pages][row_idx] // page_size
    return AttentionMetadata(
        cache_seqlens_int32=cache_lens,
        cu_seqlens_q=_pad_cumsum(extend),
        cu_seqlens_k=_pad_cumsum(cache_lens),
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        token_table=token_table,
        page_table=page_table,
        extend_seq_lens_cpu=extend_cpu,
        cache_seqlens_cpu=cache_cpu,
        **enc_fields,
    )


def _decode_in_place(fb: ForwardBatch, page_size: int, into: AttentionMetadata) -> AttentionMetadata:
    """`build_attention_metadata` of a decode batch (page table only) written into `into`'s
    tensors by one kernel: the same values as the torch ops above (tests/test_decode_prep_kernels.py)."""
    from attention.decode_metadata_kernel import fill_decode_metadata  # Triton: CUDA installs only

    assert fb.req_to_token_pool is not None
    bs = fb.batch_size
    cache_cpu = fb.seq_lens_cpu.tolist()
    max_k = max(cache_cpu) if cache_cpu else 0
    pages = (max(max_k, 1) + page_size - 1) // page_size
    meta = into.graph_view(bs, max_seqlen_k=max_k, cache_seqlens_cpu=cache_cpu, pages=pages)
    fill_decode_metadata(fb.seq_lens, fb.req_pool_indices, fb.req_to_token_pool.req_to_token, page_size, pages,
                         meta.cache_seqlens_int32, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.page_table)
    return meta
