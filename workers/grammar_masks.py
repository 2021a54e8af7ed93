"""Structured output on TP rank 0: one llguidance matcher per constrained request, and the token
masks the sampler applies.

A matcher follows its request's output token by token (`RequestSamplingState.extend`). Its mask
for the next token is computed when the sampler needs it: in `ModelRunner._launch` that is after
the step's forward has been enqueued on the device (and, with overlapped scheduling, after the
previous step's tokens reached the host and were consumed), so the CPU fills the masks while the
GPU runs the forward. The masks of a batch are filled in parallel by llguidance's thread pool into
one pinned int32 bitmask (llguidance's layout, written through its pointer API: its
`llguidance.torch` helpers would import torch.compile, seconds at the first use; [rows, ceil(V / 32)], bit t of a row set = token t allowed), copied to the
device in one transfer and expanded there. (On a CPU replica, where torch's threads compute the
forward, the masks are filled in the calling thread: no pool.)

A speculative round needs K + 1 masks per request: position i sees the output plus the first i
draft tokens; `fill_with_drafts` computes them by advancing the matcher over the drafts and
rolling it back (positions after a draft token the grammar refuses are never accepted, so their
masks do not matter).

Grammars are compiled once per distinct spec (a prototype matcher, `deep_copy`'d per request: a
copy costs about a microsecond); the tokenizer is read from the checkpoint on the first
constrained request.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from workers.structured_output import StructuredOutput

logger = logging.getLogger(__name__)

_MAX_GRAMMARS = 256  # compiled prototypes kept (least recently used dropped)


class GrammarMatchers:
    """The matchers of one rank 0: a tokenizer view for llguidance, compiled grammars, and a
    thread pool that fills a batch's masks."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, eos_token_ids: list[int], device: torch.device):
        self.tokenizer_dir, self.vocab_size, self.device = tokenizer_dir, vocab_size, device
        self.eos_token_ids = sorted(eos_token_ids)
        self.words = (vocab_size + 31) // 32
        self._tokenizer: Any = None
        self._executor: Any = None
        self._protos: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._filler: ThreadPoolExecutor | None = None  # fill_async's thread
        self._shifts = torch.arange(32, dtype=torch.int32, device=device)
        self._pin = device.type == "cuda"
        # llguidance's first mask over a tokenizer builds its token trie: about 3 s for a 128k
        # vocabulary (once per process; a new grammar after that costs milliseconds). Done here,
        # in a thread, so that the first constrained request does not stall every running one.
        self._ready = threading.Lock()
        self._ready.acquire()
        # The tokenizer files are read here, not in the thread: two threads importing one package
        # (transformers loads tokenizer modules lazily) can see it half-initialised.
        self._hf_tokenizer: Any = None
        try:
            from transformers import AutoTokenizer

            self._hf_tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        except Exception:  # (no tokenizer files: `start` says so when a grammar is needed)
            logger.debug("no tokenizer for structured output in %s", tokenizer_dir, exc_info=True)
        import llguidance.hf  # noqa: F401
        threading.Thread(target=self._warm_up, name="grammar-warm-up", daemon=True).start()

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
        finally:
            self._ready.release()

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

    def start(self, structured: StructuredOutput, output_ids: list[int]) -> Any:
        """A matcher for a new (or resumed, after a preemption) request: its output so far
        consumed. None where the tokenizer cannot drive llguidance (the HTTP edge refuses such
        requests first: `cluster.api.structured.TokenizerSupport`; a direct engine caller gets
        an error logged and free text, not a dead rank)."""
        from llguidance import LLMatcher

        proto = self._protos.get(structured)
        if proto is None:
            with self._ready:  # (the warm-up is done: waits only for a request in the first seconds)
                pass
            try:
                tokenizer = self._llg_tokenizer()
            except Exception:
                logger.exception("structured output needs a tokenizer llguidance can read; %s is ignored",
                                 structured.param)
                return None
            proto = LLMatcher(tokenizer, structured.grammar(), log_level=0)
            if proto.is_error():
                # Checked at the edge, so only a tokenizer-specific failure gets here.
                logger.warning("grammar for %s did not compile: %s", structured.param, proto.get_error())
            self._protos[structured] = proto
            if len(self._protos) > _MAX_GRAMMARS:
                self._protos.popitem(last=False)
        else:
            self._protos.move_to_end(structured)
        matcher = proto.deep_copy()
        if output_ids and not matcher.consume_tokens(list(output_ids)):
            logger.warning("a resumed request's output does not match its grammar: %s", matcher.get_error())
        return matcher

    # -- masks -------------------------------------------------------------------------------

    def _bitmask(self, rows: int) -> torch.Tensor:
        return torch.full((rows, self.words), -1, dtype=torch.int32, pin_memory=self._pin)

    def fill(self, matchers: list[Any]) -> torch.Tensor:
        """[len(matchers), words] int32 on the host: each matcher's allowed next tokens. A
        matcher in an error state (it consumed a token its grammar refused) allows every token."""
        mask = self._bitmask(len(matchers))
        live = [(m, i) for i, m in enumerate(matchers) if not m.is_error()]
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
        matchers = [states[i].matcher for i in rows]
        if self._filler is None:
            self._filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        return self._filler.submit(lambda: (rows, self.fill(matchers)))

    def fill_with_drafts(self, matchers: list[Any], drafts: list[list[int]]) -> torch.Tensor:
        """[len(matchers) * (K + 1), words]: for matcher b, row b * (K + 1) + i allows the tokens
        that may follow its output plus drafts[b][:i]. The matchers are left as they were."""
        k1 = len(drafts[0]) + 1 if drafts else 1
        mask = self._bitmask(len(matchers) * k1)
        live = [(m, b * k1, list(d)) for b, (m, d) in enumerate(zip(matchers, drafts)) if not m.is_error()]
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


def consume(matcher: Any, tokens: list[int]) -> None:
    """Advance a request's matcher over tokens it emitted. A token the grammar refuses (it cannot
    be sampled under the mask; only a stopped grammar followed by eos under ignore_eos gets here)
    leaves the matcher in its error state, where it constrains nothing more."""
    for t in tokens:
        if matcher.is_stopped() or matcher.is_error():
            return
        if not matcher.consume_token(t):
            logger.debug("grammar refused token %d: %s", t, matcher.get_error())
            return


__all__ = ["GrammarMatchers", "consume"]
