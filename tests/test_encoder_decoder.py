"""Encoder-decoder serving (BART family) against `transformers` generate on the same tiny
checkpoints: greedy tokens equal for batches of 1, 8, 32 and 128 requests whose encoder lengths
are all different, arriving together and staggered, at page sizes 1 and 16, eagerly and
through the CUDA-graph replay path (static buffers, run eagerly on CPU); a mixed batch equals
each request run alone; preemption recomputes the encoder; the API takes the encoder input as
the prompt.

The bug these guard against (seeds/003): every request of a batch used request 0's encoder
length (cross-attention extent and self-attention offset), garbling 12-36% of outputs at batch
8-128. `test_tests_catch_request0_encoder_length` injects it and checks they notice.
"""

from __future__ import annotations

import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from cluster.engine.request import GenerationResult
from tests.fixtures import tiny_model_dir
from workers.sampling_params import SamplingParams

MAX_NEW = 6
NUM_PROMPTS = 128
# 0.1 rather than make_model's 0.2: at 0.2 the tiny BART's decoder repeats one token whatever
# its input; at 0.1 its outputs depend on the encoder input and on the decoder's own tokens.
INIT_STD = 0.1
EOS_IDS = (2, 5)  # </s> and <|im_end|> of the built-in tokenizer (generation_config eos)


def make_prompts(n: int = NUM_PROMPTS, seed: int = 0) -> list[list[int]]:
    """n encoder inputs of n different lengths (2 .. n+1 tokens, shuffled), each <s> + ids."""
    g = torch.Generator().manual_seed(seed)
    lengths = (torch.randperm(n, generator=g) + 2).tolist()
    return [[1] + torch.randint(6, 500, (k - 1,), generator=g).tolist() for k in lengths]


PROMPTS = make_prompts()


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory, "bart", init_std=INIT_STD)


_HF: dict = {}


def hf_generate(model_dir, prompts: list[list[int]], n: int = MAX_NEW) -> list[list[int]]:
    """transformers' greedy generate, batched with right padding and an attention mask; the
    tokens after the decoder start, cut after the first eos (generate pads after it)."""
    from transformers import AutoModelForSeq2SeqLM

    key = (str(model_dir), n)
    cache = _HF.setdefault(key, {})
    todo = [p for p in prompts if tuple(p) not in cache]
    if todo:
        model = AutoModelForSeq2SeqLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        width = max(len(p) for p in todo)
        ids = torch.full((len(todo), width), 3)
        mask = torch.zeros(len(todo), width, dtype=torch.long)
        for i, p in enumerate(todo):
            ids[i, : len(p)] = torch.tensor(p)
            mask[i, : len(p)] = 1
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, num_beams=1)
        for p, row in zip(todo, out.tolist()):
            toks = row[1:]
            cut = next((j for j, t in enumerate(toks) if t in EOS_IDS), len(toks) - 1)
            cache[tuple(p)] = toks[: cut + 1]
    return [cache[tuple(p)] for p in prompts]


def greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


def run(engine: Engine, prompts, params, stagger: int = 0) -> list[GenerationResult]:
    """All at once (stagger=0), or `stagger` new requests before each step."""
    results: list[GenerationResult] = []
    pending = list(prompts)
    while pending or engine.has_work():
        for _ in range(len(pending) if not stagger else stagger):
            if pending:
                res = GenerationResult(rid="")
                res.rid = engine.add_request(pending.pop(0), params, res.add)
                results.append(res)
        engine.step()
        engine.scheduler.check_integrity()
    return results


