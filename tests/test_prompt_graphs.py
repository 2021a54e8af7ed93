"""Prompt batches through the piecewise-graph path (`workers.prompt_graphs`): static inputs padded
to a token-count bucket, the layers between attention calls over the whole bucket, attention cut
out and run on the real tokens with the step's metadata. Run eagerly here (no CUDA graph on the
CPU; tests/test_gpu_engine.py replays the captured graphs); greedy tokens equal transformers'."""

from __future__ import annotations

import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from tests.fixtures import tiny_model_dir
from tests.test_engine import PROMPTS, greedy, hf_greedy, run_staggered
from workers.forward_batch import ForwardMode
from workers.prompt_graphs import unowned_view


@pytest.mark.parametrize("arch", ["llama", "deepseek_v2"])  # paged GQA; MLA + MoE
def test_prompt_pieces_padded_to_buckets_match_transformers(tmp_path_factory, arch):
    """Chunked prompts (pieces of 2-6 tokens) padded to buckets of 4 and 8, alone or beside
    decodes in MIXED steps (split: the decode graph path, then the prompt graphs): every
    attention call sees the real tokens, and the padding changes no token."""
    d = tiny_model_dir(tmp_path_factory, arch)
    engine = Engine(EngineConfig(model=str(d), chunked_prefill_size=6, max_num_batched_tokens=8, page_size=4,
                                 max_running_requests=16))
    runner = engine.workers.runner
    pipeline = runner.pipeline
    pipeline.use_graphs(16, runner.pad_row, batch_sizes=(1, 2, 4, 8, 16), capture=False)
    pg = pipeline.use_prompt_graphs(8, capture=False)
    pg.buckets = [4, 8]
    padded, attended = [], []
    replay, backend_forward = pg.replay, pipeline.attn_backend.forward

    def spy_replay(fb):
        padded.append((fb.num_tokens, pg._bucket(fb.num_tokens)))
        return replay(fb)

    def spy_forward(q, k, v, layer, fb, **kw):
        if fb.forward_mode == ForwardMode.EXTEND:
            attended.append(q.shape[0])
        return backend_forward(q, k, v, layer, fb, **kw)

    pg.replay, pipeline.attn_backend.forward = spy_replay, spy_forward
    results = run_staggered(engine, PROMPTS, greedy())
    for prompt, res in zip(PROMPTS, results):
        assert res.token_ids == hf_greedy(d, engine.tokenize(prompt), len(res.token_ids))
    assert any(n < size for n, size in padded), padded  # some pieces were padded
    # attention saw each piece's real token count, once per layer, never the bucket's
    layers = len(runner.model.attention_layers)
    assert attended == [n for n, _ in padded for _ in range(layers)]


def test_prompts_past_the_largest_bucket_run_eagerly(tmp_path_factory):
    d = tiny_model_dir(tmp_path_factory, "llama")
    engine = Engine(EngineConfig(model=str(d), page_size=4))
    pipeline = engine.workers.runner.pipeline
    pg = pipeline.use_prompt_graphs(16, capture=False)
    ran = []
    replay = pg.replay
    pg.replay = lambda fb: ran.append(fb.num_tokens) or replay(fb)
    long_prompt = list(range(3, 40))  # 37 tokens > 16
    for prompt in (long_prompt, list(range(50, 60))):  # (no shared prefix: 10 tokens computed)
        assert engine.generate([prompt], greedy(4))[0].token_ids == hf_greedy(d, prompt, 4)
    assert ran == [10]


@pytest.mark.parametrize("arch,applies", [("llama", True), ("deepseek_v3", True), ("bart", False),
                                          ("kimi_linear", False)])
def test_only_models_that_opt_in_take_the_path(tmp_path_factory, arch, applies):
    """Llama-family and DeepSeek models do; encoder-decoder and hybrid linear-attention models
    (their layers read the batch's lengths between attention calls) do not."""
    d = tiny_model_dir(tmp_path_factory, arch)
    engine = Engine(EngineConfig(model=str(d), page_size=4))
    assert engine.workers.runner._prompt_graphs_apply() == applies


def test_decode_and_embedding_batches_do_not_take_the_path(tmp_path_factory):
    d = tiny_model_dir(tmp_path_factory, "llama")
    engine = Engine(EngineConfig(model=str(d), page_size=4))
    inputs = engine.workers.runner.pipeline.inputs
    pg = engine.workers.runner.pipeline.use_prompt_graphs(64, capture=False)
    zeros = torch.zeros(2, dtype=torch.long)
    kw = dict(input_ids=zeros, positions=zeros, rows=zeros, seq_lens=zeros + 2, seq_lens_cpu=[2, 2], slots=zeros)
    assert not pg.can_run(inputs.decode(**kw))
    extend = dict(kw, extend=zeros + 1, extend_cpu=[1, 1], prefix=zeros + 1, prefix_cpu=[1, 1])
    assert pg.can_run(inputs.ragged(ForwardMode.EXTEND, **extend))
    assert not pg.can_run(inputs.ragged(ForwardMode.EXTEND, **extend, is_embedding=True))
    assert not pg.can_run(inputs.ragged(ForwardMode.MIXED, **extend))


def test_unowned_view_is_the_tensor_on_cpu():
    t = torch.arange(6.0).view(2, 3)[:, 1:]
    assert unowned_view(t) is t and unowned_view(None) is None
