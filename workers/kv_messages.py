"""What the scheduler tells the ranks about the hierarchical KV cache, and how a rank's side of
it is configured. Plain picklable dataclasses (they ride in `StepPlan`), no heavy imports.

Pages are named by their chain keys (`kvstore.keys.chain_keys`): one key names the whole prefix
that ends with the page, so a key read back from the store is the KV of exactly those tokens.
Order of work on a rank, at the start of a step (before the forward): saves, prefetch starts,
loads. Saves go first because a page ordered saved may be handed to a new request in the same
plan (it was evicted and reallocated): its old bytes must be copied out before anything writes it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KVSave:
    """Copy device pages page_ids[i] (holding chain key keys[i]) into the host tier now and on
    to the shared store in the background (MLA: ranks != 0 keep the host copy, write nothing).
    `sync`: write them straight to the store before the step answers (the drain at shutdown,
    when no step runs; never in serving)."""

    page_ids: list[int]
    keys: list[str]
    sync: bool = False


@dataclass
class KVPrefetch:
    """Start reading keys (leading pages of one request's prefix, past its radix-cache match)
    from the store into the host tier, in the background. Cancelled by the request's rid in a
    plan's `finished_rids`, or consumed by its `KVLoad`."""

    rid: str
    keys: list[str]


# `StepResult.kv_loaded[rid]` of a `KVLoad` with `until_done` while some rank's prefetch of the
# request is still running: no rank used any page; the scheduler orders the load again.
LOAD_PENDING = -1


@dataclass
class KVLoad:
    """Copy the leading pages of `keys` that the host tier holds into device pages page_ids,
    after waiting up to wait_s for the request's prefetch (the stop policy, decided by the
    scheduler). Every rank answers min over ranks (`kvstore.client.agree_on_pages`) in
    `StepResult.kv_loaded[rid]`; device pages past that count are garbage.

    `until_done`: the scheduler may still wait for the prefetch (it ordered the load because
    rank 0's prefetch finished, but the other ranks' may lag: an MLA rank != 0 reads from the
    store only now). Then a rank whose own prefetch is still running after its short wait makes
    every rank answer `LOAD_PENDING` (one agreement: all ranks answer the same), its prefetch
    goes on and the scheduler sends the load again in a later step. Without it (best_effort,
    or the policy's deadline passed) each rank takes what it has and the ranks agree on the min."""

    rid: str
    page_ids: list[int]
    keys: list[str]
    wait_s: float = 0.0
    until_done: bool = False


@dataclass(frozen=True)
class KVOffloadOptions:
    """A rank's side of the KV store (`workers.kv_offload`), fixed per replica.

    fingerprint: `kvstore.keys.model_fingerprint` of the replica (computed once, by the replica).
    layout: "mha" or "mla" (must match the rank's KV pool). host_cache_bytes: the rank's host
    tier (pinned when a GPU is present). store_name / namespace: the store actor (None: the
    job's namespace). chunk_pages: pages per store read of a prefetch (a stop takes whole
    chunks). idle_wait_s: how long a step with nothing to compute waits for prefetch progress
    (keeps the engine loop from spinning while a request waits for the store)."""

    fingerprint: str
    layout: str
    host_cache_bytes: int = 256 << 20
    store_name: str = "manta-kvstore"
    namespace: str | None = None
    timeout_s: float = 2.0
    chunk_pages: int = 16
    idle_wait_s: float = 0.01
    io_threads: int = 3  # requests whose pages move to or from the store at once
