"""The router's approximate per-replica prefix memory (cache-aware routing).

Each replica's memory holds the prefixes of prompts recently routed to it, in blocks of
`block` tokens named by a chained hash (block i's name covers the whole prefix through block
i, like the engine's page keys), up to a token budget, least recently used first out. It only
approximates the replica's real radix cache (which may have evicted more, or cached more),
which is all routing needs.

Every operation costs O(prompt length / block) on the server's event loop, eviction included:
a token trie that walked all its nodes to find leaves to evict took ~0.1 s per request once
full (200k nodes), stalling every stream the server was sending.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from cluster.engine.block_hash import cached_prefix_tokens, chain_hashes


class PrefixTree:
    """Prefix memory of at most `max_tokens` tokens, in blocks of `block` tokens (a prompt's
    partial last block is not remembered)."""

    def __init__(self, max_tokens: int = 200_000, block: int = 16):
        self.block = block
        self.max_blocks = max(1, max_tokens // block)
        self._lru: OrderedDict[int, None] = OrderedDict()  # chained block hash, least recent first

    @property
    def max_tokens(self) -> int:
        return self.max_blocks * self.block

    @property
    def size(self) -> int:
        """Tokens remembered."""
        return len(self._lru) * self.block

    def match(self, tokens: list[int]) -> int:
        """Length of the longest remembered prefix of `tokens` (whole blocks)."""
        return cached_prefix_tokens(tokens, self.block, self._lru)

    def insert(self, tokens: list[int]) -> None:
        """Remember `tokens`' prefix blocks as just used; evict the least recently used blocks
        beyond the budget. A prefix is refreshed after its longer continuations, so eviction
        takes the tails of prompts before the prefixes they share."""
        lru = self._lru
        for h in reversed(chain_hashes(tokens, self.block)):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.max_blocks:
            lru.popitem(last=False)


class RecentRoutes:
    """The prefixes routed to a replica in the last `window_s` seconds, whatever their size:
    what its KV events may not show yet (the prefill still running, or its event not pulled).
    Bounded by time, not by a token budget, so a busy router's recent routing is never pushed
    out by its own volume."""

    def __init__(self, window_s: float, block: int = 16):
        self.window_s = window_s
        self.block = block
        self._at: OrderedDict[int, float] = OrderedDict()  # chained block hash -> routed at, oldest first

    def insert(self, tokens: list[int], at: float | None = None) -> None:
        """Record `tokens`' prefix blocks as routed now (or at monotonic time `at`, no earlier
        than the records before it: they expire oldest first)."""
        now = time.monotonic() if at is None else at
        for h in chain_hashes(tokens, self.block):
            self._at[h] = now
            self._at.move_to_end(h)
        self._expire()

    def match(self, tokens: list[int]) -> int:
        """Tokens of `tokens`' longest prefix routed within the window (whole blocks)."""
        self._expire()
        return cached_prefix_tokens(tokens, self.block, self._at)

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.window_s
        while self._at and next(iter(self._at.values())) < cutoff:
            self._at.popitem(last=False)
