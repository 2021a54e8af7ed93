"""The router's index of what one replica's caches hold, kept from the replica's KV events
(`cluster/engine/kv_events.py`): the chained block hashes of its pages on the GPU, in its ranks'
host tier, and (in one index every replica's events feed, `StoreIndex`) in the shared store,
less the pages the store itself reports removed (`kvstore/removals.py`).

`cache_aware` routing scores a replica by the longest prefix of a prompt whose blocks it can
serve, each block from the best tier that holds it, weighted by tier (`TIER_WEIGHTS`: a GPU
block costs nothing, a host block a copy up over PCIe, a store block a NIXL read and that copy;
each far less than computing it), while the index is fresh (its last pull answered recently),
and falls back to the router's own approximate memory (`cluster/prefix_tree.py`) when the
events lag or the replica cannot send them.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from cluster.engine.block_hash import cached_prefix_tokens, chain_hashes
from cluster.engine.kv_events import GPU, HOST, REMOVED, STORE, STORED

TIER_WEIGHTS = {GPU: 1.0, HOST: 0.8, STORE: 0.6}  # a cached prompt token's worth by where it is
STORE_INDEX_MAX = 1_000_000  # store pages the router remembers, most recent kept
RESYNC_EVERY_S = 600.0  # how often the store index is checked against the store's whole list


class StoreIndex:
    """The shared store's pages: what every replica's events report it wrote there, less what
    the store reports it removed (`kvstore/removals.py`, pulled by `sync`), most recent last."""

    def __init__(self, capacity: int = STORE_INDEX_MAX) -> None:
        self.capacity = capacity
        self.hashes: OrderedDict[int, str | None] = OrderedDict()  # block hash -> its chain key
        self.chains: dict[str, int] = {}  # chain key -> block hash
        self.epoch: str | None = None  # of the store's removal log
        self.seq = 0
        self.resynced = 0.0  # monotonic time of the last reset

    def add(self, hashes, keys=None) -> None:
        for h, key in zip(hashes, keys if keys is not None else [None] * len(hashes)):
            old = self.hashes.get(h)
            if old is not None and old != key:  # (another model's or TP size's name for the block)
                self._forget((h, old))
            self.hashes[h] = key
            self.hashes.move_to_end(h)
            if key is not None:
                self.chains[key] = h
        while len(self.hashes) > self.capacity:
            self._forget(self.hashes.popitem(last=False))

    def _forget(self, item: tuple[int, str | None]) -> None:
        if item[1] is not None and self.chains.get(item[1]) == item[0]:
            del self.chains[item[1]]

    def sync(self, reply: dict) -> int:
        """Take a store's `removed_since` reply; returns the pages it dropped from the index.
        A reset lists every chain key the store holds (None: too many to list, so everything
        is forgotten and relearnt from events); pages known only by hash stay. Pull the
        replicas' events first: a removal applied before the event that reported the page's
        write would be undone by it. What stays possible is an overcount: a page a replica
        reports writing whose write the store refused, or that the store dropped before that
        report reached the router, counts until a reset (`resync_due`)."""
        before = len(self.hashes)
        if "reset" in reply:
            present = set(reply["reset"] or ())
            for h, key in list(self.hashes.items()):
                if key is not None and key not in present:
                    self._forget((h, self.hashes.pop(h)))
            self.chains = {k: h for k, h in self.chains.items() if k in present}
            self.resynced = time.monotonic()
        else:
            for key in reply["removed"]:
                h = self.chains.pop(key, None)
                if h is not None and self.hashes.get(h) == key:
                    del self.hashes[h]
        self.epoch, self.seq = reply["epoch"], reply["seq"]
        return before - len(self.hashes)

    def resync_due(self, every_s: float = RESYNC_EVERY_S) -> bool:
        """Whether the next pull should ask the store for its whole list (a reset) again."""
        return time.monotonic() - self.resynced > every_s

    def __contains__(self, h: int) -> bool:
        return h in self.hashes


class KVIndex:
    def __init__(self, store: StoreIndex | None = None) -> None:
        self.epoch: str | None = None
        self.seq = 0
        self.block = 0
        self.hashes: set[int] = set()  # on the GPU
        self.host: set[int] = set()  # in the ranks' host tier
        self.store = store if store is not None else StoreIndex()
        self.updated = 0.0  # monotonic time of the last pull that answered

    def apply(self, reply: dict) -> None:
        """Take a `KVEventLog.since` reply: a snapshot replaces the index, events update it."""
        if "snapshot" in reply:
            self.hashes = set(reply["snapshot"])
            self.host = set(reply.get("snapshot_host", ()))
            self.store.add(reply.get("snapshot_store", ()), reply.get("snapshot_store_keys"))
        else:
            for kind, hashes, *rest in reply["events"]:
                tier = rest[0] if rest else GPU
                if tier == STORE:
                    if kind == STORED:
                        self.store.add(hashes, rest[1] if len(rest) > 1 else None)
                    continue
                held = self.hashes if tier == GPU else self.host
                if kind == STORED:
                    held.update(hashes)
                elif kind == REMOVED:
                    held.difference_update(hashes)
        self.epoch, self.seq, self.block = reply["epoch"], reply["seq"], reply["block"]
        self.updated = time.monotonic()

    def tiers(self, tokens: list[int]) -> dict[str, int]:
        """Tokens of the longest prefix of `tokens` this replica can serve from its caches, by
        the tier each block comes from (the best that holds it)."""
        out = {GPU: 0, HOST: 0, STORE: 0}
        if not self.block:
            return out
        for h in chain_hashes(tokens, self.block):
            tier = GPU if h in self.hashes else HOST if h in self.host else STORE if h in self.store else None
            if tier is None:
                break
            out[tier] += self.block
        return out

    def score(self, tokens: list[int]) -> int:
        """The prefix's worth in GPU-cached tokens (`TIER_WEIGHTS`)."""
        return int(sum(TIER_WEIGHTS[t] * n for t, n in self.tiers(tokens).items()))

    def lag_s(self) -> float:
        """Seconds since the index was last brought up to date (inf: never)."""
        return time.monotonic() - self.updated if self.updated else float("inf")

    def match(self, tokens: list[int]) -> int:
        """Tokens of the longest prefix of `tokens` whose blocks the replica has cached."""
        return cached_prefix_tokens(tokens, self.block, self.hashes) if self.block else 0
