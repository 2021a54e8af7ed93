"""Page-granular radix prefix cache of KV pages, keyed by token ids.

Keys are stored and matched in whole pages only: a node's key is k * page_size token ids and it
owns the k KV pages that hold them. A partial last page is never cached. Children are indexed by
the token ids of their first page, so two siblings never share a first page, and edges are split
at page boundaries when keys diverge.

Scheduler flow (one request):

1. Admission: `m = cache.match_prefix(prompt[:-1])` (all but the last token, so at least one
   token is computed and yields logits), then at once `cache.lock(m.node)` (lock before use: an
   unlocked node may be evicted or trimmed by the next `evict`). The request's page table starts
   as `RequestKV.with_prefix(m.pages, page_size)`; those pages belong to the tree, never free them.
2. Every step: `kv.reserve(allocator, n)` gives the slots of the next n tokens, allocating the
   request's own pages. When it returns None, call `cache.evict(kv.pages_needed(n, page_size)
   - allocator.num_free)` and retry before preempting anyone.
3. Finish or preemption: `cache.release(kv, token_ids, m.node)`, where token_ids are the tokens
   whose KV is in the pages (prompt + output tokens already fed to the model). It inserts the
   full pages into the tree, frees the request's pages that the tree already had (`insert`'s
   return value) and its last partial page, and unlocks the admission node.

Page accounting: allocator free + pages in the tree + pages owned by running requests ==
allocator.num_total at all times; `check_integrity` asserts it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Collection, Iterator
from typing import NamedTuple

from cluster.engine.kv_allocator import PageAllocator, RequestKV


class TreeNode:
    """One edge of the tree with the node it leads to.

    key: token ids of this edge, len(key) == len(pages) * page_size (empty only at the root).
    depth: tokens from the root through the end of this node (the full prefix length, which a
    KV-store integration needs to name pages).
    lock_ref: locks taken on this node or any descendant; a node with lock_ref > 0 is protected.
    """

    __slots__ = ("key", "pages", "parent", "children", "depth", "lock_ref", "last_access", "id")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: TreeNode | None, node_id: int):
        self.key = key
        self.pages = pages
        self.parent = parent
        self.children: dict[tuple[int, ...], TreeNode] = {}  # first page's token ids -> child
        self.depth = (parent.depth if parent is not None else 0) + len(key)
        self.lock_ref = 0
        self.last_access = 0
        self.id = node_id  # ties in LRU order break by creation order

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, depth={self.depth}, pages={self.pages}, lock_ref={self.lock_ref})"


class MatchResult(NamedTuple):
    pages: list[int]  # KV pages of the matched prefix, in order (owned by the tree)
    num_tokens: int  # == len(pages) * page_size
    node: TreeNode  # deepest matched node: lock it before using `pages`


class RadixCache:
    """Prefix cache over a `PageAllocator`.

    Invariants:
    - Lock before use: pages from `match_prefix` may be used only while their node is locked;
      `lock` right after matching, `unlock` once (in `release`) when the request is done.
    - Locked nodes and their ancestors are never evicted, trimmed or detached; `insert` may
      split a locked edge, but the node object a request holds keeps ending at the same depth,
      so `unlock(node)` stays correct.
    - Evicting 0 pages is always safe (a no-op), as is evicting more than is evictable.
    - Every page in the tree is allocated (not free in the allocator) and in exactly one node.

    Disabled (`disabled=True`): the tree stays empty. `match_prefix` matches nothing (node is the
    root; lock/unlock of it are no-ops), `evict` frees nothing, and `insert` takes no pages and
    returns len(pages): by `insert`'s contract the caller then frees all of its pages itself.
    `release` does that, so a scheduler using it needs no special case.
    """

    def __init__(self, allocator: PageAllocator, page_size: int, disabled: bool = False):
        if page_size != allocator.page_size:
            raise ValueError(f"page_size {page_size} != allocator page_size {allocator.page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.disabled = disabled
        self._ids = itertools.count()
        self._clock = 0  # logical time for LRU: deterministic, unlike wall-clock time
        # Called as on_evict(leaf, n) before `evict` frees the last n pages of leaf (while leaf
        # still holds them); the KV store's write-back hooks in here (cluster/engine/kv_saves.py).
        self.on_evict: Callable[[TreeNode, int], None] | None = None
        # Listeners of what the tree holds (cluster/engine/kv_events.py): on_insert(token_ids,
        # pages, k) after `insert` took pages[k:] of token_ids' pages; evict_listeners as on_evict.
        self.insert_listeners: list[Callable[[list[int], list[int], int], None]] = []
        self.evict_listeners: list[Callable[[TreeNode, int], None]] = []
        self.reset_listeners: list[Callable[[], None]] = []  # the whole tree was dropped
        self.reset_tree()

    # -- public API ---------------------------------------------------------------------------

    @property
    def evictable_pages(self) -> int:
        """Pages in unlocked nodes (all of them can be evicted, leaves first)."""
        return self._evictable

    @property
    def protected_pages(self) -> int:
        """Pages in locked nodes (on the path of some running request's prefix)."""
        return self._protected

    @property
    def total_cached_pages(self) -> int:
        return self._evictable + self._protected

    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        """Longest cached prefix of token_ids in whole pages; refreshes its LRU time.

        May split an edge so that the returned node ends exactly at the match."""
        P = self.page_size
        node = self.root
        pages: list[int] = []
        if self.disabled:
            return MatchResult(pages, 0, node)
        now = self._tick()
        n = len(token_ids) // P * P
        pos = 0
        while pos < n:
            child = node.children.get(tuple(token_ids[pos : pos + P]))
            if child is None:
                break
            k = self._matched_pages(child.key, token_ids, pos, n)
            diverged = k < len(child.pages)
            if diverged:
                child = self._split(child, k)
            child.last_access = now
            pages.extend(child.pages)
            pos += k * P
            node = child
            if diverged:
                break
        return MatchResult(pages, pos, node)

    def lock(self, node: TreeNode) -> None:
        """Protect node and its ancestors from eviction (counted: lock twice, unlock twice)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.pages)
                self._protected += len(node.pages)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock(node)`. Raises RuntimeError on an unlock without a matching lock."""
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked node {node}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.pages)
                self._evictable += len(node.pages)
            node = node.parent  # type: ignore[assignment]

    def insert(self, token_ids: list[int], pages: list[int]) -> int:
        """Insert a prefix of whole pages: len(token_ids) must be len(pages) * page_size.

        Returns k, the number of leading pages the tree did NOT take. The tree takes ownership
        of pages[k:] (the new part); pages[:k] stay with the caller, who must free the ones it
        owns. Enabled: k is the number of leading pages that were already cached (the tree keeps
        its own copy of those). Disabled: k == len(pages) (the tree takes nothing).
        """
        P = self.page_size
        if len(token_ids) != len(pages) * P:
            raise ValueError(f"{len(token_ids)} tokens for {len(pages)} pages of {P}")
        if self.disabled:
            return len(pages)
        now = self._tick()
        n = len(token_ids)
        node = self.root
        pos = 0
        while pos < n:
            first = tuple(token_ids[pos : pos + P])
            child = node.children.get(first)
            if child is None:
                leaf = TreeNode(tuple(token_ids[pos:]), list(pages[pos // P :]), node, next(self._ids))
                leaf.last_access = now
                node.children[first] = leaf
                self._evictable += len(leaf.pages)
                for listener in self.insert_listeners:
                    listener(token_ids, pages, pos // P)
                return pos // P
            k = self._matched_pages(child.key, token_ids, pos, n)
            if k < len(child.pages):
                if pos + k * P == n:
                    child.last_access = now
                    return len(pages)  # the new key ends inside this edge: nothing to add
                child = self._split(child, k)
            child.last_access = now
            node = child
            pos += k * P
        return len(pages)

    def release(self, kv: RequestKV, token_ids: list[int], node: TreeNode) -> int:
        """Finish (or preempt) a request: cache its full pages, free what the tree does not
        keep, unlock its admission node, and empty `kv`. Returns `insert`'s k: the tree took
        the request's full pages from index k on (the KV store saves those).

        token_ids[:kv.num_tokens] must be the tokens whose KV the request's pages hold."""
        P = self.page_size
        if len(token_ids) < kv.num_tokens:
            raise ValueError(f"{len(token_ids)} token ids for {kv.num_tokens} tokens with KV")
        n_full = kv.num_tokens // P
        k = self.insert(token_ids[: n_full * P], kv.pages[:n_full])
        # The locked prefix is in the tree with these very pages, so insert matched it.
        assert k >= kv.num_cached_pages, (k, kv.num_cached_pages)
        self.allocator.free(kv.pages[kv.num_cached_pages : k] + kv.pages[n_full:])
        self.unlock(node)
        kv.pages = []
        kv.num_tokens = 0
        kv.num_cached_pages = 0
        return k

    def evict(self, num_pages: int) -> int:
        """Free up to num_pages pages of unlocked leaves, least recently used first; returns
        the number freed (fewer only when nothing else is evictable).

        A leaf is freed from its tail: when it holds more pages than still needed, only its
        deepest pages go and its head stays cached. A parent becomes a candidate once its last
        child is gone (its LRU time is never older than its children's)."""
        if num_pages <= 0 or self.disabled:
            return 0
        heap = [(n.last_access, n.id, n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        P = self.page_size
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            take = min(len(leaf.pages), num_pages - freed)
            if self.on_evict is not None:
                self.on_evict(leaf, take)
            for listener in self.evict_listeners:
                listener(leaf, take)
            if take < len(leaf.pages):
                tail = leaf.pages[-take:]
                del leaf.pages[-take:]
                leaf.key = leaf.key[: -take * P]
                leaf.depth -= take * P
            else:
                tail = leaf.pages
                parent = leaf.parent
                assert parent is not None
                del parent.children[leaf.key[:P]]
                leaf.parent = None
                if parent is not self.root and not parent.children and parent.lock_ref == 0:
                    heapq.heappush(heap, (parent.last_access, parent.id, parent))
            self.allocator.free(tail)
            self._evictable -= len(tail)
            freed += len(tail)
        return freed

    def check_integrity(self, extra_used: int | Collection[int] = 0) -> None:
        """Raise AssertionError unless the tree is well formed and the pages add up:
        allocator free + pages in the tree + extra_used == allocator.num_total.

        extra_used: pages owned by running requests (their `owned_pages`), as a count, or as
        the pages themselves, which are then also checked to be allocated, unique and not in
        the tree."""
        P = self.page_size
        alloc = self.allocator
        root = self.root
        assert root.parent is None and root.key == () and root.pages == [] and root.depth == 0
        assert root.lock_ref == 0
        seen: set[int] = set()
        evictable = protected = 0
        for node in self._nodes():
            parent = node.parent
            assert parent is not None, node
            assert node.pages and len(node.key) == len(node.pages) * P, node
            assert parent.children.get(node.key[:P]) is node, node
            assert node.depth == parent.depth + len(node.key), node
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), node
            for p in node.pages:
                assert 0 < p < alloc.num_pages and not alloc.is_free(p), (p, node)
                assert p not in seen, f"page {p} twice in the tree"
                seen.add(p)
            if node.lock_ref > 0:
                protected += len(node.pages)
            else:
                evictable += len(node.pages)
        assert (evictable, protected) == (self._evictable, self._protected), (
            (evictable, protected),
            (self._evictable, self._protected),
        )
        if isinstance(extra_used, int):
            n_extra = extra_used
        else:
            owned = list(extra_used)
            assert len(set(owned)) == len(owned), "a running page is owned twice"
            for p in owned:
                assert 0 < p < alloc.num_pages and not alloc.is_free(p), f"owned page {p} is free"
                assert p not in seen, f"owned page {p} is also in the tree"
            n_extra = len(owned)
        total = alloc.num_free + len(seen) + n_extra
        assert total == alloc.num_total, (
            f"free {alloc.num_free} + cached {len(seen)} + used {n_extra} != {alloc.num_total}"
        )

    def reset(self) -> None:
        """Drop the whole tree, freeing its pages. Requires no locks (no running requests)."""
        if self._protected:
            raise RuntimeError(f"reset with {self._protected} locked pages")
        self.allocator.free([p for node in self._nodes() for p in node.pages])
        self.reset_tree()

    def reset_tree(self) -> None:
        """Forget the tree without freeing its pages (for use with `allocator.reset()`)."""
        self.root = TreeNode((), [], None, next(self._ids))
        self._evictable = 0
        self._protected = 0
        for listener in getattr(self, "reset_listeners", ()):
            listener()

    # -- internals ----------------------------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def path_tokens(self, node: TreeNode) -> list[int]:
        """The tokens from the root through the end of `node`'s key."""
        keys = []
        while node is not self.root and node is not None:
            keys.append(node.key)
            node = node.parent  # type: ignore[assignment]
        return [t for key in reversed(keys) for t in key]

    def _nodes(self) -> Iterator[TreeNode]:
        """Every node but the root."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _matched_pages(self, key: tuple[int, ...], token_ids: list[int], pos: int, end: int) -> int:
        """Whole pages of `key` equal to token_ids[pos:end]."""
        m = 0
        for a, b in zip(key, token_ids[pos : min(end, pos + len(key))]):
            if a != b:
                break
            m += 1
        return m // self.page_size

    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Cut child's edge after k pages (0 < k < len(child.pages)); returns the new head node.

        `child` keeps the tail and its depth, so node references held by requests stay valid;
        the head inherits child's lock count and LRU time (every lock through child passes it)."""
        P = self.page_size
        parent = child.parent
        assert parent is not None and 0 < k < len(child.pages)
        head = TreeNode(child.key[: k * P], child.pages[:k], parent, next(self._ids))
        head.lock_ref = child.lock_ref
        head.last_access = child.last_access
        parent.children[head.key[:P]] = head
        child.key = child.key[k * P :]
        child.pages = child.pages[k:]
        child.parent = head
        head.children[child.key[:P]] = child
        return head
