"""Prompt batches through the piecewise-graph path (`workers.prompt_graphs`): static inputs padded
to a token-count bucket, the layers between attention calls over the whole bucket, attention cut
out and run on the real tokens with the step's metadata. Run eagerly here (no CUDA graph on the
CPU; tests/test_gpu_engine.py replays the captured graphs); greedy tokens equal transformers'."""

from __future__ import annotations

import pytest
import torch

from attention.kernel_options import KernelOptions
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
    pg = pipeline.use_prompt_graphs(8, runner.pad_row, capture=False)
    pg.buckets = [4, 8]
    padded, attended = [], []
    replay, backend_forward = pg.replay, pipeline.attn_backend.forward

    def spy_replay(fb):
        padded.append((fb.num_tokens, pg.padded_size(fb.num_tokens)))
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


def test_prompt_logprobs_read_every_real_token_of_a_padded_piece(tmp_path_factory):
    """Prompt logprobs need the hidden state of every prompt token: through the padded
    static-buffer path they still equal transformers' log-softmax."""
    from tests.test_prompt_logprobs import PROMPTS as LP_PROMPTS
    from tests.test_prompt_logprobs import hf_prompt_logprobs
    from workers.sampling_params import SamplingParams

    d = tiny_model_dir(tmp_path_factory, "llama")
    engine = Engine(EngineConfig(model=str(d), page_size=4, chunked_prefill_size=5, max_num_batched_tokens=9))
    runner = engine.workers.runner
    pg = runner.pipeline.use_prompt_graphs(8, runner.pad_row, capture=False)
    ran = []
    replay = pg.replay
    pg.replay = lambda fb: ran.append(fb.num_tokens) or replay(fb)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    for prompt, res in zip(LP_PROMPTS, engine.generate(LP_PROMPTS, params)):
        ids = engine.tokenize(prompt)
        want, _ = hf_prompt_logprobs(str(d), ids, 1)
        assert [g.token_logprob for g in res.prompt_logprobs[1:]] == pytest.approx(want, abs=1e-4), prompt
    assert any(n < 8 for n in ran), ran


def test_prompts_past_the_largest_bucket_run_eagerly(tmp_path_factory):
    d = tiny_model_dir(tmp_path_factory, "llama")
    engine = Engine(EngineConfig(model=str(d), page_size=4))
    runner = engine.workers.runner
    pg = runner.pipeline.use_prompt_graphs(16, runner.pad_row, capture=False)
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
    runner = engine.workers.runner
    pg = runner.pipeline.use_prompt_graphs(64, runner.pad_row, capture=False)
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_unowned_view_aliases_without_keeping_the_memory():
    """The view reads and writes the tensor's memory with its shape, strides and offset, and
    dropping the tensor frees the memory although the view lives (what lets later graphs of
    the pool reuse a q/k/v that attention has read)."""
    base = torch.arange(64, dtype=torch.bfloat16, device="cuda").view(8, 8)
    t = base[2:, 1::2]
    view = unowned_view(t)
    assert view.shape == t.shape and view.stride() == t.stride() and view.data_ptr() == t.data_ptr()
    assert torch.equal(view, t)
    view.fill_(3)
    assert torch.all(t == 3)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    del base, t
    assert torch.cuda.memory_allocated() < before


def test_prompt_token_cap_beside_decodes_defaults_to_1024_where_prompts_run_as_graphs():
    """`--mixed-prefill-tokens` unset: 1,024 on CUDA with graphs (measured with prompt graphs),
    none where a capped step would pay an eager prompt piece's host time every time."""
    cuda = EngineConfig(model="m", device="cuda")
    assert cuda.prefill_cap == 1024
    assert EngineConfig(model="m").prefill_cap == 0  # CPU
    assert cuda.replace(disable_cuda_graph=True).prefill_cap == 0
    assert cuda.replace(kernels=KernelOptions(prompt_graphs=False)).prefill_cap == 0
    assert cuda.replace(mixed_prefill_tokens=0).prefill_cap == 0
    assert EngineConfig(model="m", mixed_prefill_tokens=768).prefill_cap == 768
    with pytest.raises(ValueError, match="mixed_prefill_tokens"):
        EngineConfig(model="m", mixed_prefill_tokens=-1)
