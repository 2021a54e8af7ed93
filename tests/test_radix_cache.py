"""Scheduler-side KV bookkeeping: PageAllocator, RequestKV and the page-granular RadixCache.

Hand-built scenarios with exact page counts, plus one seeded random workload that plays the
scheduler flow of `cluster.engine.radix_cache` and checks integrity and cached KV contents after each op.
"""

import random

import pytest

from cluster.engine.kv_allocator import PageAllocator, RequestKV, slots_for
from cluster.engine.radix_cache import RadixCache


def make(num_pages: int = 64, page_size: int = 4, disabled: bool = False):
    alloc = PageAllocator(num_pages, page_size)
    return alloc, RadixCache(alloc, page_size, disabled=disabled)


def cache_tokens(cache: RadixCache, tokens: list[int]) -> tuple[list[int], int]:
    """Allocate pages for len(tokens) // P whole pages and insert them; returns (pages, dup)."""
    pages = cache.allocator.alloc(len(tokens) // cache.page_size)
    assert pages is not None
    dup = cache.insert(tokens, pages)
    cache.allocator.free(pages[:dup])
    return pages, dup


# -- PageAllocator / RequestKV ------------------------------------------------------------------


def test_allocator_counts_and_reserved_page():
    alloc = PageAllocator(8, 4)
    assert (alloc.num_total, alloc.num_free, alloc.used_pages) == (7, 7, 0)
    pages = alloc.alloc(7)
    assert sorted(pages) == [1, 2, 3, 4, 5, 6, 7]  # page 0 is never handed out
    assert (alloc.num_free, alloc.used_pages) == (0, 7)
    assert alloc.alloc(0) == []
    assert alloc.alloc(1) is None


def test_allocator_is_atomic_and_rejects_double_free():
    alloc = PageAllocator(5, 2)
    a = alloc.alloc(3)
    assert alloc.alloc(2) is None and alloc.num_free == 1  # never partial
    alloc.free(a[:1])
    with pytest.raises(ValueError, match="double free"):
        alloc.free(a[:1])
    with pytest.raises(ValueError, match="double free"):
        alloc.free([a[1], a[1]])  # twice in one call
    assert alloc.num_free == 2  # the failed calls freed nothing
    with pytest.raises(ValueError):
        alloc.free([0])
    with pytest.raises(ValueError):
        alloc.free([5])
    with pytest.raises(ValueError):
        alloc.free([a[1], a[0]])  # a[0] is already free: a[1] must stay allocated
    assert not alloc.is_free(a[1])
    alloc.free(a[1:])
    assert alloc.num_free == 4


def test_slots_for_mapping():
    assert slots_for([5, 2, 9], 3, 6, 4) == [23, 8, 9, 10, 11, 36]
    assert slots_for([7], 0, 1, 1) == [7]
    assert PageAllocator(10, 4).slots_for([5, 2, 9], 3, 6) == [23, 8, 9, 10, 11, 36]
    assert slots_for([5], 2, 0, 4) == []
    with pytest.raises(ValueError):
        slots_for([5, 2], 6, 3, 4)  # position 8 needs a third page


def test_request_kv_reserve_is_atomic():
    alloc = PageAllocator(4, 4)  # 3 usable pages
    kv = RequestKV()
    assert kv.pages_needed(5, 4) == 2
    slots = kv.reserve(alloc, 5)
    p0, p1 = kv.pages
    assert slots == [p0 * 4, p0 * 4 + 1, p0 * 4 + 2, p0 * 4 + 3, p1 * 4]
    assert kv.num_tokens == 5 and alloc.num_free == 1
    assert kv.pages_needed(3, 4) == 0 and kv.reserve(alloc, 3) == [p1 * 4 + 1, p1 * 4 + 2, p1 * 4 + 3]
    assert kv.pages_needed(5, 4) == 2
    assert kv.reserve(alloc, 5) is None  # needs 2 pages, 1 free: nothing changes
    assert (kv.num_tokens, kv.pages, alloc.num_free) == (8, [p0, p1], 1)
    (p2,) = alloc.alloc(1)
    alloc.free([p2])
    assert kv.reserve(alloc, 1) == [p2 * 4]
    kv.truncate(alloc, 6)  # e.g. rejected speculative tokens: the third page goes back
    assert (kv.num_tokens, kv.pages, alloc.num_free) == (6, [p0, p1], 1)


def test_request_kv_with_prefix_never_frees_cached_pages():
    alloc = PageAllocator(16, 2)
    kv = RequestKV.with_prefix([3, 4], 2)
    assert (kv.num_tokens, kv.num_cached_pages, kv.owned_pages) == (4, 2, [])
    assert alloc.alloc(4) == [1, 2, 3, 4]  # 3 and 4 stand for the tree's pages
    assert kv.reserve(alloc, 3) == [10, 11, 12]
    assert kv.owned_pages == [5, 6]
    with pytest.raises(ValueError):
        kv.truncate(alloc, 3)  # would cut into the cached pages
    kv.truncate(alloc, 4)
    assert kv.pages == [3, 4] and alloc.num_free == 11


# -- RadixCache: match / insert -----------------------------------------------------------------


@pytest.mark.parametrize("P", [1, 4, 16])
def test_match_after_insert(P):
    alloc, cache = make(64, P)
    tokens = list(range(100, 100 + 3 * P))
    pages, dup = cache_tokens(cache, tokens)
    assert dup == 0 and cache.total_cached_pages == 3 and cache.evictable_pages == 3
    m = cache.match_prefix(tokens)
    assert (m.pages, m.num_tokens, m.node.depth) == (pages, 3 * P, 3 * P)
    m = cache.match_prefix(tokens + [7] * (P + 1))  # longer query: still 3 pages
    assert (m.pages, m.num_tokens) == (pages, 3 * P)
    m = cache.match_prefix(tokens[: 2 * P + P - 1])  # last page incomplete: not matched
    assert (m.pages, m.num_tokens, m.node.depth) == (pages[:2], 2 * P, 2 * P)
    assert cache.match_prefix(tokens[: P - 1]).num_tokens == 0
    assert cache.match_prefix([1] + tokens).num_tokens == 0
    cache.check_integrity()
    assert cache.total_cached_pages == 3  # matching (and splitting) does not change counts


@pytest.mark.parametrize("P", [2, 4, 16])  # P = 1 has no partial pages
def test_partial_page_is_not_cached(P):
    alloc, cache = make(64, P)
    prompt = list(range(1, 2 * P + 2))  # 2 whole pages + 1 token
    m = cache.match_prefix(prompt[:-1])
    cache.lock(m.node)
    kv = RequestKV.with_prefix(m.pages, P)
    kv.reserve(alloc, len(prompt) - m.num_tokens)
    assert len(kv.pages) == 3 and alloc.used_pages == 3
    cache.check_integrity(kv.owned_pages)
    cache.release(kv, prompt, m.node)
    assert cache.total_cached_pages == 2 and alloc.used_pages == 2  # the partial page was freed
    assert kv.pages == [] and kv.num_tokens == 0
    assert cache.match_prefix(prompt).num_tokens == 2 * P
    cache.check_integrity()
    with pytest.raises(ValueError):
        cache.insert(prompt, [1, 2])  # token count must be whole pages


def test_diverging_branches_split_at_page_boundaries():
    P = 4
    alloc, cache = make(64, P)
    a = list(range(0, 12))  # pages [0..3] [4..7] [8..11]
    b = a[:5] + [99, 98, 97] + [50, 51, 52, 53]  # diverges inside the second page
    pa, dup = cache_tokens(cache, a)
    assert dup == 0
    pb = alloc.alloc(3)
    assert cache.insert(b, pb) == 1  # only the first page was cached
    alloc.free(pb[:1])
    assert cache.total_cached_pages == 5
    (head,) = cache.root.children.values()
    assert head.pages == [pa[0]] and head.depth == 4 and len(head.children) == 2
    tails = {c.key[:P]: c.pages for c in head.children.values()}
    assert tails == {(4, 5, 6, 7): pa[1:], (4, 99, 98, 97): pb[1:]}
    m = cache.match_prefix(b)
    assert m.pages == [pa[0], pb[1], pb[2]] and m.node.depth == 12
    m = cache.match_prefix(a[:7] + [0])  # first page, then a mismatch inside the second
    assert m.pages == [pa[0]] and m.node is head
    cache.check_integrity()


def test_insert_reports_duplicates_exactly():
    P = 2
    alloc, cache = make(64, P)
    a = [1, 2, 3, 4, 5, 6]
    pa, _ = cache_tokens(cache, a)
    q = alloc.alloc(3)
    assert cache.insert(a, q) == 3  # all already cached: the caller frees its copies
    alloc.free(q)
    q = alloc.alloc(2)
    assert cache.insert(a[:4], q) == 2  # a prefix ending inside an edge
    alloc.free(q)
    q = alloc.alloc(4)
    assert cache.insert(a + [7, 8], q) == 3  # extends the path by one page
    alloc.free(q[:3])
    assert cache.total_cached_pages == 4 and alloc.used_pages == 4
    assert cache.match_prefix(a + [7, 8]).pages == pa + [q[3]]
    assert cache.insert([], []) == 0
    cache.check_integrity()


def test_two_requests_same_prompt_release_duplicates():
    P = 4
    alloc, cache = make(64, P)
    prompt = list(range(10))  # 2 whole pages + 2 tokens
    reqs = []
    for _ in range(2):  # both admitted before either finished: neither sees a cached prefix
        m = cache.match_prefix(prompt[:-1])
        assert m.num_tokens == 0
        cache.lock(m.node)
        kv = RequestKV.with_prefix(m.pages, P)
        kv.reserve(alloc, len(prompt))
        reqs.append((kv, m.node))
    assert alloc.used_pages == 6
    first_pages = list(reqs[0][0].pages)
    cache.release(reqs[0][0], prompt, reqs[0][1])
    assert alloc.used_pages == 2 + 3  # tree keeps 2, partial page freed; request 2 holds 3
    cache.check_integrity(reqs[1][0].owned_pages)
    cache.release(reqs[1][0], prompt, reqs[1][1])
    assert alloc.used_pages == 2 and cache.match_prefix(prompt).pages == first_pages[:2]
    cache.check_integrity()


# -- RadixCache: lock / evict -------------------------------------------------------------------


def test_lock_prevents_eviction_and_unlock_allows_it():
    alloc, cache = make(32, 4)
    tokens = list(range(12))
    cache_tokens(cache, tokens)
    m = cache.match_prefix(tokens[:8])  # splits the 3-page edge: lock covers 2 pages
    cache.lock(m.node)
    assert (cache.protected_pages, cache.evictable_pages) == (2, 1)
    assert cache.evict(0) == 0
    assert cache.evict(100) == 1  # only the unlocked tail goes
    assert (cache.protected_pages, cache.evictable_pages) == (2, 0)
    assert cache.match_prefix(tokens).pages == m.pages
    cache.lock(m.node)  # locks are counted
    cache.unlock(m.node)
    assert cache.evict(100) == 0
    cache.unlock(m.node)
    assert (cache.protected_pages, cache.evictable_pages) == (0, 2)
    with pytest.raises(RuntimeError):
        cache.unlock(m.node)
    assert cache.evict(100) == 2 and alloc.num_free == alloc.num_total
    cache.check_integrity()


def test_locked_node_survives_split_by_insert():
    alloc, cache = make(32, 1)
    cache_tokens(cache, [1, 2, 3])
    m = cache.match_prefix([1, 2, 3])
    cache.lock(m.node)
    _, dup = cache_tokens(cache, [1, 5])  # splits the locked edge after one page
    assert dup == 1
    assert (cache.protected_pages, cache.evictable_pages) == (3, 1)
    cache.check_integrity()
    assert cache.evict(10) == 1  # only [5]
    cache.unlock(m.node)
    assert (cache.protected_pages, cache.evictable_pages) == (0, 3)
    cache.check_integrity()


def test_eviction_is_lru_and_parents_follow_children():
    alloc, cache = make(32, 1)
    pa, _ = cache_tokens(cache, [1, 2, 3])  # t=1
    pb, _ = cache_tokens(cache, [1, 2, 4])  # t=2: head [1, 2], leaves [3] (t=1), [4] (t=2)
    pc, _ = cache_tokens(cache, [7, 8])  # t=3
    cache.match_prefix([1, 2, 3])  # t=4: [3] and head are now the newest
    assert cache.evict(1) == 1 and alloc.is_free(pb[2])  # [4]: oldest leaf (the head is not a leaf)
    assert cache.evict(1) == 1 and alloc.is_free(pc[1])  # [7, 8] from the tail: 8 goes first
    assert cache.match_prefix([7, 8]).pages == pc[:1]  # t=5: [7] is now newer than [3]
    assert cache.evict(1) == 1 and alloc.is_free(pa[2])  # [3]
    # The head [1, 2] (t=4) is a leaf now and older than [7] (t=5): it goes next, tail first.
    assert cache.evict(1) == 1 and alloc.is_free(pa[1])
    assert cache.match_prefix([1, 2]).pages == pa[:1]  # t=6
    assert cache.evict(1) == 1 and alloc.is_free(pc[0])
    assert cache.evict(5) == 1 and cache.total_cached_pages == 0  # fewer than asked: all gone
    assert alloc.num_free == alloc.num_total
    cache.check_integrity()


def test_evict_trims_leaf_tail_only():
    alloc, cache = make(32, 2)
    tokens = list(range(8))
    pages, _ = cache_tokens(cache, tokens)
    assert cache.evict(1) == 1 and alloc.is_free(pages[3])
    m = cache.match_prefix(tokens)
    assert m.pages == pages[:3] and m.node.depth == 6
    assert cache.evict(2) == 2 and cache.match_prefix(tokens).pages == pages[:1]
    cache.check_integrity()


def test_reset_frees_everything_and_refuses_locks():
    alloc, cache = make(32, 2)
    cache_tokens(cache, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2])
    cache.lock(m.node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.unlock(m.node)
    cache.reset()
    assert cache.total_cached_pages == 0 and alloc.num_free == alloc.num_total
    assert cache.match_prefix([1, 2, 3, 4]).num_tokens == 0
    cache.check_integrity()


def test_check_integrity_catches_leaks():
    alloc, cache = make(16, 1)
    cache_tokens(cache, [1, 2])
    leaked = alloc.alloc(1)
    with pytest.raises(AssertionError):
        cache.check_integrity()
    cache.check_integrity(1)
    cache.check_integrity(leaked)
    with pytest.raises(AssertionError):
        cache.check_integrity(cache.match_prefix([1]).pages)  # a tree page counted as owned


# -- disabled -----------------------------------------------------------------------------------


def test_disabled_cache_caches_nothing_and_caller_frees_all():
    P = 4
    alloc, cache = make(32, P, disabled=True)
    prompt = list(range(10))
    m = cache.match_prefix(prompt[:-1])
    assert (m.pages, m.num_tokens, m.node) == ([], 0, cache.root)
    cache.lock(m.node)
    kv = RequestKV.with_prefix(m.pages, P)
    kv.reserve(alloc, len(prompt))
    pages = alloc.alloc(2)
    assert cache.insert(prompt[:8], pages) == 2  # took none: all of them are the caller's
    alloc.free(pages)
    cache.release(kv, prompt, m.node)
    assert alloc.num_free == alloc.num_total and cache.total_cached_pages == 0
    assert cache.match_prefix(prompt).num_tokens == 0
    assert cache.evict(10) == 0
    cache.check_integrity()


# -- randomized workload ------------------------------------------------------------------------


@pytest.mark.parametrize("P,disabled", [(1, False), (4, False), (4, True)])
def test_random_workload_keeps_integrity_and_kv_contents(P, disabled):
    """Play the scheduler: admit with match+lock, reserve (evict, else preempt), decode, release.

    The fake KV of position t is the token prefix tokens[:t+1]; every matched page must hold
    exactly the prefix the request asked for, which checks the tree's token-to-page mapping."""
    rng = random.Random(1234 + P)
    alloc, cache = make(48, P, disabled=disabled)
    kv_content: dict[int, tuple[int, ...]] = {}
    systems = [[rng.randrange(1000) for _ in range(rng.randrange(1, 3 * P + 3))] for _ in range(4)]
    running: list[dict] = []
    history: list[list[int]] = []
    hits = evicted = preempted = 0

    def check():
        owned = [p for r in running for p in r["kv"].owned_pages]
        cache.check_integrity(owned)

    def release(r):
        history.append(list(r["tokens"]))
        cache.release(r["kv"], r["tokens"], r["node"])
        running.remove(r)

    def reserve(r, new_tokens) -> bool:
        nonlocal evicted, preempted
        kv = r["kv"]
        while (slots := kv.reserve(alloc, len(new_tokens))) is None:
            freed = cache.evict(kv.pages_needed(len(new_tokens), P) - alloc.num_free)
            evicted += freed
            if freed == 0:
                victims = [v for v in running if v is not r]
                if not victims:
                    return False
                release(victims[-1])  # preempt the newest
                preempted += 1
            check()
        start = len(r["tokens"])
        r["tokens"].extend(new_tokens)
        for i, s in enumerate(slots):
            kv_content[s] = tuple(r["tokens"][: start + i + 1])
        return True

    for _ in range(400):
        op = rng.random()
        if op < 0.35 or not running:
            if history and rng.random() < 0.4:  # a follow-up turn: part of an earlier sequence
                base = rng.choice(history)
                base = base[: rng.randrange(1, len(base) + 1)]
            else:
                base = rng.choice(systems)
            prompt = base + [rng.randrange(1000) for _ in range(rng.randrange(1, 2 * P + 2))]
            m = cache.match_prefix(prompt[:-1])
            cache.lock(m.node)
            assert m.num_tokens % P == 0 and m.num_tokens < len(prompt)
            for t in range(m.num_tokens):
                assert kv_content[m.pages[t // P] * P + t % P] == tuple(prompt[: t + 1])
            hits += m.num_tokens
            kv = RequestKV.with_prefix(m.pages, P)
            r = {"kv": kv, "node": m.node, "tokens": prompt[: m.num_tokens]}
            running.append(r)
            if not reserve(r, prompt[m.num_tokens :]):
                release(r)  # cannot fit even alone: reject
        elif op < 0.8:
            r = rng.choice(running)
            reserve(r, [rng.randrange(1000)])  # one decode step
        else:
            release(rng.choice(running))
        check()
        if rng.random() < 0.05:
            evicted += cache.evict(rng.randrange(0, 4))
            check()

    for r in list(running):
        release(r)
    check()
    cache.evict(alloc.num_total)
    assert alloc.num_free == alloc.num_total and cache.total_cached_pages == 0
    if disabled:
        assert hits == 0 and evicted == 0
    else:
        assert hits > 0 and evicted > 0  # the workload really exercised the cache
    assert preempted > 0  # and ran out of pages often enough to preempt
