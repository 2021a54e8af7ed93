"""How the router serves a request on a prefill replica and a decode replica.

1. A prefill replica (chosen by the router's policy among prefill replicas: `cache_aware`
   sends a shared prefix where it is cached) runs the prompt to its first token, with
   `hand_off` set: it keeps the prompt's pages in its ranks' hand-off rows (on their GPUs) for a
   decode replica.
2. The first token goes to the client at once: it never waits for the transfer.
3. A decode replica is admitted with that token (`resume_ids`) and the prefill replica's
   `kv_source`; its ranks pull the pages over NIXL while it keeps decoding its other requests,
   then it streams the rest. Pages that do not arrive (dead prefill replica, deadline, bad
   checksum) are computed by the decode replica, so the tokens never depend on the transfer.

A request that ends with its first token (eos, a stop string, max_tokens 1) never reaches a
decode replica. No decode replica can take it: a prefill or mixed replica continues it (the
pages are in its own cache or read the same way). Every prefill replica full (QueueFull) or
gone: a mixed or decode replica serves the request whole; only when they are full too does the
client get a 503. The client's disconnect aborts whichever
side holds the request; the prefill side's lent pages are unpinned by the read's release or
its lease's expiry.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator

from cluster.engine.client import NoReplicaAvailable
from cluster.engine.request import RequestOutput
from workers.request_errors import QueueFull, RequestError
from workers.sampling_params import SamplingParams


async def disaggregated_stream(router, rid: str, tokens: list[int], params: SamplingParams,
                               group: str | None) -> AsyncIterator[RequestOutput]:
    if params.max_tokens <= 1:  # nothing to hand off: one replica serves it whole
        async for out in router.attempts(rid, tokens, params, False, group, ("prefill", "decode")):
            yield out
        return
    first_params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
    first: RequestOutput | None = None
    started = False
    try:
        async with contextlib.aclosing(router.attempts(rid, tokens, first_params, False, group, ("prefill",),
                                                       hand_off=True)) as prefill:
            async for out in prefill:
                started = True
                if out.finished:
                    first = out
                    break
                yield out
    except (QueueFull, NoReplicaAvailable):
        if started:
            raise
        # Every prefill replica's queue is full (or none is left): a decode or mixed replica
        # serves it whole rather than the client getting a 503 while they have room.
        async with contextlib.aclosing(router.attempts(rid, tokens, params, False, group,
                                                       ("mixed", "decode"))) as whole:
            async for out in whole:
                yield out
        return
    if first is None:
        return
    # "length" is the prefill's max_tokens of 1 — unless the context is full (nothing to continue).
    more = (first.finish_reason == "length" and first.error is None and len(first.delta_token_ids) == 1
            and len(tokens) + 1 < router.max_context_len)
    if not more:
        yield first
        return
    handle = router.replicas.get(first.replica)
    source = handle.kv_source if handle is not None else None
    prefill_stamps = _engine_stamps(first)
    first.finished, first.finish_reason = False, None
    first.completion_tokens = 1
    yield first
    resume = list(first.delta_token_ids)
    # The prompt's logprobs went out with the first token: the decode side would compute the
    # whole prompt again to send them twice.
    rest = dataclasses.replace(params, prompt_logprobs=None) if params.prompt_logprobs is not None else params
    for roles in (("decode",), ("mixed", "prefill")):
        started = False
        try:
            async with contextlib.aclosing(router.attempts(rid, tokens, rest, False, group, roles,
                                                           resume_ids=resume, kv_source=source)) as decode:
                async for out in decode:
                    started = True
                    if out.finished:
                        _first_token_from(out, prefill_stamps, first.replica)
                    yield out
            return
        except (NoReplicaAvailable, QueueFull, RequestError, RuntimeError):
            if started:
                raise
            continue  # none of these replicas took it: the next kind may
    yield RequestOutput(rid, finished=True, finish_reason="error", error_type="internal",
                        error="no replica could continue the request after its first token",
                        replica=first.replica)


def _engine_stamps(first: RequestOutput) -> tuple:
    """The prefill engine's timings of a request (its final output: max_tokens 1)."""
    return first.arrival_wall, first.first_token_wall, first.ttft_s, first.queue_s


def _first_token_from(out: RequestOutput, stamps: tuple, replica: str) -> None:
    """The request's final output carries the decode engine's timings, from when it was admitted
    there, after the first token had reached the client. Its time to first token and where that
    went (`manta:request_queue_time_seconds`, under `first_replica`'s name) are the prefill
    engine's. (`e2e_s` stays the decode engine's: the server measures the request's own, and the
    two engines' clocks may be on different hosts. The decode side's wait for the pages is
    `manta:pd_transfer_wait_seconds` and the stream's gap before its second token.)"""
    out.arrival_wall, out.first_token_wall, out.ttft_s, out.queue_s = stamps
    out.first_replica = replica
