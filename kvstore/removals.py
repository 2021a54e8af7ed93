"""Which pages left the shared store, for the router's index of the store tier (issue 24).

Replicas report the pages they write to the store (`cluster/engine/kv_events.py`, tier "store"),
but only the store sees its own evictions: a RAM page dropped without a file copy, a file the
LRU deletes with no RAM copy left, a page that failed its checksum, `clear()`. Without them the
router would keep scoring a replica for a prefix the store no longer holds.

`RemovalLog` numbers each page that leaves the index by its *chain key* (`kvstore.keys`: the
page's name without the rank and K/V suffix, which is what the router knows a store page by). An
MHA page is several store keys (K and V of every rank); the first of them to go makes the page
unreadable, so that is the one that counts, and the rest repeat its chain key harmlessly.

A reader asks `since(epoch, seq)`. One that is new, from another epoch (the store restarted) or
behind the retained window gets `reset` with every chain key the store holds now (or None past
`RESYNC_MAX`: then the reader drops what it knows of the store and relearns it from events).
"""

from __future__ import annotations

import itertools
import uuid
from collections import deque

MAX_REMOVALS = 65_536  # chain keys retained (~11 MiB at worst); a reader further behind resyncs
RESYNC_MAX = 262_144  # chain keys a resync lists at most


def chain_of(key: str) -> str:
    """The chain key a store key belongs to ("<chain>-r<rank>-k|v" for MHA; MLA's is the chain)."""
    return key.split("-", 1)[0]


class RemovalLog:
    def __init__(self, max_removals: int = MAX_REMOVALS) -> None:
        self.epoch = uuid.uuid4().hex
        self.seq = 0
        self._removed: deque[tuple[int, str]] = deque(maxlen=max_removals)

    def note(self, key: str) -> None:
        """`key` left the store's index (under the store's lock)."""
        chain = chain_of(key)
        if not self._removed or self._removed[-1][1] != chain:
            self.seq += 1
            self._removed.append((self.seq, chain))

    def since(self, epoch: str | None, seq: int, present) -> dict:
        """Chain keys removed after `seq` of `epoch`: {"epoch", "seq", "removed": [...]}, or
        {"epoch", "seq", "reset": [chain keys present] | None}. `present()` lists the store keys
        it holds (called only for a reset; under the store's lock)."""
        out = {"epoch": self.epoch, "seq": self.seq}
        first = self._removed[0][0] if self._removed else self.seq + 1
        if epoch != self.epoch or seq > self.seq or seq < first - 1:
            keys = present()
            chains = {chain_of(k) for k in keys} if len(keys) <= RESYNC_MAX * 4 else None
            out["reset"] = sorted(chains) if chains is not None and len(chains) <= RESYNC_MAX else None
            return out
        out["removed"] = [c for _, c in itertools.islice(self._removed, seq - first + 1, None)]
        return out
