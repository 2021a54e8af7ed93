"""Speculative decoding on one rank: the draft model beside the target, and one round per plan.

Design (what lives where):
- The target's `ModelRunner` holds a `DraftRunner` when `speculative_draft_model` is set. The
  draft model is sharded over the same TP group, on the same device, and its weights and K/V
  come out of the same memory budget (the runner sizes its KV pool after loading both).
- The draft's KV pool mirrors the target's: as many pages, and the same slot for the same token.
  The req -> token table (the page table) is shared; only the K/V tensors differ. So the one
  scheduler-side page allocator serves both models: a radix-cache hit gives both the prefix,
  and truncating a request's pages frees a rejected token's slot in both.
- Prefill (EXTEND / MIXED plans, and the odd DECODE): the draft runs the same batch right after
  the target (`follow`), writing its K/V at the same slots: it prefills the same chunks.
- A TARGET_VERIFY plan (`workers.spec_messages.SpecStepPlan`) is one round, in one call:
  1. DRAFT_EXTEND_V2: the draft writes the tokens it lacks (the last accepted token t0, plus the
     last draft of a round that accepted all K, which the draft never wrote). `seq_lens` is the
     draft's prefix before the write; the attention reads prefix + extend. The logits of each
     request's last token give draft 1.
  2. K - 1 draft DECODE steps give drafts 2..K.
  3. TARGET_VERIFY: the target extends K + 1 tokens per request (t0 and the drafts) and scores
     every one of them.
  4. TP rank 0 accepts (`workers.rejection_sampler`) and reports the tokens; the scheduler frees
     the rejected tokens' slots and sends the draft's catch-up tokens with the next round.
  Greedy drafts are the argmax of all-gathered logits, identical on every rank; sampled drafts
  are drawn on rank 0 and broadcast.
- CUDA graphs (GPU): the draft's decode steps replay the draft's decode graphs. The two ragged
  forwards (steps 1 and 3) replay decode graphs too when their tokens fit a captured size:
  each new token becomes a decode row of its own whose cache length is its position + 1, its
  causal extent (row j of request i reads prefix_i + j + 1 keys: the prefix and the rows written
  before it in the same forward). Otherwise, and always on CPU, they run eagerly with metadata
  from `build_attention_metadata`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from workers.loader import load_model
from workers.memory_pool import make_kv_pool
from workers.messages import TokenLogprobs
from workers.model_config import ModelConfig
from workers.pipeline import ModelPipeline
from workers.rejection_sampler import (
    categorical,
    greedy_verify,
    processed_probs,
    rejection_sample,
    row_generators,
)
from workers.sampler import LOGPROB_FLOOR, RequestSamplingState
from workers.spec_inputs import SpecRound
from workers.spec_messages import SpecStepPlan, SpecStepResult

if TYPE_CHECKING:
    from workers.forward_batch import ForwardBatch
    from workers.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class DraftRunner:
    """The draft model on one rank: a second `ModelPipeline` beside the target's, over the same
    request table, and the speculative round that runs both."""

    def __init__(self, target: ModelRunner):
        opts = target.opts
        assert opts.speculative_draft_model is not None
        self.target = target
        self.device = target.device
        self.tp = target.tp
        self.num_tokens = opts.speculative_num_tokens
        default_dtype = "float32" if self.device.type == "cpu" else None
        mc = ModelConfig.from_pretrained(opts.speculative_draft_model, dtype=opts.dtype or default_dtype)
        tmc = target.model_config
        if mc.vocab_size != tmc.vocab_size:
            raise ValueError(f"draft model {opts.speculative_draft_model} has vocab {mc.vocab_size}; the target "
                             f"{opts.model} has {tmc.vocab_size}: they must share the tokenizer")
        if mc.max_context_len < target.max_context_len:
            raise ValueError(f"draft model {opts.speculative_draft_model} handles {mc.max_context_len} positions; "
                             f"the target serves {target.max_context_len} (lower --max-context-len)")
        if mc.is_encoder_decoder or not mc.is_causal:
            raise ValueError("the draft model must be a causal decoder")
        if tmc.is_encoder_decoder or not tmc.is_causal or tmc.is_embedding_model:
            # Its rounds verify decoder tokens only; cross-attention and pooling take no part.
            raise ValueError(f"speculative decoding serves causal decoder targets; {opts.model} "
                             f"({tmc.architecture}) is not one")
        for m in (mc, tmc):
            # A recurrent state cannot take back the rejected tokens that a round feeds it.
            if len(m.full_attn_layers) != m.num_layers:
                raise ValueError(f"speculative decoding needs attention-only models; {m.architecture} has "
                                 "linear-attention layers")
        self.model_config = mc
        self.model = load_model(mc, self.tp, self.device, mc.dtype, opts.load_format)
        self.pipeline: ModelPipeline | None = None  # attach(), once the target's pools exist
        logger.info("draft model %s (%d layers), %d draft tokens per round",
                    opts.speculative_draft_model, mc.num_layers, self.num_tokens)

    def attach(self) -> None:
        """Mirror the target's pools: as many pages (the same slots), the same page table."""
        from workers.attention_choice import make_attention_backend

        t = self.target
        mc = self.model_config
        kv_pool = make_kv_pool(mc, self.tp.size, t.kv_pool.num_pages, t.opts.page_size, self.device)
        backend = make_attention_backend(t.opts, mc.use_mla, self.device, t.serving)
        self.pipeline = ModelPipeline(self.model, kv_pool=kv_pool, attn_backend=backend,
                                      req_to_token_pool=t.req_to_token_pool, device=self.device,
                                      page_size=t.opts.page_size)
        if t.pipeline.graphs is not None and backend.supports_cuda_graph:
            self.pipeline.use_graphs(t.opts.most_rows, t.pad_row)

    # ---------------- prefill: the draft follows the target ----------------
    def follow(self, fb: ForwardBatch) -> None:
        """Run the draft over the batch the target just ran, writing its K/V at the same slots
        (the request table was written by the target's batch)."""
        assert self.pipeline is not None
        self.pipeline.forward(self.pipeline.inputs.rebind(fb))

    # ---------------- one speculative round ----------------
    def verify(self, plan: SpecStepPlan, t_start: float, result: SpecStepResult) -> SpecStepResult:
        """One round, into `result` (the step's result so far: whatever ran before the forward)."""
        t, draft = self.target, self.pipeline
        assert draft is not None
        rnd = SpecRound.pack(plan, t.pipeline.inputs)
        states = [t.states[r.rid] for r in plan.reqs]
        sampled = [i for i, s in enumerate(states) if not s.params.greedy]
        q_rows: list[torch.Tensor] = []  # rank 0: per draft step, [len(sampled), V]
        # 1. DRAFT_EXTEND_V2 gives draft 1; 2. K - 1 draft decode steps give drafts 2..K.
        drafts = [self._propose(draft.run(rnd.draft_extend(draft.inputs)), states, sampled, 0, q_rows)]
        for j in range(1, rnd.K):
            fb = rnd.draft_decode(draft.inputs, j, drafts[-1])
            drafts.append(self._propose(draft.run(fb), states, sampled, j, q_rows))
        draft_ids = torch.stack(drafts, dim=1)  # [B, K]
        # 3. TARGET_VERIFY: the target scores t0 and the K drafts.
        logits = t.pipeline.run(rnd.verify(t.pipeline.inputs, draft_ids))
        if t.sampler is not None:  # 4. rank 0 decides
            self._accept(plan, states, sampled, logits, draft_ids, q_rows, result)
        result.compute_s = time.perf_counter() - t_start
        return result

    def _propose(self, logits: torch.Tensor, states: list[RequestSamplingState], sampled: list[int], step: int,
                 q_rows: list[torch.Tensor]) -> torch.Tensor:
        """Draft tokens [B] (device) from the draft's logits: argmax for greedy requests, a draw
        from the processed draft distribution q for sampled ones (rank 0 draws and keeps q for
        the acceptance test, then broadcasts the tokens)."""
        V = self.target.model_config.vocab_size
        x = logits[:, :V]
        tokens = x.argmax(dim=-1)
        if not sampled:
            return tokens
        if self.tp.is_first:
            rows_t = torch.tensor(sampled, device=x.device)
            params = [states[i].params for i in sampled]
            q = processed_probs(x.index_select(0, rows_t).float(), params)
            # A seeded request's draft takes the noise plain sampling draws at that position:
            # where q is near p it proposes the very token the target will draw.
            gens = row_generators([p.seed for p in params], [len(states[i].output_ids) + step for i in sampled],
                                  0, x.device)
            tokens.index_copy_(0, rows_t, categorical(q, gens))
            q_rows.append(q)
        if self.tp.size > 1:
            src = 0 if self.tp.group is None else dist.get_global_rank(self.tp.group, 0)
            dist.broadcast(tokens, src=src, group=self.tp.group)
        return tokens

    def _accept(self, plan: SpecStepPlan, states: list[RequestSamplingState], sampled: list[int],
                logits: torch.Tensor, draft_ids: torch.Tensor, q_rows: list[torch.Tensor],
                result: SpecStepResult) -> None:
        sampler = self.target.sampler
        assert sampler is not None
        V = sampler.vocab_size
        B, K = draft_ids.shape
        dev = logits.device
        # A copy: graph replay returns its static output buffer, and the penalties work in place.
        x = logits[:, :V].to(torch.float32, copy=True).reshape(B, K + 1, V)
        drafts = draft_ids.tolist()
        # Penalties and min_tokens as the sampler applies them, per position: row i of a request
        # sees its output so far plus drafts[:i].
        adjust = [b for b, s in enumerate(states)
                  if s.params.needs_adjustment or len(s.output_ids) < s.params.min_tokens]
        if adjust:
            virtual = []
            for b in adjust:
                s = states[b]
                if s.params.needs_penalties:
                    sampler._prompt_ids(s)  # upload once; the virtual states share it
                for i in range(K + 1):
                    v = RequestSamplingState(s.params, s.prompt_ids, s.output_ids + drafts[b][:i])
                    v._prompt_dev, v.matcher = s._prompt_dev, s.matcher  # (the grammar is applied below)
                    virtual.append(v)
            adj_t = torch.tensor(adjust, device=dev)
            sub = x.index_select(0, adj_t).reshape(-1, V)
            sampler._apply_penalties(sub, virtual)
            sampler._apply_logit_bias(sub, virtual)
            sampler._apply_min_tokens(sub, virtual)
            constrained = [j for j, b in enumerate(adjust) if states[b].matcher is not None]
            if constrained and sampler.grammars is not None:  # position i: the grammar after drafts[:i]
                mask = sampler.grammars.fill_with_drafts([states[adjust[j]].matcher for j in constrained],
                                                         [drafts[adjust[j]] for j in constrained])
                sampler.grammars.apply(sub, [j * (K + 1) + i for j in constrained for i in range(K + 1)], mask)
            x.index_copy_(0, adj_t, sub.view(len(adjust), K + 1, V))

        n = torch.zeros(B, dtype=torch.long, device=dev)
        nxt = torch.zeros(B, dtype=torch.long, device=dev)
        drawn = set(sampled)
        greedy = [b for b in range(B) if b not in drawn]
        if greedy:
            g_t = torch.tensor(greedy, device=dev)
            v = greedy_verify(x.index_select(0, g_t).argmax(dim=-1), draft_ids.index_select(0, g_t))
            n.index_copy_(0, g_t, v.num_accepted)
            nxt.index_copy_(0, g_t, v.next_token)
        seeded = [b for b in sampled if states[b].params.seed is not None]
        if seeded:
            # Coupled: at each position the token plain sampling draws (the target's distribution,
            # the noise of (seed, position)); drafts are kept while they equal it. A seeded
            # request's output is then the same whether a step of it ran as a speculative round
            # or as a plain decode, which the batch around it decides.
            s_t = torch.tensor(seeded, device=dev)
            params = [states[b].params for b in seeded]
            p = processed_probs(x.index_select(0, s_t).reshape(-1, V), [pp for pp in params for _ in range(K + 1)])
            gens = row_generators([pp.seed for pp in params for _ in range(K + 1)],
                                  [len(states[b].output_ids) + i for b in seeded for i in range(K + 1)], 0, dev)
            v = greedy_verify(categorical(p, gens).view(len(seeded), K + 1), draft_ids.index_select(0, s_t))
            n.index_copy_(0, s_t, v.num_accepted)
            nxt.index_copy_(0, s_t, v.next_token)
        unseeded = [j for j, b in enumerate(sampled) if states[b].params.seed is None]
        if unseeded:
            rows = [sampled[j] for j in unseeded]
            s_t = torch.tensor(rows, device=dev)
            params = [states[b].params for b in rows]
            p = processed_probs(x.index_select(0, s_t).reshape(-1, V), [pp for pp in params for _ in range(K + 1)])
            q = torch.stack(q_rows, dim=1).index_select(0, torch.tensor(unseeded, device=dev))
            v = rejection_sample(p.view(len(rows), K + 1, V), q, draft_ids.index_select(0, s_t), [None] * len(rows))
            n.index_copy_(0, s_t, v.num_accepted)
            nxt.index_copy_(0, s_t, v.next_token)
        n_host, nxt_host = torch.stack([n, nxt]).tolist()  # one synchronisation
        for b, r in enumerate(plan.reqs):
            toks = drafts[b][: n_host[b]] + [nxt_host[b]]
            lps: list[TokenLogprobs | None] = [None] * len(toks)
            k = states[b].params.logprobs
            if k is not None:
                lps = _logprobs(x[b, : len(toks)], toks, min(k, V))
            states[b].extend(toks)
            result.sampled_rids.append(r.rid)
            result.next_token_ids.append(toks[-1])
            result.logprobs.append(lps[-1])
            result.spec_token_ids.append(toks)
            result.spec_logprobs.append(lps)
            result.spec_num_accepted.append(n_host[b])


def _logprobs(x: torch.Tensor, toks: list[int], k: int) -> list[TokenLogprobs | None]:
    """The sampler's logprobs (processed logits before temperature) of each emitted token:
    x [n, V] are the rows that predicted them."""
    lp = x.log_softmax(dim=-1)
    chosen = lp.gather(1, torch.tensor(toks, device=x.device).unsqueeze(1)).squeeze(1).clamp_min(LOGPROB_FLOOR)
    out: list[TokenLogprobs | None] = []
    if k > 0:
        top_lp, top_ids = lp.topk(k, dim=-1)
        top_lp, top_ids = top_lp.clamp_min(LOGPROB_FLOOR).tolist(), top_ids.tolist()
    for i, c in enumerate(chosen.tolist()):
        top = list(zip(top_ids[i], top_lp[i], strict=True)) if k > 0 else []
        out.append(TokenLogprobs(token_logprob=c, top=top))
    return out
