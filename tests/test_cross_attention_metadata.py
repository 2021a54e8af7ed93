"""Contract 4 in units: per-request encoder lengths in the attention metadata (eager and through
the CUDA-graph capture/replay hooks on CPU static buffers, at several batch sizes, page sizes 1
and 16), and the scheduler's encoder pages (reserved before the decoder, never cached, freed
on finish and preemption).

The metadata cases give every request a different encoder length and decoder length, rows in a
shuffled order, and pages scattered over the pool, so an offset or extent taken from another
request (seeds/003: request 0's for everyone) shows up as a wrong slot or a wrong attention
output."""

from __future__ import annotations

import random

import pytest
import torch

from attention.base import AttentionLayer
from attention.flash import FlashAttentionBackend
from attention.metadata import build_attention_metadata, round_up
from attention.torch_ops import paged_attention_ref
from cluster.engine.request import Request
from cluster.engine.scheduler import RequestRejected, Scheduler
from workers.forward_batch import ForwardBatch, ForwardMode
from workers.memory_pool import ReqToTokenPool
from workers.messages import StepResult
from workers.sampling_params import SamplingParams

MAX_BS = 16
WIDTH = 2 * 64 + 16  # row width: encoder (<= 64, whole pages) + decoder (<= 64)
NUM_PAGES = 4096
LAYER = AttentionLayer(layer_id=0, num_heads=4, num_kv_heads=2, head_dim=8, scaling=8**-0.5)


