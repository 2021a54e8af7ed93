"""Structured output on TP rank 0: one llguidance matcher per constrained request, and the token
masks the sampler applies.

A matcher follows its request's output token by token (`RequestSamplingState.extend`). Its mask
for the next token is computed when the sampler needs it: after the step's forward has been
enqueued and the previous step's tokens were consumed. Overlapped, the draw is deferred
(`ModelRunner._launch_sampling`) and the masks are filled on the grammar thread while the engine
processes the previous result; otherwise they are filled in the sampler while the GPU runs the
forward. A batch's masks are filled in parallel by llguidance's pool (on a CPU replica, where
torch's threads compute the forward, in the calling thread) into one pinned int32 bitmask
([rows, ceil(V / 32)], bit t of a row set = token t allowed; written through llguidance's
pointer API: its `llguidance.torch` helpers import torch.compile, seconds at the first use),
copied to the device in one transfer and expanded there.

A speculative round needs K + 1 masks per request: position i sees the output plus the first i
draft tokens; `fill_with_drafts` computes them by advancing the matcher over the drafts and
rolling it back (positions after a draft token the grammar refuses are never accepted, so their
masks do not matter).

A grammar's text is compiled once per distinct spec (`workers.structured_output`); each request
gets its own matcher, built on the grammar thread, which also fills the masks of overlapped
steps; the tokenizer is read when the rank starts.
"""

from __future__ import annotations

import logging
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from workers.structured_output import StructuredOutput

logger = logging.getLogger(__name__)


