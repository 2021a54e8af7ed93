"""What a replica's GPU prefix cache holds, as events for the router (issue 24's KV events).

The router's `cache_aware` policy used to route on an approximate memory of what it sent where
(`cluster/prefix_tree.py`), which never learns that a replica evicted a prefix, nor that one it
did not route there got cached. `KVEventLog` hooks the radix cache (`insert_listeners`,
`evict_listeners`, `reset_listeners`) and records, per cached page, its chained block hash
(`cluster/engine/block_hash.py`, one block per page): `stored` when the tree takes pages,
`removed` when it evicts them, and a reset when the whole tree is dropped. The router pulls the
log with `since(epoch, seq)` on its stats poll (one call per replica per poll, whatever the
number of requests) and keeps a `cluster.kv_index.KVIndex` per replica.

Tiers: with the KV store on, a page the GPU evicts after the scheduler saved it (write-back
policies save on eviction; hot pages are saved earlier) is not gone: its copy sits in this
replica's ranks' host tier and, written on, in the shared store. Such an eviction is three
events: `removed` from "gpu", `stored` in "host" and in "store". The host tier's own LRU runs on
the ranks (refreshed by their reads): the first rank reports the chain keys its tier evicts with
each step result (`HostTierPicture`, cluster/engine/kv_host_admission.py), and the log, which
keeps the chain key of each page it put in "host", turns those into `removed` from "host" (the
store keeps them). A page goes into "host" when the GPU evicts it after its save, before the
rank has said it published it (a save the rank drops leaves by the fallback below). A report
comes a step or two after the save it answers, so the log may hold a few pages more than the tier
for a moment; past `host_capacity` + `host_slack` pages (reports lost to a rank that restarted,
say) its oldest go as well. The store's own evictions are not seen here: the store logs them by
chain key (`kvstore/removals.py`) and the router pulls them, so a "store" event carries the chain
keys of its pages too. Events are (kind, hashes, tier), and (kind, hashes, "store", chain keys).

A reader that is new, behind the retained window, or from another epoch (the replica's engine
restarted) gets a snapshot of every cached page instead of deltas. Everything runs on the
engine thread under the engine's lock (the log is made under it too, by `engine.kv_events`)
except `since`; the log's own lock covers what both touch. The cost per cached page is one tuple
hash and a dict insert.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections import OrderedDict, deque

from cluster.engine.block_hash import chain_hashes

STORED, REMOVED = "stored", "removed"
GPU, HOST, STORE = "gpu", "host", "store"
MAX_EVENTS = 65_536  # retained event batches; a reader further behind gets a snapshot
MAX_STORE_HASHES = 200_000  # pages this replica wrote to the store, remembered for snapshots
HOST_SLACK_PAGES = 64  # (at least) see KVEventLog.host_slack


class KVEventLog:
    def __init__(self, radix, max_events: int = MAX_EVENTS, host_capacity: int = 0, copied=None,
                 host_slack: int | None = None):
        """host_capacity: pages of the ranks' host tier (0: no KV store); copied(pages) -> the
        pages of an eviction that have a copy in the host tier and the store, with their chain
        keys (the scheduler's KV store side says: `cluster.engine.kv_saves.KVSaves.evict_copies`).
        `host_changed` takes the first rank's reports of its tier."""
        self.radix = radix
        self.host_capacity = host_capacity
        # pages past the capacity before the log drops its own oldest: the saves of the plans in
        # flight, whose evictions the rank has not reported yet
        self.host_slack = max(HOST_SLACK_PAGES, host_capacity // 8) if host_slack is None else host_slack
        self.copied = copied
        self._host: OrderedDict[str, int] = OrderedDict()  # the host tier's chain keys -> hashes, oldest first
        # keys the rank evicted while the GPU still held their pages (saved early: write-through,
        # hot pages): their GPU eviction later finds the copy in the store alone
        self._host_gone: OrderedDict[str, None] = OrderedDict()
        self._store: OrderedDict[int, str] = OrderedDict()  # block hash -> chain key, oldest first
        self.block = radix.page_size
        self.epoch = uuid.uuid4().hex
        self.seq = 0  # the last event's number
        self._events: deque[tuple] = deque(maxlen=max_events)  # (seq, kind, hashes, tier[, keys])
        self._lock = threading.Lock()
        self._page_hash: dict[int, int] = {}  # cached page -> its block hash
        self._snapshot()
        radix.insert_listeners.append(self._stored)
        radix.evict_listeners.append(self._removed)
        radix.reset_listeners.append(self._reset)

    # ---------------- the radix cache's hooks (engine thread) ----------------
    def _stored(self, token_ids: list[int], pages: list[int], k: int) -> None:
        hashes = chain_hashes(token_ids[: len(pages) * self.block], self.block)[k:]
        with self._lock:
            self._page_hash.update(zip(pages[k:], hashes))
            self._append(STORED, hashes)

    def _removed(self, leaf, take: int) -> None:
        pages = leaf.pages[len(leaf.pages) - take :]
        copied = self.copied(pages) if self.copied is not None and self.host_capacity else {}
        with self._lock:
            gone = [(p, self._page_hash.pop(p, None)) for p in pages]
            self._append(REMOVED, [h for _, h in gone if h is not None])
            kept = [(copied[p], h) for p, h in gone if h is not None and p in copied]
            if kept:
                self._append(STORED, [h for key, h in kept if key not in self._host_gone], HOST)
                self._append(STORED, [h for _, h in kept], STORE, [key for key, _ in kept])
                for key, h in kept:
                    if key in self._host_gone:  # (the host tier's copy is gone already)
                        del self._host_gone[key]
                        continue
                    self._host[key] = h
                    self._host.move_to_end(key)
                for key, h in kept:
                    self._store[h] = key
                    self._store.move_to_end(h)
                over = len(self._host) - self.host_capacity - self.host_slack
                out = [self._host.popitem(last=False)[1] for _ in range(over)]
                self._append(REMOVED, out, HOST)
                while len(self._store) > MAX_STORE_HASHES:
                    self._store.popitem(last=False)

    def host_changed(self, ready: list[str], evicted: list[str]) -> None:
        """The first rank's host tier took `ready` and evicted `evicted` (chain keys): the pages
        this log put in "host" that it evicted are `removed` from it."""
        with self._lock:
            out = []
            for key in evicted:
                if key in self._host:
                    out.append(self._host.pop(key))
                else:
                    self._host_gone[key] = None
            self._append(REMOVED, out, HOST)
            for key in ready:
                self._host_gone.pop(key, None)
                if key in self._host:
                    self._host.move_to_end(key)
            while len(self._host_gone) > max(self.host_capacity, 1024):
                self._host_gone.popitem(last=False)

    def _reset(self) -> None:
        with self._lock:
            self._page_hash.clear()
            self._events.clear()
            self.epoch = uuid.uuid4().hex  # every reader starts over from a snapshot
            self.seq = 0

    def _append(self, kind: str, hashes: list[int], tier: str = GPU, keys: list[str] | None = None) -> None:
        """(under the lock) `keys`: a "store" event's chain keys, one per hash."""
        if hashes:
            self.seq += 1
            self._events.append((self.seq, kind, hashes, tier) if keys is None else (self.seq, kind, hashes, tier, keys))

    def _snapshot(self) -> None:
        """Hashes of the pages already cached when the log starts (a walk of the tree)."""
        stack = list(self.radix.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            tokens = self.radix.path_tokens(node)
            hashes = chain_hashes(tokens, self.block)[-len(node.pages):] if node.pages else []
            self._page_hash.update(zip(node.pages, hashes))

    # ---------------- the reader (any thread) ----------------
    def since(self, epoch: str | None, seq: int) -> dict:
        """Events after `seq` of `epoch`: {"epoch", "seq", "block", "events": [(kind, hashes, tier
        [, chain keys])]}, or with "snapshot" (the GPU's pages), "snapshot_host", "snapshot_store"
        and "snapshot_store_keys" (their chain keys) instead, when the reader cannot catch up."""
        with self._lock:
            out = {"epoch": self.epoch, "seq": self.seq, "block": self.block}
            first = self._events[0][0] if self._events else self.seq + 1
            if epoch != self.epoch or seq > self.seq or seq < first - 1:
                out["snapshot"] = list(self._page_hash.values())
                out["snapshot_host"], out["snapshot_store"] = list(self._host.values()), list(self._store)
                out["snapshot_store_keys"] = list(self._store.values())
                return out
            out["events"] = [ev[1:] for ev in itertools.islice(self._events, seq - first + 1, None)]
            return out
