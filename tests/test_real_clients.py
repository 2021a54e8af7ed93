"""The third-party clients users point at the server, run for real against it: lm-eval's
`local-completions` model (a loglikelihood multiple-choice task and a generate_until task,
shipped offline under tests/data/lm_eval/), guidellm's streaming benchmark and aiperf's streaming
profile.

Each client lives in its own virtual environment under `.clients/` (their pins clash with ours),
made by scripts/setup.sh at the versions written there; a missing one is skipped with the reason.
They run as child processes, offline (`HF_HUB_OFFLINE`, `HF_DATASETS_OFFLINE`), with the tokenizer
of the tiny checkpoint the server serves. The server is the real HTTP app on 127.0.0.1 over an
in-process engine, as in tests/test_server.py; no part of it is stubbed.

What is checked is what the client computed from our answers: lm-eval's loglikelihoods equal
transformers' log-softmax on the same tokens, its accuracy follows from them, its generations equal
our greedy completion of the same token ids; guidellm and aiperf saw no error and measured TTFT and
ITL over the token counts we were asked for. The server's own counters agree on how many requests came.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections import defaultdict
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.api.metrics import ServerMetrics
from cluster.api.server import BackgroundServer, build_app
from cluster.engine.client import LocalEngineClient
from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from tests.fixtures import tiny_model_dir

ROOT = Path(__file__).resolve().parents[1]
CLIENTS = ROOT / ".clients"
LM_EVAL_DATA = Path(__file__).resolve().parent / "data" / "lm_eval"
MODEL = "tiny"


def client_bin(venv: str, program: str) -> Path:
    """The client's console script; skipped where scripts/setup.sh has not installed it (it prints
    a note and leaves a log beside .clients/<venv> when the install fails)."""
    path = CLIENTS / venv / "bin" / program
    if not (CLIENTS / venv / ".installed").exists() or not path.exists():
        pytest.skip(f".clients/{venv} is not installed: run scripts/setup.sh (see .clients/{venv}.log if it failed)")
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = tiny_model_dir(tmp_path_factory, "llama")
    engine = Engine(EngineConfig(model=str(model_dir), served_model_name=MODEL, kv_cache_tokens=4096,
                                 max_running_requests=16))
    metrics = ServerMetrics()
    client = LocalEngineClient(engine, metrics=metrics)
    http = BackgroundServer(build_app(client, metrics))
    try:
        yield {"url": http.url, "model_dir": model_dir}
    finally:
        http.stop()
        asyncio.run(client.aclose())


def counters(url: str) -> defaultdict[str, float]:
    """The server's counters from /metrics, each summed over its labels (0 before its first
    labelled sample, e.g. a finish reason not seen yet)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out: defaultdict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_total"):
                out[sample.name] += sample.value
    return out


def run_client(argv: list, cwd: Path, home: Path, timeout_s: float = 300,
               hf_offline: bool = True) -> subprocess.CompletedProcess:
    """A client's command line, offline, with its own HF cache; its output is in the failure.
    `hf_offline=False` leaves HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE unset (there is still no
    network: the tokenizer is a local directory) for a client that takes either as "load the
    tokenizer from the HF cache" and so cannot load one from a directory (aiperf)."""
    # The clients' venvs are installed without byte-compiling (scripts/setup.sh: faster); let the
    # first run cache what it imports, for the later runs and the clients' own worker processes.
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(home),
               TOKENIZERS_PARALLELISM="false", NO_COLOR="1", COLUMNS="200")
    if not hf_offline:
        del env["HF_HUB_OFFLINE"], env["TRANSFORMERS_OFFLINE"]
    proc = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0, f"{argv[0]} exited {proc.returncode}:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    return proc


# ------------------------------------------------------------------------------------------------
# lm-eval
# ------------------------------------------------------------------------------------------------


