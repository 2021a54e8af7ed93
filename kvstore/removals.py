"""Which pages left the shared store, for the router's index of the store tier (issue 24).

Replicas report the pages they write to the store (`cluster/engine/kv_events.py`, tier "store"),
but only the store sees its own evictions: a RAM page dropped without a file copy, a file the
LRU deletes with no RAM copy left, a page that failed its checksum, `clear()`. Without them the
router would keep scoring a replica for a prefix the store no longer holds.

`RemovalLog` numbers each store key that leaves the index and hands readers its *chain key*
(`kvstore.keys`: the page's name without the rank and K/V suffix, which is what the router knows
a store page by). An MHA page is several store keys (K and V of every rank); the first of them to
go makes the page unreadable, so that is the one that counts, and the rest repeat its chain key
harmlessly (a reply lists each chain key once).

A reader asks `since(epoch, seq)`. One that is new, from another epoch (the store restarted) or
behind the retained window gets `reset` instead: the store then lists every chain key it holds
(`present_chains`, outside the store's lock; None past `RESYNC_MAX`: the reader drops what it
knows of the store and relearns it from events). A chain key counts as present while any of its
keys is, so after a reset an MHA page missing one rank's keys counts until it goes entirely.
"""

from __future__ import annotations

import itertools
import uuid
from collections import deque

from kvstore.keys import chain_of

MAX_REMOVALS = 65_536  # store keys retained (~12 MiB at worst); a reader further behind resyncs
RESYNC_MAX = 262_144  # chain keys a resync lists at most


class RemovalLog:
    def __init__(self, max_removals: int = MAX_REMOVALS) -> None:
        self.epoch = uuid.uuid4().hex
        self.seq = 0
        self._removed: deque[str] = deque(maxlen=max_removals)  # keys numbered seq - len + 1 .. seq

    def note(self, key: str) -> None:
        """`key` left the store's index (under the store's lock)."""
        self.seq += 1
        self._removed.append(key)

    def since(self, epoch: str | None, seq: int) -> dict:
        """Chain keys removed after `seq` of `epoch`: {"epoch", "seq", "removed": [...]}, or
        {"epoch", "seq", "reset": True} when the reader must resync (under the store's lock:
        cheap either way)."""
        out = {"epoch": self.epoch, "seq": self.seq}
        first = self.seq - len(self._removed) + 1  # the number of the oldest key retained
        if epoch != self.epoch or seq > self.seq or seq < first - 1:
            out["reset"] = True
            return out
        keys = itertools.islice(self._removed, seq - first + 1, None)
        out["removed"] = list(dict.fromkeys(chain_of(k) for k in keys))
        return out


def present_chains(keys: list[str]) -> list[str] | None:
    """A reset's list: the chain keys of `keys` (the store's, copied under its lock), sorted, or
    None when there are more than `RESYNC_MAX`."""
    if len(keys) > RESYNC_MAX * 16:  # (16 keys a page: K and V of 8 ranks)
        return None
    chains = {chain_of(k) for k in keys}
    return sorted(chains) if len(chains) <= RESYNC_MAX else None