def assert_equal_to_hf(model_dir, prompts, results):
    want = hf_generate(model_dir, prompts)
    bad = [i for i, (r, w) in enumerate(zip(results, want)) if r.token_ids != w]
    assert not bad, f"{len(bad)}/{len(prompts)} differ, e.g. #{bad[0]}: {results[bad[0]].token_ids} != {want[bad[0]]}"


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("batch", [1, 8, 32, 128])
def test_greedy_equals_transformers(bart, batch, page_size):
    prompts = PROMPTS[:batch]
    assert len({len(p) for p in prompts}) == batch  # every encoder length different
    for stagger in (0, max(3, batch // 8)):  # together; a few new requests before every step
        engine = Engine(EngineConfig(model=str(bart), page_size=page_size, max_running_requests=128))
        assert_equal_to_hf(bart, prompts, run(engine, prompts, greedy(), stagger))


def test_cuda_graph_replay_path_equals_transformers(bart):
    """Decode steps through the static buffers and the capture/replay hooks (padded to the
    captured sizes), run eagerly on CPU: the same tokens as transformers at every batch size."""
    for page_size in (1, 16):
        engine = Engine(EngineConfig(model=str(bart), page_size=page_size, max_running_requests=128))
        runner = engine.workers.runner
        gr = runner.pipeline.use_graphs(128, runner.pad_row, batch_sizes=(1, 2, 4, 8, 16, 32, 64, 128),
                                        capture=False)
        replayed: list[int] = []
        original = gr.replay
        gr.replay = lambda fb, o=original, r=replayed: r.append(fb.batch_size) or o(fb)
        for batch, stagger in ((128, 0), (37, 5), (3, 1)):
            replayed.clear()
            assert_equal_to_hf(bart, PROMPTS[:batch], run(engine, PROMPTS[:batch], greedy(), stagger))
            assert replayed and any(b not in (1, 2, 4, 8, 16, 32, 64, 128) for b in replayed), replayed
        assert runner.req_to_token_pool.req_to_token[runner.pad_row].eq(0).all()


@pytest.mark.parametrize("arch", ["mbart", "marian"])
def test_other_families_equal_transformers(tmp_path_factory, arch):
    # mBART: pre-LN, final layer norms, scaled embeddings, tied tables; Marian: sinusoidal
    # positions, no embedding norm, decoder starts from <pad>.
    d = tiny_model_dir(tmp_path_factory, arch, init_std=INIT_STD, tie_word_embeddings=arch == "mbart")
    prompts = PROMPTS[:16]
    engine = Engine(EngineConfig(model=str(d), page_size=16))
    assert_equal_to_hf(d, prompts, run(engine, prompts, greedy(), stagger=4))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "serial"])
