"""Per-request state of linear-attention layers, beside the KV pool.

A linear-attention layer (KDA: Kimi-Linear, Bailing hybrid) summarises everything a request
has seen in two fixed-size tensors instead of a KV entry per token:
- the recurrent state, [heads, head_dim (keys), head_dim (values)], kept in float32 (as
  transformers keeps it: the decay products are sensitive to rounding);
- the short-convolution state, the last `conv_kernel - 1` pre-convolution inputs q|k|v,
  [3 * heads * head_dim, conv_kernel - 1], in the model dtype.

Slots: a request's state lives in row `req_pool_idx` of every tensor, the request row the
scheduler already allocates on admission and frees with the request, so there is no second
allocator to keep in step. The row is zeroed when the request is (re)admitted
(`reset_admitted`), carried over chunked-prefill pieces and decodes, and simply reused by the
next request that gets the row.

Invariants:
- A state is not page-addressable: it describes a whole prefix, so prefix-cache hits cannot
  restore it. Hybrid models run with the radix cache off (`workers.model_config.serving_mode`)
  and a preempted request recomputes from scratch; `reset_admitted` refuses an admission that
  claims a cached prefix.
- Heads are this rank's heads (tp splits them); every rank holds its own heads' state.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from workers.parallel import divide

if TYPE_CHECKING:
    from workers.messages import StepPlan
    from workers.model_config import ModelConfig

logger = logging.getLogger(__name__)


class LinearStatePool:
    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        conv_kernel: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        """num_slots: request rows (ReqToTokenPool rows, the padding row included);
        num_layers: linear-attention layers only (index i is the i-th linear layer);
        num_heads: this rank's heads."""
        if conv_kernel < 1:
            raise ValueError(f"conv_kernel must be >= 1, not {conv_kernel}")
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.conv_kernel = conv_kernel
        self.conv_dim = 3 * num_heads * head_dim
        self.dtype = dtype
        self.device = device
        self.recurrent = [
            torch.zeros(num_slots, num_heads, head_dim, head_dim, dtype=torch.float32, device=device)
            for _ in range(num_layers)
        ]
        self.conv = [
            torch.zeros(num_slots, self.conv_dim, conv_kernel - 1, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]

    @classmethod
    def for_model(cls, mc: ModelConfig, tp_size: int, num_slots: int, dtype: torch.dtype,
                  device: torch.device | str) -> LinearStatePool | None:
        """The pool a hybrid checkpoint needs on one rank; None for a model without
        linear-attention layers."""
        if not mc.linear_attn_layers:
            return None
        hf = mc.hf_config
        pool = cls(num_slots, len(mc.linear_attn_layers), divide(int(hf.linear_num_heads), tp_size),
                   int(hf.linear_head_dim), int(hf.linear_conv_kernel_dim), dtype, device)
        logger.info("linear-attention state pool: %d layers x %d slots, %.1f MiB", pool.num_layers,
                    num_slots, pool.bytes_per_slot() * num_slots / 2**20)
        return pool

    def bytes_per_slot(self) -> int:
        """Bytes one request's state occupies on this rank over all linear layers."""
        rec = self.num_heads * self.head_dim * self.head_dim * 4
        conv = self.conv_dim * (self.conv_kernel - 1) * self.dtype.itemsize
        return (rec + conv) * self.num_layers

    def reset(self, rows: list[int]) -> None:
        """Zero the state of `rows` (a fresh request: no tokens seen)."""
        if not rows:
            return
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        for rec, conv in zip(self.recurrent, self.conv):
            rec.index_fill_(0, idx, 0.0)
            conv.index_fill_(0, idx, 0.0)

    def reset_admitted(self, plan: StepPlan) -> None:
        """Zero the rows of the requests this plan admits (or re-admits after preemption).
        Call before the forward; the plan's finished rids were dropped already."""
        new = {nr.rid for nr in plan.new_requests}
        if not new:
            return
        admitted = [r for r in plan.reqs if r.rid in new]
        cached = [r.rid for r in admitted if r.prefix_len > 0]
        if cached:
            raise RuntimeError(
                f"requests {cached} were admitted with a cached prefix, but linear-attention state "
                "cannot be restored from KV pages (the radix cache must be off for hybrid models)"
            )
        self.reset([r.req_pool_idx for r in admitted])
