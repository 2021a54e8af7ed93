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
from dataclasses import fields, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from workers.cuda_graph import CudaGraphRunner
from workers.forward_batch import ForwardBatch, ForwardMode
from workers.loader import load_model
from workers.memory_pool import KVPool, MHATokenToKVPool, MLATokenToKVPool
from workers.messages import StepResult, TokenLogprobs
from workers.model_config import ModelConfig
from workers.rejection_sampler import (
    DRAFT_SALT,
    VERIFY_SALT,
    categorical,
    greedy_verify,
    processed_probs,
    rejection_sample,
    row_generators,
)
from workers.sampler import LOGPROB_FLOOR, RequestSamplingState
from workers.spec_messages import SpecStepPlan, SpecStepResult

if TYPE_CHECKING:
    from workers.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def kv_bytes_per_token(mc: ModelConfig, tp_size: int) -> int:
    """Bytes of K/V one token takes in this rank's pool of model `mc`."""
    item = mc.dtype.itemsize
    if mc.use_mla:
        return (mc.hf_config.kv_lora_rank + mc.hf_config.qk_rope_head_dim) * item * mc.num_layers
    return mc.per_rank_kv_heads(tp_size) * 2 * mc.head_dim * item * mc.num_layers


def make_kv_pool(mc: ModelConfig, tp_size: int, num_pages: int, page_size: int, device) -> KVPool:
    if mc.use_mla:
        return MLATokenToKVPool(num_pages, page_size, mc.num_layers, mc.hf_config.kv_lora_rank,
                                mc.hf_config.qk_rope_head_dim, mc.dtype, device)
    return MHATokenToKVPool(num_pages, page_size, mc.num_layers, mc.per_rank_kv_heads(tp_size), mc.head_dim,
                            mc.dtype, device)


def as_decode_rows(fb: ForwardBatch, positions_cpu: list[int]) -> ForwardBatch:
    """A ragged batch (TARGET_VERIFY, DRAFT_EXTEND_V2) as one DECODE row per new token, for the
    decode CUDA graphs. The token at position p reads keys 0..p of its request: p + 1 keys, i.e.
    row j of request i reads prefix_i + j + 1 (the prefix and the rows before it, which the same
    forward writes first). Over a request's rows that ends at prefix_i + extend_i, the extent
    `fb.cache_lens_cpu()` gives in every mode."""
    assert fb.extend_seq_lens is not None
    T = fb.num_tokens
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=T,
        input_ids=fb.input_ids,
        positions=fb.positions,
        req_pool_indices=fb.req_pool_indices.repeat_interleave(fb.extend_seq_lens.long(), output_size=T),
        seq_lens=(fb.positions + 1).to(torch.int32),
        seq_lens_cpu=torch.tensor(positions_cpu, dtype=torch.int32) + 1,
        out_cache_loc=fb.out_cache_loc,
        req_to_token_pool=fb.req_to_token_pool,
        kv_pool=fb.kv_pool,
        attn_backend=fb.attn_backend,
    )