def test_mixed_batch_equals_each_request_alone(bart, overlap):
    """Greedy and seeded-sampling requests with different encoder lengths and max_tokens in one
    batch give what each gives alone, with steps planned ahead of their results or one at a
    time (the forced first/last tokens of generate read the tokens so far either way)."""
    prompts = PROMPTS[:10]
    params = [SamplingParams(max_tokens=3 + i % 5, temperature=0.0) if i % 2 else
              SamplingParams(max_tokens=4 + i % 4, temperature=0.9, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    engine = Engine(EngineConfig(model=str(bart), page_size=16, disable_overlap_schedule=not overlap))
    assert engine.overlap == overlap
    alone = [engine.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    together = engine.generate(prompts, params)
    assert [r.token_ids for r in together] == alone
    assert len({tuple(a) for a in alone}) > len(prompts) // 2  # the inputs matter


def test_preemption_recomputes_the_encoder(bart):
    """A KV pool too small for every request at once: requests are preempted (their encoder
    and decoder pages freed), re-admitted, re-encoded, and still match transformers."""
    prompts = PROMPTS[:24]
    need = sum(len(p) + MAX_NEW + 1 for p in prompts)
    engine = Engine(EngineConfig(model=str(bart), page_size=4, kv_cache_tokens=need // 3))
    results = run(engine, prompts, greedy(), stagger=24)
    assert engine.scheduler.stats.preemptions > 0
    assert_equal_to_hf(bart, prompts, results)
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_total


def test_tests_catch_request0_encoder_length(bart, monkeypatch):
    """Inject seeds/003's bug (every request reads request 0's encoder length): the equality
    checks above fail for a good share of a batch of 32."""
    import attention.paged as paged

    real = paged.build_attention_metadata

    def buggy(fb, page_size):
        if fb.encoder_lens is not None:
            fb.encoder_lens_cpu = [fb.encoder_lens_cpu[0]] * fb.batch_size
            fb.encoder_lens = fb.encoder_lens[:1].expand(fb.batch_size).contiguous()
        return real(fb, page_size)

    monkeypatch.setattr(paged, "build_attention_metadata", buggy)
    prompts = PROMPTS[:32]
    engine = Engine(EngineConfig(model=str(bart), page_size=16, max_running_requests=128))
    got = [r.token_ids for r in run(engine, prompts, greedy())]
    wrong = sum(g != w for g, w in zip(got, hf_generate(bart, prompts)))
    assert wrong >= len(prompts) // 4, f"only {wrong}/32 garbled: the model does not expose the bug"


def test_engine_api_and_rejections(bart):
    engine = Engine(EngineConfig(model=str(bart), max_num_batched_tokens=64, max_context_len=48))
    text = "The quick brown fox jumps over the lazy dog"
    res = engine.generate([text], greedy())[0]
    ids = engine.tokenize(text)
    assert res.token_ids == hf_generate(bart, [ids])[0]
    assert res.prompt_tokens == len(ids)  # the encoder input is the prompt
    assert res.token_ids[0] == 1  # generation_config's forced_bos_token_id (<s>)
    # Forced eos on the max_tokens-th token (with forced bos at 1 token, eos wins: as generate).
    assert engine.generate([text], greedy(1))[0].token_ids == [2]
    from cluster.engine.scheduler import RequestRejected

    with pytest.raises(RequestRejected, match="encoder"):
        engine.generate([[1] * 49], greedy())
    with pytest.raises(RequestRejected, match="prompt"):
        engine.generate([[]], greedy())
    with pytest.raises(RequestRejected, match="embeddings"):
        engine.embed([text])
    assert not engine.has_work()


def test_completions_endpoint_takes_the_encoder_input(bart):
    import asyncio

    import httpx

    from cluster.api.metrics import ServerMetrics
    from cluster.api.server import BackgroundServer, build_app
    from cluster.engine.client import LocalEngineClient

    engine = Engine(EngineConfig(model=str(bart), served_model_name="tiny-bart"))
    prompt = "Translate to French: The house is small but very warm."
    expected = engine.generate([prompt], greedy())[0]
    client = LocalEngineClient(engine, metrics=ServerMetrics())
    server = BackgroundServer(build_app(client, ServerMetrics()))
    try:
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "tiny-bart", "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == expected.text
        assert body["usage"]["prompt_tokens"] == len(engine.tokenize(prompt))
        # The context limit applies to the encoder input and to the decoder separately: a
        # prompt of the whole context with a long generation is valid, one token more is not.
        limit = engine.max_context_len
        full = [7] * limit
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "tiny-bart", "prompt": full, "max_tokens": limit - 1, "temperature": 0})
        assert r.status_code == 200, r.text
        for prompt_ids, max_tokens, param in ((full + [7], 2, "prompt"), ([7, 8], limit, "max_tokens")):
            r = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": "tiny-bart", "prompt": prompt_ids, "max_tokens": max_tokens})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert r.json()["error"]["code"] == "context_length_exceeded"
    finally:
        server.stop()
        asyncio.run(client.aclose())


@pytest.mark.slow
def test_tp2_equals_transformers(bart):
    """Two gloo ranks: heads, FFN and vocab split; the cross-attention K/V of each rank's heads
    in its own pool."""
    engine = Engine(EngineConfig(model=str(bart), tp_size=2, page_size=16))
    try:
        assert_equal_to_hf(bart, PROMPTS[:8], run(engine, PROMPTS[:8], greedy(), stagger=3))
    finally:
        engine.shutdown()


def test_make_model_bart_ids_match_the_tokenizer(bart):
    """`manta make-model --arch bart`: the special ids of config and generation config are the
    built-in tokenizer's (</s> starts the decoder, <s> is the forced first token)."""
    import json

    from transformers import AutoTokenizer

    from workers.make_model import ARCHS

    assert {"bart", "mbart", "marian"} <= set(ARCHS)
    tok = AutoTokenizer.from_pretrained(bart)
    cfg = json.loads((bart / "config.json").read_text())
    gen = json.loads((bart / "generation_config.json").read_text())
    assert cfg["architectures"] == ["BartForConditionalGeneration"] and cfg["vocab_size"] >= len(tok)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (
        tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    assert gen["decoder_start_token_id"] == cfg["decoder_start_token_id"] == tok.eos_token_id
    assert gen["forced_bos_token_id"] == tok.bos_token_id
    assert gen["forced_eos_token_id"] == tok.eos_token_id
