"""The scheduler's side of prefill/decode disaggregation (the ranks' side: `workers/kv_peer.py`).

A prefill replica runs a handed-off request (`Request.hand_off`) to its first token; when it
finishes, the prompt's full pages are saved into its ranks' hand-off rows (a `KVSave` with
`store=False`, in the next plan, before anything can reuse the pages; `workers/handoff_rows.py`),
where decode ranks read them.

A decode replica admits the request with that first token already in its output and the
prefill replica as its `kv_source`. Its prompt's pages past the radix match are fetched like a
store prefetch (`SchedulerKVOffload`: set aside, the ranks read in the background, requeued
and admitted with a `KVLoad`), except that they come from the prefill replica's ranks, the
stop is the transfer's deadline (`KVSource.timeout_s`) or the end of every rank's read, and
nothing asks the store. Whatever did not arrive intact by then (a dead or restarted prefill
replica, a timeout, a bad checksum) is computed here: the request's tokens never depend on
the transfer having worked.
"""

from __future__ import annotations

import dataclasses

from kvstore.keys import chain_keys
from workers.kv_messages import KVPrefetch, KVSave

DEADLINE_MARGIN_S = 0.5  # the scheduler's stop comes this long after the ranks' own deadline
# Upper bounds, seconds, of a decode request's wait on its prompt's pages (`manta:pd_transfer_wait_seconds`):
# a GPU-to-GPU read of a long prompt in milliseconds up to the default 10 s deadline and past it.
WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclasses.dataclass
class HandoffStats:
    handed_off: int = 0  # prefill side: requests whose pages were saved for a decode replica
    handed_off_pages: int = 0
    fetches: int = 0  # decode side: requests that read their prompt from a prefill replica
    fetch_pages: int = 0  # pages asked for
    fetched_pages: int = 0  # pages every rank read intact (loaded)
    fetch_timeouts: int = 0  # fetches stopped by the deadline before every rank's read ended


@dataclasses.dataclass
class PeerFetch:
    """A decode request's read from its prefill replica, as `SchedulerKVOffload` sets it aside:
    its radix match (m pages, `node`), the pages it reads up to (n), its chain and deadline."""

    m: int
    n: int
    node: object
    chain: list[str]
    deadline: float
    prefetch: KVPrefetch


def plan_fetch(off, req, now: float) -> PeerFetch | None:
    """What a decode request reads from its prefill replica; None when nothing worth reading
    lies past its radix match (it is admitted as usual)."""
    src = req.kv_source
    P = off.P
    if src.page_size != P:
        return None
    last = len(req.prompt_ids) if req.output_ids else len(req.prompt_ids) - 1  # one token left to compute
    n = last // P
    tokens = req.prompt_ids[: n * P]
    match = off.radix.match_prefix(tokens)
    m = len(match.pages)
    if n - m < 1:
        return None
    src_keys = chain_keys(tokens, P, src.fingerprint, src.layout)
    chain = off.chain_of(req, n)
    off.handoff.fetches += 1
    off.handoff.fetch_pages += n - m
    return PeerFetch(m, n, match.node, chain, now + src.timeout_s + DEADLINE_MARGIN_S,
                     KVPrefetch(req.rid, chain[m:n], dataclasses.replace(src, keys=tuple(src_keys[m:n]))))


def should_stop(e, now: float) -> bool:
    """A fetch stops when every rank's read has ended or at its deadline."""
    return e.finished or now >= e.deadline


def note_stop(off, e, now: float) -> None:
    """A fetch stopped at `now`: its wait (from being set aside) is observed."""
    off.handoff_wait.observe(now - e.started)
    if not e.finished:
        off.handoff.fetch_timeouts += 1


def hand_off_pages(off, req, pages: list[int], num_tokens: int, token_ids: list[int], settled: bool = False) -> None:
    """A finished prefill of a handed-off request: save its prompt's full pages (to the hand-off rows).
    `settled`: every plan that wrote them has completed (`KVSave.settled`)."""
    P = off.P
    n = min(num_tokens, len(req.prompt_ids)) // P
    if n < 1:
        return
    chain = off.chain_of(req, n, token_ids=token_ids)
    off.pending_handoff.append(KVSave(list(pages[:n]), chain[:n], store=False, settled=settled))
    off.handoff.handed_off += 1
    off.handoff.handed_off_pages += n


def take_handoff_saves(off) -> list[KVSave]:
    saves, off.pending_handoff = off.pending_handoff, []
    return saves
