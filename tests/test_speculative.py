"""Speculative decoding with a draft model (cluster/engine/spec_scheduler.py, workers/spec_runner.py).

- DRAFT_EXTEND_V2 metadata of a skewed batch (a long prefix with a short extend, a short prefix
  with a long extend), field by field against a by-hand computation, eagerly and through the
  CUDA-graph capture/replay hooks (their static-buffer path runs on CPU); the attention output
  against a by-hand reference over prefix + extend, and a prefix-only read (the real bug) is
  shown to differ.
- Rejection sampling keeps the target's distribution (chi-square over many seeded draws).
- The engine: greedy tokens with speculation equal those without, token for token, for mixed
  batches with staggered arrivals, with a draft that agrees (a copy of the target) and one that
  does not (another random model with the same tokenizer); with radix-cache hits, chunked
  prefill, preemption, the static-buffer graph path, penalties/min_tokens/logprobs, stop
  conditions inside a round, the context limit, an MLA model, and TP=2.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from attention.base import AttentionLayer
from attention.flash import FlashAttentionBackend
from attention.reference import TorchReferenceBackend
from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from tests.fixtures import tiny_model_dir
from tests.test_engine import PROMPTS, greedy, run_staggered
from workers.forward_batch import ForwardBatch, ForwardMode
from workers.memory_pool import MHATokenToKVPool, ReqToTokenPool
from workers.rejection_sampler import greedy_verify, processed_probs, rejection_sample, row_generators
from workers.sampling_params import SamplingParams

SHARED = "In a distant land, far beyond the mountains and the rivers, there lived an old king who"
MIXED_PROMPTS = PROMPTS + [SHARED + " loved music", "Count: one two three four five six seven eight nine ten"]


# ------------------------------------------------------------------ DRAFT_EXTEND_V2 metadata

P = 4  # page size
PREFIX = [37, 3]  # request 0: long prefix, short extend; request 1: short prefix, long extend
EXTEND = [2, 9]


def skewed_batch(backend, pool: MHATokenToKVPool, r2t: ReqToTokenPool, prefix=PREFIX, extend=EXTEND, seed=0):
    """A DRAFT_EXTEND_V2 batch over two requests whose pages are a random permutation."""
    g = torch.Generator().manual_seed(seed)
    pages = (torch.randperm(pool.num_pages - 1, generator=g) + 1).tolist()
    slots_of: list[list[int]] = []
    for row, n in enumerate(p + e for p, e in zip(prefix, extend)):
        used = -(-n // P)
        mine, pages = pages[:used], pages[used:]
        slots = [mine[t // P] * P + t % P for t in range(n)]
        r2t.req_to_token[row, :n] = torch.tensor(slots, dtype=torch.int32)
        slots_of.append(slots)
    ext = torch.tensor(extend, dtype=torch.int32)
    fb = ForwardBatch(
        forward_mode=ForwardMode.DRAFT_EXTEND_V2,
        batch_size=2,
        input_ids=torch.zeros(sum(extend), dtype=torch.long),
        positions=torch.tensor([p + j for p, e in zip(prefix, extend) for j in range(e)]),
        req_pool_indices=torch.tensor([0, 1]),
        seq_lens=torch.tensor(prefix, dtype=torch.int32),  # the prefix *before* the write
        seq_lens_cpu=torch.tensor(prefix, dtype=torch.int32),
        out_cache_loc=torch.tensor([s for sl, p in zip(slots_of, prefix) for s in sl[p:]]),
        extend_seq_lens=ext,
        extend_seq_lens_cpu=list(extend),
        extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32),
        extend_prefix_lens_cpu=list(prefix),
        extend_start_loc=torch.nn.functional.pad(torch.cumsum(ext, 0, dtype=torch.int32), (1, 0)),
        req_to_token_pool=r2t,
        kv_pool=pool,
        attn_backend=backend,
    )
    return fb, slots_of


def check_fields(meta, slots_of, prefix=PREFIX, extend=EXTEND):
    """Every field against the by-hand values: the attention reads prefix + extend."""
    lens = [p + e for p, e in zip(prefix, extend)]
    assert meta.cache_seqlens_int32.tolist() == lens
    assert meta.cu_seqlens_k.tolist() == [0, lens[0], lens[0] + lens[1]]
    assert meta.cu_seqlens_q.tolist() == [0, extend[0], extend[0] + extend[1]]
    assert meta.max_seqlen_q == max(extend)
    assert meta.max_seqlen_k == max(lens)  # max_i(prefix_i + extend_i) ...
    assert meta.max_seqlen_k != max(prefix) + max(extend)  # ... not max(prefix) + max(extend)
    assert meta.extend_seq_lens_cpu == extend and meta.cache_seqlens_cpu == lens
    assert meta.token_table.shape[1] >= max(lens)
    for i, slots in enumerate(slots_of):
        assert meta.token_table[i, : lens[i]].tolist() == slots
        cols = -(-lens[i] // P)
        assert meta.page_table[i, :cols].tolist() == [slots[j * P] // P for j in range(cols)]


def reference_attention(q, k, v, pool, slots_of, layer, prefix=PREFIX, extend=EXTEND):
    """By hand: request i's new queries over its prefix (from the pool) + its new rows, causal."""
    out, start = [], 0
    rep = layer.num_heads // layer.num_kv_heads
    for i, (p, e) in enumerate(zip(prefix, extend)):
        pre = torch.tensor(slots_of[i][:p], dtype=torch.long)
        keys = torch.cat([pool.k_buffer[0][pre], k[start : start + e]]).repeat_interleave(rep, dim=1)
        vals = torch.cat([pool.v_buffer[0][pre], v[start : start + e]]).repeat_interleave(rep, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[start : start + e], keys) * layer.scaling
        mask = torch.arange(p + e)[None, :] > (p + torch.arange(e))[:, None]
        s = s.masked_fill(mask, -math.inf)
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vals).reshape(e, -1))
        start += e
    return torch.cat(out)


