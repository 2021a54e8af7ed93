"""FP8 checkpoints on the GPU through the engine (CUDA graphs on): float32 activations take the
dequantize-and-multiply path and give the CPU's greedy tokens exactly; bfloat16 runs the FP8
kernels (`workers/layers/fp8_gemm.py`, the FP8 grouped GEMM of `fused_moe`), whose first-step
logits stay within 5% of the largest |logit| of float32 with bf16 activations (as bf16 against
float32 does on a plain checkpoint, tests/test_gpu_engine.py), 20% where prefill quantizes them
to FP8. Skipped without CUDA."""

from __future__ import annotations

import shutil

import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from tests.fixtures import tiny_model_dir
from tests.test_engine import PROMPTS, greedy, run_staggered
from workers.make_fp8 import quantize_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CASES = {  # name -> (arch, FP8 format, block)
    "llama_channel": ("llama", "fp8-channel", (128, 128)),
    "llama_block": ("llama", "fp8-block", (32, 32)),
    "dsv3_block": ("deepseek_v3", "fp8-block", (16, 16)),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    out = {}
    for name, (arch, kind, block) in CASES.items():
        d = tmp_path_factory.mktemp(name) / "m"
        shutil.copytree(tiny_model_dir(tmp_path_factory, arch), d)
        quantize_checkpoint(d, kind, block)
        out[name] = d
    return out


def _tokens(d, **kw):
    return [r.token_ids for r in run_staggered(Engine(EngineConfig(model=str(d), page_size=4, **kw)), PROMPTS,
                                               greedy())]


@pytest.mark.parametrize("name", list(CASES))
def test_gpu_float32_greedy_equals_cpu(dirs, name):
    engine_kw = dict(device="cuda", dtype="float32", max_running_requests=32)
    got = _tokens(dirs[name], **engine_kw)
    assert got == _tokens(dirs[name])


# 24 tokens with the tiny tokenizer: the prompt graphs pad them to 32 rows, under A8_MIN_M. (With a
# third prompt, 42 tokens padded to 64 rows took the W8A8 products: 12-15% off float32, H100, 2026-11-26.)
SHORT = ["Hello", "Serving systems batch requests"]


def _first_logits(d, dtype: str, prompts: list[str], **kw) -> tuple[torch.Tensor, int]:
    """The first step's logits (the prompts' prefill) and the rows its matrix products saw: the
    prompt tokens, padded to their bucket where the prompt graphs run them."""
    # (4 running requests at most: decode graphs for 1, 2 and 4 rows only, not the default's
    # fifteen sizes up to 256, which made each of these engines' start the bulk of the test)
    engine = Engine(EngineConfig(model=str(d), device="cuda", dtype=dtype, page_size=4, max_running_requests=4, **kw))
    runner = engine.workers.runner
    assert runner.pipeline.graphs is not None
    captured = []
    original = runner.model.compute_logits
    runner.model.compute_logits = lambda h, o=original, c=captured: c.append(o(h)) or c[-1]
    out = engine.generate(prompts, greedy(4))  # prefill, then decode steps through the graphs
    assert all(len(r.token_ids) == 4 for r in out)
    tokens = sum(len(engine.tokenize(p)) for p in prompts)
    pg = runner.pipeline.prompt_graphs
    return captured[0].float().cpu(), pg.padded_size(tokens) if pg is not None and tokens <= pg.max_tokens else tokens


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("prompts, bound, tma", [(SHORT, 0.05, False), (SHORT, 0.2, True), (PROMPTS[:3], 0.2, False)],
                         ids=["w8a16", "tma", "w8a8"])
def test_gpu_bf16_fp8_kernels_close_to_float32(dirs, name, prompts, bound, tma):
    """Fewer rows than `A8_MIN_M` (prompt tokens, padded by the prompt graphs) with the TMA kernel
    off: every product is W8A16 (bf16 activations), as close to float32 as a bf16 model is (5%).
    More rows (cuBLAS or the Triton W8A8 kernel: the TMA option off), or per-channel products of
    fewer on a Hopper GPU's TMA kernel (`fp8_tma` on; elsewhere W8A16 again): the products
    quantize activations to e4m3 per token (~2.6% relative error each,
    tests/test_fp8_gemm.py); through these tiny random models' layers the first logits moved
    10-13% of the largest |logit| (H100, 2026-11-25): bound 20%."""
    from attention.kernel_options import KernelOptions
    from workers.layers.fp8_gemm import A8_MIN_M

    ref, _ = _first_logits(dirs[name], "float32", prompts)
    got, rows = _first_logits(dirs[name], "bfloat16", prompts, kernels=KernelOptions(fp8_tma=tma))
    assert (rows < A8_MIN_M) == (prompts is SHORT)
    assert (got - ref).abs().max().item() < bound * ref.abs().max().item()


def test_gpu_fp8_norms_and_silu_write_quantized_rows(dirs, monkeypatch):
    """A per-channel FP8 Llama's prefill of at least A8_MIN_M rows: both norms and SiLU·up of
    each layer write their rows quantized per token for the W8A8 products (`quant_rows`), and
    the first logits stay within the W8A8 bound of float32 (test_gpu_bf16_fp8_kernels_close_to_float32),
    as the unfused ops' do (`fp8_rows` off: 16-bit rows, quantized by each product). The two are
    not the same bits: the compiled norm of the unfused path does not round its normalised row
    to bf16 before the weight, as torch's ops and the fused kernel do, which moves ~3% of the
    e4m3 inputs a step (`scripts/fp8_rows_probe.py`); on an H200 the fused path's first logits
    were 9.5% of the largest |logit| off float32, the unfused 12.3% (2026-12-02)."""
    from attention.kernel_options import KernelOptions
    from workers.layers import quant_rows
    from workers.layers.fp8_gemm import A8_MIN_M

    calls = []
    for name in ("add_rms_norm", "silu_and_mul"):
        monkeypatch.setattr(quant_rows, name, lambda *a, f=getattr(quant_rows, name), n=name: calls.append(n) or f(*a))
    d = dirs["llama_channel"]
    ref, _ = _first_logits(d, "float32", PROMPTS[:3])
    assert not calls
    got = {}
    for on in (True, False):
        calls.clear()
        got[on], rows = _first_logits(d, "bfloat16", PROMPTS[:3], kernels=KernelOptions(fp8_rows=on))
        assert rows >= A8_MIN_M
        assert set(calls) == ({"add_rms_norm", "silu_and_mul"} if on else set())
        assert calls.count("add_rms_norm") == 2 * calls.count("silu_and_mul")  # both norms of each layer
    scale = ref.abs().max().item()
    errors = [(got[on] - ref).abs().max().item() / scale for on in (True, False)]
    assert max(errors) < 0.2, errors


def test_gpu_batch1_fp8_takes_the_fused_one_row_kernels(dirs, monkeypatch):
    """A per-channel FP8 Llama at batch 1 in bf16: every product goes through the fused one-row
    kernel on FP8 weights (`workers.layers.gemv`, norms, SiLU, RoPE and the residual add in its
    prologues and epilogues, SiLU·up in gate/up's epilogue; eager steps, to read each one's logits), and each
    step's logits stay as close to float32 as the unfused FP8 products' (`MANTA_GEMV=0`), up to the first
    token where either run leaves float32's."""
    import inspect

    from attention.kernel_options import KernelOptions
    from workers.layers import gemv

    launches = []  # (an FP8 weight with row scales, the SiLU·up epilogue) of each one-row launch
    launch = gemv._launch
    names = list(inspect.signature(launch).parameters)

    def spy(*a):
        args = dict(zip(names, a))
        launches.append((args["scale"] is not None, args["glu"]))
        return launch(*a)

    monkeypatch.setattr(gemv, "_launch", spy)

    def run(dtype: str, fused: bool = True) -> tuple[list[torch.Tensor], list[int]]:
        engine = Engine(EngineConfig(model=str(dirs["llama_channel"]), device="cuda", dtype=dtype, page_size=4,
                                     disable_cuda_graph=True, kernels=KernelOptions(one_row_gemv=fused)))
        runner = engine.workers.runner
        captured = []
        original = runner.model.compute_logits
        runner.model.compute_logits = lambda h, o=original, c=captured: c.append(o(h)) or c[-1]
        out = engine.generate([PROMPTS[1]], greedy(12))
        return [t.float().cpu() for t in captured], out[0].token_ids

    ref_logits, ref_tokens = run("float32")
    assert not launches  # float32: the dequantize-and-multiply path
    got = {}
    for fused in (True, False):
        launches.clear()
        got[fused] = run("bfloat16", fused)
        assert any(s for s, _ in launches) == fused  # (the LM head stays bf16)
        assert any(s and glu for s, glu in launches) == fused  # gate/up finishing SiLU·up
        assert not any(glu and not s for s, glu in launches)  # (bf16 keeps SiLU in down's prologue)
    for logits, tokens in got.values():
        same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
        for step in range(min(same + 1, len(tokens))):  # the prefill, then decode steps on the same tokens as float32
            scale = ref_logits[step].abs().max().item()
            assert (logits[step] - ref_logits[step]).abs().max().item() < 0.05 * scale, step
