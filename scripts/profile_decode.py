"""Where a decode step's time goes on a GPU: the engine's step interval, one graph replay alone,
and the GPU's kernels over a window of steady-state steps (busy time, the gaps between
kernels, the kernels by total time).

    python3 scripts/profile_decode.py MODEL_DIR [BATCH] [--prefill N] [--quantization fp8] [--out FILE.json]

--prefill N profiles MIXED steps instead: before each profiled step a new N-token prompt
(max_tokens 1) joins the BATCH decoding requests, so every step computes N prompt tokens beside
the decodes (BATCH 0: prompt-only steps, the prefill's kernels by total time). The GPU's busy
time against the step's wall time says whether such a step is bound by the device (kernels)
or by the host (launches, preparation): piecewise graphs only pay for the latter.

Under programmatic dependent launch (`attention/pdl.py`, on by default on Hopper) a
kernel starts before its predecessor ends, so per-kernel times overlap and add up to more than
the step: set `MANTA_PDL=0` for a per-kernel breakdown (the step itself is then slower).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from workers.sampling_params import SamplingParams


def kernel_intervals(prof) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of every GPU kernel or copy the profiler saw."""
    out = []
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            out.append((e.name, e.time_range.start, e.time_range.end))
    return sorted(out, key=lambda x: x[1])


def layer_breakdown(iv: list[tuple[str, float, float]], anchor: str = "_decode_stage1") -> list[tuple[str, float, float]]:
    """The kernels of one decoder layer, averaged over the layers and steps profiled: the
    sequence between consecutive `anchor` kernels (the layer's position in the step differs,
    its kernels do not; `_mla_stage1` for MLA models), as (name, mean duration µs, mean end-to-end interval µs). The interval
    (this kernel's end minus the previous kernel's) is what a kernel adds to the step even
    when PDL overlaps it with its neighbours."""
    idx = [i for i, (name, _, _) in enumerate(iv) if name == anchor]
    groups: dict[tuple[str, ...], list[list[tuple[float, float]]]] = defaultdict(list)
    for a, b in zip(idx, idx[1:]):
        seq = iv[a + 1 : b + 1]
        key = tuple(name for name, _, _ in seq)
        groups[key].append([(e - s, e - iv[a + j][2]) for j, (_, s, e) in enumerate(seq)])
    if not groups:
        return []
    key, runs = max(groups.items(), key=lambda kv: len(kv[1]))  # the most common layer sequence
    return [(name, sum(r[j][0] for r in runs) / len(runs), sum(r[j][1] for r in runs) / len(runs))
            for j, name in enumerate(key)]


def busy_union(iv: list[tuple[str, float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for _, s, e in iv:
        if s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("batch", type=int, nargs="?", default=1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--input-len", type=int, default=512, help="the decoding requests' prompt length")
    ap.add_argument("--prefill", type=int, default=0, help="a new prompt of this many tokens in every step")
    ap.add_argument("--quantization", default=None, help="e.g. fp8: quantize the weights at load")
    ap.add_argument("--kv-cache-dtype", default="auto", help="fp8_e4m3: the FP8 KV cache")
    ap.add_argument("--load-format", default="auto", help="dummy: random weights drawn at load (make-model --no-weights)")
    ap.add_argument("--out")
    a = ap.parse_args()
    engine = Engine(EngineConfig(model=a.model, device="cuda", page_size=16, max_context_len=4096, mem_fraction=0.5,
                                 chunked_prefill_size=max(2048, a.prefill), mixed_prefill_tokens=0,
                                 quantization=a.quantization, load_format=a.load_format,
                                 kv_cache_dtype=a.kv_cache_dtype))
    runner = engine.workers.runner
    prompts = [[5 + (i * 7 + j) % 800 for j in range(a.input_len)] for i in range(a.batch)]
    params = SamplingParams(max_tokens=a.steps + 60, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params, lambda out: None)
    once = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    fresh = iter(range(1, 1 << 30))
    vocab = engine.model_config.vocab_size

    def step() -> None:
        if a.prefill:  # a prompt no earlier one shares a page with (no prefix-cache hit)
            k = next(fresh)
            engine.add_request([(k * 131 + j * 17) % (vocab - 5) + 5 for j in range(a.prefill)], once, lambda out: None)
        engine.step()

    sched = engine.scheduler
    while sched.waiting or any(not r.output_ids for r in sched.running):  # the batch's prefill
        engine.step()
    for _ in range(10):  # warm-up
        engine.step()
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            step()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    iv = kernel_intervals(prof)
    anchor = next((n for n in ("_decode_stage1", "_mla_stage1") if any(k == n for k, _, _ in iv)), "_decode_stage1")
    span_us = iv[-1][2] - iv[0][1] if iv else 0.0
    busy_us = busy_union(iv)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, s, e in iv:
        by_name[name][0] += 1
        by_name[name][1] += e - s
    gr = runner.pipeline.graphs
    graph_ms = None
    if gr is not None and gr.use_graphs and a.batch:
        g = gr.graphs[gr.inputs.padded_size(a.batch)]
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(20):
            g.replay()
        e.record()
        torch.cuda.synchronize()
        graph_ms = s.elapsed_time(e) / 20
    n = a.steps
    report = {
        "batch": a.batch, "prefill": a.prefill, "steps": n, "wall_ms_per_step": wall_ms / n,
        "gpu_span_ms_per_step": span_us / 1e3 / n, "gpu_busy_ms_per_step": busy_us / 1e3 / n,
        "gpu_kernels_per_step": len(iv) / n, "graph_replay_alone_ms": graph_ms,
        "layer": layer_breakdown(iv, anchor) if a.batch else [],
        "kernels": sorted(([k, c / n, t / 1e3 / n] for k, (c, t) in by_name.items()), key=lambda x: -x[2])[:30],
    }
    print(f"batch {a.batch}{f' + a {a.prefill}-token prompt' if a.prefill else ''}: step (profiled) "
          f"{wall_ms / n:.3f} ms; GPU busy {busy_us / 1e3 / n:.3f} ms of "
          f"{span_us / 1e3 / n:.3f} ms span per step, {len(iv) / n:.0f} kernels/copies per step; "
          f"graph replay alone {graph_ms if graph_ms is None else round(graph_ms, 3)} ms")
    print(f"{'kernel':90s} {'per step':>8s} {'ms/step':>8s}")
    for name, c, t in report["kernels"]:
        print(f"{name[:90]:90s} {c:8.1f} {t:8.3f}")
    print(f"one layer ({'kernel':<40s} {'dur us':>7s} {'end-to-end us':>13s})")
    for name, dur, gap in report["layer"]:
        print(f"  {name[:48]:48s} {dur:7.2f} {gap:13.2f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
