"""Admissions that load from the rank's host tier at once (`cluster.engine.kv_offload`).

Pages the GPU cache evicted (or a store read brought in) sit in each rank's host tier
(`workers.host_tier`). Loading them through the store's path costs a lookup, a prefetch whose
progress comes back with a step's result, and a requeue: about three steps before the request
runs, against one to compute a short prompt. So the first rank tells the scheduler what its
host tier holds — the chain keys that became ready and those evicted, in every step result
(`StepResult.kv_host_ready` / `kv_host_evicted`) — and a request whose next `min_pages` or more
pages past its radix match are in that picture is admitted in the plan being built, with a
`KVLoad` of them: no lookup, no prefetch, no set-aside.

The picture may be a step behind (a page evicted while the plan was on its way), and only the
first rank reports (another rank's tier could lack a page, e.g. one whose store client did not
start). Either way the ranks agree on fewer pages than ordered, the request computes its prompt
past the good ones (`SchedulerKVOffload._short_load`) and the picture forgets the pages it was
wrong about; when the ranks loaded none of them, it is not used for `HOST_SKIP_S`. On the ranks
the loads' rows are pinned before the plan's saves take rows (`workers.kv_offload`), so a
plan's own evictions never cost its loads.

The picture travels with step results, so it is as fresh as the last step: a page published
after an idle replica's last step is unknown to it until the next one, and the first request
after a pause goes the store's way (whose prefetch then finds the page in the host tier). That
would include the pages a rank warms its tier with at start (`workers/host_warm.py`), read
while the replica is idle. So while the first rank says its warm runs (`StepResult.
kv_host_warming`, true from its start), the scheduler sends an empty plan every `WARM_POLL_S`
for the picture (for at most `WARM_POLL_MAX_S`): a replica started again on a store that
outlived it admits its old prompts from host rows from its first request on.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from cluster.engine.kv_loads import Loading

HOST_SKIP_S = 10.0  # admissions from the host tier pause this long after one came back short
WARM_POLL_S = 0.5  # while the ranks warm their host tiers: an empty plan this often, for the picture
WARM_POLL_MAX_S = 300.0  # and not for longer than this after start


class HostTierPicture:
    """The chain keys the first rank's host tier holds, as its step results said, at most
    `capacity` of them (the tier's pages: older ones are dropped first)."""

    def __init__(self, capacity: int, warming: bool = False):
        self.keys: OrderedDict[str, None] = OrderedDict()
        self.capacity = capacity
        self.skip_until = 0.0
        self.warming_until = time.monotonic() + WARM_POLL_MAX_S if warming else 0.0
        self._poll_at = 0.0
        # listener(ready, evicted) of each step result's changes (the KV events' host tier:
        # cluster/engine/kv_events.py), on the engine thread
        self.listeners: list = []

    def poll_due(self, now: float) -> bool:
        """Whether an empty plan should fetch what a warming rank published since the last one."""
        return now < self.warming_until and now >= self._poll_at

    def polled(self, now: float) -> None:
        self._poll_at = now + WARM_POLL_S

    def update(self, ready: list[str], evicted: list[str], warming: bool = False) -> None:
        """One step result's changes (a key is in one list at most: its state now), and whether
        the first rank's warm still runs."""
        if not warming:
            self.warming_until = 0.0
        for key in evicted:
            self.keys.pop(key, None)
        for key in ready:
            self.keys[key] = None
            self.keys.move_to_end(key)
        while len(self.keys) > self.capacity:
            self.keys.popitem(last=False)
        if ready or evicted:
            for listener in self.listeners:
                listener(ready, evicted)

    def forget(self, keys: list[str]) -> None:
        for key in keys:
            self.keys.pop(key, None)

    def trusted(self) -> bool:
        return bool(self.keys) and time.monotonic() >= self.skip_until

    def distrust(self) -> None:
        self.skip_until = time.monotonic() + HOST_SKIP_S

    def plan_load(self, off, req) -> Loading | None:
        """`req`'s load when at least `off.min_pages` leading pages past its radix match are in
        the picture: that match locked, the load ready to be carried by the plan that admits it
        (`SchedulerKVOffload.extend`). None: admit it the usual way."""
        n = (len(req.prompt_ids) - 1) // off.P  # the last token is always computed
        if n < off.min_pages:
            return None
        match = off.radix.match_prefix(req.prompt_ids[: n * off.P])
        m = len(match.pages)
        if n - m < off.min_pages:
            return None
        chain = off.chain_of(req, n)
        h = 0
        while m + h < n and chain[m + h] in self.keys:
            h += 1
        if h < off.min_pages:
            return None
        off.radix.lock(match.node)
        now = time.monotonic()
        return Loading(req, chain, m, match.node, m + h, now, now, ready=h, reported=True, finished=True,
                       queued=True, requeued_at=now, host=True)
