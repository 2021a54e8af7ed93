"""Hybrid linear/full-attention models (Kimi-Linear, Bailing hybrid) against `transformers`, and
the wrapper backend that delegates every hook (`attention.hybrid_linear`).

The tiny checkpoints have 4 layers: KDA linear attention at layers 0 and 2, MLA full attention
at 1 and 3 (dense MLP at layer 0, MoE after). transformers runs KDA through its torch reference
(chunked form for prefill, recurrent for decode: flash-linear-attention is not installed).

Tolerances (float32): logits within 1e-4 of transformers (its chunked KDA form and ours, the
recurrent form, round differently); within 1e-5 between two manta computations of the same
quantity (chunked vs one-step prefill); within 5e-5 between TP=2 and TP=1 (logits of size ~3
after four row-parallel all-reduces, MoE partial sums and KDA heads summed in another order).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from attention.base import AttentionBackend, AttentionLayer
from attention.flash import FlashAttentionBackend
from attention.hybrid_linear import HybridLinearAttnBackend
from attention.linear_attn import LinearAttentionBackend
from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from tests.fixtures import gloo_rank, tiny_model_dir
from tests.test_engine import MAX_NEW, PROMPTS, greedy, run_staggered
from tests.test_mla import CHUNK, Cache, _free_port, _load, _logits, _prompts
from workers.forward_batch import ForwardMode
from workers.messages import NewRequest, ScheduledReq, StepPlan
from workers.parallel import TPGroup
from workers.sampling_params import SamplingParams
from workers.state_pool import LinearStatePool

ATOL_HF = 1e-4
ATOL_SELF = 1e-5
ATOL_TP = 5e-5

VARIANTS = {
    "kimi": ("kimi_linear", {}),
    "kimi_qlora": ("kimi_linear", {"q_lora_rank": 16}),
    "bailing": ("bailing_hybrid", {}),
    "bailing_softplus": ("bailing_hybrid", {"kda_safe_gate": False}),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    def get(name: str) -> str:
        arch, kw = VARIANTS[name]
        return str(tiny_model_dir(tmp_path_factory, arch, layers=4, max_position=128, **kw))

    return get


class HybridCache(Cache):
    """`tests.test_mla.Cache` (request rows 0..B-1, scattered pages) with a state pool and the
    hybrid wrapper over the MLA and KDA backends."""

    def __init__(self, cfg, capacity: int, num_reqs: int, page_size: int = 4, chunk: int = CHUNK, tp_size: int = 1):
        super().__init__(cfg, capacity, num_reqs, page_size, chunk)
        self.states = LinearStatePool.for_model(cfg, tp_size, num_reqs, torch.float32, "cpu")
        self.full = self.backend
        self.backend = HybridLinearAttnBackend(self.full, LinearAttentionBackend(self.states), cfg.full_attn_layers)


# ---- the models against transformers ----------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_logits_match_transformers(model_dir, variant):
    from transformers import AutoModelForCausalLM

    path = model_dir(variant)
    cfg, model = _load(path)
    assert cfg.linear_attn_layers == (0, 2) and cfg.full_attn_layers == (1, 3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(cfg.vocab_size)
    cache = HybridCache(cfg, 32, len(prompts))
    logits = _logits(model, cache.step(prompts))
    start, nxt = 0, []
    with torch.no_grad():
        for p in prompts:
            ref = hf(p[None]).logits[0]
            assert (logits[start : start + p.numel()] - ref).abs().max().item() < ATOL_HF, variant
            nxt.append(logits[start + p.numel() - 1].argmax().view(1))
            start += p.numel()
        step = _logits(model, cache.step(nxt))  # DECODE: absorbed MLA, one recurrence step
        for i, p in enumerate(prompts):
            ref = hf(torch.cat([p, nxt[i]])[None]).logits[0, -1]
            assert (step[i] - ref).abs().max().item() < ATOL_HF, variant


@pytest.mark.parametrize("variant", ["kimi", "bailing"])
def test_chunked_prefill_carries_state_and_reads_prefix_in_chunks(model_dir, variant):
    """Prefill in two steps: the second continues each request's KDA state and convolution
    state, and its MLA layers read prefixes of 9, 2 and 14 tokens in chunks of 2 — planned by
    `init_mha_chunk_metadata`, reached through the wrapper. Same logits as one step."""
    cfg, model = _load(model_dir(variant))
    full = _prompts(cfg.vocab_size, lens=(15, 12, 20), seed=1)
    split = (9, 2, 14)
    one = HybridCache(cfg, 32, 3)
    ref = _logits(model, one.step(full)).split([t.numel() for t in full])
    two = HybridCache(cfg, 32, 3, chunk=2)
    _logits(model, two.step([t[:s] for t, s in zip(full, split)]))
    second = [t[s:] for t, s in zip(full, split)]
    fb = two.step(second)
    # The wrapper delegates the chunk plan (the real bug: it did not, and prefill crashed).
    two.full.chunk_plan = None
    two.backend.init_mha_chunk_metadata(fb)
    assert two.full.chunk_plan is not None and two.full.chunk_plan.prefix_lens == list(split)
    assert len(two.full.chunk_plan.chunks) == 7
    got = _logits(model, fb).split([t.numel() for t in second])
    for r, g, t in zip(ref, got, second):
        assert (r[-t.numel() :] - g).abs().max().item() < ATOL_SELF
    for a, b in zip(one.states.recurrent + one.states.conv, two.states.recurrent + two.states.conv):
        assert (a - b).abs().max().item() < ATOL_SELF


_REF: dict = {}


def hf_greedy_cached(path: str, prompt_ids: list[int], n: int = MAX_NEW) -> list[int]:
    """transformers' greedy continuation through its own cache (prefill by its chunked KDA form,
    then one recurrent step per token): the full recompute of `tests.test_engine.hf_greedy`
    gives the same tokens on these checkpoints but costs ~5x more CPU (a chunked KDA prefill
    per token); the logits tests above compare against full forwards."""
    from transformers import AutoModelForCausalLM

    key = (path, tuple(prompt_ids), n)
    if key not in _REF:
        if path not in _REF:
            _REF[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        model, ids = _REF[path], []
        with torch.no_grad():
            out = model(torch.tensor([prompt_ids]), use_cache=True)
            for _ in range(n):
                ids.append(int(out.logits[0, -1].argmax()))
                out = model(torch.tensor([ids[-1:]]), past_key_values=out.past_key_values, use_cache=True)
        _REF[key] = ids
    return _REF[key]


def check_against_hf(engine: Engine, path: str, prompts=PROMPTS) -> None:
    results = run_staggered(engine, prompts, greedy())
    for prompt, res in zip(prompts, results):
        assert res.token_ids == hf_greedy_cached(path, engine.tokenize(prompt)), f"prompt {prompt!r}"
        assert res.finish_reason == "length"


def _engine(path: str, **kw) -> Engine:
    engine = Engine(EngineConfig(model=path, **kw))
    backend = engine.workers.runner.attn_backend
    assert isinstance(backend, HybridLinearAttnBackend)
    full = backend.full_attn_backend
    assert isinstance(full, FlashAttentionBackend) and full.use_mla
    backend.full_attn_backend.prefix_chunk_tokens = CHUNK  # cached prefixes in several chunks
    return engine


@pytest.mark.parametrize(
    "variant,options",
    [
        ("kimi", dict(page_size=4)),
        ("kimi_qlora", dict(page_size=1, chunked_prefill_size=3, max_num_batched_tokens=7)),
        ("bailing", dict(page_size=4, chunked_prefill_size=5, max_num_batched_tokens=9)),
        ("bailing_softplus", dict(page_size=1)),
    ],
)
def test_engine_greedy_equals_transformers(model_dir, variant, options):
    """Staggered mixed-length batches through the real Engine: decodes, extends, and with
    chunked prefill MIXED steps whose later chunks continue the KDA state and read the MLA
    prefix from the cache in chunks."""
    path = model_dir(variant)
    engine = _engine(path, **options)
    runner = engine.workers.runner
    assert runner.kv_pool.num_layers == 2  # KV for the full-attention layers only
    assert runner.state_pool is not None and runner.state_pool.num_layers == 2
    inputs = runner.pipeline.inputs
    modes, build = [], inputs.from_plan  # called by every step, overlapped or not
    inputs.from_plan = lambda plan, **kw: (modes.append(plan.mode), build(plan, **kw))[1]
    check_against_hf(engine, path)
    assert {ForwardMode.EXTEND, ForwardMode.DECODE} <= set(modes)
    if "chunked_prefill_size" in options:
        assert ForwardMode.MIXED in modes


def test_prefix_cache_is_off_and_preemption_recomputes(model_dir):
    """States are not page-addressable: the radix cache is off (a shared prefix is recomputed),
    and a preempted request restarts from a reset state."""
    path = model_dir("kimi")
    engine = _engine(path, page_size=4)
    assert engine.serving.disable_radix_cache and engine.scheduler.radix.disabled
    shared = PROMPTS[2] + " and then"
    engine.generate([shared], greedy(2))
    check_against_hf(engine, path, [shared + " the king", shared + " a dragon came"])
    assert engine.scheduler.stats.prefix_hit_tokens == 0
    # 5 prompts of up to ~25 tokens + 12 new each need ~150 tokens of KV; give the pool 64.
    small = _engine(path, page_size=4, kv_cache_tokens=64)
    check_against_hf(small, path)
    assert small.scheduler.stats.preemptions > 0


def test_admission_with_a_cached_prefix_is_refused():
    pool = LinearStatePool(3, 2, 2, 4, 4, torch.float32, "cpu")
    pool.recurrent[1][1] = 1.0
    pool.conv[0][1] = 1.0
    nr = NewRequest("a", SamplingParams(), [5, 6, 7])
    fresh = StepPlan(1, ForwardMode.EXTEND, [ScheduledReq("a", 1, [5, 6, 7], 0, [4, 5, 6])], [nr])
    pool.reset_admitted(fresh)
    assert pool.recurrent[1][1].abs().sum() == 0 and pool.conv[0][1].abs().sum() == 0
    cached = StepPlan(2, ForwardMode.EXTEND, [ScheduledReq("a", 1, [7], 2, [6])], [nr])
    with pytest.raises(RuntimeError, match="cached prefix"):
        pool.reset_admitted(cached)


# ---- the wrapper delegates every hook ------------------------------------------------------------

HOOKS = sorted(AttentionBackend.__abstractmethods__)
METADATA_HOOKS = [h for h in HOOKS if not h.startswith("forward_")]


def _recording(hook: str):
    def call(self, *args):
        self.calls.append((hook, *args))
        return self.tag

    return call


class _RecorderBase(AttentionBackend):
    name = "recorder"

    def __init__(self, tag: str):
        self.tag = tag
        self.calls: list[tuple] = []


# A backend whose every hook (whatever the interface declares) records (hook, *args) and returns
# its tag: the delegation tests below follow the interface as it grows.
Recorder = type("Recorder", (_RecorderBase,), {hook: _recording(hook) for hook in HOOKS})


def _dummy_args(hook: str):
    fb = object()
    return {
        "init_forward_metadata": (fb,),
        "init_mha_chunk_metadata": (fb,),
        "init_cuda_graph_state": (8, 64, True),
        "init_forward_metadata_capture_cuda_graph": (4, 4, fb),
        "init_forward_metadata_replay_cuda_graph": (4, fb),
        "get_cuda_graph_seq_len_fill_value": (),
    }[hook]


@pytest.mark.parametrize("hook", METADATA_HOOKS)
def test_wrapper_sends_metadata_hooks_to_both(hook):
    full, linear = Recorder("full"), Recorder("linear")
    wrapper = HybridLinearAttnBackend(full, linear, [1, 3])
    args = _dummy_args(hook)
    out = getattr(wrapper, hook)(*args)
    assert full.calls == [(hook, *args)]
    if hook == "get_cuda_graph_seq_len_fill_value":
        assert out == "full" and linear.calls == []
    else:
        assert linear.calls == [(hook, *args)]


@pytest.mark.parametrize("hook", ["forward_extend", "forward_decode"])
def test_wrapper_sends_forward_hooks_to_the_owner_with_storage_ids(hook):
    full, linear = Recorder("full"), Recorder("linear")
    wrapper = HybridLinearAttnBackend(full, linear, [1, 3])
    q, k, v, fb = torch.zeros(1), torch.ones(1), None, object()
    owners = {0: ("linear", 0), 1: ("full", 0), 2: ("linear", 1), 3: ("full", 1), 4: ("linear", 2)}
    for layer_id, (tag, storage_id) in owners.items():
        layer = AttentionLayer(layer_id=layer_id, num_heads=2, num_kv_heads=2, head_dim=4, scaling=0.5)
        assert getattr(wrapper, hook)(q, k, v, layer, fb, False) == tag
        rec = full if tag == "full" else linear
        name, *args = rec.calls[-1]
        assert name == hook and args[0] is q and args[1] is k and args[2] is v
        assert args[4] is fb and args[5] is False
        assert args[3].layer_id == storage_id and args[3].num_heads == 2
    assert len(full.calls) == 2 and len(linear.calls) == 3


# ---- tensor parallelism ---------------------------------------------------------------------------


def _tp_run(model, cfg, out_dir: str, tag: str, tp_size: int) -> None:
    """A two-step (chunked) prefill, then a decode; logits and the KV pool saved."""
    prompts = _prompts(cfg.vocab_size, lens=(7, 12, 4))
    cache = HybridCache(cfg, 32, len(prompts), chunk=2, tp_size=tp_size)
    first = _logits(model, cache.step([p[:3] for p in prompts]))
    second = _logits(model, cache.step([p[3:] for p in prompts]))
    last = second.split([n - 3 for n in (7, 12, 4)])
    third = _logits(model, cache.step([t[-1].argmax().view(1) for t in last]))
    torch.save({"logits": [first, second, third], "pool": cache.pool.kv_buffer[:2]}, os.path.join(out_dir, f"{tag}.pt"))


def _tp_worker(rank: int, port: int, paths: list[str], out_dir: str) -> None:
    with gloo_rank(rank, port, 2):
        for i, path in enumerate(paths):
            cfg, model = _load(path, TPGroup(rank=rank, size=2))
            _tp_run(model, cfg, out_dir, f"{i}-rank{rank}", 2)


def test_tp2_logits_equal_tp1(model_dir):
    """MLA heads, KDA heads (with their conv channels, gates and states) and every expert's
    intermediate split over two gloo ranks: chunked prefill and decode give the TP=1 logits,
    and both ranks hold identical MLA latents."""
    import torch.multiprocessing as mp

    paths = [model_dir("kimi_qlora"), model_dir("bailing")]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_tp_worker, args=(_free_port(), paths, out), nprocs=2, join=True)
        for i, path in enumerate(paths):
            cfg, model = _load(path)
            _tp_run(model, cfg, out, f"{i}-tp1", 1)
            ref, r0, r1 = (torch.load(os.path.join(out, f"{i}-{t}.pt")) for t in ("tp1", "rank0", "rank1"))
            for a, b, c in zip(ref["logits"], r0["logits"], r1["logits"]):
                assert torch.equal(b, c)
                assert (a - b).abs().max().item() < ATOL_TP, path
            for a, b, c in zip(ref["pool"], r0["pool"], r1["pool"]):
                assert torch.equal(b, c)
                assert (a - b).abs().max().item() < ATOL_SELF


@pytest.mark.parametrize("variant", ["kimi", "bailing"])
def test_engine_tp2_greedy_equals_transformers(model_dir, variant):
    """The Engine at tp_size=2 (ranks as processes, gloo), chunked prefill and mixed batches."""
    path = model_dir(variant)
    engine = Engine(EngineConfig(model=path, tp_size=2, page_size=4, chunked_prefill_size=4,
                                 max_num_batched_tokens=8))
    try:
        check_against_hf(engine, path, PROMPTS[:4])
    finally:
        engine.shutdown()
