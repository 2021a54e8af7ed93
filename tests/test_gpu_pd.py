"""Prefill/decode disaggregation on a GPU: two replicas sharing one GPU (`gpus_per_rank` 0.5),
the hand-off's prompt pages gathered on the prefill rank beside the step in flight into its
hand-off rows in GPU memory, read over NIXL from GPU memory to GPU memory in chunks, checked
on the decode rank's GPU and scattered into its pool. Greedy text through the HTTP server
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
    ray.init(address="local", num_cpus=6, num_gpus=torch.cuda.device_count(), include_dashboard=False, namespace=NS)
    yield
    ray.shutdown()


@pytest.mark.parametrize("memory,decode_tp", [("gpu", 1), ("host", 1), ("gpu", 2)])
def test_disaggregated_on_a_gpu_equals_one_engine(ray_gpu, tmp_path, memory, decode_tp):
    """memory: where the hand-off rows are (--pd-memory): GPU memory (read GPU to GPU), or
    pinned host memory (copied down, read host to host, copied up). decode_tp 2: each decode
    rank cuts its kv head out of the prefill rank's pages (a scratch READ on its own stream);
    NCCL wants a GPU per TP rank, so that case gives each decode rank 0.6 of a GPU (two cannot
    fit on one) beside the prefill rank's 0.3: two GPUs. The others share one GPU, 0.3 of it
    per rank. Fails, not skips, where NIXL cannot read GPU memory: that is what it is here to
    find."""
    from transformers import AutoTokenizer

    decode_share, gpus = (None, 1) if decode_tp == 1 else (0.6, decode_tp)
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"decode TP {decode_tp} takes a GPU per rank: {gpus} GPUs")

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
    pd = PD(model, tmp_path / "kv", 1, decode_tp, gpus_per_rank=0.3, pd_memory=memory, decode_share=decode_share,
            **{k: v for k, v in gpu.items() if k != "page_size"})
    try:
        from cluster.launch import pd_sides_sharing_gpus

        if torch.cuda.device_count() == 1:  # (one GPU: the sides share it, and start-up says so)
            assert len(pd_sides_sharing_gpus(pd.cluster.infos)) == 1
        texts, _ = pd.complete(prompts)
        assert texts == want
        ranks = pd.rank_stats(pd.decode)
        assert sum(r["pd_pages"] for r in ranks) >= 3 + 3 + 3 + 18 - 4  # (a page each may be recomputed)
        assert sum(r["pd_corrupt"] for r in ranks) == 0
        for r in ranks + pd.rank_stats(pd.prefill):  # the pages moved between GPU memories (or host ones)
            assert r["handoff"]["device"].startswith("cuda" if memory == "gpu" else "cpu"), r["handoff"]
            assert r["handoff"]["pages"] > 0, r["handoff"]
        pd.wait_idle()
    finally:
        pd.close()


@pytest.mark.parametrize("width", [4096, 4098, 1 << 21])
def test_page_sums_on_the_gpu_equal_the_cpus(width):
    """A prefill rank's checksums and a decode rank's must agree wherever they are computed."""
    from kvstore.transfer import page_sums

    rows = torch.randint(0, 256, (11, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(width))
    assert page_sums(rows.cuda()).cpu().tolist() == page_sums(rows).tolist()
    # What a prefill rank sums: the used bytes of wider rows (a strided view), on a side stream.
    wide = torch.zeros((11, width + 64), dtype=torch.uint8, device="cuda")
    wide[:, :width] = rows.cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = page_sums(wide[:, :width]).tolist()
    assert got == page_sums(rows).tolist()
