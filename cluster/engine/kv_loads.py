"""The state of the KV store integration's loads (`cluster.engine.kv_offload`): what `set_aside`
says about admitting a request, a load's life from lookup to result, and the counters."""

from __future__ import annotations

from dataclasses import dataclass, field


class Verdict:
    """What the store integration says about admitting a request now (`set_aside`)."""

    ADMIT = "admit"  # admit it as usual
    SET_ASIDE = "set_aside"  # it left the queue to have its prefix loaded from the store
    DEFER = "defer"  # its store lookup has not answered yet: admit the ones behind it first


@dataclass
class KVOffloadStats:
    query_pages: int = 0  # pages past the radix match looked up in the store
    probe_hit_pages: int = 0  # of those, present for every rank when probed
    hit_pages: int = 0  # pages loaded into the device pool (agreed by all ranks)
    loaded_tokens: int = 0  # hit_pages * page_size: prompt tokens the prefill did not compute
    loads: int = 0  # requests that went through a store load
    saved_pages: int = 0  # pages ordered saved (device -> host tier -> store)
    early_stops: int = 0  # prefetches stopped before they finished (best_effort, timeout)
    probe_skips: int = 0  # requests not probed while probing pauses after a store error
    probe_timeouts: int = 0  # lookups not answered within PROBE_WAIT_S
    bypassed: int = 0  # requests computed while the store is slower than recompute (still probed)
    busy: int = 0  # requests computed because MAX_LOADING others were loading
    drained_pages: int = 0  # pages ordered saved at shutdown
    released_holds: int = 0  # loads dropped: their locked prefixes held the memory of an idle replica
    short_loads: int = 0  # loads the ranks agreed came back short: their requests computed again
    host_admissions: int = 0  # of `loads`, admitted at once on pages the host tier held


@dataclass(eq=False)
class Loading:
    req: object
    chain: list[str]
    m: int  # radix pages matched (locked) when set aside
    node: object
    s: int  # leading pages every rank's keys were in the store for, when probed (> m)
    started: float
    deadline: float
    ready: int = 0  # pages past m that every rank holds, as last reported
    reported: bool = False  # a progress report has come back (the ranks run the prefetch)
    finished: bool = False  # every rank's read has ended
    queued: bool = False  # back in the waiting queue: admitted with its load
    base: int = 0  # at admission: the radix pages matched then (the load's pages follow them)
    pages: list[int] = field(default_factory=list)  # at admission: the pages the load fills
    load_step: int = 0  # the plan that carries the load (and admits the request)
    requeued_at: float = 0.0
    admitted_at: float = 0.0
    loaded_at: float = 0.0  # the result of the plan that carried the load came back
    peer: bool = False  # read from a prefill replica (cluster/engine/kv_handoff.py), not the store
    host: bool = False  # admitted at once on pages the host tier held (`kv_host_admission`): no prefetch
