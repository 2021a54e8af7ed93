"""Decode roofline: bytes a decode step must read (weights + KV) over the measured copy
bandwidth of the device. A step cannot be faster than this; `manta bench latency` prints the
measured step time as a fraction of it."""

from __future__ import annotations

import time

import torch


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 31, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written."""
    if device.type != "cuda":
        n = 1 << 26
        a, b = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
        b.copy_(a)
        t0 = time.perf_counter()
        for _ in range(5):
            b.copy_(a)
        return 2 * n * 5 / (time.perf_counter() - t0)
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize(device)
    seconds = start.elapsed_time(end) / 1e3
    del a, b
    return 2 * nbytes * iters / seconds


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def step_weight_bytes(model: torch.nn.Module, batch: int) -> int:
    """Bytes of weights one decode step of `batch` requests must read: every parameter once,
    except
    - an input embedding table: only the `batch` rows looked up (a table tied to the LM head is
      read whole by the head, and counted whole);
    - the routed experts of a MoE layer (`DeepseekMoE`): the expected number of distinct
      experts `batch` tokens select, each choosing top_k of E uniformly at random,
      E * (1 - (1 - k/E)^batch); a real router's skew touches fewer, so this errs high.
    An 8B Llama reads ~15 GB, not its 16 GB of parameters: its 1 GB input embedding is not read."""
    from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from workers.models.deepseek_moe import DeepseekMoE

    partial: dict[int, float] = {}  # id(param) -> fraction of it a step reads
    head = {id(p) for m in model.modules() if isinstance(m, ParallelLMHead) for p in m.parameters()}
    for m in model.modules():
        if isinstance(m, VocabParallelEmbedding) and id(m.weight) not in head:
            partial[id(m.weight)] = min(1.0, batch / m.weight.shape[0])
        elif isinstance(m, DeepseekMoE):
            e, k = m.gate.num_experts, m.gate.top_k
            touched = e * (1 - (1 - k / e) ** batch)
            for p in m.experts.parameters():
                partial[id(p)] = touched / e
    return int(sum(p.numel() * p.element_size() * partial.get(id(p), 1.0) for p in model.parameters()))


def decode_roofline_ms(model: torch.nn.Module, kv_bytes_per_token: int, batch: int, context: int,
                       bandwidth: float) -> float:
    """Lower bound of one decode step: the weights it reads (`step_weight_bytes`) plus each
    request's KV once, over the copy bandwidth."""
    return 1e3 * (step_weight_bytes(model, batch) + batch * context * kv_bytes_per_token) / bandwidth