class GrammarMatchers:
    """The matchers of one rank 0: a tokenizer view for llguidance, compiled grammars, and a
    thread pool that fills a batch's masks."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, eos_token_ids: list[int], device: torch.device):
        self.tokenizer_dir, self.vocab_size, self.device = tokenizer_dir, vocab_size, device
        self.eos_token_ids = sorted(eos_token_ids)
        self.words = (vocab_size + 31) // 32
        self._tokenizer: Any = None
        self._executor: Any = None
        self._shifts = torch.arange(32, dtype=torch.int32, device=device)
        self._pin = device.type == "cuda"
        # The tokenizer files are read here, not in a thread: two threads importing one package
        # (transformers loads tokenizer modules lazily) can see it half-initialised.
        self._hf_tokenizer: Any = None
        try:
            from transformers import AutoTokenizer

            self._hf_tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        except Exception:  # (no tokenizer files: a constrained request is then served unconstrained, logged)
            logger.debug("no tokenizer for structured output in %s", tokenizer_dir, exc_info=True)
        try:
            import llguidance.hf  # noqa: F401
        except ImportError:  # (a broken install: the HTTP edge refuses constrained requests then)
            logger.warning("llguidance is not importable: structured output is unavailable")
        # One thread builds matchers and fills masks, in submission order (llguidance releases
        # the GIL). Its first task builds llguidance's view of the tokenizer and computes a few
        # masks (about 3 s for a 128k vocabulary, once), so no request waits for that.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._protos: dict[StructuredOutput, Any] = {}  # CPU replicas: one compiled matcher per spec
        self._thread.submit(self._warm_up)

    def _warm_up(self) -> None:
        try:
            from llguidance import LLMatcher

            tokenizer = self._llg_tokenizer()
            # A JSON string and number: the lexer states whose token sets ("slices") cost the most.
            schema = StructuredOutput.json_schema({"type": "object", "properties": {
                "s": {"type": "string"}, "n": {"type": "number"}}}, "warm-up")
            matcher = LLMatcher(tokenizer, schema.grammar(), log_level=0)
            mask = self._bitmask(1)
            for piece in ('{"s": "', "ab", '", "n": ', "1"):
                matcher.unsafe_compute_mask_ptr(mask[0].data_ptr(), self.words * 4)
                matcher.consume_tokens(tokenizer.tokenize_str(piece))
        except Exception:  # (a tokenizer llguidance cannot read: `start` says so when it is needed)
            logger.debug("grammar warm-up failed", exc_info=True)

    def _llg_tokenizer(self) -> Any:
        if self._tokenizer is None:
            import llguidance
            import llguidance.hf

            hf = self._hf_tokenizer
            if hf is None:
                raise ValueError(f"no tokenizer could be loaded from {self.tokenizer_dir}")
            eos = self.eos_token_ids or [hf.eos_token_id]
            self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=eos)
            self._executor = llguidance.LLExecutor(num_threads=max(1, min(8, (os.cpu_count() or 2) // 2)))
        return self._tokenizer

    def start(self, structured: StructuredOutput, output_ids: list[int]) -> RequestGrammar:
        """A new (or resumed, after a preemption) request's matcher, its output so far consumed,
        built on the grammar thread. On CUDA hosts each request gets its own compiled matcher,
        not a copy of a shared one: copies share llguidance's lexer state, and their masks barely
        fill in parallel (H100 host, 64 rows: 22.6 ms with 8 threads against 6.4 ms for
        independent matchers); a build costs 1.5-2 ms, off the step's path. On a CPU replica,
        which fills one row at a time, copies of one matcher per spec share the lexer's caches."""
        return RequestGrammar(self._thread.submit(self._build, structured, list(output_ids)))

    def _build(self, structured: StructuredOutput, output_ids: list[int]) -> Any:
        """On the grammar thread. None where the tokenizer cannot drive llguidance (the HTTP edge
        refuses such requests first: `cluster.api.structured.TokenizerSupport`; a direct engine
        caller gets an error logged and free text, not a dead rank)."""
        from llguidance import LLMatcher

        try:
            tokenizer = self._llg_tokenizer()
        except Exception:
            logger.exception("structured output needs a tokenizer llguidance can read; %s is ignored",
                             structured.param)
            return None
        proto = self._protos.get(structured)
        if proto is None:
            proto = LLMatcher(tokenizer, structured.grammar(), log_level=0)
            if proto.is_error():  # checked at the edge, so only a tokenizer-specific failure gets here
                logger.warning("grammar for %s did not compile: %s", structured.param, proto.get_error())
            if self.device.type == "cpu":  # filled one row at a time: copies share the lexer's caches
                self._protos[structured] = proto
                if len(self._protos) > 256:
                    self._protos.pop(next(iter(self._protos)))
        matcher = proto.deep_copy() if self.device.type == "cpu" else proto
        if output_ids and not matcher.consume_tokens(output_ids):
            logger.warning("a resumed request's output does not match its grammar: %s", matcher.get_error())
        return matcher

    # -- masks -------------------------------------------------------------------------------

    def _bitmask(self, rows: int) -> torch.Tensor:
        return torch.full((rows, self.words), -1, dtype=torch.int32, pin_memory=self._pin)

    def fill(self, grammars: list[RequestGrammar]) -> torch.Tensor:
        """[len(grammars), words] int32 on the host: each request's allowed next tokens. A
        matcher in an error state (it consumed a token its grammar refused), or none, allows
        every token."""
        mask = self._bitmask(len(grammars))
        live = [(m, i) for i, m in enumerate(g.get() for g in grammars) if m is not None and not m.is_error()]
        if self.device.type == "cuda" and len(live) > 1:  # the host is idle while the GPU runs: use its cores
            self._executor.unsafe_compute_mask_ptr(live, mask.data_ptr(), self.words * 4, mask.shape[0])
            return mask
        # On a CPU replica torch's threads run the forward: a pool's idle spinning would slow them.
        row_bytes = self.words * 4
        for m, i in live:
            m.unsafe_compute_mask_ptr(mask[i].data_ptr(), row_bytes)
        return mask

    def fill_async(self, states: list[Any]) -> Future:
        """`fill` of the constrained rows of `states` on a background thread (llguidance
        releases the GIL): a future of (rows, mask) for `Sampler.launch(grammar_masks=...)`."""
        rows = [i for i, s in enumerate(states) if s.matcher is not None]
        grammars = [states[i].matcher for i in rows]
        return self._thread.submit(lambda: (rows, self.fill(grammars)))

    def fill_with_drafts(self, grammars: list[RequestGrammar], drafts: list[list[int]]) -> torch.Tensor:
        """[len(matchers) * (K + 1), words]: for matcher b, row b * (K + 1) + i allows the tokens
        that may follow its output plus drafts[b][:i]. The matchers are left as they were."""
        k1 = len(drafts[0]) + 1 if drafts else 1
        mask = self._bitmask(len(grammars) * k1)
        matchers = [g.get() for g in grammars]
        live = [(m, b * k1, list(d)) for b, (m, d) in enumerate(zip(matchers, drafts))
                if m is not None and not m.is_error()]
        if live:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(live, mask.data_ptr(), self.words * 4,
                                                                     mask.shape[0])
        return mask

    def apply(self, logits: torch.Tensor, rows: list[int], mask: torch.Tensor) -> None:
        """In place on logits [B, V]: in each of `rows`, the tokens its mask row refuses get -inf."""
        V = logits.shape[1]
        dev_mask = mask.to(self.device, non_blocking=True) if self.device.type != "cpu" else mask
        allowed = ((dev_mask.unsqueeze(-1) >> self._shifts) & 1).view(len(rows), -1)[:, :V].bool()
        if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
            logits.masked_fill_(~allowed, -math.inf)
            return
        idx = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        sub = logits.index_select(0, idx).masked_fill_(~allowed, -math.inf)
        logits.index_copy_(0, idx, sub)


class RequestGrammar:
    """One request's matcher, being built on the grammar thread: `get()` waits for it (a mask
    needs it first, and the thread builds before it fills: no wait in practice)."""

    def __init__(self, future: Future):
        self._future: Future | None = future
        self._matcher: Any = None

    def get(self) -> Any:
        """The llguidance matcher, or None where it could not be built."""
        if self._future is not None:
            self._matcher, self._future = self._future.result(), None
        return self._matcher


def consume(grammar: RequestGrammar, tokens: list[int]) -> None:
    """Advance a request's matcher over tokens it emitted. A token the grammar refuses (it cannot
    be sampled under the mask; only a stopped grammar followed by eos under ignore_eos gets here)
    leaves the matcher in its error state, where it constrains nothing more."""
    matcher = grammar.get()
    if matcher is None:
        return
    for t in tokens:
        if matcher.is_stopped() or matcher.is_error():
            return
        if not matcher.consume_token(t):
            logger.debug("grammar refused token %d: %s", t, matcher.get_error())
            return


__all__ = ["GrammarMatchers", "RequestGrammar", "consume"]
