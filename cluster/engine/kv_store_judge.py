"""Whether loading prompts from the KV store beats computing them, judged by what users see.

What a load must beat is the first token a user would otherwise get, so both paths are judged
by their requests' time to first token per prompt token, measured as the replica runs (arrival
to first token: queueing included): requests that loaded most of their prompt from the store
against requests that computed it. When loading has been the slower path, requests are not set
aside for `BYPASS_S`, then the store is tried again. (A throughput comparison — the store's
bandwidth against the GPU's prefill rate — bypassed a store that halved TTFT under load: an H100
prefills an 8B model's tokens faster than the store moves their 128 KiB each, but a loaded
request skips the queue for prefill.)

It also keeps where a load's time goes (`LOAD_PHASES`, means over loads, in the replica's
stats): waiting to be set aside, the prefetch until its stop, the wait for admission, the step
that loads and admits it (until its result), then to the first token.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)

BYPASS_S = 30.0  # a store slower than recompute is not used for this long, then tried again
RATE_SAMPLES = 3  # first tokens measured on each path before the store may be bypassed
LOAD_PHASES = ("to_set_aside", "prefetch", "to_admission", "to_load_result", "to_first_token")


class _Rate:
    """Tokens per second, averaged (exponentially) over the last few measurements."""

    def __init__(self) -> None:
        self.value, self.samples = 0.0, 0

    def add(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        self.value = rate if self.samples == 0 else 0.7 * self.value + 0.3 * rate
        self.samples += 1


class StoreJudge:
    """min_prompt_tokens: shorter prompts are never samples (they are never looked up)."""

    def __init__(self, min_prompt_tokens: int):
        self.min_prompt_tokens = min_prompt_tokens
        self.load_rate, self.compute_rate = _Rate(), _Rate()
        self.bypass_until = 0.0
        self._loaded: dict[str, tuple[int, object]] = {}  # rid -> (prompt tokens it loaded, its load)
        self._phases: dict[str, list[float]] = {k: [0.0, 0] for k in LOAD_PHASES}

    def bypassing(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) < self.bypass_until

    def loaded(self, rid: str, tokens: int, load=None) -> None:
        """`rid` was admitted with `tokens` of its prompt loaded (`load`: its
        `cluster.engine.kv_loads.Loading`, for the phase marks)."""
        self._loaded[rid] = (tokens, load)

    def first_token(self, req, ttft_s: float) -> None:
        """`req`'s first token came `ttft_s` after its arrival: a sample of the path its
        prompt took."""
        loaded, e = self._loaded.pop(req.rid, (0, None))
        prompt = req.num_prompt_tokens
        if prompt < self.min_prompt_tokens or req.is_embedding or req.num_preemptions:
            return
        if e is not None:
            marks = (req.arrival_time, e.started, e.requeued_at, e.admitted_at, e.loaded_at or e.admitted_at,
                     req.arrival_time + ttft_s)
            for name, a, b in zip(LOAD_PHASES, marks, marks[1:]):
                self._phases[name][0] += (b - a) * 1e3
                self._phases[name][1] += 1
        if 2 * loaded >= prompt:
            self.load_rate.add(prompt, ttft_s)
            self._judge()
        elif req.cached_tokens * 2 < prompt:
            self.compute_rate.add(prompt, ttft_s)

    def forget(self, live) -> None:
        """Drop the requests that ended before a first token (`live`: the ones still known)."""
        for rid in [r for r in self._loaded if r not in live]:
            del self._loaded[rid]

    def _judge(self) -> None:
        """Bypass the store while loading has given later first tokens than computing."""
        if (self.load_rate.samples >= RATE_SAMPLES and self.compute_rate.samples >= RATE_SAMPLES
                and self.load_rate.value < self.compute_rate.value):
            logger.warning("KV store: requests that load their prompt get their first token at %.0f prompt "
                           "tokens/s, those that compute it at %.0f: not using the store for %.0f s",
                           self.load_rate.value, self.compute_rate.value, BYPASS_S)
            self.bypass_until = time.monotonic() + BYPASS_S
            self.load_rate = _Rate()  # measured afresh when the store is tried again

    def counters(self) -> dict:
        return {"ttft_tokens_per_s_loaded": self.load_rate.value,
                "ttft_tokens_per_s_computed": self.compute_rate.value,
                "bypassing": self.bypassing(),
                "load_phase_ms": {k: round(t / n, 1) for k, (t, n) in self._phases.items() if n}}
