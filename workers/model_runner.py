"""One rank's forward pass: StepPlan in, StepResult out.

The runner owns the model shard, the KV pool, the req → token table, the attention backend
and (on rank 0) the sampler and per-request sampling state. It holds no scheduling logic:
which tokens go where was decided by the replica's scheduler.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from workers import encoder_decoder
from workers.attention_choice import make_attention_backend
from workers.cuda_graph import CudaGraphRunner
from workers.forward_batch import ForwardBatch, ForwardMode
from workers.kv_messages import KVOffloadOptions
from workers.kv_offload import make_rank_offload
from workers.loader import load_model
from workers.memory_pool import KVPool, MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool
from workers.messages import StepPlan, StepResult
from workers.model_config import ModelConfig, serving_mode
from workers.parallel import TPGroup
from workers.pooling import PoolingState, default_pooling
from workers.sampler import PendingSample, RequestSamplingState, Sampler
from workers.spec_messages import SpecStepPlan
from workers.spec_runner import DraftRunner
from workers.state_pool import LinearStatePool

logger = logging.getLogger(__name__)

@dataclass
class _InFlight:
    """A launched step: its plan and partial result, and the draw still on the device."""

    plan: StepPlan
    result: StepResult
    t0: float
    sampled: bool = False  # rows were sampled (on rank 0; the same on every rank)
    sample: PendingSample | None = None
    rids: list[str] = field(default_factory=list)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RunnerOptions:
    """The narrow slice of the engine config a rank needs."""

    model: str
    device: str = "cpu"
    dtype: str | None = None
    page_size: int = 1
    kv_cache_tokens: int | None = None
    mem_fraction: float = 0.85
    max_running_requests: int = 256
    max_context_len: int | None = None
    attention_backend: str = "flash"
    is_embedding: bool = False
    chunked_prefill_size: int = 2048
    disable_radix_cache: bool = False
    disable_cuda_graph: bool = False
    seed: int = 0
    # Speculative decoding (workers.spec_runner): a draft model with the target's tokenizer
    # proposes this many tokens a round; None: off.
    speculative_draft_model: str | None = None
    speculative_num_tokens: int = 4
    kv_offload: KVOffloadOptions | None = None  # the shared KV store; None: off


class ModelRunner:
    def __init__(self, opts: RunnerOptions, tp: TPGroup | None = None):
        self.opts = opts
        self.tp = tp or TPGroup()
        self.device = torch.device(opts.device if opts.device == "cpu" else f"cuda:{torch.cuda.current_device()}")
        default_dtype = "float32" if self.device.type == "cpu" else None
        self.model_config = ModelConfig.from_pretrained(opts.model, dtype=opts.dtype or default_dtype)
        self.dtype = self.model_config.dtype
        torch.manual_seed(opts.seed)
        self.model = load_model(self.model_config, self.tp, self.device, self.dtype)
        self.max_context_len = min(opts.max_context_len or self.model_config.max_context_len,
                                   self.model_config.max_context_len)
        # The draft model loads before the KV pool is sized: its weights and its K/V per token
        # come out of the same memory (its pool mirrors the target's pages: see attach()).
        self.drafter = DraftRunner(self) if opts.speculative_draft_model else None
        # Hybrid models: per-request linear-attention state, one row per request row (sized
        # before the KV pool, which takes what memory is left).
        self.state_pool = LinearStatePool.for_model(self.model_config, self.tp.size, opts.max_running_requests + 1,
                                                    self.dtype, self.device)
        self.kv_pool = self._make_kv_pool()
        self.kv_offload = make_rank_offload(opts.kv_offload, self.kv_pool, self.tp)  # host tier + store client
        # One extra row (all zeros: the reserved page 0) for padded CUDA-graph batch entries.
        self.pad_row = opts.max_running_requests
        # An encoder-decoder request's row holds its encoder slots, then its decoder tokens.
        width = (encoder_decoder.row_width(self.max_context_len, opts.page_size)
                 if self.model_config.is_encoder_decoder else self.max_context_len)
        self.req_to_token_pool = ReqToTokenPool(opts.max_running_requests + 1, width, self.device)
        mc = self.model_config
        self.serving = serving_mode(mc, is_embedding=opts.is_embedding, chunked_prefill_size=opts.chunked_prefill_size,
                                    disable_radix_cache=opts.disable_radix_cache)
        self.pooling = mc.pooling or default_pooling(is_encoder=not mc.is_causal)
        self.attn_backend = make_attention_backend(opts, mc.use_mla, self.device, self.serving)
        if self.state_pool is not None:
            from attention.hybrid_linear import HybridLinearAttnBackend
            from attention.linear_attn import LinearAttentionBackend

            self.attn_backend = HybridLinearAttnBackend(
                self.attn_backend, LinearAttentionBackend(self.state_pool), mc.full_attn_layers
            )
        if self.serving.is_embedding:
            logger.info("embedding replica: pooling %s (normalize=%s, from %s)",
                        self.pooling.mode, self.pooling.normalize, self.pooling.source)
        self.sampler = (
            Sampler(self.model_config.vocab_size, self.device, eos_token_ids=set(self.model_config.eos_token_ids))
            if self.tp.is_first
            else None
        )
        self.states: dict[str, RequestSamplingState] = {}
        self.generation_rules = (encoder_decoder.GenerationRules.of(mc) if mc.is_encoder_decoder and self.tp.is_first
                                 else None)
        # Overlapped execution (launch/collect): each row's last sampled token on the device
        # (decode graphs read it), the launched step whose draw is in flight, and completed
        # results not collected yet.
        self.last_token = torch.zeros(opts.max_running_requests + 1, dtype=torch.long, device=self.device)
        self._inflight: _InFlight | None = None
        self._ready: deque[StepResult] = deque()
        self.graph_runner: CudaGraphRunner | None = None
        # Decode graphs serve generation; an embedding replica only prefills (a batch of
        # one-token prompts, planned as DECODE, runs eagerly).
        if (self.device.type == "cuda" and not opts.disable_cuda_graph and self.attn_backend.supports_cuda_graph
                and not self.serving.is_embedding):
            self.graph_runner = CudaGraphRunner(self, pad_row=self.pad_row)
            self.graph_runner.capture()
        if self.drafter is not None:
            self.drafter.attach()
        if self.sampler is not None and not self.serving.is_embedding:
            self.sampler.warm_up(CudaGraphRunner.most_rows(opts))
        # Embedding requests (rid -> pooling accumulated over their prefill pieces).
        self.pooling_states: dict[str, PoolingState] = {}

    # ---------------- memory ----------------
    def _kv_tokens(self, bytes_per_token: int) -> int:
        if self.opts.kv_cache_tokens is not None:
            return self.opts.kv_cache_tokens
        if self.device.type == "cpu":
            return 65536
        free, _total = torch.cuda.mem_get_info(self.device)
        budget = int(free * self.opts.mem_fraction) - (1 << 30)  # keep 1 GiB for activations
        # More than every running request at full context can never be used.
        most = self.opts.max_running_requests * self.max_context_len
        tokens = max(min(budget // bytes_per_token, most), 2 * self.opts.page_size)
        # Every rank must size its pool identically: take the minimum over the TP group.
        return self.tp.all_min_int(tokens)

    def _make_kv_pool(self) -> KVPool:
        mc, ps = self.model_config, self.opts.page_size
        layers = len(mc.full_attn_layers)  # a hybrid model's linear layers keep no KV
        if mc.use_mla:
            lora, rope = mc.hf_config.kv_lora_rank, mc.hf_config.qk_rope_head_dim
            def build(pages: int) -> KVPool:
                return MLATokenToKVPool(pages, ps, layers, lora, rope, self.dtype, self.device)
            per_token = (lora + rope) * self.dtype.itemsize * layers
        else:
            kv_heads = mc.per_rank_kv_heads(self.tp.size)
            def build(pages: int) -> KVPool:
                return MHATokenToKVPool(pages, ps, layers, kv_heads, mc.head_dim, self.dtype, self.device)
            per_token = kv_heads * 2 * mc.head_dim * self.dtype.itemsize * layers
        if self.drafter is not None:  # the draft's pool mirrors this one page for page
            per_token += self.drafter.kv_bytes_per_token
        num_pages = self._kv_tokens(per_token) // ps + 1  # + the reserved page 0
        pool = build(num_pages)
        logger.info("KV pool: %d pages x %d tokens, %.1f MiB", num_pages, ps,
                    pool.bytes_per_token() * pool.num_slots / 2**20)
        return pool

    @property
    def num_pages(self) -> int:
        return self.kv_pool.num_pages

    # ---------------- one step ----------------
    @property
    def can_overlap(self) -> bool:
        """Whether `launch`/`collect` may run plans ahead of their results: not with a draft
        model (a speculative round needs its tokens on the host). Under TP, rank 0 broadcasts
        each step's sampled tokens (`last_token`) so that every rank resolves placeholders."""
        return self.drafter is None

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> None:
        """Overlapped execution: enqueue `plan`'s forward and sampling without waiting for
        them. The previous launched plan's result is completed here, after this plan's forward
        is enqueued (so the device stays busy while the host reads it) and before this plan's
        sampling (which reads the tokens it appended). `collect()` returns results in order."""
        t0 = time.perf_counter()
        self._prepare(plan)
        result = StepResult(plan.step_id)
        if self.kv_offload is not None:  # KV store saves/prefetches/loads, before the forward
            self.kv_offload.run(plan, result)
        fb = hidden = logits = None
        if plan.mode != ForwardMode.IDLE and plan.reqs:
            fb = self.build_forward_batch(plan)
            hidden, logits = self.forward(fb)
        if self._inflight is not None:
            self._ready.append(self._complete(self._inflight))
        self._inflight = (self._launch_sampling(plan, fb, hidden, logits, result, t0) if fb is not None
                          else _InFlight(plan, result, t0))
        if self._inflight.sampled and self.tp.size > 1:
            self.tp.broadcast(self.last_token)  # rank 0 sampled; every rank reads placeholders

    def collect(self) -> StepResult:
        """The result of the oldest launched plan not collected yet (waits for it if needed)."""
        if not self._ready:
            assert self._inflight is not None, "collect() without a launched plan"
            self._ready.append(self._complete(self._inflight))
            self._inflight = None
        return self._ready.popleft()

    def take_ready(self) -> StepResult | None:
        """A completed result not collected yet, without waiting (None: none is ready)."""
        return self._ready.popleft() if self._ready else None

    def discard_inflight(self) -> None:
        """Forget launched plans (the engine failed them)."""
        self._inflight = None
        self._ready.clear()

    def _prepare(self, plan: StepPlan) -> None:
        for rid in plan.finished_rids:
            self.states.pop(rid, None)
            self.pooling_states.pop(rid, None)
        for nr in plan.new_requests:
            if nr.is_embedding:
                self.pooling_states[nr.rid] = PoolingState(self.pooling, len(nr.prompt_ids))
            else:
                self.states[nr.rid] = RequestSamplingState(nr.sampling, nr.prompt_ids, list(nr.output_ids))
        if self.state_pool is not None:
            self.state_pool.reset_admitted(plan)
        for row, start, slots in plan.table_writes:
            self.req_to_token_pool.write(row, start, self._upload(slots, torch.int32))

    def _upload(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        """A host list on the device without waiting for the stream (pinned, non-blocking)."""
        host = torch.tensor(values, dtype=dtype)
        return host.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else host

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        self._prepare(plan)
        result = StepResult(plan.step_id)
        if self.kv_offload is not None:  # KV store saves/prefetches/loads, before the forward
            self.kv_offload.run(plan, result)
        if plan.mode == ForwardMode.IDLE or not plan.reqs:
            return result
        if plan.mode == ForwardMode.TARGET_VERIFY:  # one speculative round (workers.spec_runner)
            assert self.drafter is not None and isinstance(plan, SpecStepPlan), "TARGET_VERIFY needs a draft model"
            return self.drafter.verify(plan, t0, result)
        fb = self.build_forward_batch(plan)
        hidden, logits = self.forward(fb)
        if self.drafter is not None:  # the draft computes the same tokens into its own pool
            self.drafter.follow(fb)
        return self._complete(self._launch_sampling(plan, fb, hidden, logits, result, t0))

    def build_forward_batch(self, plan: StepPlan) -> ForwardBatch:
        gr = self.graph_runner
        if gr is not None and gr.can_stage(plan):  # straight into a decode graph's inputs
            return gr.stage_decode(plan)
        dev = self.device
        reqs = plan.reqs
        ext = [len(r.input_ids) for r in reqs]
        prefix = [r.prefix_len for r in reqs]
        seq = [p + e for p, e in zip(prefix, ext)]
        bs, n = len(reqs), sum(ext)
        # One host buffer, one host-to-device copy; the fields are views of it. (The device's
        # CPU side is slow: eight small transfers cost more than the decode step's attention.)
        host = torch.tensor(
            [t for r in reqs for t in r.input_ids]
            + [p + j for p, e in zip(prefix, ext) for j in range(e)]
            + [s for r in reqs for s in r.out_cache_loc]
            + [r.req_pool_idx for r in reqs] + seq + ext + prefix,
            dtype=torch.long,
        )
        # Pinned: a copy from pageable memory may wait for the stream to drain, which would
        # stall the host behind the step in flight (overlapped scheduling).
        packed = host.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else host
        input_ids, positions, out_loc, rows, seq_lens, ext_t, prefix_t = packed.split([n, n, n, bs, bs, bs, bs])
        # Record the new tokens' slots in the request table before the attention reads it (an
        # encoder-decoder request's decoder columns start after its own encoder pages).
        cols = (encoder_decoder.decoder_columns(plan, positions, ext_t, self.opts.page_size)
                if self.model_config.is_encoder_decoder else positions)
        row_of_token = rows.repeat_interleave(ext_t, output_size=n)
        self.req_to_token_pool.req_to_token[row_of_token, cols] = out_loc.to(torch.int32)
        if any(len(r.input_ids) == 1 and r.input_ids[0] < 0 for r in reqs):
            # Overlapped scheduling: a decode whose input was still being sampled when the plan
            # was made reads it from its row's last sampled token (cluster/engine/scheduler.py).
            input_ids = torch.where(input_ids < 0, self.last_token[row_of_token], input_ids)
        seq_lens_cpu = host[3 * n + bs : 3 * n + 2 * bs].to(torch.int32)
        ext_t = ext_t.to(torch.int32)
        start_loc = torch.nn.functional.pad(torch.cumsum(ext_t, 0, dtype=torch.int32), (1, 0))
        mode = plan.mode
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=len(reqs),
            input_ids=input_ids,
            positions=positions,
            req_pool_indices=rows,
            seq_lens=seq_lens.to(torch.int32),
            seq_lens_cpu=seq_lens_cpu,
            out_cache_loc=out_loc,
            extend_seq_lens=None if mode.is_decode() else ext_t,
            extend_seq_lens_cpu=None if mode.is_decode() else ext,
            extend_prefix_lens=None if mode.is_decode() else prefix_t.to(torch.int32),
            extend_prefix_lens_cpu=None if mode.is_decode() else prefix,
            extend_start_loc=start_loc,
            is_embedding=any(r.rid in self.pooling_states for r in reqs),
            logits_indices=start_loc[1:].long() - 1,
            req_to_token_pool=self.req_to_token_pool,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
        )
        if self.model_config.is_encoder_decoder:
            encoder_decoder.attach(fb, plan, self.req_to_token_pool)
        return fb

    def forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states [T, hidden] of every new token, and — when a CUDA graph ran the step,
        which computes them inside the graph — the logits of every row ([B, vocab])."""
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            return self.graph_runner.replay(fb)
        self.attn_backend.init_forward_metadata(fb)
        return self.model(fb.input_ids, fb.positions, fb), None

    def _launch_sampling(self, plan: StepPlan, fb: ForwardBatch, hidden: torch.Tensor,
                         all_logits: torch.Tensor | None, result: StepResult, t0: float) -> _InFlight:
        """Pool embeddings, compute the logits of the sampled rows and enqueue their draw; each
        row's token also lands in `last_token` on the device (the next plan may read it)."""
        if self.pooling_states:
            self._pool(plan, hidden, result)
        sample_idx = [i for i, r in enumerate(plan.reqs) if r.sample and r.rid in self.states]
        assert fb.logits_indices is not None
        inflight = _InFlight(plan, result, t0, sampled=bool(sample_idx))
        if sample_idx:
            every_row = len(sample_idx) == fb.batch_size
            idx = None if every_row else self._upload(sample_idx, torch.long)
            if all_logits is not None:  # decode graph: one row per request
                logits = all_logits if idx is None else all_logits[idx]
            else:
                at = fb.logits_indices if idx is None else fb.logits_indices[idx]
                logits = self.model.compute_logits(hidden[at])  # all ranks gather
            if self.sampler is not None:
                states = [self.states[plan.reqs[i].rid] for i in sample_idx]
                if self.generation_rules is not None:  # generate's forced bos/eos tokens
                    logits = self.generation_rules.force(logits, states)
                inflight.sample = self.sampler.launch(logits, states)
                inflight.rids = [plan.reqs[i].rid for i in sample_idx]
                rows = fb.req_pool_indices if idx is None else fb.req_pool_indices[idx]
                self.last_token[rows] = inflight.sample.token_ids
        return inflight

    def _complete(self, inflight: _InFlight) -> StepResult:
        """Wait for a launched step's draw; its tokens go to the sampling states and the result."""
        result = inflight.result
        if inflight.sample is not None:
            out = inflight.sample.wait()
            for rid, tok, lp in zip(inflight.rids, out.token_ids, out.logprobs):
                state = self.states.get(rid)
                if state is not None:  # else finished or preempted since the launch
                    state.output_ids.append(tok)
                result.sampled_rids.append(rid)
                result.next_token_ids.append(tok)
                result.logprobs.append(lp)
        result.compute_s = time.perf_counter() - inflight.t0
        return result

    def _pool(self, plan: StepPlan, hidden: torch.Tensor, result: StepResult) -> None:
        """Feed each embedding request's new hidden states to its pooling; a request whose
        prompt is complete gets its vector in `result.embeddings` (every rank computes it: the
        hidden states are identical after the all-reduce; rank 0's result is the one used)."""
        start = 0
        for r in plan.reqs:
            n = len(r.input_ids)
            state = self.pooling_states.get(r.rid)
            if state is not None:
                state.add(hidden[start : start + n], r.prefix_len)
                if state.done:
                    result.embeddings[r.rid] = state.result().tolist()
            start += n
