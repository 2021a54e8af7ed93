"""The router's approximate per-replica prefix trees (cache-aware routing).

Each replica's tree remembers token prefixes of prompts recently routed to it, up to a token
budget; the least recently used leaves go first. It only approximates the replica's real
radix cache (which may have evicted more, or cached more), which is all routing needs.
"""

from __future__ import annotations

import heapq
import itertools


class _Node:
    __slots__ = ("children", "parent", "key", "last_used", "count")

    def __init__(self, parent: _Node | None, key: int | None):
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.key = key
        self.last_used = 0
        self.count = 0  # prompts that passed through this node


class PrefixTree:
    """A token trie with a budget of `max_tokens` nodes and LRU eviction of leaves."""

    def __init__(self, max_tokens: int = 200_000):
        self.max_tokens = max_tokens
        self.root = _Node(None, None)
        self.size = 0
        self._clock = itertools.count(1)

    def match(self, tokens: list[int]) -> int:
        """Length of the longest remembered prefix of `tokens`."""
        node, n = self.root, 0
        for t in tokens:
            nxt = node.children.get(t)
            if nxt is None:
                break
            node, n = nxt, n + 1
        return n

    def insert(self, tokens: list[int]) -> None:
        now = next(self._clock)
        node = self.root
        for t in tokens:
            nxt = node.children.get(t)
            if nxt is None:
                nxt = _Node(node, t)
                node.children[t] = nxt
                self.size += 1
            nxt.last_used = now
            nxt.count += 1
            node = nxt
        if self.size > self.max_tokens:
            self._evict(self.size - self.max_tokens)

    def _evict(self, n: int) -> None:
        leaves = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            if not node.children and node is not self.root:
                leaves.append(node)
            stack.extend(node.children.values())
        heap = [(leaf.last_used, id(leaf), leaf) for leaf in leaves]
        heapq.heapify(heap)
        while n > 0 and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None and leaf.key is not None
            del parent.children[leaf.key]
            self.size -= 1
            n -= 1
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
