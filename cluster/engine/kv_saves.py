"""The write side of the hierarchical KV cache: which device pages get a copy in the rank's host
tier and the shared store, and when (`cluster.engine.kv_offload` holds the read side and owns
this as `SchedulerKVOffload.saves`).

The write policies (`--kv-write-policy`):

- write_back_selective (default): write_back's pages plus write_through_selective's. A page is
  written when it is about to have no other copy (evicted from the GPU, or the replica stops)
  or has proven hot (matched twice: then other replicas may want it too). Each page is written
  at most once, and nothing is written while the GPU cache holds the working set: a workload
  of one-off prompts (a benchmark's random ones) costs the store nothing while it runs.
- write_back: a page when the radix cache evicts it (the plan that evicts it carries the
  save, which runs before the forward that may overwrite the page), and at shutdown the pages
  still cached, prompt pages first and each prefix before its extensions, for up to the drain
  timeout (`drain`).
- write_through_selective: a cached page once admissions have matched it `HIT_THRESHOLD` (2)
  times, so pages used once never cost a store write;
- write_through: every full page the radix cache takes on `release` (a finished or
  preempted request), in the next plan. Every page of every request: the most store traffic
  (an 8B model writes 128 KiB per token), for stores that must survive a crash.

A page the store already holds (it was loaded from there, or the request's lookup found it) is
never written again. Saves go out in the order they were decided (eviction order: the host
tier's LRU order follows it); `KVSave.prompt` counts their leading prompt pages, which the
store keeps as such (a restarted replica warms its host tier with prompt pages first:
`workers.host_warm`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

from workers.kv_messages import KVSave

logger = logging.getLogger(__name__)

HIT_THRESHOLD = 2  # write_through_selective: matches before a page is saved
DRAIN_CHUNK_PAGES = 64  # pages per drain order at shutdown
DRAIN_WAIT_S = 2.0  # at most this long a drain order's pages refused by a full store are offered again
WRITE_BACK = ("write_back", "write_back_selective")  # policies that save on eviction and at shutdown
SELECTIVE = ("write_through_selective", "write_back_selective")  # policies that save hot pages


class KVSaves:
    """The pages of one scheduler's radix cache with their chain keys, and the saves its write
    policy orders. Runs under the engine's lock, as its owner does."""

    def __init__(self, write_policy: str, stats):
        self.policy = write_policy
        self.stats = stats  # the owner's `KVOffloadStats` (saved_pages, drained_pages)
        self.tree_keys: dict[int, str] = {}  # page in the radix tree -> its chain key
        self.saved: set[int] = set()  # tree pages already saved (or that the store holds)
        self.hits: Counter[int] = Counter()  # selective policies: admissions that matched a page
        self.pending: list[tuple[int, str, bool]] = []  # (page, key, holds prompt tokens)
        self.prompt_pages: set[int] = set()  # tree pages that hold prompt tokens (drained first)
        self.depth: dict[int, int] = {}  # tree page -> its index in its chain (a prefix drains first)
        self._evict_copied: dict[int, str] = {}  # pages of the eviction under way that have copies -> keys

    def matched(self, pages: list[int]) -> None:
        """An admission matched these cached pages: the selective policies save hot ones."""
        if self.policy not in SELECTIVE:
            return
        for p in pages:
            self.hits[p] += 1
            if self.hits[p] >= HIT_THRESHOLD and p not in self.saved and p in self.tree_keys:
                self._save(p, self.tree_keys[p])

    def cached(self, pages: list[int], kept: int, chain: list[str], prompt_full: int, held: set[int],
               in_store: int) -> None:
        """The radix cache took pages[kept:len(chain)] of a request; `chain` their chain keys,
        `prompt_full` its whole pages of prompt, `held` the pages that came from the store and
        `in_store` the leading pages its lookup found there (neither is saved again)."""
        for i in range(kept, len(chain)):
            self.tree_keys[pages[i]] = chain[i]
            self.depth[pages[i]] = i
            if pages[i] in held or i < in_store:
                self.saved.add(pages[i])  # it came from the store, or the store has it already
                continue
            if i < prompt_full:
                self.prompt_pages.add(pages[i])
            if self.policy == "write_through":
                self._save(pages[i], chain[i])

    def on_evict(self, leaf, take: int) -> None:
        """Radix eviction of leaf's last `take` pages (`RadixCache.on_evict`): forget them (the
        page ids come back with other tokens); write_back saves them now."""
        self._evict_copied = {}
        for p in leaf.pages[len(leaf.pages) - take :]:
            key = self.tree_keys.pop(p, None)
            self.hits.pop(p, None)
            self.depth.pop(p, None)
            if self.policy in WRITE_BACK and key is not None and p not in self.saved:
                self._save(p, key)
            self.prompt_pages.discard(p)
            if p in self.saved and key is not None:  # its copy is in the host tier and on its way to the store
                self._evict_copied[p] = key
            self.saved.discard(p)

    def evict_copies(self, pages: list[int]) -> dict[int, str]:
        """Of the pages the radix cache is evicting now, those with a copy in the host tier and
        the store, with their chain keys (the KV events' tiers: cluster/engine/kv_events.py)."""
        return {p: self._evict_copied[p] for p in pages if p in self._evict_copied}

    def take(self) -> list[KVSave]:
        """This step's saves: one order, in the order they were decided, marked as prompt pages
        only when they all are (`KVSave.prompt` counts leading pages)."""
        pending, self.pending = self.pending, []
        if not pending:
            return []
        n_prompt = len(pending) if all(s[2] for s in pending) else 0
        return [KVSave([p for p, _, _ in pending], [k for _, k, _ in pending], prompt=n_prompt)]

    def drain(self) -> list[KVSave]:
        """At shutdown (write_back policies): `sync` saves of every cached page not saved yet,
        prompt pages first, each kind by depth in its chain (a page is no use without the ones
        before it: a drain cut short by its deadline leaves whole prefixes), most recently
        cached first at one depth; in chunks the caller sends one at a time until its
        deadline. Empty for the write-through policies (their pages went out)."""
        if self.policy not in WRITE_BACK:
            return []
        recent = [p for p in reversed(self.tree_keys) if p not in self.saved]
        order = sorted(recent, key=lambda p: (p not in self.prompt_pages, self.depth.get(p, 0)))  # stable
        out = []
        for i in range(0, len(order), DRAIN_CHUNK_PAGES):
            chunk = order[i : i + DRAIN_CHUNK_PAGES]
            out.append(KVSave(chunk, [self.tree_keys[p] for p in chunk], sync=True,
                              prompt=sum(p in self.prompt_pages for p in chunk), wait_s=DRAIN_WAIT_S))
        return out

    def drained(self, save: KVSave) -> None:
        self.saved.update(save.page_ids)
        self.stats.drained_pages += len(save.page_ids)

    def write_out(self, saves: list[KVSave], budget_s: float, execute: Callable[[KVSave], None]) -> None:
        """`drain`'s saves, one `execute` (an idle plan the ranks run to completion) each, until
        done or `budget_s` has passed; each save's wait for store room is cut to what is left."""
        t0 = time.monotonic()
        done = 0
        for save in saves:
            if time.monotonic() - t0 > budget_s:
                break
            save.wait_s = min(save.wait_s, max(0.0, budget_s - (time.monotonic() - t0)))
            execute(save)
            self.drained(save)
            done += len(save.page_ids)
        logger.info("KV store: saved %d of %d cached pages at shutdown in %.1f s", done,
                    sum(len(s.page_ids) for s in saves), time.monotonic() - t0)

    def _save(self, page: int, key: str) -> None:
        self.saved.add(page)
        self.pending.append((page, key, page in self.prompt_pages))
        self.stats.saved_pages += 1
