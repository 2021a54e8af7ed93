"""Where a decode step's time goes on a GPU: forward-batch build, graph replay, logits, sampling.

    python3 scripts/profile_decode.py MODEL_DIR [BATCH]
"""

import sys
import time

import torch

from cluster.config import EngineConfig
from cluster.engine import Engine
from workers.sampling_params import SamplingParams


def main() -> None:
    model, batch = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1
    engine = Engine(EngineConfig(model=model, device="cuda", page_size=16, max_context_len=4096, mem_fraction=0.5))
    runner = engine.workers.runner
    timings: dict[str, list[float]] = {"build": [], "forward": [], "logits": [], "sample": [], "total": []}
    orig_build, orig_forward = runner.build_forward_batch, runner.forward
    orig_logits, orig_sample = runner.model.compute_logits, runner.sampler.sample

    def timed(name, fn):
        def wrapper(*a, **k):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn(*a, **k)
            torch.cuda.synchronize()
            timings[name].append(time.perf_counter() - t0)
            return out
        return wrapper

    runner.build_forward_batch = timed("build", orig_build)
    runner.forward = timed("forward", orig_forward)
    runner.model.compute_logits = timed("logits", orig_logits)
    runner.sampler.sample = timed("sample", orig_sample)
    orig_exec = runner.execute
    runner.execute = timed("total", orig_exec)
    prompts = [[5 + (i * 7 + j) % 800 for j in range(256)] for i in range(batch)]
    engine.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for name, xs in timings.items():
        xs = sorted(xs[5:])
        print(f"{name:8s} median {1e3 * xs[len(xs) // 2]:.3f} ms  (n={len(xs)})")
    # GPU time of one graph replay alone.
    gr = runner.graph_runner
    bs = next(b for b in gr.batch_sizes if b >= batch)
    g = gr.graphs[bs]
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    print(f"graph replay alone: {s.elapsed_time(e) / 20:.3f} ms")


if __name__ == "__main__":
    main()
