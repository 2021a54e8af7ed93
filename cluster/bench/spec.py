"""`manta bench spec`: offline throughput with and without speculative decoding.

Three engines, one at a time, each running the same greedy workload (`bench_offline`: B prompts
submitted together, fixed lengths, ignore_eos) at each batch size B of `--batch`:

- baseline:  no draft model;
- agree:     the draft is a copy of the target (every draft is accepted: the ceiling of what
             acceptance can buy, at the price of a draft as large as the target);
- disagree:  a draft with other random weights and the same tokenizer (`--speculative-draft-model`,
             or a small random Llama made here with the target's vocabulary): almost nothing is
             accepted, so this is the cost of speculating in vain.

Each row reports output tokens/s, the speedup over the baseline, drafts proposed and accepted,
and the mean acceptance length (tokens emitted per request per round, 1 .. K + 1).

`--identity-tail-layers M` adds a draft that agrees *and* is cheap, which random weights cannot
otherwise give: the target with its decoder layers from M on turned into exact identities (their
output projections zeroed), beside the same target with its first M layers as the draft.
"""

from __future__ import annotations

import gc
import json
import tempfile
import time
from pathlib import Path

from cluster.bench.offline import bench_offline
from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine


def random_draft(target_dir: str, out_dir: Path) -> str:
    """A small random Llama with the target's vocabulary (so make-model writes the same
    tokenizer) and enough positions for it."""
    from workers.make_model import make_model

    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    make_model(out_dir, "llama", layers=1, hidden=128, heads=4, kv_heads=2, intermediate=256,
               vocab=int(cfg["vocab_size"]), max_position=int(cfg.get("max_position_embeddings", 2048)), seed=1)
    return str(out_dir)


def identity_tail_pair(target_dir: str, out_dir: Path, keep: int) -> tuple[str, str]:
    """A target whose decoder layers from `keep` on are exact identities (o_proj and down_proj
    zeroed: the residual stream passes through them) and a draft made of its first `keep` layers.
    The draft then computes exactly the target's function at a fraction of its cost: the
    agreeing, cheap draft that random weights cannot otherwise give. Llama-family checkpoints."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    src = Path(target_dir)
    tgt, drf = out_dir / "target", out_dir / "draft"
    tgt.mkdir(parents=True)
    drf.mkdir(parents=True)
    layer = re.compile(r"model\.layers\.(\d+)\.")
    draft_tensors = {}
    for f in sorted(src.iterdir()):
        if f.suffix == ".safetensors":
            tensors = load_file(str(f))
            for name, t in tensors.items():
                m = layer.match(name)
                if m is None or int(m.group(1)) < keep:
                    draft_tensors[name] = t
                elif ".o_proj." in name or ".down_proj." in name:
                    t.zero_()
            save_file(tensors, str(tgt / f.name), metadata={"format": "pt"})
        elif f.is_file():
            shutil.copy(f, tgt / f.name)
            if not f.name.endswith(".index.json"):
                shutil.copy(f, drf / f.name)
    save_file(draft_tensors, str(drf / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = keep
    for key in ("layer_types",):  # per-layer lists follow the layer count
        if isinstance(cfg.get(key), list):
            cfg[key] = cfg[key][:keep]
    (drf / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(tgt), str(drf)


def _run(config: EngineConfig, batches: list[int], input_len: int, output_len: int) -> dict:
    """One engine, the workload at each batch size (number of prompts submitted at once)."""
    engine = Engine(config)
    try:
        rows = {}
        for b in batches:
            st = engine.scheduler.stats
            before = (st.spec_draft_tokens, st.spec_accepted_tokens, st.spec_verify_requests)
            cpu0 = time.process_time()
            row = bench_offline(engine, b, input_len, output_len)
            cpu = time.process_time() - cpu0  # includes bench_offline's 2-token warm-up
            drafts, accepted, rounds = (now - was for now, was in zip(
                (st.spec_draft_tokens, st.spec_accepted_tokens, st.spec_verify_requests), before))
            # CPU seconds of this process: on a shared CPU machine (one torch thread) a steadier
            # measure of the work than wall time; meaningless on GPU.
            row = {k: row[k] for k in ("seconds", "output_tokens_per_s")}
            row.update(cpu_seconds=cpu, output_tokens_per_cpu_s=b * output_len / cpu)
            if config.speculative_draft_model is not None:
                row.update(draft_tokens=drafts, accepted_tokens=accepted,
                           acceptance_rate=accepted / max(1, drafts),
                           mean_acceptance_length=(accepted + rounds) / max(1, rounds))
            rows[f"batch {b}"] = row
        return rows
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass


def bench_spec(config: EngineConfig, batches: list[int], input_len: int, output_len: int,
               identity_tail_layers: int = 0, identity_tail_only: bool = False) -> dict:
    """The three runs above; with identity_tail_layers = M > 0 also a fourth and fifth: the
    target with its layers from M on made identities, without a draft and with its first M
    layers as the draft (`identity_tail_pair`); identity_tail_only: those two alone."""
    if identity_tail_only and identity_tail_layers < 1:
        raise ValueError("identity_tail_only needs identity_tail_layers >= 1")
    base = config.replace(speculative_draft_model=None)
    with tempfile.TemporaryDirectory(prefix="manta-draft-") as tmp:
        other = config.speculative_draft_model or random_draft(config.model, Path(tmp) / "draft")
        runs = {
            "baseline": ("baseline", base),
            "agree (draft = copy of target)": ("baseline", base.replace(speculative_draft_model=config.model)),
            f"disagree (draft = {Path(other).name})": ("baseline", base.replace(speculative_draft_model=other)),
        }
        if identity_tail_only:
            runs = {}
        if identity_tail_layers > 0:
            tgt, drf = identity_tail_pair(config.model, Path(tmp) / "identity-tail", identity_tail_layers)
            ident = base.replace(model=tgt, tokenizer=config.tokenizer or config.model)
            runs["identity-tail target, baseline"] = ("identity-tail target, baseline", ident)
            runs[f"identity-tail target, draft = its first {identity_tail_layers} layers"] = (
                "identity-tail target, baseline", ident.replace(speculative_draft_model=drf))
        out: dict = {"num_draft_tokens": config.speculative_num_tokens, "input_len": input_len,
                     "output_len": output_len}
        for name, (_, cfg) in runs.items():
            out[name] = _run(cfg, batches, input_len, output_len)
    for name, (ref, _) in runs.items():
        for b, row in out[name].items():
            row["speedup"] = row["output_tokens_per_s"] / out[ref][b]["output_tokens_per_s"]
    return out
