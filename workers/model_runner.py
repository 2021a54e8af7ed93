"""One rank's forward pass: StepPlan in, StepResult out.

The runner owns the model shard, the KV pool, the req → token table, the attention backend
and (on rank 0) the sampler and per-request sampling state. It holds no scheduling logic:
which tokens go where was decided by the replica's scheduler.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from attention import kernel_options
from attention.kernel_options import KernelOptions
from workers import encoder_decoder
from workers.attention_choice import make_attention_backend
from workers.forward_batch import ForwardBatch, ForwardMode
from workers.grammar_masks import GrammarMatchers
from workers.kv_messages import KVOffloadOptions
from workers.kv_offload import make_rank_offload
from workers.kv_quant import is_fp8
from workers.loader import load_model
from workers.memory_pool import KVPool, ReqToTokenPool, kv_bytes_per_token, make_kv_pool
from workers.messages import StepPlan, StepResult, TokenLogprobs
from workers.model_config import ModelConfig, serving_mode
from workers.parallel import TPGroup
from workers.pipeline import ModelPipeline
from workers.pooling import PoolingState, default_pooling
from workers.sampler import LOGPROB_FLOOR, PendingSample, RequestSamplingState, Sampler
from workers.spec_messages import SpecStepPlan, SpecStepResult
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
    # Overlapped steps with grammar-constrained rows: the draw, enqueued when the next plan is
    # launched or this one collected (its masks are filled meanwhile, off the engine's path).
    deferred: Callable[[], None] | None = None


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RunnerOptions:
    """The narrow slice of the engine config a rank needs."""

    model: str
    device: str = "cpu"
    dtype: str | None = None
    quantization: str | None = None  # "fp8": quantize an unquantized checkpoint's linear weights at load
    kv_cache_dtype: str = "auto"  # "fp8_e4m3": the KV cache in FP8 with per-layer scales (workers/kv_quant.py)
    page_size: int = 1
    kv_cache_tokens: int | None = None
    mem_fraction: float = 0.85
    gpu_share: float = 1.0  # of one GPU (Ray's fractional resource): other ranks may share it
    sm_percent: int | None = None  # under CUDA MPS: the SMs a Ray rank may occupy, % (set in its environment)
    max_running_requests: int = 256
    max_context_len: int | None = None
    attention_backend: str = "flash"
    is_embedding: bool = False
    chunked_prefill_size: int = 2048
    disable_radix_cache: bool = False
    disable_cuda_graph: bool = False
    seed: int = 0
    load_format: str = "auto"  # "dummy": random weights at the checkpoint's shapes (workers/dummy_weights.py)
    # Speculative decoding (workers.spec_runner): a draft model with the target's tokenizer
    # proposes this many tokens a round; None: off.
    speculative_draft_model: str | None = None
    speculative_num_tokens: int = 4
    kv_offload: KVOffloadOptions | None = None  # the shared KV store; None: off
    kernels: KernelOptions = field(default_factory=KernelOptions)  # installed on the rank at start

    @property
    def can_overlap(self) -> bool:
        """Whether a rank may run plans ahead of their results (`ModelRunner.launch`): not with
        a draft model (a speculative round needs its tokens on the host)."""
        return self.speculative_draft_model is None

    @property
    def most_rows(self) -> int:
        """The most rows a decode graph replay can have: one per running request, or with a
        draft model K + 1 per request (a round's verify runs each of its tokens as a row)."""
        per_request = 1 + self.speculative_num_tokens if self.speculative_draft_model else 1
        return self.max_running_requests * per_request


def _check_kv_dtype(mc: ModelConfig, device: torch.device) -> None:
    """An FP8 KV cache needs FP8 loads in the GPU's kernels (compute capability 8.9: Ada, Hopper)."""
    if is_fp8(mc.kv_dtype) and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"--kv-cache-dtype {mc.kv_cache_dtype}: this GPU (sm_{major}{minor}) has no FP8; it needs "
                         "compute capability 8.9 or newer (Ada, Hopper)")


