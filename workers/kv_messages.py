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
    store: bool = True  # False: into the host tier only (a prefill replica's hand-off to decode)
    prompt: int = 0  # the leading pages that hold prompt tokens (a restarted replica warms those first)
    wait_s: float = 0.0  # `sync`: how long pages the store refuses for want of room are offered again
    # Every plan that wrote these pages has completed (its result read): the copy need not wait
    # for the step in flight (workers/kv_offload.py `_copy_out`). Set only where the scheduler
    # knows it: a PD hand-off of a prefill that finished on its sampled token.
    settled: bool = False


@dataclass
class KVPrefetch:
    """Start reading keys (leading pages of one request's prefix, past its radix-cache match)
    from the store into the host tier, in the background. Every step until the request's
    `KVLoad` (or its rid in a plan's `finished_rids`, which cancels it), the ranks report its
    progress in `StepResult.kv_prefetched[rid]` = (pages every rank holds, pinned; whether
    every rank's read has ended): the min over ranks, agreed before the step's forward."""

    rid: str
    keys: list[str]
    source: KVSource | None = None  # read from a prefill replica's ranks, not the store


@dataclass(frozen=True)
class KVSource:
    """Where a disaggregated request's prompt pages wait: in the host tiers of the prefill
    replica that computed them (`workers.kv_peer`). The decode ranks read them over NIXL
    from the ranks named here (Ray actors, looked up by name: a restarted replica's ranks keep
    their names and come with fresh NIXL metadata).

    keys: the prefill side's chain keys of the pages to read, aligned with the prefetch's own
    keys (the two sides' keys differ when their TP sizes do: the MHA fingerprint names it).
    timeout_s: the transfer's deadline; pages not read by then are computed by the decode
    side. The prefill side keeps what it lent pinned for longer than that, so a read never
    races a reuse of its rows."""

    replica: str
    rank_actors: tuple[str, ...]
    namespace: str | None
    tp_size: int
    layout: str
    fingerprint: str  # the prefill replica's (`kvstore.keys.model_fingerprint`): names its keys
    page_size: int
    keys: tuple[str, ...] = ()
    timeout_s: float = 10.0


@dataclass
class KVLoad:
    """Copy the host-tier pages of `keys` into device pages page_ids (ahead of this step's
    forward, which may read them: the load rides in the plan that admits its request) and end
    the request's prefetch. The scheduler orders no more pages than the ranks reported holding
    (pinned since), so every rank has them; the ranks still agree on the count (min over
    ranks, `StepResult.kv_loaded[rid]`), and a count short of page_ids means the pages past it
    are garbage (the scheduler drops the token that step sampled and has the request compute
    its prompt past the good pages). Empty
    page_ids: just end the prefetch (nothing worth loading arrived)."""

    rid: str
    page_ids: list[int]
    keys: list[str]


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
    warm: bool = True  # fill the host tier at start with the store's recent pages (workers/host_warm.py)
    handoff_bytes: int = 0  # the rank's PD hand-off rows (0: none), workers/handoff_rows.py
    handoff_memory: str = "gpu"  # ... on the rank's GPU where it has one, or in pinned host memory ("host")