@pytest.mark.parametrize("backend_cls", [FlashAttentionBackend, TorchReferenceBackend])
def test_draft_extend_v2_metadata_and_attention_skewed_batch(backend_cls):
    torch.manual_seed(0)
    layer = AttentionLayer(layer_id=0, num_heads=4, num_kv_heads=2, head_dim=16, scaling=0.25)
    pool = MHATokenToKVPool(20, P, 1, 2, 16, torch.float32, "cpu")
    prefix_k, prefix_v = torch.randn_like(pool.k_buffer[0]), torch.randn_like(pool.v_buffer[0])
    r2t = ReqToTokenPool(3, 64, "cpu")
    backend = backend_cls(P)
    fb, slots_of = skewed_batch(backend, pool, r2t)
    T = sum(EXTEND)
    q, k, v = torch.randn(T, 4, 16), torch.randn(T, 2, 16), torch.randn(T, 2, 16)

    def attend():
        pool.k_buffer[0].copy_(prefix_k)
        pool.v_buffer[0].copy_(prefix_v)
        return backend.forward(q, k, v, layer, fb)

    pool.k_buffer[0].copy_(prefix_k)
    pool.v_buffer[0].copy_(prefix_v)
    ref = reference_attention(q, k, v, pool, slots_of, layer)

    # Eager.
    backend.init_forward_metadata(fb)
    check_fields(backend.metadata, slots_of)
    eager = attend()
    torch.testing.assert_close(eager, ref, atol=1e-5, rtol=1e-5)

    # The CUDA-graph hooks: capture with another skewed batch, replay with this one; the same
    # builder fills the static buffers.
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=32)
    other, _ = skewed_batch(backend, pool, ReqToTokenPool(3, 64, "cpu"), prefix=[5, 30], extend=[7, 1], seed=1)
    backend.init_forward_metadata_capture_cuda_graph(2, 8, other)
    check_fields(backend.metadata, _, prefix=[5, 30], extend=[7, 1])
    backend.init_forward_metadata_replay_cuda_graph(2, fb)
    check_fields(backend.metadata, slots_of)
    replayed = attend()
    torch.testing.assert_close(replayed, ref, atol=1e-5, rtol=1e-5)

    # The real bug: reading only the prefix (seq_lens taken as the whole extent) misses the rows
    # just written, and the output is wrong.
    backend.init_forward_metadata(replace(fb, forward_mode=ForwardMode.EXTEND))
    assert backend.metadata.cache_seqlens_int32.tolist() == PREFIX
    broken = attend()
    first = slice(0, EXTEND[0])  # request 0: its queries miss their own new keys
    assert (broken[first] - ref[first]).abs().max() > 1e-2
    assert not torch.allclose(torch.nan_to_num(broken), ref, atol=1e-3)


