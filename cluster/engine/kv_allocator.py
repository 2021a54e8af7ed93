"""Scheduler-side bookkeeping of KV pages: which pages are free, and each request's page table.

No tensors here: the worker owns the KV pools (`workers.memory_pool`) and only ever sees the
slots the scheduler computed. Page 0 is reserved (CUDA-graph padding writes there), so the
allocatable pages are 1..num_pages-1. The KV slot of offset `o` in page `p` is `p * page_size + o`.

Ownership: a page is at any moment in exactly one of three places: free in the `PageAllocator`,
held by the radix cache (`cluster.engine.radix_cache`), or owned by one running request
(`RequestKV.owned_pages`). `RadixCache.check_integrity` asserts that the three add up.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


class PageAllocator:
    """Free list of KV pages. `alloc` is all-or-nothing; `free` rejects double frees.

    Freed pages are reused first (LIFO), which keeps the working set of pages small.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages  # counts the reserved page 0
        self.page_size = page_size
        self._free: list[int] = []
        self._is_free = bytearray(num_pages)
        self.reset()

    def reset(self) -> None:
        """Mark every allocatable page free (forgets all owners: call only when nothing runs)."""
        # Popped from the end, so the lowest page ids go out first.
        self._free = list(range(self.num_pages - 1, 0, -1))
        self._is_free = bytearray(self.num_pages)
        for p in self._free:
            self._is_free[p] = 1

    @property
    def num_total(self) -> int:
        """Allocatable pages (page 0 excluded)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_total - len(self._free)

    def is_free(self, page: int) -> bool:
        return bool(self._is_free[page])

    def alloc(self, n: int) -> list[int] | None:
        """Take `n` pages, or return None (and take nothing) when fewer than `n` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()
        for p in pages:
            self._is_free[p] = 0
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages. Raises ValueError (and frees nothing) on page 0, an out-of-range id,
        a page that is already free, or a page listed twice."""
        pages = list(pages)
        seen: set[int] = set()
        for p in pages:
            if not 0 < p < self.num_pages:
                raise ValueError(f"page {p} is not allocatable (valid: 1..{self.num_pages - 1})")
            if self._is_free[p] or p in seen:
                raise ValueError(f"double free of page {p}")
            seen.add(p)
        for p in pages:
            self._is_free[p] = 1
        self._free.extend(pages)

    def slots_for(self, pages: list[int], start_token: int, num_tokens: int) -> list[int]:
        """KV slots of token positions [start_token, start_token + num_tokens) of one request
        whose page table is `pages`: position t -> pages[t // P] * P + t % P."""
        return slots_for(pages, start_token, num_tokens, self.page_size)


def slots_for(pages: list[int], start_token: int, num_tokens: int, page_size: int) -> list[int]:
    """Position t -> pages[t // page_size] * page_size + t % page_size, for t in the range.

    Raises ValueError when the range runs past the pages (the caller forgot to reserve)."""
    end = start_token + num_tokens
    if start_token < 0 or num_tokens < 0 or end > len(pages) * page_size:
        raise ValueError(f"tokens [{start_token}, {end}) do not fit in {len(pages)} pages of {page_size}")
    p = page_size
    return [pages[t // p] * p + t % p for t in range(start_token, end)]


@dataclass
class RequestKV:
    """One request's KV page table, as the scheduler sees it.

    pages[:num_cached_pages] belong to the radix cache: the request matched them on admission
    and holds a lock on their tree node, so they cannot be evicted; it must never free them.
    pages[num_cached_pages:] are owned by the request. `num_tokens` counts the positions that
    have a KV slot (reserved for this step or already written); len(pages) is always at least
    ceil(num_tokens / page_size). The page size is the allocator's (passed where needed).
    """

    pages: list[int] = field(default_factory=list)  # the page table
    num_tokens: int = 0
    num_cached_pages: int = 0

    @classmethod
    def with_prefix(cls, cached_pages: list[int], page_size: int) -> RequestKV:
        """A new request whose first len(cached_pages) whole pages come from the radix cache."""
        return cls(list(cached_pages), len(cached_pages) * page_size, len(cached_pages))

    @property
    def owned_pages(self) -> list[int]:
        return self.pages[self.num_cached_pages :]

    def pages_needed(self, n_tokens: int, page_size: int) -> int:
        """New pages that reserving `n_tokens` more positions would allocate."""
        want = -(-(self.num_tokens + n_tokens) // page_size)
        return max(0, want - len(self.pages))

    def reserve(self, allocator: PageAllocator, n_tokens: int) -> list[int] | None:
        """KV slots of the next `n_tokens` positions, allocating pages as needed; advances
        num_tokens. Atomic: returns None and changes nothing when the allocator is short."""
        if n_tokens < 0:
            raise ValueError(f"cannot reserve {n_tokens} tokens")
        need = self.pages_needed(n_tokens, allocator.page_size)
        if need:
            new = allocator.alloc(need)
            if new is None:
                return None
            self.pages.extend(new)
        slots = allocator.slots_for(self.pages, self.num_tokens, n_tokens)
        self.num_tokens += n_tokens
        return slots

    def truncate(self, allocator: PageAllocator, num_tokens: int) -> None:
        """Shrink to the first `num_tokens` positions (e.g. rejected speculative tokens) and free
        the owned pages no longer needed. Cannot cut into the cached (locked) pages."""
        P = allocator.page_size
        if not self.num_cached_pages * P <= num_tokens <= self.num_tokens:
            raise ValueError(
                f"truncate to {num_tokens}: valid range is [{self.num_cached_pages * P}, {self.num_tokens}]"
            )
        keep = -(-num_tokens // P)  # >= num_cached_pages, by the check above
        allocator.free(self.pages[keep:])
        del self.pages[keep:]
        self.num_tokens = num_tokens
