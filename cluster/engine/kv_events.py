"""What a replica's GPU prefix cache holds, as events for the router (issue 24's KV events).

The router's `cache_aware` policy used to route on an approximate memory of what it sent where
(`cluster/prefix_tree.py`), which never learns that a replica evicted a prefix, nor that one it
did not route there got cached. `KVEventLog` hooks the radix cache (`insert_listeners`,
`evict_listeners`, `reset_listeners`) and records, per cached page, its chained block hash
(`cluster/engine/block_hash.py`, one block per page): `stored` when the tree takes pages,
`removed` when it evicts them, and a reset when the whole tree is dropped. The router pulls the
log with `since(epoch, seq)` on its stats poll (one call per replica per poll, whatever the
number of requests) and keeps a `cluster.kv_index.KVIndex` per replica.

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
from collections import deque

from cluster.engine.block_hash import chain_hashes

STORED, REMOVED = "stored", "removed"
MAX_EVENTS = 65_536  # retained event batches; a reader further behind gets a snapshot


class KVEventLog:
    def __init__(self, radix, max_events: int = MAX_EVENTS):
        self.radix = radix
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
        with self._lock:
            hashes = [h for h in (self._page_hash.pop(p, None) for p in leaf.pages[len(leaf.pages) - take :])
                      if h is not None]
            self._append(REMOVED, hashes)

    def _reset(self) -> None:
        with self._lock:
            self._page_hash.clear()
            self._events.clear()
            self.epoch = uuid.uuid4().hex  # every reader starts over from a snapshot
            self.seq = 0

    def _append(self, kind: str, hashes: list[int]) -> None:
        """(under the lock)"""
        if hashes:
            self.seq += 1
            self._events.append((self.seq, kind, hashes))

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
        """Events after `seq` of `epoch`: {"epoch", "seq", "block", "events": [(kind, hashes)]},
        or with "snapshot": every cached page's hash instead, when the reader cannot catch up."""
        with self._lock:
            out = {"epoch": self.epoch, "seq": self.seq, "block": self.block}
            first = self._events[0][0] if self._events else self.seq + 1
            if epoch != self.epoch or seq > self.seq or seq < first - 1:
                out["snapshot"] = list(self._page_hash.values())
                return out
            out["events"] = [(kind, hashes) for _, kind, hashes in itertools.islice(self._events, seq - first + 1, None)]
            return out
