"""The router's index of what one replica's GPU prefix cache holds, kept from the replica's
KV events (`cluster/engine/kv_events.py`): the chained block hashes of its cached pages.

`cache_aware` routing scores a replica by the longest prefix of a prompt whose blocks the
index holds while the index is fresh (its last pull answered recently), and falls back to the
router's own approximate memory (`cluster/prefix_tree.py`) when the events lag or the replica
cannot send them.
"""

from __future__ import annotations

import time

from cluster.engine.block_hash import cached_prefix_tokens
from cluster.engine.kv_events import REMOVED, STORED


class KVIndex:
    def __init__(self) -> None:
        self.epoch: str | None = None
        self.seq = 0
        self.block = 0
        self.hashes: set[int] = set()
        self.updated = 0.0  # monotonic time of the last pull that answered

    def apply(self, reply: dict) -> None:
        """Take a `KVEventLog.since` reply: a snapshot replaces the index, events update it."""
        if "snapshot" in reply:
            self.hashes = set(reply["snapshot"])
        else:
            for kind, hashes in reply["events"]:
                if kind == STORED:
                    self.hashes.update(hashes)
                elif kind == REMOVED:
                    self.hashes.difference_update(hashes)
        self.epoch, self.seq, self.block = reply["epoch"], reply["seq"], reply["block"]
        self.updated = time.monotonic()

    def lag_s(self) -> float:
        """Seconds since the index was last brought up to date (inf: never)."""
        return time.monotonic() - self.updated if self.updated else float("inf")

    def match(self, tokens: list[int]) -> int:
        """Tokens of the longest prefix of `tokens` whose blocks the replica has cached."""
        return cached_prefix_tokens(tokens, self.block, self.hashes) if self.block else 0
