"""SiLU(gate) * up of a fused gate_up product, as one Triton kernel (CUDA).

`torch.compile` fused `fused._silu_and_mul` into one pointwise kernel, but over a flat index
with the row length as a runtime value: at a 2,048-token prompt of the 8B shape it took 132 us
a layer, three times its bytes' time on an H200 (4.2 ms of a 57 ms prefill step; BENCHMARKS.md).
Here a program takes one row and one block of columns, so the gate and up addresses need no
division, and each load is a contiguous run.

The math is the CPU path's: SiLU in float32 rounded to the input's dtype (torch's `F.silu`), then
the product with `up` in float32 rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention import pdl

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (r, c): row r's columns c*BLOCK ... of gate = x[r, :inter], up = x[r, inter:]."""
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    row = x_ptr + r * stride_x
    gate = tl.load(row + cols, mask=mask, other=0.0)
    up = tl.load(row + inter + cols, mask=mask, other=0.0)
    tl.store(out_ptr + r * stride_o + cols, silu_mul(gate, up), mask=mask)


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up in gate's dtype, rounded as the CPU path: SiLU in float32 rounded to the
    dtype (torch's `F.silu`), then the product in float32 rounded once."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    return (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * inter] (last dim contiguous) -> silu(x[..., :inter]) * x[..., inter:]."""
    inter = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], inter, dtype=x.dtype, device=x.device)
    if rows.shape[0] and inter:
        use_pdl = pdl.enabled(x.device)
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(inter, BLOCK))](
            rows, out, rows.stride(0), out.stride(0), inter, BLOCK=BLOCK, PDL=use_pdl, num_warps=4,
            launch_pdl=use_pdl,
        )
    return out.view(*x.shape[:-1], inter)
