"""The inputs of one speculative round (`workers.spec_runner`), packed once for both models.

A round's plan (`workers.spec_messages.SpecStepPlan`) is read here into one host buffer and one
host-to-device copy; the slots of every position of the round go into the shared request table
before any attention reads it (the target's input batch's placement rule). The three kinds of
batch of the round are built by each model's own `InputBatch`:
- `draft_extend`: DRAFT_EXTEND_V2, the tokens the draft lacks (seq_lens is the draft's prefix
  *before* the write; the attention reads prefix + extend); logits at each request's last token;
- `draft_decode(j)`: draft j + 1 at position L + j;
- `verify`: TARGET_VERIFY, t0 and the K drafts at positions L .. L + K; logits of every one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.forward_batch import ForwardBatch, ForwardMode
from workers.input_batch import InputBatch
from workers.spec_messages import SpecStepPlan


@dataclass
class SpecRound:
    B: int
    K: int
    catch: list[int]  # tokens the draft writes first (>= 1 per request)
    dprefix: list[int]  # the draft's cached length before them
    prefix: list[int]  # the target's (t0's position, L)
    c_ids: torch.Tensor
    c_pos: torch.Tensor
    c_slots: torch.Tensor
    v_pos: torch.Tensor
    v_slots: torch.Tensor
    rows: torch.Tensor
    dprefix_t: torch.Tensor
    catch_t: torch.Tensor
    prefix_t: torch.Tensor

    @classmethod
    def pack(cls, plan: SpecStepPlan, inputs: InputBatch) -> SpecRound:
        reqs = plan.reqs
        B, K = len(reqs), plan.num_draft_tokens
        catch = [len(r.input_ids) for r in reqs]
        dprefix = [r.prefix_len for r in reqs]
        prefix = [d + c - 1 for d, c in zip(dprefix, catch)]
        c_pos = [d + j for d, c in zip(dprefix, catch) for j in range(c)]
        v_pos = [p + j for p in prefix for j in range(K + 1)]
        Tc, Tv = len(c_pos), len(v_pos)
        for r, c in zip(reqs, catch):
            assert len(r.out_cache_loc) == c + K, (r.rid, len(r.out_cache_loc), c, K)
        packed = inputs.upload(
            [tok for r in reqs for tok in r.input_ids] + c_pos
            + [s for r, c in zip(reqs, catch) for s in r.out_cache_loc[:c]]
            + v_pos + [s for r, c in zip(reqs, catch) for s in r.out_cache_loc[c - 1:]]
            + [r.req_pool_idx for r in reqs] + dprefix + catch + prefix, torch.long)
        parts = packed.split([Tc, Tc, Tc, Tv, Tv, B, B, B, B])
        rnd = cls(B, K, catch, dprefix, prefix, *parts)
        # Slots of every position of the round, before any attention reads the table.
        inputs.place(rnd.rows.repeat_interleave(rnd.catch_t, output_size=Tc), rnd.c_pos, rnd.c_slots)
        inputs.place(rnd.rows.repeat_interleave(K + 1, output_size=Tv), rnd.v_pos, rnd.v_slots)
        return rnd

    def draft_extend(self, inputs: InputBatch) -> ForwardBatch:
        return inputs.ragged(ForwardMode.DRAFT_EXTEND_V2, input_ids=self.c_ids, positions=self.c_pos, rows=self.rows,
                             seq_lens=self.dprefix_t, seq_lens_cpu=self.dprefix, slots=self.c_slots,
                             extend=self.catch_t, extend_cpu=self.catch, prefix=self.dprefix_t,
                             prefix_cpu=self.dprefix)

    def draft_decode(self, inputs: InputBatch, j: int, input_ids: torch.Tensor) -> ForwardBatch:
        """Draft j + 1 (1 <= j < K) from draft j (`input_ids`), at position L + j."""
        return inputs.decode(input_ids=input_ids, positions=self.prefix_t + j, rows=self.rows,
                             seq_lens=self.prefix_t + (j + 1), seq_lens_cpu=[p + j + 1 for p in self.prefix],
                             slots=self.v_slots.view(self.B, self.K + 1)[:, j])

    def verify(self, inputs: InputBatch, draft_ids: torch.Tensor) -> ForwardBatch:
        """t0 and the drafts [B, K], scored at every position."""
        B, K = self.B, self.K
        last = torch.cumsum(self.catch_t, 0) - 1
        v_ids = torch.cat([self.c_ids[last].unsqueeze(1), draft_ids], dim=1).reshape(-1)
        ext = torch.full((B,), K + 1, dtype=torch.int32, device=self.rows.device)
        return inputs.ragged(ForwardMode.TARGET_VERIFY, input_ids=v_ids, positions=self.v_pos, rows=self.rows,
                             seq_lens=self.prefix_t + (K + 1), seq_lens_cpu=[p + K + 1 for p in self.prefix],
                             slots=self.v_slots, extend=ext, extend_cpu=[K + 1] * B, prefix=self.prefix_t,
                             prefix_cpu=self.prefix, every_token=True)