def ragged_logits(runner, fb: ForwardBatch, positions_cpu: list[int],
                  select: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of a ragged batch run on `runner` (the target's ModelRunner or a DraftRunner):
    every token's ([T, V']), or those of the tokens `select` indexes. Every rank must call it."""
    gr = runner.graph_runner
    if gr is not None and fb.num_tokens <= gr.max_bs:
        _, logits = gr.replay(as_decode_rows(fb, positions_cpu))
        return logits if select is None else logits[select]
    runner.attn_backend.init_forward_metadata(fb)
    hidden = runner.model(fb.input_ids, fb.positions, fb)
    return runner.model.compute_logits(hidden if select is None else hidden[select])


def decode_logits(runner, fb: ForwardBatch) -> torch.Tensor:
    """Logits [B, V'] of a decode batch on `runner` (graph replay when one fits)."""
    gr = runner.graph_runner
    if gr is not None and gr.can_run(fb):
        return gr.replay(fb)[1]
    runner.attn_backend.init_forward_metadata(fb)
    return runner.model.compute_logits(runner.model(fb.input_ids, fb.positions, fb))


class DraftRunner:
    """The draft model on one rank. Attribute names follow `ModelRunner` (`model`, `kv_pool`,
    `attn_backend`, `req_to_token_pool`, `graph_runner`, `opts`, `device`) so that a
    `CudaGraphRunner` captures it as it captures the target."""

    def __init__(self, target: ModelRunner):
        opts = target.opts
        assert opts.speculative_draft_model is not None
        self.target = target
        self.opts = opts
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
        self.model = load_model(mc, self.tp, self.device, mc.dtype)
        self.kv_bytes_per_token = kv_bytes_per_token(mc, self.tp.size)
        # Set by attach(), once the target's pools exist.
        self.kv_pool: KVPool | None = None
        self.attn_backend = None
        self.req_to_token_pool = None
        self.graph_runner: CudaGraphRunner | None = None
        logger.info("draft model %s (%d layers), %d draft tokens per round",
                    opts.speculative_draft_model, mc.num_layers, self.num_tokens)

    def attach(self) -> None:
        """Mirror the target's pools: as many pages (the same slots), the same page table."""
        from workers.attention_choice import make_attention_backend

        t = self.target
        mc = self.model_config
        self.req_to_token_pool = t.req_to_token_pool
        self.kv_pool = make_kv_pool(mc, self.tp.size, t.kv_pool.num_pages, t.opts.page_size, self.device)
        self.attn_backend = make_attention_backend(t.opts, mc.use_mla, self.device, t.serving)
        if t.graph_runner is not None and self.attn_backend.supports_cuda_graph:
            self.graph_runner = CudaGraphRunner(self, pad_row=t.pad_row)
            self.graph_runner.capture()

    # ---------------- prefill: the draft follows the target ----------------
    def follow(self, fb: ForwardBatch) -> None:
        """Run the draft over the batch the target just ran, writing its K/V at the same slots
        (the request table was written by the target's batch)."""
        dfb = replace(fb, kv_pool=self.kv_pool, attn_backend=self.attn_backend, extras={})
        if self.graph_runner is not None and self.graph_runner.can_run(dfb):
            self.graph_runner.replay(dfb)
            return
        self.attn_backend.init_forward_metadata(dfb)
        self.model(dfb.input_ids, dfb.positions, dfb)

    # ---------------- one speculative round ----------------
    def verify(self, plan: SpecStepPlan, t_start: float, base: StepResult) -> SpecStepResult:
        """One round; `base` is the step's result so far (whatever ran before the forward)."""
        t = self.target
        dev = self.device
        reqs = plan.reqs
        B, K = len(reqs), plan.num_draft_tokens
        catch = [len(r.input_ids) for r in reqs]  # tokens the draft writes now (>= 1)
        dprefix = [r.prefix_len for r in reqs]  # the draft's cached length before them
        prefix = [d + c - 1 for d, c in zip(dprefix, catch)]  # the target's (t0's position)
        c_pos_cpu = [d + j for d, c in zip(dprefix, catch) for j in range(c)]
        v_pos_cpu = [p + j for p in prefix for j in range(K + 1)]
        Tc, Tv = len(c_pos_cpu), len(v_pos_cpu)
        for r, c in zip(reqs, catch):
            assert len(r.out_cache_loc) == c + K, (r.rid, len(r.out_cache_loc), c, K)
        # One host buffer, one host-to-device copy; the fields are views of it.
        host = torch.tensor(
            [tok for r in reqs for tok in r.input_ids] + c_pos_cpu
            + [s for r, c in zip(reqs, catch) for s in r.out_cache_loc[:c]]
            + v_pos_cpu + [s for r, c in zip(reqs, catch) for s in r.out_cache_loc[c - 1:]]
            + [r.req_pool_idx for r in reqs] + dprefix + catch + prefix,
            dtype=torch.long,
        )
        packed = host.to(dev, non_blocking=True) if dev.type == "cuda" else host
        c_ids, c_pos, c_slots, v_pos, v_slots, rows, dprefix_t, catch_t, prefix_t = packed.split(
            [Tc, Tc, Tc, Tv, Tv, B, B, B, B])
        # Slots of every position of the round, before any attention reads the table.
        r2t = t.req_to_token_pool.req_to_token
        r2t[rows.repeat_interleave(catch_t, output_size=Tc), c_pos] = c_slots.to(torch.int32)
        r2t[rows.repeat_interleave(K + 1, output_size=Tv), v_pos] = v_slots.to(torch.int32)

        states = [t.states[r.rid] for r in reqs]
        sampled = [i for i, s in enumerate(states) if not s.params.greedy]
        q_rows: list[torch.Tensor] = []  # rank 0: per draft step, [len(sampled), V]

        # 1. DRAFT_EXTEND_V2: seq_lens is the prefix *before* the write; reads prefix + extend.
        catch_i32 = catch_t.to(torch.int32)
        start = torch.nn.functional.pad(torch.cumsum(catch_i32, 0, dtype=torch.int32), (1, 0))
        last = start[1:].long() - 1
        fb = ForwardBatch(
            forward_mode=ForwardMode.DRAFT_EXTEND_V2, batch_size=B, input_ids=c_ids, positions=c_pos,
            req_pool_indices=rows, seq_lens=dprefix_t.to(torch.int32),
            seq_lens_cpu=torch.tensor(dprefix, dtype=torch.int32), out_cache_loc=c_slots,
            extend_seq_lens=catch_i32, extend_seq_lens_cpu=catch, extend_prefix_lens=dprefix_t.to(torch.int32),
            extend_prefix_lens_cpu=dprefix, extend_start_loc=start, logits_indices=last,
            req_to_token_pool=t.req_to_token_pool, kv_pool=self.kv_pool, attn_backend=self.attn_backend,
        )
        drafts = [self._propose(ragged_logits(self, fb, c_pos_cpu, last), states, sampled, 0, q_rows)]

        # 2. K - 1 draft decode steps: draft j at position L + j.
        v_slots_2d = v_slots.view(B, K + 1)
        prefix_i32 = prefix_t.to(torch.int32)
        for j in range(1, K):
            fb = ForwardBatch(
                forward_mode=ForwardMode.DECODE, batch_size=B, input_ids=drafts[-1], positions=prefix_t + j,
                req_pool_indices=rows, seq_lens=prefix_i32 + (j + 1),
                seq_lens_cpu=torch.tensor([p + j + 1 for p in prefix], dtype=torch.int32),
                out_cache_loc=v_slots_2d[:, j], req_to_token_pool=t.req_to_token_pool,
                kv_pool=self.kv_pool, attn_backend=self.attn_backend,
            )
            drafts.append(self._propose(decode_logits(self, fb), states, sampled, j, q_rows))
        draft_ids = torch.stack(drafts, dim=1)  # [B, K]

        # 3. TARGET_VERIFY: t0 and the K drafts at positions L .. L + K; logits of every one.
        v_ids = torch.cat([c_ids[last].unsqueeze(1), draft_ids], dim=1).reshape(-1)
        fb = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY, batch_size=B, input_ids=v_ids, positions=v_pos,
            req_pool_indices=rows, seq_lens=prefix_i32 + (K + 1),
            seq_lens_cpu=torch.tensor([p + K + 1 for p in prefix], dtype=torch.int32), out_cache_loc=v_slots,
            extend_seq_lens=torch.full((B,), K + 1, dtype=torch.int32, device=dev), extend_seq_lens_cpu=[K + 1] * B,
            extend_prefix_lens=prefix_i32, extend_prefix_lens_cpu=prefix,
            extend_start_loc=torch.arange(B + 1, dtype=torch.int32, device=dev) * (K + 1), logits_indices=None,
            req_to_token_pool=t.req_to_token_pool, kv_pool=t.kv_pool, attn_backend=t.attn_backend,
        )
        logits = ragged_logits(t, fb, v_pos_cpu)

        result = SpecStepResult(**{f.name: getattr(base, f.name) for f in fields(base)})
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
            gens = row_generators([p.seed for p in params], [len(states[i].output_ids) + step for i in sampled],
                                  DRAFT_SALT, x.device)
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
                  if s.params.needs_penalties or len(s.output_ids) < s.params.min_tokens]
        if adjust:
            virtual = []
            for b in adjust:
                s = states[b]
                if s.params.needs_penalties:
                    sampler._prompt_ids(s)  # upload once; the virtual states share it
                for i in range(K + 1):
                    v = RequestSamplingState(s.params, s.prompt_ids, s.output_ids + drafts[b][:i])
                    v._prompt_dev = s._prompt_dev
                    virtual.append(v)
            adj_t = torch.tensor(adjust, device=dev)
            sub = x.index_select(0, adj_t).reshape(-1, V)
            sampler._apply_penalties(sub, virtual)
            sampler._apply_min_tokens(sub, virtual)
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
        if sampled:
            s_t = torch.tensor(sampled, device=dev)
            params = [states[b].params for b in sampled]
            p = processed_probs(x.index_select(0, s_t).reshape(-1, V), [pp for pp in params for _ in range(K + 1)])
            gens = row_generators([pp.seed for pp in params], [len(states[b].output_ids) for b in sampled],
                                  VERIFY_SALT, dev)
            v = rejection_sample(p.view(len(sampled), K + 1, V), torch.stack(q_rows, dim=1),
                                 draft_ids.index_select(0, s_t), gens)
            n.index_copy_(0, s_t, v.num_accepted)
            nxt.index_copy_(0, s_t, v.next_token)
        n_host, nxt_host = torch.stack([n, nxt]).tolist()  # one synchronisation
        for b, r in enumerate(plan.reqs):
            toks = drafts[b][: n_host[b]] + [nxt_host[b]]
            lps: list[TokenLogprobs | None] = [None] * len(toks)
            k = states[b].params.logprobs
            if k is not None:
                lps = _logprobs(x[b, : len(toks)], toks, min(k, V))
            states[b].output_ids.extend(toks)
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
