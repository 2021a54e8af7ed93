"""Prefill/decode disaggregation on a GPU: two replicas sharing one GPU (`gpus_per_rank` 0.5),
the hand-off's prompt pages gathered on the prefill rank beside the step in flight, read over
NIXL in chunks and loaded on the decode rank's load stream. Greedy text through the HTTP server
equals one in-process engine on the same GPU (float32, as the other GPU tests compare). Skipped
without a GPU; on the CPU `tests/test_pd.py` checks the same path against transformers."""

from __future__ import annotations

import pytest
import ray
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from tests.fixtures import tiny_model_dir
from tests.test_kvstore_serving import prompt_ids
from tests.test_pd import MAX_TOKENS, NS, PD

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


@pytest.fixture(scope="module")
def ray_gpu():
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=6, num_gpus=1, include_dashboard=False, namespace=NS)
    yield
    ray.shutdown()


def test_disaggregated_on_a_gpu_equals_one_engine(ray_gpu, tmp_path):
    from transformers import AutoTokenizer

    from workers.sampling_params import SamplingParams

    model = str(tiny_model_dir(None, "llama"))
    prompts = [prompt_ids(53 + s, s) for s in range(3)] + [prompt_ids(300, 7)]  # 3 pages; 18 (three READs)
    gpu = dict(device="cuda", dtype="float32", page_size=16)
    ref = Engine(EngineConfig(model=model, **gpu))
    try:
        outs = ref.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    finally:
        ref.shutdown()
    tok = AutoTokenizer.from_pretrained(model)
    want = [tok.decode(o.token_ids, skip_special_tokens=True) for o in outs]
    pd = PD(model, tmp_path / "kv", 1, 1, gpus_per_rank=0.5, **{k: v for k, v in gpu.items() if k != "page_size"})
    try:
        texts, _ = pd.complete(prompts)
        assert texts == want
        ranks = pd.rank_stats(pd.decode)
        assert sum(r["pd_pages"] for r in ranks) >= 3 + 3 + 3 + 18 - 4  # (a page each may be recomputed)
        assert sum(r["pd_corrupt"] for r in ranks) == 0
        pd.wait_idle()
    finally:
        pd.close()
