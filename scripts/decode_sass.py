"""Compile the paged decode's stage-1 kernels for sm_90 without a GPU and count their main loop.

`python3 scripts/decode_sass.py` (Triton with its NVIDIA backend: `ptxas`, `nvdisasm` and
`cuobjdump` ship in the wheel; no GPU needed): for each variant (the FP8 cache loaded as e4m3
elements or as 16-bit words by `attention.triton_decode._decode_stage1`, and the keys-on-M
kernel of `attention.triton_decode_mma`), the registers, dynamic shared memory, and the SASS
instructions of the longest loop (one 64-key block) with the commonest opcodes. Llama-8B heads
(GROUP 4, dim 128), page size 16, bf16 queries and output, pointers and the specialised strides
16-divisible as the launches give them. A proxy for the GPU: instructions issued and occupancy, not time.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from attention.decode_splits import VARYING
from attention.triton_decode import _decode_stage1
from attention.triton_decode_mma import _decode_stage1_t

POINTERS = {"Q": "*bf16", "K": "*fp8e4nv", "V": "*fp8e4nv", "PageTable": "*i32", "SeqLens": "*i32",
            "MidO": "*fp32", "MidLse": "*fp32", "Out": "*bf16", "Counters": "*i32"}
SCALARS = {"sm_scale_log2": "fp32", "num_splits": "i32"}
STRIDES = ["stride_qb", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_pb", "stride_ob",
           "stride_oh", "stride_os", "stride_lb", "stride_lh", "stride_outb", "stride_outh"]
COMMON = dict(GROUP=4, HEAD_DIM=128, V_DIM=128, PAGE_SIZE=16, BLOCK_H=16, BLOCK_D=128, BLOCK_DV=128,
              PDL=True, MERGE=True, BLOCK_S=2, BLOCK_G=4, CHUNK_S=2, EARLY=False, BLOCK_N=64)
OLD = dict(DOT_PREC="tf32", Q_TO_F16=True)  # bf16 queries over an FP8 cache: widened to float16 (decode_dtype)
# (name, kernel, constexprs, warps, stages): the shipped launches at serve batches and the new kernel's
VARIANTS = [
    ("elements 64,2,5", _decode_stage1, dict(OLD, WIDEN=False), 2, 5),
    ("words 64,4,5", _decode_stage1, dict(OLD, WIDEN=True), 4, 5),
    ("words 64,2,3", _decode_stage1, dict(OLD, WIDEN=True), 2, 3),
    ("keys-on-M elements 64,4,3", _decode_stage1_t, dict(WIDEN=False), 4, 3),
    ("keys-on-M words 64,4,3", _decode_stage1_t, dict(WIDEN=True), 4, 3),
    ("keys-on-M words 64,4,5", _decode_stage1_t, dict(WIDEN=True), 4, 5),
]


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_sm90(fn, constexprs: dict, warps: int, stages: int):
    signature = {**POINTERS, **SCALARS, **{s: "i32" for s in STRIDES}, **{c: "constexpr" for c in constexprs}}
    hinted = set(POINTERS) | (set(STRIDES) - {"stride_os"} - set(VARYING))  # (VARYING: never specialised)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(signature) if n in hinted}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcodes of the longest backward branch's body (the loop over key blocks)."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, ln in enumerate(lines) if (m := re.match(r"\s*\.L_x_(\d+):", ln))}
    loops = [(labels[m.group(1)], i) for i, ln in enumerate(lines)
             if (m := re.search(r"BRA\s+`?\(?\.L_x_(\d+)", ln)) and labels.get(m.group(1), i) < i]
    if not loops:
        return collections.Counter()
    start, end = max(loops, key=lambda t: t[1] - t[0])
    ops = (re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", ln) for ln in lines[start:end + 1])
    return collections.Counter(m.group(1) for m in ops if m)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--top", type=int, default=8, help="opcodes shown per variant")
    a = p.parse_args()
    print(f"{'variant':<28} {'regs':>4} {'smem KB':>7} {'loop':>5} {'x warps':>7}  commonest opcodes")
    for name, fn, extra, warps, stages in VARIANTS:
        kernel = compile_sm90(fn, {**COMMON, **extra}, warps, stages)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            sass = subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout
            usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                                   text=True, check=True).stdout
        regs = int(re.search(r"REG:(\d+)", usage).group(1))
        ops = loop_opcodes(sass)
        n = sum(ops.values())
        top = ", ".join(f"{k} {v}" for k, v in ops.most_common(a.top))
        print(f"{name:<28} {regs:>4} {kernel.metadata.shared / 1024:>7.1f} {n:>5} {n * warps:>7}  {top}")


if __name__ == "__main__":
    main()