class ModelRunner:
    """One rank's step loop over its `ModelPipeline` (the target model; the draft model of
    speculative decoding is a second pipeline, in `DraftRunner`): `launch` runs a plan's forward
    and enqueues its sampling, `collect` completes it; `execute` is the two in a row."""

    def __init__(self, opts: RunnerOptions, tp: TPGroup | None = None):
        self.opts = opts
        kernel_options.install(opts.kernels)  # before any kernel is chosen or compiled
        self.tp = tp or TPGroup()
        self.device = torch.device(opts.device if opts.device == "cpu" else f"cuda:{torch.cuda.current_device()}")
        default_dtype = "float32" if self.device.type == "cpu" else None
        self.model_config = ModelConfig.from_pretrained(opts.model, dtype=opts.dtype or default_dtype,
                                                        quantization=opts.quantization,
                                                        kv_cache_dtype=opts.kv_cache_dtype)
        self.dtype = self.model_config.dtype
        _check_kv_dtype(self.model_config, self.device)
        torch.manual_seed(opts.seed)
        self.model = load_model(self.model_config, self.tp, self.device, self.dtype, opts.load_format)
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
        mc = self.model_config
        # An encoder-decoder request's row holds its encoder slots, then its decoder tokens.
        width = (encoder_decoder.row_width(self.max_context_len, opts.page_size)
                 if mc.is_encoder_decoder else self.max_context_len)
        self.req_to_token_pool = ReqToTokenPool(opts.max_running_requests + 1, width, self.device)
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
        # Overlapped execution (launch/collect): each row's last sampled token lives on the
        # device in the input batch (decode graphs read it); the launched step whose draw is in
        # flight, and completed results not collected yet.
        self.pipeline = ModelPipeline(
            self.model, kv_pool=self.kv_pool, attn_backend=self.attn_backend, req_to_token_pool=self.req_to_token_pool,
            device=self.device, page_size=opts.page_size, is_encoder_decoder=mc.is_encoder_decoder,
            last_token=torch.zeros(opts.max_running_requests + 1, dtype=torch.long, device=self.device))
        self._inflight: _InFlight | None = None
        self._ready: deque[StepResult] = deque()
        # Decode graphs serve generation; an embedding replica only prefills (a batch of
        # one-token prompts, planned as DECODE, runs eagerly).
        if (self.device.type == "cuda" and not opts.disable_cuda_graph and self.attn_backend.supports_cuda_graph
                and not self.serving.is_embedding):
            self.pipeline.use_graphs(opts.most_rows, self.pad_row)
            if self._prompt_graphs_apply():
                chunk = opts.chunked_prefill_size
                self.pipeline.use_prompt_graphs(chunk if chunk > 0 else 1 << 30, self.pad_row)
        if self.drafter is not None:
            self.drafter.attach()
        if self.sampler is not None and not self.serving.is_embedding:
            self.sampler.warm_up(opts.most_rows)
            self._grammars()  # its tokenizer view is built in a thread now, not at the first constrained request
        # Embedding requests (rid -> pooling accumulated over their prefill pieces).
        self.pooling_states: dict[str, PoolingState] = {}

    def _prompt_graphs_apply(self) -> bool:
        """Prompt batches through piecewise graphs (`workers.prompt_graphs`): models whose
        layers between attention calls depend on no host value of the batch (`piecewise_graphs`),
        without linear-attention state or an encoder, unless the kernel options turn it off."""
        return (kernel_options.current().prompt_graphs and getattr(self.model, "piecewise_graphs", False)
                and self.state_pool is None and not self.model_config.is_encoder_decoder)

    def _grammars(self) -> GrammarMatchers:
        """Structured output's matchers (rank 0, generation replicas)."""
        assert self.sampler is not None
        if self.sampler.grammars is None:
            self.sampler.grammars = GrammarMatchers(self.opts.model, self.model_config.vocab_size,
                                                    list(self.model_config.eos_token_ids), self.device)
        return self.sampler.grammars

    # ---------------- memory ----------------
    def _kv_tokens(self, bytes_per_token: int) -> int:
        if self.opts.kv_cache_tokens is not None:
            return self.opts.kv_cache_tokens
        if self.device.type == "cpu":
            return 65536
        free, total = torch.cuda.mem_get_info(self.device)
        # Keep 1 GiB for activations, and the PD hand-off rows' share (made after the pool).
        off = self.opts.kv_offload
        keep = (1 << 30) + (off.handoff_bytes if off is not None and off.handoff_memory == "gpu" else 0)
        budget = int(free * self.opts.mem_fraction) - keep
        if self.opts.gpu_share < 1.0:
            # A GPU shared with other ranks (which may still be loading): this rank's part of
            # it, less what it holds already (weights), whatever the others have taken so far.
            mine = int(total * self.opts.mem_fraction * self.opts.gpu_share) - torch.cuda.memory_reserved(self.device)
            budget = min(budget, mine - keep)
        # More than every running request at full context can never be used.
        most = self.opts.max_running_requests * self.max_context_len
        tokens = max(min(budget // bytes_per_token, most), 2 * self.opts.page_size)
        # Every rank must size its pool identically: take the minimum over the TP group.
        return self.tp.all_min_int(tokens)

    def _make_kv_pool(self) -> KVPool:
        per_token = kv_bytes_per_token(self.model_config, self.tp.size)
        if self.drafter is not None:  # the draft's pool mirrors this one page for page
            per_token += kv_bytes_per_token(self.drafter.model_config, self.tp.size)
        ps = self.opts.page_size
        num_pages = self._kv_tokens(per_token) // ps + 1  # + the reserved page 0
        pool = make_kv_pool(self.model_config, self.tp.size, num_pages, ps, self.device,
                            getattr(self.model, "kv_cache_scales", None))
        logger.info("KV pool: %d pages x %d tokens, %.1f MiB, %s", num_pages, ps,
                    pool.bytes_per_token() * pool.num_slots / 2**20, str(pool.dtype).removeprefix("torch."))
        return pool

    @property
    def num_pages(self) -> int:
        return self.kv_pool.num_pages

    # ---------------- one step ----------------
    @property
    def can_overlap(self) -> bool:
        """Whether `launch`/`collect` may run plans ahead of their results (see
        `RunnerOptions.can_overlap`). Under TP, rank 0 broadcasts each step's sampled tokens
        (`last_token`) so that every rank resolves placeholders."""
        return self.opts.can_overlap

    def launch(self, plan: StepPlan) -> None:
        """Overlapped execution: enqueue `plan`'s forward and sampling without waiting for
        them. The previous launched plan's result is completed here, after this plan's forward
        is enqueued (so the device stays busy while the host reads it) and before this plan's
        sampling (which reads the tokens it appended). `collect()` returns results in order."""
        self._launch(plan, share_tokens=True)

    def execute(self, plan: StepPlan) -> StepResult:
        """One step, waited for: `launch` and `collect` (nothing else may be in flight)."""
        assert self._inflight is None and not self._ready, "execute() with launched plans not collected"
        self._launch(plan, share_tokens=False)
        return self.collect()

    @torch.inference_mode()
    def _launch(self, plan: StepPlan, share_tokens: bool) -> None:
        t0 = time.perf_counter()
        self._draw_deferred()  # the previous step's tokens, before this forward reads them
        self._prepare(plan)
        spec = plan.mode == ForwardMode.TARGET_VERIFY  # one speculative round (workers.spec_runner), waited for
        result = SpecStepResult(plan.step_id) if spec else StepResult(plan.step_id)
        if self.kv_offload is not None:  # KV store saves/prefetches/loads, before the forward
            self.kv_offload.run(plan, result)
        if spec:
            assert self.drafter is not None and isinstance(plan, SpecStepPlan), "TARGET_VERIFY needs a draft model"
            assert isinstance(result, SpecStepResult)
            self._retire_inflight()
            self._ready.append(self._reported(self.drafter.verify(plan, t0, result)))
            return
        fb = hidden = logits = None
        split = self._split_mixed(plan)
        if split is not None:  # decode rows through their graph, prompt pieces eagerly
            fb, logits = self.pipeline.forward_mixed(*split)
            plan = dataclasses.replace(plan, reqs=split[0].reqs + split[1].reqs)  # the joined batch's row order
        elif plan.mode != ForwardMode.IDLE and plan.reqs:
            fb = self.pipeline.inputs.from_plan(plan, is_embedding=any(r.rid in self.pooling_states for r in plan.reqs))
            hidden, logits = self.pipeline.forward(fb)
            if self.drafter is not None:  # the draft computes the same tokens into its own pool
                self.drafter.follow(fb)
        self._retire_inflight()
        self._inflight = (self._launch_sampling(plan, fb, hidden, logits, result, t0, share_tokens) if fb is not None
                          else _InFlight(plan, result, t0))
        if share_tokens and self._inflight.sampled and self._inflight.deferred is None:
            self._share_tokens()

    def _split_mixed(self, plan: StepPlan):
        """`ModelPipeline.split_mixed`, for a plan whose every row is sampled or not from its
        last token alone: no draft model to follow it, no embedding, no prompt logprobs."""
        if (self.drafter is not None or self.pooling_states
                or any(s.params.prompt_logprobs is not None for s in (self.states.get(r.rid) for r in plan.reqs)
                       if s is not None)):
            return None
        return self.pipeline.split_mixed(plan)

    def _share_tokens(self) -> None:
        if self.tp.size > 1:
            self.tp.broadcast(self.pipeline.inputs.last_token)  # rank 0 sampled; every rank reads placeholders

    def _draw_deferred(self) -> None:
        if self._inflight is not None and self._inflight.deferred is not None:
            draw, self._inflight.deferred = self._inflight.deferred, None
            draw()

    def _retire_inflight(self) -> None:
        self._draw_deferred()
        if self._inflight is not None:
            self._ready.append(self._reported(self._complete(self._inflight)))
            self._inflight = None

    def _reported(self, result: StepResult) -> StepResult:
        """A completed result with the KV offload's prefetch progress, sampled now (every rank
        completes its steps at the same points, so its collective lines up)."""
        if self.kv_offload is not None:
            self.kv_offload.report(result)
        return result

    def collect(self) -> StepResult:
        """The result of the oldest launched plan not collected yet (waits for it if needed)."""
        if not self._ready:
            assert self._inflight is not None, "collect() without a launched plan"
            self._retire_inflight()
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
                state = RequestSamplingState(nr.sampling, nr.prompt_ids, list(nr.output_ids))
                if nr.sampling.structured is not None and self.sampler is not None:
                    state.matcher = self._grammars().start(nr.sampling.structured, state.output_ids)
                self.states[nr.rid] = state
        if self.state_pool is not None:
            self.state_pool.reset_admitted(plan)
        for row, start, slots in plan.table_writes:
            self.req_to_token_pool.write(row, start, self.pipeline.inputs.upload(slots, torch.int32))

    def _launch_sampling(self, plan: StepPlan, fb: ForwardBatch, hidden: torch.Tensor,
                         all_logits: torch.Tensor | None, result: StepResult, t0: float,
                         overlapped: bool = False) -> _InFlight:
        """Pool embeddings, compute the logits of the sampled rows and enqueue their draw; each
        row's token also lands in `last_token` on the device (the next plan may read it).

        Overlapped, a step with grammar-constrained rows defers its draw: their masks are filled
        on llguidance's threads while this call returns and the engine processes the previous
        result and plans the next step; the draw (and, under TP, the token broadcast) is enqueued
        at the next launch or collect, which is when the device needs it. Every rank decides the
        same way (from the plan's sampling parameters)."""
        if self.pooling_states:
            self._pool(plan, hidden, result)
        if hidden is not None:  # (a split MIXED step has no prompt logprobs to compute)
            self._prompt_logprobs(plan, hidden, result)
        sample_idx = [i for i, r in enumerate(plan.reqs) if r.sample and r.rid in self.states]
        inflight = _InFlight(plan, result, t0, sampled=bool(sample_idx))
        if sample_idx:
            every_row = len(sample_idx) == fb.batch_size
            idx = None if every_row else self.pipeline.inputs.upload(sample_idx, torch.long)
            logits = self.pipeline.logits(fb, hidden, all_logits, idx)  # all ranks gather
            states = [self.states[plan.reqs[i].rid] for i in sample_idx]
            rows = fb.req_pool_indices if idx is None else fb.req_pool_indices[idx]
            if self.sampler is not None and self.generation_rules is not None:  # generate's forced bos/eos tokens
                logits = self.generation_rules.force(logits, states)
            if overlapped and any(s.params.structured is not None for s in states):
                masks = self.sampler.grammars.fill_async(states) if self.sampler is not None and self.sampler.grammars else None
                inflight.deferred = lambda: self._draw(inflight, logits, states, rows, masks, share=True)
            else:
                self._draw(inflight, logits, states, rows, None, share=False)
            inflight.rids = [plan.reqs[i].rid for i in sample_idx]
        return inflight

    def _draw(self, inflight: _InFlight, logits: torch.Tensor, states: list[RequestSamplingState],
              rows: torch.Tensor, masks, share: bool) -> None:
        """Enqueue the draw of a launched step (rank 0) and put its tokens in `last_token`;
        `masks`: the grammar masks being filled (None: filled here, if any row needs one)."""
        if self.sampler is not None:
            inflight.sample = self.sampler.launch(logits, states, grammar_masks=masks)
            self.pipeline.inputs.last_token[rows] = inflight.sample.token_ids
        if share:
            self._share_tokens()

    def _prompt_logprobs(self, plan: StepPlan, hidden: torch.Tensor, result: StepResult) -> None:
        """For each request of the plan that asked for prompt logprobs, the logprob of every
        prompt token its piece predicts (token p + 1 from position p), with the top
        alternatives and its rank. Every rank computes the logits (the LM head gathers over the
        TP group); rank 0 reads them (a host sync, for these requests only)."""
        if plan.mode.is_decode() or not any(s.params.prompt_logprobs is not None for s in self.states.values()):
            return  # (a decode step covers no prompt position)
        start = 0
        for r in plan.reqs:
            n, state = len(r.input_ids), self.states.get(r.rid)
            first, begin = r.prefix_len + 1, start
            start += n
            if state is None or state.params.prompt_logprobs is None or n == 0:
                continue
            targets = state.prompt_ids[first : r.prefix_len + n + 1]
            if not targets:
                continue
            logits = self.model.compute_logits(hidden[begin : begin + len(targets)])
            if self.sampler is None:
                continue
            lp = logits[:, : self.model_config.vocab_size].float().log_softmax(dim=-1)
            ids = torch.tensor(targets, device=lp.device).unsqueeze(1)
            chosen = lp.gather(1, ids)
            ranks = (lp > chosen).sum(dim=1) + 1
            k = state.params.prompt_logprobs
            top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
            rows = zip(chosen.squeeze(1).clamp_min(LOGPROB_FLOOR).tolist(), ranks.tolist(),
                       top_lp.clamp_min(LOGPROB_FLOOR).tolist(), top_ids.tolist())
            result.prompt_logprobs[r.rid] = (first, [TokenLogprobs(c, list(zip(ti, tl)), rank)
                                                     for c, rank, tl, ti in rows])

    def _complete(self, inflight: _InFlight) -> StepResult:
        """Wait for a launched step's draw; its tokens go to the sampling states and the result."""
        result = inflight.result
        if inflight.sample is not None:
            out = inflight.sample.wait()
            for rid, tok, lp in zip(inflight.rids, out.token_ids, out.logprobs):
                state = self.states.get(rid)
                if state is not None:  # else finished or preempted since the launch
                    state.extend([tok])
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