def test_target_verify_metadata_reads_seq_lens():
    """TARGET_VERIFY: seq_lens already counts the K + 1 new tokens."""
    pool = MHATokenToKVPool(20, P, 1, 2, 16, torch.float32, "cpu")
    r2t = ReqToTokenPool(3, 64, "cpu")
    backend = FlashAttentionBackend(P)
    fb, slots_of = skewed_batch(backend, pool, r2t)
    lens = [p + e for p, e in zip(PREFIX, EXTEND)]
    fb = replace(fb, forward_mode=ForwardMode.TARGET_VERIFY, seq_lens=torch.tensor(lens, dtype=torch.int32),
                 seq_lens_cpu=torch.tensor(lens, dtype=torch.int32))
    backend.init_forward_metadata(fb)
    check_fields(backend.metadata, slots_of)


# ------------------------------------------------------------------ acceptance

def test_greedy_verify_longest_prefix_plus_target_token():
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [1, 2, 3, 4]])
    drafts = torch.tensor([[5, 6, 7], [5, 9, 7], [0, 2, 3]])
    v = greedy_verify(target, drafts)
    assert v.num_accepted.tolist() == [3, 1, 0]
    assert v.next_token.tolist() == [8, 6, 1]


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs * n
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("seeded", [False, True])
def test_rejection_sampling_keeps_target_distribution(seeded):
    """Drafts from q, verification against p: the first emitted token is distributed as p_0 and,
    after an accepted first draft, the second as p_1 (with p_1 independent of the context here),
    for a q far from p. 20k rounds with fixed seeds; chi-square with V - 1 = 5 degrees of
    freedom stays under 25 (p < 2e-4 for a correct sampler)."""
    torch.manual_seed(0)
    B, K, V = 20000, 2, 6
    g = torch.Generator().manual_seed(1)
    p = torch.distributions.Dirichlet(torch.ones(V)).sample((K + 1,))
    p[0, 5] = 0.0  # a token the target never emits ...
    p[0] /= p[0].sum()
    q = torch.distributions.Dirichlet(torch.full((V,), 0.5)).sample((K,))
    q[0, 5] += 0.3  # ... that the draft likes
    q[0] /= q[0].sum()
    drafts = torch.stack([torch.multinomial(q[i], B, replacement=True, generator=g) for i in range(K)], dim=1)
    gens = row_generators([7 + i if seeded else None for i in range(B)], [0] * B, 0, torch.device("cpu"))
    v = rejection_sample(p.expand(B, K + 1, V), q.expand(B, K, V), drafts, gens)
    n = v.num_accepted
    first = torch.where(n >= 1, drafts[:, 0], v.next_token)
    assert _chi2(torch.bincount(first, minlength=V).float(), p[0]) < 25
    second = torch.where(n >= 2, drafts[:, 1], v.next_token)[n >= 1]
    assert second.numel() > 1000
    assert _chi2(torch.bincount(second, minlength=V).float(), p[1]) < 25
    # Acceptance rate of the first draft is sum_x min(p, q).
    assert abs((n >= 1).float().mean().item() - torch.minimum(p[0], q[0]).sum().item()) < 0.02