def reference_logprobs(model_dir: Path):
    """ids -> logprob of each token after the first, by transformers on the same checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()

    def score(ids: list[int]) -> tuple[list[float], list[bool]]:
        with torch.no_grad():
            lp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        chosen = [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]
        greedy = [int(lp[i - 1].argmax()) == ids[i] for i in range(1, len(ids))]
        return chosen, greedy

    return score


def read_samples(out: Path, task: str) -> list[dict]:
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("batching", ["sequential", "batched"])
def test_lm_eval_local_completions(server, tmp_path, batching):
    """lm-eval as its docs tell users to run it against an OpenAI-compatible server: token-id
    prompts (`tokenized_requests`), loglikelihood by `echo` + `logprobs` + `max_tokens: 1`. The
    "batched" run sends 4 prompts per request, 2 requests at a time (aiohttp)."""
    from transformers import AutoTokenizer

    lm_eval = client_bin("lm-eval", "lm-eval")
    model_dir, url = server["model_dir"], server["url"]
    args = {"model": MODEL, "base_url": f"{url}/v1/completions", "tokenizer": model_dir,
            "tokenizer_backend": "huggingface", "tokenized_requests": True, "max_length": 512, "max_retries": 1}
    batch = ["--batch_size", "1"]
    if batching == "batched":
        args["num_concurrent"] = 2
        batch = ["--batch_size", "4"]
    before = counters(url)
    out = tmp_path / "out"
    run_client([lm_eval, "run", "--model", "local-completions",
                "--model_args", ",".join(f"{k}={v}" for k, v in args.items()),
                "--tasks", "manta_mc,manta_gen", "--include_path", LM_EVAL_DATA,
                "--output_path", out, "--log_samples", *batch],
               cwd=LM_EVAL_DATA, home=tmp_path / "hf")
    after = counters(url)

    (results_file,) = out.rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]
    acc, exact = results["manta_mc"]["acc,none"], results["manta_gen"]["exact_match,none"]
    assert 0.0 <= acc <= 1.0 and 0.0 <= exact <= 1.0

    tok = AutoTokenizer.from_pretrained(model_dir)
    encode = lambda s: tok(s, add_special_tokens=False).input_ids  # noqa: E731 - lm-eval's tok_encode

    # Loglikelihood: lm-eval encodes context + continuation whole and scores the tokens past the
    # context's length; the sum must be transformers' own, and the accuracy must follow from it.
    score = reference_logprobs(model_dir)
    mc = read_samples(out, "manta_mc")
    assert len(mc) == len((LM_EVAL_DATA / "manta_mc.jsonl").read_text().splitlines())
    n_loglikelihood, correct = 0, 0
    for sample in mc:
        lls = []
        for resp, arg in zip(sample["resps"], sample["arguments"].values()):
            context, continuation = arg["arg_0"], arg["arg_1"]
            ctxlen = len(encode(context))
            chosen, greedy = score(encode(context + continuation))
            got_ll, got_greedy = float(resp[0][0]), resp[0][1] == "True"
            assert got_ll == pytest.approx(sum(chosen[ctxlen - 1:]), abs=1e-3), (context, continuation)
            assert got_greedy == all(greedy[ctxlen - 1:]), (context, continuation)
            lls.append(got_ll)
            n_loglikelihood += 1
        correct += max(range(len(lls)), key=lls.__getitem__) == sample["doc"]["answer"]
    assert acc == pytest.approx(correct / len(mc))

    # generate_until: greedy, stop at a newline, at most 8 tokens, on the context's token ids.
    gen = read_samples(out, "manta_gen")
    assert len(gen) == len((LM_EVAL_DATA / "manta_gen.jsonl").read_text().splitlines())
    for sample in gen:
        context = sample["arguments"]["gen_args_0"]["arg_0"]
        ours = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": encode(context), "max_tokens": 8, "temperature": 0, "stop": ["\n"]})
        assert ours.status_code == 200, ours.text
        assert sample["resps"][0][0] == ours.json()["choices"][0]["text"], context

    # The server saw each scoring request and each generation once, and failed none.
    finished = after["manta:request_finished_total"] - before["manta:request_finished_total"]
    assert finished == n_loglikelihood + len(gen)
    assert after["manta:request_errors_total"] == before["manta:request_errors_total"]


# ------------------------------------------------------------------------------------------------
# guidellm
# ------------------------------------------------------------------------------------------------

GUIDELLM_REQUESTS = 6
PROMPT_TOKENS, OUTPUT_TOKENS = 16, 8


@pytest.mark.parametrize("request_format", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm_streaming_benchmark(server, tmp_path, request_format):
    """A synchronous benchmark of synthetic prompts (16 tokens in, 8 out, streamed with usage),
    as guidellm's quick start runs it."""
    guidellm = client_bin("guidellm", "guidellm")
    url = server["url"]
    before = counters(url)
    report = tmp_path / "report.json"
    run_client([guidellm, "run",
                "--backend", f"kind=openai_http,target={url},model={MODEL},request_format={request_format}",
                "--profile", "kind=synchronous",
                "--constraint", f"kind=max_requests,count={GUIDELLM_REQUESTS}",
                "--tokenizer", f"kind=huggingface_auto,model={server['model_dir']}",
                "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
                "--output", f"kind=json,path={report}",
                "--disable-console-interactive"],
               cwd=tmp_path, home=tmp_path / "hf")
    after = counters(url)

    (bench,) = json.loads(report.read_text())["benchmarks"]
    totals = bench["metrics"]["request_totals"]
    assert totals == {"successful": GUIDELLM_REQUESTS, "errored": 0, "incomplete": 0, "total": GUIDELLM_REQUESTS}
    metrics = bench["metrics"]
    ttft = metrics["time_to_first_token_ms"]["successful"]
    itl = metrics["inter_token_latency_ms"]["successful"]
    assert ttft["count"] == GUIDELLM_REQUESTS and ttft["min"] > 0
    # ITL: one sample per token after the first, timed from the stream and counted from our usage.
    assert itl["count"] == GUIDELLM_REQUESTS * (OUTPUT_TOKENS - 1) and itl["min"] > 0
    for req in bench["requests"]["successful"]:
        assert req["output_metrics"]["text_tokens"] == OUTPUT_TOKENS  # our usage: ignore_eos + max_tokens
        if request_format == "/v1/completions":  # a chat prompt adds the template's tokens
            assert req["input_metrics"]["text_tokens"] == PROMPT_TOKENS

    assert after["manta:request_finished_total"] - before["manta:request_finished_total"] == GUIDELLM_REQUESTS
    assert (after["manta:generation_tokens_total"] - before["manta:generation_tokens_total"]
            == GUIDELLM_REQUESTS * OUTPUT_TOKENS)
    assert after["manta:request_errors_total"] == before["manta:request_errors_total"]