class Batch:
    """Hand-built decode batch: request i in row rows[i] has enc[i] encoder slots at columns
    0.. and seq[i] decoder slots from column round_up(enc[i], P), on scattered pages."""

    def __init__(self, enc: list[int], seq: list[int], page_size: int, seed: int):
        rng = random.Random(seed)
        P, bs = page_size, len(enc)
        self.enc, self.seq, self.P = enc, seq, P
        self.pool = ReqToTokenPool(MAX_BS + 1, WIDTH, "cpu")
        need = sum(-(-e // P) + -(-s // P) for e, s in zip(enc, seq))
        pages = rng.sample(range(1, NUM_PAGES), need)  # page 0 stays reserved
        self.rows = rng.sample(range(MAX_BS), bs)
        self.enc_slots, self.dec_slots = [], []
        for i in range(bs):
            e_pages = [pages.pop() for _ in range(-(-enc[i] // P))]
            d_pages = [pages.pop() for _ in range(-(-seq[i] // P))]
            e = [p * P + t % P for t in range(enc[i]) for p in [e_pages[t // P]]]
            d = [p * P + t % P for t in range(seq[i]) for p in [d_pages[t // P]]]
            self.enc_slots.append(e)
            self.dec_slots.append(d)
            row = self.pool.req_to_token[self.rows[i]]
            row[: enc[i]] = torch.tensor(e, dtype=torch.int32)
            off = round_up(enc[i], P)
            row[off : off + seq[i]] = torch.tensor(d, dtype=torch.int32)
        # One pool size for every batch: replay reads stale (masked) slots of earlier ones.
        self.num_slots = NUM_PAGES * P

    def forward_batch(self) -> ForwardBatch:
        bs = len(self.enc)
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=torch.zeros(bs, dtype=torch.long),
            positions=torch.tensor(self.seq) - 1, req_pool_indices=torch.tensor(self.rows),
            seq_lens=torch.tensor(self.seq, dtype=torch.int32), seq_lens_cpu=torch.tensor(self.seq, dtype=torch.int32),
            out_cache_loc=torch.tensor([d[-1] for d in self.dec_slots]),
            encoder_lens=torch.tensor(self.enc, dtype=torch.int32), encoder_lens_cpu=list(self.enc),
            req_to_token_pool=self.pool)


def cases(bs: int, seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    enc = rng.sample(range(1, 65), bs)  # all different, request 0 not the longest
    return enc, [rng.randint(1, 64) for _ in range(bs)]


def check_fields(meta, b: Batch, bs: int) -> None:
    """The valid region of every per-request field is request i's own (columns past a
    request's length are never read: the kernels mask them by the lengths)."""
    P = b.P
    assert meta.encoder_lens_int32[:bs].tolist() == b.enc
    cu = meta.encoder_cu_seqlens_k[: bs + 1].tolist()
    assert cu == [sum(b.enc[:i]) for i in range(bs + 1)]
    assert meta.cache_seqlens_int32[:bs].tolist() == b.seq
    for i in range(bs):
        e, s = b.enc[i], b.seq[i]
        assert meta.encoder_token_table[i, :e].tolist() == b.enc_slots[i]
        assert meta.encoder_page_table[i, : -(-e // P)].tolist() == [x // P for x in b.enc_slots[i][::P]]
        assert meta.token_table[i, :s].tolist() == b.dec_slots[i], f"self-attention offset of request {i}"
        assert meta.page_table[i, : -(-s // P)].tolist() == [x // P for x in b.dec_slots[i][::P]]


def check_attention(backend, b: Batch, bs: int, seed: int) -> None:
    """Cross- and self-attention outputs through the backend's current metadata equal naive
    attention over each request's own slots."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b.num_slots, 2, 8, generator=g)
    v = torch.randn(b.num_slots, 2, 8, generator=g)
    q = torch.randn(bs, 4, 8, generator=g)
    meta = backend.metadata
    for view, slots in ((meta.encoder_view(), b.enc_slots), (meta, b.dec_slots)):
        got = backend._decode_kernel(q, k, v, view, LAYER)
        table = torch.zeros(bs, max(len(x) for x in slots), dtype=torch.long)
        for i, x in enumerate(slots):
            table[i, : len(x)] = torch.tensor(x)
        want = paged_attention_ref(q, k, v, table, [1] * bs, [len(x) for x in slots], LAYER.scaling, False)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("bs", [1, 3, 8, 16])
def test_eager_metadata_is_per_request(page_size, bs):
    b = Batch(*cases(bs, seed=bs), page_size=page_size, seed=bs)
    meta = build_attention_metadata(b.forward_batch(), page_size)
    assert meta.encoder_max_seqlen_k == max(b.enc)
    assert meta.encoder_lens_cpu == b.enc
    check_fields(meta, b, bs)
    backend = FlashAttentionBackend(page_size)
    backend.init_forward_metadata(b.forward_batch())
    check_attention(backend, b, bs, seed=bs)


@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_capture_and_replay_fill_every_row(page_size):
    """One backend, captured once at MAX_BS, then replayed at several batch sizes in turn (each
    over stale buffers of the previous, larger or smaller, batch): the static views hold each
    request's own encoder length, tables and self-attention offset, and attention through them
    equals the eager path's."""
    backend = FlashAttentionBackend(page_size)
    backend.init_cuda_graph_state(MAX_BS, MAX_BS)
    capture = Batch([1] * MAX_BS, [1] * MAX_BS, page_size, seed=0)
    backend.init_forward_metadata_capture_cuda_graph(MAX_BS, MAX_BS, capture.forward_batch())
    assert backend.metadata.encoder_lens_int32 is not None
    for bs in (16, 3, 8, 1, 13, 2):
        b = Batch(*cases(bs, seed=100 + bs), page_size=page_size, seed=100 + bs)
        backend.init_forward_metadata_replay_cuda_graph(bs, b.forward_batch())
        view = backend.metadata
        assert view.encoder_token_table.data_ptr() == backend._static.encoder_token_table.data_ptr()
        check_fields(view, b, bs)
        check_attention(backend, b, bs, seed=bs)


# ------------------------------------------------------------------------------------------------
# Scheduler: encoder pages
# ------------------------------------------------------------------------------------------------


def scheduler(**kw) -> Scheduler:
    args = dict(num_pages=41, page_size=4, max_running_requests=8, max_num_batched_tokens=24,
                chunked_prefill_size=16, max_context_len=64, eos_token_ids=(2,))
    args.update(kw)
    return Scheduler(**args)


def encdec(rid: str, n: int, max_tokens: int = 3) -> Request:
    return Request(rid, [2], SamplingParams(max_tokens=max_tokens), encoder_ids=list(range(10, 10 + n)))


def step(s: Scheduler, token: int = 7):
    plan = s.schedule()
    assert plan is not None
    res = StepResult(plan.step_id)
    for r in plan.reqs:
        if r.sample:
            res.sampled_rids.append(r.rid)
            res.next_token_ids.append(token)
            res.logprobs.append(None)
    s.process_result(plan, res)
    s.check_integrity()
    return plan


def test_encoder_pages_reserved_before_decoder_and_counted_in_budget():
    s = scheduler()
    s.add_request(encdec("a", 10))
    s.add_request(encdec("b", 13))  # 10 + 1 + 13 + 1 > 24 tokens: waits a step
    plan = step(s)
    assert [r.rid for r in plan.reqs] == ["a"]
    (row, start, slots), = plan.table_writes
    a = s.requests["a"]
    assert (row, start) == (a.req_pool_idx, 0) and len(slots) == 10
    assert len(a.encoder_pages) == 3 and {x // 4 for x in slots} == set(a.encoder_pages)
    assert plan.reqs[0].encoder_len == 10 and plan.reqs[0].prefix_len == 0
    assert set(a.encoder_pages).isdisjoint(x // 4 for x in plan.reqs[0].out_cache_loc)
    assert plan.new_requests[0].encoder_ids == list(range(10, 20))
    plan = step(s)
    assert [r.rid for r in plan.reqs] == ["a", "b"] and plan.new_requests[0].rid == "b"
    assert [r.encoder_len for r in plan.reqs] == [10, 13]
    assert plan.mode == ForwardMode.DECODE  # two one-token pieces (the runner still runs b's encoder)
    while s.has_work():
        step(s)
    # Nothing was cached (prefix cache on, but never for encoder-decoder requests).
    assert s.radix.total_cached_pages == 0
    assert s.allocator.num_free == s.allocator.num_total


def test_an_encoder_longer_than_the_prompt_cap_still_gets_a_step():
    s = scheduler(mixed_prefill_tokens=4)
    s.add_request(encdec("a", 10, max_tokens=8))
    step(s)
    s.add_request(encdec("b", 13))  # its encoder runs whole: more than the 4 tokens beside a's decode
    plan = step(s)
    assert [r.rid for r in plan.reqs] == ["a", "b"] and plan.reqs[1].encoder_len == 13


def test_preempted_request_frees_and_recomputes_its_encoder():
    s = scheduler(num_pages=9, max_num_batched_tokens=64)  # 8 pages of 4 tokens
    s.add_request(encdec("a", 9, max_tokens=6))  # 3 encoder pages + decoder pages
    s.add_request(encdec("b", 9, max_tokens=6))
    first = step(s)
    assert len(first.new_requests) == 2
    for _ in range(5):
        step(s)
    assert s.stats.preemptions > 0
    readmitted = [p for p in iter(lambda: step(s) if s.has_work() else None, None) if p.new_requests]
    assert readmitted and all(nr.encoder_ids == list(range(10, 19)) for p in readmitted for nr in p.new_requests)
    again = readmitted[0]
    r = next(x for x in again.reqs if x.rid == again.new_requests[0].rid)
    assert r.prefix_len == 0 and len(r.input_ids) > 1  # decoder start + outputs recomputed
    assert s.allocator.num_free == s.allocator.num_total


def test_encoder_input_rejections():
    s = scheduler(num_pages=5)
    with pytest.raises(RequestRejected, match="encoder takes at most 64"):
        s.add_request(encdec("long", 65))
    with pytest.raises(RequestRejected, match="one step"):
        scheduler(max_num_batched_tokens=8).add_request(encdec("wide", 8))
    with pytest.raises(RequestRejected, match="KV cache"):
        s.add_request(encdec("big", 16))  # 4 encoder pages + 1 decoder page > 4 pages
    with pytest.raises(RequestRejected, match="empty"):
        s.add_request(encdec("none", 0))
    assert not s.has_work()