def test_processed_probs_follow_the_sampler_truncation():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    top_k = processed_probs(logits, [SamplingParams(temperature=1.0, top_k=2)])
    assert (top_k[0, 2:] == 0).all() and abs(top_k.sum().item() - 1) < 1e-6
    top_p = processed_probs(logits, [SamplingParams(temperature=1.0, top_p=0.5)])
    assert top_p[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    min_p = processed_probs(logits, [SamplingParams(temperature=1.0, min_p=0.3)])
    assert min_p[0, 0] > 0 and min_p[0, 1] > 0 and (min_p[0, 2:] == 0).all()


# ------------------------------------------------------------------ the engine

@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return {"target": tiny_model_dir(tmp_path_factory, "llama"),
            "other": tiny_model_dir(tmp_path_factory, "llama", seed=1)}


@pytest.fixture(scope="module")
def base_tokens(dirs):
    """Greedy tokens without speculation (the engine matches transformers: tests/test_engine.py)."""
    engine = Engine(EngineConfig(model=str(dirs["target"]), page_size=4))
    return {r.rid: r.token_ids for r in _named(run_staggered(engine, MIXED_PROMPTS, greedy()))}


def _named(results):
    for i, r in enumerate(results):
        r.rid = MIXED_PROMPTS[i]
    return results


def spec_engine(dirs, draft="target", k=3, **kw):
    return Engine(EngineConfig(model=str(dirs["target"]), speculative_draft_model=str(dirs[draft]),
                               speculative_num_tokens=k, **kw))


def check_pages_back(engine):
    sch = engine.scheduler
    sch.check_integrity()
    assert not sch.running and not sch.draft_lens
    assert sch.allocator.num_free + sch.radix.total_cached_pages == sch.allocator.num_total


def test_greedy_equal_with_agreeing_draft_and_radix_hits(dirs, base_tokens):
    """A copy of the target as the draft: every draft is accepted; a second pass over the same
    prompts hits the radix cache (for the draft's pool as well: the tokens stay equal)."""
    engine = spec_engine(dirs, "target", k=3, page_size=4)
    for _ in range(2):
        got = _named(run_staggered(engine, MIXED_PROMPTS, greedy()))
        assert {r.rid: r.token_ids for r in got} == base_tokens
    st = engine.scheduler.stats
    assert st.prefix_hit_tokens > 40
    assert st.spec_verify_requests > 0 and st.spec_accepted_tokens == st.spec_draft_tokens
    check_pages_back(engine)


@pytest.mark.parametrize("page_size,chunk", [(1, 8), (4, 2048)])
def test_greedy_equal_with_disagreeing_draft(dirs, base_tokens, page_size, chunk):
    """A different random model (same tokenizer) as the draft: few drafts accepted, the tokens
    are still the target's; also with chunked prefill of the longer prompts."""
    engine = spec_engine(dirs, "other", k=4, page_size=page_size, chunked_prefill_size=chunk,
                         max_num_batched_tokens=max(chunk, 64))
    got = _named(run_staggered(engine, MIXED_PROMPTS, greedy()))
    assert {r.rid: r.token_ids for r in got} == base_tokens
    st = engine.scheduler.stats
    assert st.spec_verify_requests > 0 and st.spec_accepted_tokens < st.spec_draft_tokens / 2
    check_pages_back(engine)


def test_greedy_equal_under_preemption(dirs, base_tokens):
    engine = spec_engine(dirs, "other", k=3, page_size=4, kv_cache_tokens=96)
    got = _named(run_staggered(engine, MIXED_PROMPTS, greedy()))
    assert {r.rid: r.token_ids for r in got} == base_tokens
    assert engine.scheduler.stats.preemptions > 0
    check_pages_back(engine)


def test_static_buffer_graph_path_equals_eager(dirs, base_tokens):
    """The GPU path run eagerly on CPU: the draft's decode steps and the ragged forwards (as one
    decode row per token) through CudaGraphRunner's static buffers and the replay hooks."""
    engine = spec_engine(dirs, "other", k=3, page_size=4, max_running_requests=16)
    runner = engine.workers.runner
    drafter = runner.drafter
    sizes = (1, 2, 4, 8, 16)
    runner.pipeline.use_graphs(runner.opts.most_rows, runner.pad_row, batch_sizes=sizes, capture=False)
    drafter.pipeline.use_graphs(runner.opts.most_rows, runner.pad_row, batch_sizes=sizes, capture=False)
    seen: dict[str, list[int]] = {"target": [], "draft": []}
    for name, gr in (("target", runner.pipeline.graphs), ("draft", drafter.pipeline.graphs)):
        original = gr.replay

        def spy(fb, original=original, log=seen[name]):
            log.append(fb.batch_size)
            return original(fb)

        gr.replay = spy
    got = _named(run_staggered(engine, MIXED_PROMPTS, greedy()))
    assert {r.rid: r.token_ids for r in got} == base_tokens
    assert any(b > 1 for b in seen["target"]) and seen["draft"]
    assert (runner.req_to_token_pool.req_to_token[runner.pad_row] == 0).all()


def test_graphs_cover_a_rounds_rows(dirs):
    """A verify runs (K + 1) rows per request: with 4 running requests and K = 3 the graphs
    reach 16 rows, not 4 (a round past the largest graph runs eagerly: on the H200, batch 16
    of an 8B target ran at 0.6x the plain decode until graphs covered it)."""
    engine = spec_engine(dirs, "other", k=3, page_size=4, max_running_requests=4)
    runner = engine.workers.runner
    gr = runner.pipeline.use_graphs(runner.opts.most_rows, runner.pad_row, batch_sizes=(1, 2, 4, 8, 16, 32),
                                    capture=False)
    assert gr.max_bs == 16
    plain = Engine(EngineConfig(model=str(dirs["target"]), page_size=4, max_running_requests=4)).workers.runner
    assert plain.pipeline.use_graphs(plain.opts.most_rows, plain.pad_row, batch_sizes=(1, 2, 4, 8, 16, 32),
                                     capture=False).max_bs == 4


def test_mla_target_and_draft(tmp_path_factory):
    """DeepSeek-V2 (MLA + MoE) as target and draft: the MLA backend's DRAFT_EXTEND_V2 and
    TARGET_VERIFY extents; a copy accepts every draft."""
    d = str(tiny_model_dir(tmp_path_factory, "deepseek_v2"))
    prompts = PROMPTS[:3]
    want = [r.token_ids for r in run_staggered(Engine(EngineConfig(model=d, page_size=4)), prompts, greedy(8))]
    engine = Engine(EngineConfig(model=d, page_size=4, speculative_draft_model=d, speculative_num_tokens=3))
    assert [r.token_ids for r in run_staggered(engine, prompts, greedy(8))] == want
    st = engine.scheduler.stats
    assert st.spec_accepted_tokens == st.spec_draft_tokens > 0


def test_penalties_min_tokens_and_logprobs_equal(dirs):
    """Per-position penalties and min_tokens inside a round (each row sees the drafts before
    it), and the target's logprobs of every emitted token."""
    params = SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.2,
                            min_tokens=6, logprobs=2)
    prompts = PROMPTS[:3]
    want = Engine(EngineConfig(model=str(dirs["target"]))).generate(prompts, params)
    got = spec_engine(dirs, "target", k=3).generate(prompts, params)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert [lp.top[0][0] for lp in g.logprobs] == [lp.top[0][0] for lp in w.logprobs]
        for a, b in zip(g.logprobs, w.logprobs):
            assert abs(a.token_logprob - b.token_logprob) < 1e-4


