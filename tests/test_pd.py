"""Prefill/decode disaggregation on CPU with real Ray, real NIXL, the HTTP server and the
`openai` client: a prefill replica computes the prompt and its first token, a decode replica
reads the prompt's KV pages from it over NIXL and decodes. The oracle is transformers' greedy
continuation; the transfer is checked to have happened (pages counted on both sides), and the
faults the issue lists (a corrupted page, a transfer past its deadline, the prefill rank killed
while a decode rank waits on it, then restarted) still give the right tokens, and KV usage on
both sides goes back to 0.
"""

from __future__ import annotations

import asyncio
import os
import time

import openai
import pytest
import ray

from cluster.api.metrics import ServerMetrics
from cluster.api.server import BackgroundServer, build_app
from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from cluster.launch import ClusterOptions, ServingCluster
from cluster.router import RouterOptions
from tests.fixtures import local_ray, tiny_model_dir
from tests.test_engine import hf_greedy
from tests.test_kvstore_serving import prompt_ids
from workers.kv_peer import READ_CHUNK_PAGES
from workers.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NS = "manta-pd-test"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def ray_local():
    with local_ray(6, namespace=NS):
        yield


class PD:
    """A disaggregated cluster behind the HTTP server."""

    def __init__(self, model: str, root, prefill_tp: int, decode_tp: int, oracle: str | None = None,
                 sides: dict | None = None, pd_memory: str = "gpu", decode_share: float | None = None, **engine):
        """oracle: the checkpoint transformers runs for the expected tokens (default: model);
        sides: the replica counts (default one prefill and one decode replica); pd_memory: where
        the hand-off rows live (`--pd-memory`; the same on a CPU); decode_share: the decode
        side's `--decode-gpus-per-rank`."""
        cfg = EngineConfig(**{**dict(model=model, page_size=16, kv_cache_tokens=2048, max_running_requests=8,
                                     kv_store=str(root), kv_store_host_gb=0.01, kv_store_disk_gb=0.05,
                                     kv_host_cache_gb=0.004), **engine})
        self.model, self.oracle = model, oracle or model
        self.metrics = ServerMetrics()
        self.cluster = ServingCluster(ClusterOptions(
            engine=cfg, **(sides or dict(replicas=0, prefill_replicas=1, decode_replicas=1)), prefill_tp=prefill_tp,
            pd_buffer_gb=0.004, pd_memory=pd_memory, decode_gpus_per_rank=decode_share,
            decode_tp=decode_tp, router=RouterOptions(stats_interval_s=0.2)), self.metrics)
        self.router = self.cluster.start()
        self.server = BackgroundServer(build_app(self.router, self.metrics, admin=self.cluster))
        self.find_sides()

    def find_sides(self) -> None:
        self.prefill = next((h for h in self.router.replicas.values() if h.role == "prefill"), None)
        self.decode = next((h for h in self.router.replicas.values() if h.role == "decode"), None)

    def close(self) -> None:
        self.server.stop()
        self.cluster.shutdown()

    def complete(self, prompts: list[list[int]], stream_every: int = 2) -> list[list[int]]:
        """Greedy completions over HTTP (every other one streamed), as token ids."""
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.model)

        async def run():
            client = openai.AsyncOpenAI(base_url=f"{self.server.url}/v1", api_key="none", max_retries=0,
                                        timeout=120)

            async def one(i: int, p: list[int]) -> str:
                kw = dict(model=os.path.basename(self.model), prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                          extra_body={"ignore_eos": True})
                if i % stream_every:
                    stream = await client.completions.create(stream=True, **kw)
                    return "".join([c.choices[0].text async for c in stream if c.choices])
                return (await client.completions.create(**kw)).choices[0].text

            try:
                return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            finally:
                await client.close()

        texts = asyncio.run(run())
        return texts, [tok.decode(hf_greedy(self.oracle, p, MAX_TOKENS), skip_special_tokens=True)
                       for p in prompts]

    def handoff(self, handle) -> dict:
        return ray.get(handle.actor.stats.remote())["kvstore"]["handoff"]

    def rank_stats(self, handle) -> list[dict]:
        """Each rank's KV offload counters, asked now (the replica's own copy is polled)."""
        tp = self.cluster.infos[handle.name]["tp_size"]
        ranks = [ray.get_actor(f"manta-{handle.name}-rank{i}", namespace=NS) for i in range(tp)]
        return ray.get([r.kv_store_stats.remote() for r in ranks], timeout=30)

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """KV usage on both sides back to 0 (requests' pages freed; cached pages are not usage)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            usage = [ray.get(h.actor.stats.remote())["kv_usage"] for h in (self.prefill, self.decode)]
            if usage == [0.0, 0.0]:
                return
            time.sleep(0.2)
        raise AssertionError(f"KV usage stays at {usage}")

    def fault(self, kind: str | None, seconds: float = 0.0, rank: int = 0) -> None:
        actor = ray.get_actor(f"manta-{self.prefill.name}-rank{rank}", namespace=NS)
        ray.get(actor.pd_fault.remote(kind, seconds))


def _metric_sum(pd: PD, name: str, **labels) -> float:
    """A histogram's sum over every replica (PD requests are counted under either side's name)."""
    return sum(s.value for m in pd.metrics.registry.collect() for s in m.samples
               if s.name == name + "_sum" and all(s.labels.get(k) == v for k, v in labels.items()))


def _exported(pd: PD, name: str, **labels) -> float:
    """A sample of the server's /metrics registry, summed over the series that match `labels`."""
    return sum(s.value for m in pd.metrics.registry.collect() for s in m.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _wait_exported(pd: PD, name: str, above: float, **labels) -> float:
    """The sample once the replicas' polled stats have taken it past `above` (they lag a poll)."""
    deadline = time.monotonic() + 15
    while (got := _exported(pd, name, **labels)) <= above and time.monotonic() < deadline:
        time.sleep(0.1)
    assert got > above, (name, labels, got, above)
    return got


# The decode replica's transfer metrics (what they must show after requests that read their prompts).
PD_EXPORTED = ("manta:pd_transfer_wait_seconds_count", "manta:pd_transfer_wait_seconds_sum",
               "manta:pd_transfer_bytes_total", "manta:pd_transfer_pages_total", "manta:pd_transfers_total")


def _check_pd(pd: PD, seeds: range, length: int = 53) -> None:
    before = pd.handoff(pd.decode)["fetched_pages"]
    exported = {name: _exported(pd, name, replica=pd.decode.name) for name in PD_EXPORTED}
    prompts = [prompt_ids(length + s, s) for s in seeds]
    ttft_before = _metric_sum(pd, "manta:time_to_first_token_seconds")
    parts_before = [_metric_sum(pd, "manta:request_queue_time_seconds", stage=s) for s in ("to_engine", "from_engine")]
    engine = "manta:engine_time_to_first_token_seconds"
    engine_before = {h.name: _metric_sum(pd, engine, replica=h.name) for h in (pd.prefill, pd.decode)}
    texts, want = pd.complete(prompts)
    assert texts == want
    # Where the first tokens' time went is the prefill engine's account, under its name: reaching
    # it, its time to the first token and the way back add up to what the server saw (the decode
    # engine is only reached after the first token has gone out).
    ttft = _metric_sum(pd, "manta:time_to_first_token_seconds") - ttft_before
    parts = sum(_metric_sum(pd, "manta:request_queue_time_seconds", stage=s) - b
                for s, b in zip(("to_engine", "from_engine"), parts_before))
    engine_ttft = {n: _metric_sum(pd, engine, replica=n) - b for n, b in engine_before.items()}
    assert engine_ttft[pd.decode.name] == 0 < engine_ttft[pd.prefill.name], engine_ttft
    parts += engine_ttft[pd.prefill.name]
    slack = 0.002 * len(prompts)
    assert ttft * 0.95 - slack <= parts <= ttft * 1.05 + slack, (parts, ttft)
    got = pd.handoff(pd.decode)
    assert got["fetched_pages"] - before >= len(prompts) * (length // 16), got  # the prompts came over NIXL
    assert pd.handoff(pd.prefill)["handed_off"] >= len(prompts)
    # ... and /metrics says so: a wait observed per request, the bytes and pages read.
    for name, was in exported.items():
        _wait_exported(pd, name, was, replica=pd.decode.name)
    waits = _wait_exported(pd, "manta:pd_transfer_wait_seconds_count", exported[PD_EXPORTED[0]] + len(prompts) - 1,
                           replica=pd.decode.name)
    assert _exported(pd, "manta:pd_transfer_wait_seconds_bucket", replica=pd.decode.name, le="+Inf") == waits
    pd.wait_idle()


# (Llama at TP 1 on both sides opens test_disaggregated_faults_end_with_the_right_tokens, with
# the same checks, before its faults: a cluster of its own here would repeat it.)
@pytest.mark.parametrize("arch,prefill_tp,decode_tp", [("llama", 2, 1), ("llama", 1, 2),
                                                       ("deepseek_v2", 1, 1), ("deepseek_v2", 2, 1)])
def test_disaggregated_greedy_equals_transformers(ray_local, tmp_path, arch, prefill_tp, decode_tp):
    pd = PD(str(tiny_model_dir(None, arch)), tmp_path / "kv", prefill_tp, decode_tp)
    try:
        _check_pd(pd, range(4))
        ranks = pd.rank_stats(pd.decode)
        assert sum(r["pd_pages"] for r in ranks) > 0 and sum(r["pd_corrupt"] for r in ranks) == 0
    finally:
        pd.close()


def test_an_fp8_checkpoint_disaggregated_across_tp_sizes(ray_local, tmp_path):
    """A block-wise FP8 DeepSeek-V3 checkpoint (issue 25) prefilled at TP=2 and decoded at TP=1
    through Ray, NIXL, the HTTP server and the openai client: greedy tokens equal transformers
    on the dequantized checkpoint (it cannot run the format on a CPU: tests/test_fp8.py)."""
    import shutil

    from workers.make_fp8 import dequantize_checkpoint, quantize_checkpoint

    model = tmp_path / "fp8"
    shutil.copytree(tiny_model_dir(None, "deepseek_v3"), model)
    quantize_checkpoint(model, "fp8-block", (16, 16))
    dequantize_checkpoint(model, tmp_path / "deq")
    pd = PD(str(model), tmp_path / "kv", 2, 1, oracle=str(tmp_path / "deq"))
    try:
        _check_pd(pd, range(3))
    finally:
        pd.close()


def test_an_fp8_kv_cache_disaggregated_equals_one_replica(ray_local, tmp_path):
    """`--kv-cache-dtype fp8_e4m3` (issue 25): the hand-off moves the FP8 pages as they are. The
    oracle is one engine with the same FP8 cache (transformers has no FP8 KV cache): the same
    tokens, and the pages did come over NIXL."""
    from transformers import AutoTokenizer

    model = str(tiny_model_dir(None, "llama"))
    prompts = [prompt_ids(53 + s, s) for s in range(3)]
    engine = Engine(EngineConfig(model=model, page_size=16, kv_cache_dtype="fp8_e4m3"))
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        want = [r.token_ids for r in engine.generate(prompts, params)]
    finally:
        engine.shutdown()
    tok = AutoTokenizer.from_pretrained(model)
    pd = PD(model, tmp_path / "kv", 1, 1, kv_cache_dtype="fp8_e4m3")
    try:
        before = pd.handoff(pd.decode)["fetched_pages"]
        texts, _ = pd.complete(prompts)
        assert texts == [tok.decode(w, skip_special_tokens=True) for w in want]
        assert pd.handoff(pd.decode)["fetched_pages"] - before >= 3 * 3  # the prompts' pages came over NIXL
        pd.wait_idle()
    finally:
        pd.close()


def test_admin_api_turns_a_mixed_deployment_into_prefill_and_decode(ray_local, tmp_path):
    """`POST /admin/replicas {"role": ...}` adds a prefill and a decode replica beside a mixed
    one; from then on requests go through both (pages over NIXL, transformers' tokens); the
    decode replica removed, the mixed replica serves them whole again. Bad roles are a 400
    naming the field."""
    import httpx

    pd = PD(str(tiny_model_dir(None, "llama")), tmp_path / "kv", 1, 1, sides=dict(replicas=1))
    url = pd.server.url + "/admin/replicas"
    try:
        assert pd.prefill is None and pd.decode is None
        for body, param in (({"role": "prefil"}, "role"), ({"role": "decode", "tp": 2}, "tp")):
            bad = httpx.post(url, json=body, timeout=30)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
        assert httpx.post(url, content=b"{nope", timeout=30).status_code == 400
        for role in ("prefill", "decode"):
            added = httpx.post(url, json={"role": role}, timeout=300)
            assert added.status_code == 201, added.text
            assert {r["name"]: r["role"] for r in added.json()["replicas"]}[added.json()["name"]] == role
        pd.find_sides()
        _check_pd(pd, range(3))  # through both sides, over NIXL
        mixed = next(h for h in pd.router.replicas.values() if h.role == "mixed")
        assert "handoff" not in pd.rank_stats(mixed)[0]  # (started with no prefill replica beside it)
        assert all(pd.rank_stats(h)[0]["handoff"]["pages"] for h in (pd.prefill, pd.decode))
        handoff_bytes = lambda: pd.metrics.registry.get_sample_value("manta:kvstore_usage_bytes",  # noqa: E731
                                                                     {"tier": "handoff"}) or 0
        deadline = time.monotonic() + 30  # (the replicas' rank stats are polled)
        while not handoff_bytes() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert handoff_bytes() > 0
        removed = httpx.delete(f"{url}/{pd.decode.name}", timeout=300)
        assert removed.status_code == 200, removed.text
        before = pd.handoff(pd.prefill)["handed_off"]
        texts, want = pd.complete([prompt_ids(40, 9)])
        assert texts == want and pd.handoff(pd.prefill)["handed_off"] == before  # served whole, by the mixed one
    finally:
        pd.close()


def test_prefill_and_decode_sharing_a_gpu_are_named():
    """The start-up warning's pairs: a prefill and a decode replica whose ranks hold one GPU of
    one node (GPU 0 of another node, or another GPU, is not shared; mixed replicas do not count)."""
    from cluster.launch import pd_sides_sharing_gpus

    def info(role, *ranks):
        return {"role": role, "group": {"ranks": [{"node_id": n, "ip": f"10.0.0.{n}", "gpu_ids": g}
                                                  for n, g in ranks]}}

    infos = {"replica-0": info("prefill", (1, [0]), (1, [1])), "replica-1": info("decode", (2, [0])),
             "replica-2": info("decode", (1, [1])), "replica-3": info("mixed", (1, [0])),
             "replica-4": info("prefill", (3, []))}
    assert pd_sides_sharing_gpus(infos) == ["prefill replica replica-0 and decode replica replica-2 share GPU 1 "
                                            "of node 10.0.0.1"]
    assert pd_sides_sharing_gpus(infos, among="replica-1") == []
    assert pd_sides_sharing_gpus({**infos, "replica-1": info("decode", (1, [0]))}, among="replica-1") == [
        "prefill replica replica-0 and decode replica replica-1 share GPU 0 of node 10.0.0.1"]


def test_hand_off_rows_go_to_the_replicas_that_hand_off():
    """Prefill and decode replicas get --pd-buffer-gb of hand-off rows, and so do mixed ones
    beside prefill replicas (they continue requests when the decode side is full); a deployment
    of mixed replicas alone keeps none, and one with prefill replicas cannot do without."""
    from cluster.engine.config import ConfigError
    from cluster.launch import ClusterOptions

    cfg = EngineConfig(model="m", page_size=16, kv_store="/tmp/kv")
    pd = ClusterOptions(engine=cfg, replicas=1, prefill_replicas=1, decode_replicas=1, pd_buffer_gb=0.5,
                        pd_memory="host")
    assert [pd.engine_for(r).pd_buffer_gb for r in ("prefill", "decode", "mixed")] == [0.5, 0.5, 0.5]
    assert pd.engine_for("decode").pd_memory == "host"
    assert ClusterOptions(engine=cfg, replicas=2).engine_for("mixed").pd_buffer_gb == 0
    for bad, field in ((dict(pd_buffer_gb=0.0), "pd_buffer_gb"), (dict(pd_memory="disk"), "pd_memory")):
        with pytest.raises(ConfigError) as err:
            ClusterOptions(engine=cfg, prefill_replicas=1, decode_replicas=1, **bad)
        assert err.value.field == field


def test_admin_roles_need_the_kv_store():
    from cluster.api.admin import _role
    from cluster.api.errors import APIError

    cfg = EngineConfig(model="m", page_size=16)
    assert _role(b"", cfg) == "mixed" and _role(b'{"role": "mixed"}', cfg) == "mixed"
    with pytest.raises(APIError) as err:
        _role(b'{"role": "prefill"}', cfg)
    assert err.value.status == 400 and err.value.param == "role" and "KV store" in err.value.message
    with pytest.raises(APIError):
        _role(b'{"role": "decode"}', EngineConfig(model="m", page_size=4, kv_store="/tmp/kv"))
    assert _role(b'{"role": "decode"}', EngineConfig(model="m", page_size=16, kv_store="/tmp/kv")) == "decode"


def test_a_full_prefill_queue_sends_the_request_whole_to_the_decode_replica(ray_local, tmp_path):
    """One running and one waiting request fill the prefill replica (a long prompt computed one
    token a step keeps it busy for hundreds of steps); a third request is not refused with a 503
    while the decode replica has room: it computes its prompt there and decodes."""
    pd = PD(str(tiny_model_dir(None, "llama")), tmp_path / "kv", 1, 1, max_running_requests=1, max_waiting=1,
            chunked_prefill_size=1, max_num_batched_tokens=1)
    try:
        before = pd.handoff(pd.prefill)["handed_off"]

        def until(key: str) -> None:
            deadline = time.monotonic() + 30
            while ray.get(pd.prefill.actor.stats.remote())[key] < 1:
                assert time.monotonic() < deadline, f"the prefill replica never had a request {key}"
                time.sleep(0.01)

        async def staggered():
            one = asyncio.create_task(asyncio.to_thread(pd.complete, [prompt_ids(480, 1)], 1))
            await asyncio.to_thread(until, "num_running")
            two = asyncio.create_task(asyncio.to_thread(pd.complete, [prompt_ids(40, 2)], 1))
            await asyncio.to_thread(until, "num_waiting")
            three = await asyncio.to_thread(pd.complete, [prompt_ids(44, 3)], 1)
            return [await one, await two, three]

        for texts, want in asyncio.run(staggered()):
            assert texts == want
        full = pd.metrics.registry.get_sample_value("manta:router_retries_total",
                                                    {"replica": pd.prefill.name, "reason": "queue_full"})
        assert full == 1  # the third was refused by the prefill replica once ...
        assert pd.handoff(pd.prefill)["handed_off"] - before == 2  # ... and never handed off from it
        pd.wait_idle()
    finally:
        pd.close()


def test_disaggregated_faults_end_with_the_right_tokens(ray_local, tmp_path):
    """A corrupted page, a transfer past its deadline, the prefill rank killed while the decode
    rank waits on it, then the restarted prefill replica serving again with fresh NIXL metadata."""
    # A 4 s deadline: a first contact between the ranks (NIXL metadata) on a loaded CI machine fits it.
    pd = PD(str(tiny_model_dir(None, "llama")), tmp_path / "kv", 1, 1, pd_transfer_timeout_s=4.0)
    try:
        _check_pd(pd, range(4))  # first without faults: TP 1 on both sides equals transformers
        ranks = pd.rank_stats(pd.decode)
        assert sum(r["pd_pages"] for r in ranks) > 0 and sum(r["pd_corrupt"] for r in ranks) == 0

        # A lent page's bytes change after the save took their checksum: the reader's checksum of
        # what it read differs, and the pages from it on are computed.
        pd.fault("corrupt_bytes")
        _check_pd_faulted(pd, range(10, 12), "pd_corrupt")
        pd.fault("corrupt")  # one page's checksum goes out wrong (as if the bytes changed on the way)
        # A prompt of 30 pages is read in chunks of 8, the bad middle page in the second: the
        # pages before it (the first chunk whole, part of the second) still come over. (What
        # this checks is the chunked read's bookkeeping; one READ of every page gives the same.)
        pages = sum(r["pd_pages"] for r in pd.rank_stats(pd.decode))
        _check_pd_faulted(pd, range(14, 15), "pd_corrupt", length=480)
        got = sum(r["pd_pages"] for r in pd.rank_stats(pd.decode)) - pages
        assert READ_CHUNK_PAGES < got < 30, got
        pd.fault(None)

        pd.fault("delay", 8.0)  # past the 4 s deadline: the decode side computes the prompt itself
        t0 = time.monotonic()
        _check_pd_faulted(pd, range(20, 21), "pd_timeouts")
        assert time.monotonic() - t0 < 30
        pd.fault(None)
        deadline = time.monotonic() + 30  # the lent rows come back when the lease expires
        while any(r["handoff"]["pinned_rows"] for r in pd.rank_stats(pd.prefill)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(r["handoff"]["pinned_rows"] or r["host"]["pinned_rows"]
                       for r in pd.rank_stats(pd.prefill) + pd.rank_stats(pd.decode))
        # The pages lent and read went through the hand-off rows, not the host tier.
        assert all(r["handoff"]["pages"] for r in pd.rank_stats(pd.prefill) + pd.rank_stats(pd.decode))

        # The prefill rank dies while the decode rank waits on its answer.
        pd.fault("delay", 3.0)  # the kill (0.3 s after the first token) lands inside it
        agents_before = {r["name"] for r in pd.rank_stats(pd.prefill)}

        async def killed_mid_transfer():
            client = openai.AsyncOpenAI(base_url=f"{pd.server.url}/v1", api_key="none", max_retries=0, timeout=120)
            p = prompt_ids(70, 30)
            try:
                stream = await client.completions.create(model=os.path.basename(pd.model), prompt=p,
                                                         max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                                         extra_body={"ignore_eos": True})
                text, killed = "", False
                async for c in stream:
                    text += c.choices[0].text if c.choices else ""
                    if not killed:  # the first token is out: the decode side is reading now
                        await asyncio.sleep(0.3)
                        ray.kill(ray.get_actor(f"manta-{pd.prefill.name}-rank0", namespace=NS))
                        killed = True
                return p, text
            finally:
                await client.close()

        p, text = asyncio.run(killed_mid_transfer())
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(pd.model)
        assert text == tok.decode(hf_greedy(pd.model, p, MAX_TOKENS), skip_special_tokens=True)
        assert sum(r["pd_failures"] for r in pd.rank_stats(pd.decode)) >= 1
        _wait_exported(pd, "manta:pd_transfer_failures_total", 0, replica=pd.decode.name, kind="failed")

        # The prefill replica restarts its rank; the decode replica reads from the new one.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            st = ray.get(pd.prefill.actor.stats.remote())
            if st.get("healthy") and st.get("restarts", 0) >= 1:
                break
            time.sleep(0.5)
        assert st.get("healthy") and st["restarts"] >= 1
        time.sleep(1.0)  # the router's stats poll sees it healthy again
        assert {r["name"] for r in pd.rank_stats(pd.prefill)}.isdisjoint(agents_before)
        _check_pd(pd, range(40, 42))
        # The decode rank dropped the dead rank's NIXL agent for the new one's.
        (decode_rank,) = pd.rank_stats(pd.decode)
        (new_agent,) = {r["handoff"]["agent"] for r in pd.rank_stats(pd.prefill)}
        assert decode_rank["pd_peer_agents"] == {f"manta-{pd.prefill.name}-rank0": new_agent}, decode_rank
        assert decode_rank["pd_agents_replaced"] >= 1

        # A client that goes away mid-answer (on the decode side by then) frees its pages there.
        async def leave_early():
            client = openai.AsyncOpenAI(base_url=f"{pd.server.url}/v1", api_key="none", max_retries=0, timeout=120)
            try:
                stream = await client.completions.create(model=os.path.basename(pd.model), prompt=prompt_ids(60, 50),
                                                         max_tokens=400, temperature=0, stream=True,
                                                         extra_body={"ignore_eos": True})
                n = 0
                async for _ in stream:
                    n += 1
                    if n == 4:
                        break
                await stream.close()
            finally:
                await client.close()

        asyncio.run(leave_early())
        pd.wait_idle()
    finally:
        pd.close()


def _check_pd_faulted(pd: PD, seeds: range, counter: str, length: int = 64) -> None:
    """Requests that meet the fault: the right tokens, the rank's counter and the exported
    `manta:pd_transfer_failures_total` of that kind up."""
    kind = {"pd_corrupt": "corrupt", "pd_timeouts": "timeout"}[counter]
    exported = _exported(pd, "manta:pd_transfer_failures_total", replica=pd.decode.name, kind=kind)
    before = sum(r[counter] for r in pd.rank_stats(pd.decode))
    prompts = [prompt_ids(length + s % 7, s) for s in seeds]
    texts, want = pd.complete(prompts)
    assert texts == want
    assert sum(r[counter] for r in pd.rank_stats(pd.decode)) > before
    _wait_exported(pd, "manta:pd_transfer_failures_total", exported, replica=pd.decode.name, kind=kind)
    pd.wait_idle()
