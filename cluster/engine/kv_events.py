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
the ranks; the log follows it with an LRU of the same capacity (`host_capacity` pages), whose
overflow is a `removed` from "host" (the store keeps it). The store's own evictions are not
seen: the router bounds its store index instead. Events are (kind, hashes, tier).

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


class KVEventLog:
    def __init__(self, radix, max_events: int = MAX_EVENTS, host_capacity: int = 0, copied=None):
        """host_capacity: pages of the ranks' host tier (0: no KV store); copied(pages) -> the
        pages of an eviction that have a copy in the host tier and the store (the scheduler's
        KV store side says: `cluster.engine.kv_saves.KVSaves.evict_copies`)."""
        self.radix = radix
        self.host_capacity = host_capacity
        self.copied = copied
        self._host: OrderedDict[int, None] = OrderedDict()  # hashes in the host tier, LRU first
        self._store: OrderedDict[int, None] = OrderedDict()
        self.block = radix.page_size
        self.epoch = uuid.uuid4().hex
        self.seq = 0  # the last event's number
        self._events: deque[tuple[int, str, list[int]]] = deque(maxlen=max_events)
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
        copied = self.copied(pages) if self.copied is not None and self.host_capacity else set()
        with self._lock:
            gone = [(p, self._page_hash.pop(p, None)) for p in pages]
            self._append(REMOVED, [h for _, h in gone if h is not None])
            kept = [h for p, h in gone if h is not None and p in copied]
            if kept:
                self._append(STORED, kept, HOST)
                self._append(STORED, kept, STORE)
                for h in kept:
                    self._host[h] = None
                    self._host.move_to_end(h)
                    self._store[h] = None
                    self._store.move_to_end(h)
                out = [self._host.popitem(last=False)[0] for _ in range(len(self._host) - self.host_capacity)]
                self._append(REMOVED, out, HOST)
                while len(self._store) > MAX_STORE_HASHES:
                    self._store.popitem(last=False)

    def _reset(self) -> None:
        with self._lock:
            self._page_hash.clear()
            self._events.clear()
            self.epoch = uuid.uuid4().hex  # every reader starts over from a snapshot
            self.seq = 0

    def _append(self, kind: str, hashes: list[int], tier: str = GPU) -> None:
        """(under the lock)"""
        if hashes:
            self.seq += 1
            self._events.append((self.seq, kind, hashes, tier))

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
        """Events after `seq` of `epoch`: {"epoch", "seq", "block", "events": [(kind, hashes, tier)]},
        or with "snapshot" (the GPU's pages), "snapshot_host" and "snapshot_store" instead, when
        the reader cannot catch up."""
        with self._lock:
            out = {"epoch": self.epoch, "seq": self.seq, "block": self.block}
            first = self._events[0][0] if self._events else self.seq + 1
            if epoch != self.epoch or seq > self.seq or seq < first - 1:
                out["snapshot"] = list(self._page_hash.values())
                out["snapshot_host"], out["snapshot_store"] = list(self._host), list(self._store)
                return out
            out["events"] = [(kind, hashes, tier)
                             for _, kind, hashes, tier in itertools.islice(self._events, seq - first + 1, None)]
            return out