def test_stops_inside_a_round_drop_later_tokens(dirs, base_tokens):
    """eos-like stop token ids, max_tokens and stop strings cut a round's accepted tokens."""
    engine = spec_engine(dirs, "target", k=4)
    prompt = MIXED_PROMPTS[0]
    full = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert full.token_ids[:12] == base_tokens[prompt]
    stop_tok = full.token_ids[6]
    at = full.token_ids.index(stop_tok)
    stop_str = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    res = engine.generate(
        [prompt] * 3,
        [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_tok,)),
         SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
         SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=(stop_str,))],
    )
    assert res[0].token_ids == full.token_ids[: at + 1] and res[0].finish_reason == "stop"
    assert res[1].token_ids == full.token_ids[:7] and res[1].finish_reason == "length"
    assert res[2].finish_reason == "stop" and res[2].text == full.text[: full.text.index(stop_str)]
    assert res[2].token_ids == full.token_ids[: len(res[2].token_ids)] and len(res[2].token_ids) < 16
    check_pages_back(engine)


def test_context_limit_caps_the_round(dirs):
    engine = spec_engine(dirs, "target", k=4, max_context_len=16)
    res = engine.generate([list(range(5, 15))], greedy(50))[0]
    assert res.finish_reason == "length" and len(res.token_ids) == 6
    want = Engine(EngineConfig(model=str(dirs["target"]), max_context_len=16)).generate([list(range(5, 15))],
                                                                                        greedy(50))[0]
    assert res.token_ids == want.token_ids


def test_sampled_requests_are_seeded_and_complete(dirs):
    engine = spec_engine(dirs, "target", k=3)
    p = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=42, ignore_eos=True)
    a = engine.generate(PROMPTS[:2], p)
    b = engine.generate(PROMPTS[:2], p)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert all(len(r.token_ids) == 12 for r in a)
    assert engine.scheduler.stats.spec_accepted_tokens > 0