# ------------------------------------------------------------------------------------------------
# aiperf
# ------------------------------------------------------------------------------------------------

AIPERF_REQUESTS = 6


@pytest.mark.parametrize("endpoint_type", ["completions", "chat"])
def test_aiperf_streaming_profile(server, tmp_path, endpoint_type):
    """A streaming profile of synthetic prompts (16 tokens in, 8 out with ignore_eos), one request at
    a time, output lengths from our usage (`--use-server-token-count`), as aiperf's docs run it."""
    aiperf = client_bin("aiperf", "aiperf")
    url = server["url"]
    before = counters(url)
    out = tmp_path / "artifacts"
    run_client([aiperf, "profile", "--model", MODEL, "--url", url, "--endpoint-type", endpoint_type,
                "--streaming", "--tokenizer", server["model_dir"], "--use-server-token-count",
                "--request-count", AIPERF_REQUESTS, "--concurrency", 1,
                "--synthetic-input-tokens-mean", PROMPT_TOKENS, "--synthetic-input-tokens-stddev", 0,
                "--output-tokens-mean", OUTPUT_TOKENS, "--output-tokens-stddev", 0,
                "--extra-inputs", "ignore_eos:true", "--random-seed", 0,
                "--no-server-metrics", "--ui-type", "none", "--artifact-dir", out],
               cwd=tmp_path, home=tmp_path / "hf", hf_offline=False)
    after = counters(url)

    (export,) = out.rglob("profile_export_aiperf.json")
    metrics = json.loads(export.read_text())
    assert metrics["aiperf_version"] == "0.13.0" and metrics["is_complete"] and not metrics["was_cancelled"]
    assert metrics["request_count"]["avg"] == AIPERF_REQUESTS
    assert metrics["completed_request_count"]["avg"] == AIPERF_REQUESTS
    assert metrics["request_error_rate"]["avg"] == 0 and metrics["error_summary"] == []
    assert "error_request_count" not in metrics
    ttft, itl = metrics["time_to_first_token"], metrics["inter_token_latency"]
    assert ttft["count"] == AIPERF_REQUESTS and ttft["min"] > 0
    # ITL per request = (latency - TTFT) / (output tokens - 1), the tokens counted from our usage.
    # aiperf timestamps each network read, so a stream that arrives in one read has an ITL of 0: the
    # server's keep-alive responses did before it set TCP_NODELAY (5 of these 6 requests, so the
    # median was 0). The median, not the min: a client that is late to read on a loaded machine
    # may find one whole 8-token stream waiting.
    assert itl["count"] == AIPERF_REQUESTS and itl["p50"] > 0
    assert metrics["usage_completion_tokens"]["min"] == metrics["usage_completion_tokens"]["max"] == OUTPUT_TOKENS
    assert metrics["output_sequence_length"]["avg"] == OUTPUT_TOKENS  # ignore_eos + max_tokens
    if endpoint_type == "completions":  # a chat prompt adds the template's tokens
        assert metrics["usage_prompt_tokens"]["min"] == metrics["usage_prompt_tokens"]["max"] == PROMPT_TOKENS

    assert after["manta:request_finished_total"] - before["manta:request_finished_total"] == AIPERF_REQUESTS
    assert (after["manta:generation_tokens_total"] - before["manta:generation_tokens_total"]
            == AIPERF_REQUESTS * OUTPUT_TOKENS)
    assert after["manta:request_errors_total"] == before["manta:request_errors_total"]
