"""The static metadata buffers of CUDA-graph replay, shared by every backend whose captured
kernels read a page table and per-request lengths (the MHA/GQA paged backends, MLA decode).

A capture allocates the buffers once (at the largest batch size) and each capture or replay
builds this step's metadata with the one builder (`build_attention_metadata`, as in eager mode)
and copies it into them; the captured kernels read only the buffers. Padded rows of a graph
batch read `get_cuda_graph_seq_len_fill_value()` tokens of the reserved page 0.

With `metadata_in_graph` the capture hook runs inside the graph capture: the builder's gather
and the copies into the buffers are recorded with the model and run at every replay from the
graph's static inputs (over the buffers' whole width: the kernels mask by the lengths), so a
step costs the host one input copy and one graph launch, and the replay hook is never called.
That build asks for the page table alone (decode kernels read nothing else), and on CUDA the
builder writes a decode batch straight into the buffers in one kernel (`into`), so a replay
runs no copies.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from attention.metadata import AttentionMetadata, build_attention_metadata

if TYPE_CHECKING:
    from workers.forward_batch import ForwardBatch


class GraphMetadataBuffers:
    """Mixin implementing the four CUDA-graph hooks of `AttentionBackend` over static buffers.
    The backend provides `page_size` and reads `self.metadata`."""

    page_size: int
    metadata: AttentionMetadata | None
    _graph_max_bs: int = 0
    _static: AttentionMetadata | None = None

    _in_graph: bool = False

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, metadata_in_graph: bool = False) -> None:
        self._graph_max_bs = max_bs
        self._in_graph = metadata_in_graph
        self._static: AttentionMetadata | None = None  # allocated at the first capture

    def _alloc_static(self, forward_batch: ForwardBatch) -> AttentionMetadata:
        return AttentionMetadata.static(self._graph_max_bs, forward_batch.req_to_token_pool.max_context_len,
                                        self.page_size, forward_batch.seq_lens.device, token_table=not self._in_graph,
                                        encoder=forward_batch.encoder_lens is not None)

    def _graph_view(self, bs: int) -> AttentionMetadata:
        assert self._static is not None
        return self._static.graph_view(bs)

    def _fill_static(self, bs: int, forward_batch: ForwardBatch) -> AttentionMetadata:
        """Build this step's metadata with the one builder, into the buffers the captured
        kernels read (a decode batch on CUDA: written in place; else copied)."""
        view = self._graph_view(bs)
        meta = build_attention_metadata(forward_batch, self.page_size, with_token_table=not self._in_graph, into=view)
        if meta.cache_seqlens_int32.data_ptr() == view.cache_seqlens_int32.data_ptr():
            return meta
        st = self._static
        assert st is not None
        st.cache_seqlens_int32[:bs].copy_(meta.cache_seqlens_int32)
        st.cu_seqlens_q[: bs + 1].copy_(meta.cu_seqlens_q)
        st.cu_seqlens_k[: bs + 1].copy_(meta.cu_seqlens_k)
        if meta.token_table is not None:
            assert st.token_table is not None
            st.token_table[:bs, : meta.token_table.shape[1]].copy_(meta.token_table)
        st.page_table[:bs, : meta.page_table.shape[1]].copy_(meta.page_table)
        if meta.encoder_token_table is not None:
            # Contract 4: every row's own encoder length and table, for the whole batch.
            assert st.encoder_lens_int32 is not None and st.encoder_cu_seqlens_k is not None
            assert st.encoder_token_table is not None and st.encoder_page_table is not None
            assert meta.encoder_lens_int32 is not None and meta.encoder_cu_seqlens_k is not None
            assert meta.encoder_page_table is not None
            st.encoder_lens_int32[:bs].copy_(meta.encoder_lens_int32)
            st.encoder_cu_seqlens_k[: bs + 1].copy_(meta.encoder_cu_seqlens_k)
            st.encoder_token_table[:bs, : meta.encoder_token_table.shape[1]].copy_(meta.encoder_token_table)
            st.encoder_page_table[:bs, : meta.encoder_page_table.shape[1]].copy_(meta.encoder_page_table)
        return meta

    def _replay_view(self, bs: int, meta: AttentionMetadata, forward_batch: ForwardBatch) -> AttentionMetadata:
        """The static buffers as this step's metadata. A decode graph's host-side lengths are
        static (its kernels read only the buffers). A ragged batch (TARGET_VERIFY,
        DRAFT_EXTEND_V2) through the static buffers takes this step's host-side q lengths and
        cache extents from the same builder (prefix + extend per request; max_seqlen_k =
        max_i(prefix_i + extend_i)): its kernels take them as arguments."""
        view = self._graph_view(bs)
        if forward_batch.forward_mode.is_decode():
            return view
        return dataclasses.replace(view, max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
                                   extend_seq_lens_cpu=meta.extend_seq_lens_cpu,
                                   cache_seqlens_cpu=meta.cache_seqlens_cpu)

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, num_tokens: int, forward_batch: ForwardBatch
    ) -> None:
        if self._static is None:
            self._static = self._alloc_static(forward_batch)
        self.metadata = self._replay_view(bs, self._fill_static(bs, forward_batch), forward_batch)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, forward_batch: ForwardBatch) -> None:
        assert not self._in_graph, "metadata_in_graph: the graph fills its metadata itself"
        self.metadata = self._replay_view(bs, self._fill_static(bs, forward_batch), forward_batch)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1