@pytest.mark.parametrize("draft", ["target", "other"])
def test_a_seeded_request_samples_what_it_samples_without_a_draft_in_any_batch(dirs, draft):
    """A seeded request's tokens do not depend on which of its steps ran as speculative rounds
    (the batch decides: a step with prompts in it is a plain decode): at each position it takes
    the token plain sampling draws, so it equals the engine without a draft model, alone or
    arriving among others (a draft that differs from the target only accepts less)."""
    p = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=42, ignore_eos=True)
    plain = Engine(EngineConfig(model=str(dirs["target"]))).generate(PROMPTS, p)
    engine = spec_engine(dirs, draft, k=3)
    alone = engine.generate(PROMPTS[:1], p)[0].token_ids
    staggered = run_staggered(engine, PROMPTS, p, arrive_every=1)
    assert alone == plain[0].token_ids
    assert [r.token_ids for r in staggered] == [r.token_ids for r in plain]
    if draft == "target":  # the same model with the same noise proposes what the target draws
        assert engine.scheduler.stats.spec_accepted_tokens > 0
    check_pages_back(engine)


def test_abort_during_a_round_frees_pages(dirs):
    engine = spec_engine(dirs, "target", k=3, page_size=1)
    rids = [engine.add_request(prompt, greedy(), lambda out: None) for prompt in PROMPTS[:3]]
    engine.step()  # prefill
    sch = engine.scheduler
    plan = sch.schedule()
    assert plan.mode == ForwardMode.TARGET_VERIFY and len(plan.reqs) == 3
    result = engine.workers.execute(plan)
    engine.abort(rids[1])  # while the round's result is on its way
    sch.process_result(plan, result)
    sch.check_integrity()
    while engine.has_work():
        engine.step()
    check_pages_back(engine)


def test_config_validation():
    with pytest.raises(ValueError, match="speculative_num_tokens"):
        EngineConfig(model="x", speculative_draft_model="y", speculative_num_tokens=0)
    with pytest.raises(ValueError, match="embeddings"):
        EngineConfig(model="x", speculative_draft_model="y", is_embedding=True)


def test_encoder_decoder_target_is_refused_at_start(tmp_path_factory, dirs):
    bart = tiny_model_dir(tmp_path_factory, "bart")
    with pytest.raises(ValueError, match="causal decoder targets"):
        Engine(EngineConfig(model=str(bart), speculative_draft_model=str(dirs["target"])))


def test_in_process_server_exports_spec_metrics(dirs):
    """The in-process client pushes the engine's speculative counters after every step."""
    import asyncio
    import re

    from cluster.api.metrics import ServerMetrics
    from cluster.engine.client import LocalEngineClient

    metrics = ServerMetrics()
    client = LocalEngineClient(spec_engine(dirs, "target", k=3, page_size=4), metrics=metrics)

    async def run() -> str:
        try:
            async for _ in client.generate_stream(MIXED_PROMPTS[0], greedy()):
                pass
            return metrics.render().decode()
        finally:
            await client.aclose()

    text = asyncio.run(run())
    drafted = re.search(r'manta:spec_draft_tokens_total\{replica="local"\} (\S+)', text)
    assert drafted and float(drafted.group(1)) > 0, text


def test_spec_metrics_exported():
    from cluster.api.metrics import ServerMetrics

    m = ServerMetrics()
    m.update_replica_stats("r0", {"spec_draft_tokens": 40, "spec_accepted_tokens": 30, "spec_verify_requests": 10})
    text = m.render().decode()
    assert 'manta:spec_draft_tokens_total{replica="r0"} 40.0' in text
    assert 'manta:spec_accepted_tokens_total{replica="r0"} 30.0' in text
    assert 'manta:spec_mean_acceptance_length{replica="r0"} 4.0' in text


@pytest.mark.slow
def test_tp2_greedy_equal_and_sampled_drafts_broadcast(dirs, base_tokens):
    """Both models sharded over the same two gloo ranks (torch multiprocessing). Sampled drafts
    are drawn on rank 0 and broadcast: seeded sampled requests give the tokens they give at
    TP=1 (without the broadcast rank 1 would feed different drafts and its K/V would diverge)."""
    sampling = SamplingParams(max_tokens=10, temperature=0.9, seed=3, ignore_eos=True)
    want = spec_engine(dirs, "other", k=3, page_size=4).generate(PROMPTS[:2], sampling)
    engine = spec_engine(dirs, "other", k=3, page_size=4, tp_size=2)
    try:
        got = _named(run_staggered(engine, MIXED_PROMPTS, greedy()))
        sampled = engine.generate(PROMPTS[:2], sampling)
    finally:
        engine.shutdown()
    assert {r.rid: r.token_ids for r in got} == base_tokens
    assert [r.token_ids for r in sampled] == [r.token_ids for r in want]
