"""One worker rank's view of the shared KV store: NIXL transfers between a registered host
staging buffer and the store's DRAM tier (UCX), Ray calls only for control.

A page buffer is the bytes of one page for one rank, laid out as its store keys
(`keys.rank_keys`): MHA `[K | V]`, K = this rank's heads of every layer, `[layers, P, heads,
head_dim]`; MLA `[latent]`, `[layers, P, 1, kv_lora_rank + rope]`. In the staging buffer page i
of a batch starts at i * page_bytes.

Failure model: the store dead, unreachable, slow or full never raises into the serving path and
never hangs. Every Ray call has a timeout (`timeout_s`), every transfer a deadline; a failure
counts an error and reads as a miss (`batch_get` 0 pages, `batch_exists` 0, `batch_set` False).
A dead store actor is looked up again by name (at most every `retry_interval_s`), and the
client re-registers with whichever store answers.

MLA (contract 5): the latent is identical on every rank, so only rank 0 writes; on the other
ranks `batch_set` returns True before any transfer (counted as `pages_backup_skipped`). Every
rank reads the same single key per page.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict

import numpy as np
import torch

from kvstore.keys import (
    chain_keys,
    check_layout,
    keys_per_page,
    leading_pages,
    model_tag,
    store_keys,
    validate_keys,
)
from kvstore.messages import STORE_NAME
from kvstore.page_transfer import read_areas, write_areas
from kvstore.pages import (
    gather_pages,
    pool_device,
    pool_key_bytes,
    pool_layout,
    pool_page_bytes,
    scatter_pages,
)
from kvstore.staging import Stage, retire, serialized
from kvstore.store_link import FAILED, ClientCounters, StoreLink
from kvstore.transfer import Unreleased, nixl_transfer

logger = logging.getLogger(__name__)



class KVStoreClient:
    """Per-rank client. `store`: the store actor handle, or None to look it up by name."""

    def __init__(self, store, layout: str, tp_rank: int, tp_size: int, page_bytes: int,
                 fingerprint: str, staging_pages: int = 64, *, timeout_s: float = 2.0,
                 store_name: str = STORE_NAME, namespace: str | None = None,
                 retry_interval_s: float = 1.0, name: str | None = None, staging_slots: int = 1):
        self.layout = check_layout(layout)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.kpp = keys_per_page(layout)
        self.backup_skip = layout == "mla" and tp_rank != 0  # rank 0 alone writes MLA pages
        self.page_bytes = -(-page_bytes // 64) * 64  # aligned: page views may be any dtype
        self.staging_pages = staging_pages
        self.fingerprint = fingerprint
        self.timeout_s = timeout_s
        self.name = name or f"manta-kv-r{tp_rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.counters = ClientCounters()
        self.link = StoreLink(store, self.counters, timeout_s, store_name, namespace, retry_interval_s)
        # zeros, not empty: touched now, so the first transfers do not pay page faults.
        self._buffer = torch.zeros(staging_slots * staging_pages * self.page_bytes, dtype=torch.uint8,
                                   pin_memory=torch.cuda.is_available())
        self._free: queue.SimpleQueue[Stage] = queue.SimpleQueue()
        area = staging_pages * self.page_bytes
        for i in range(staging_slots):
            t = self._buffer[i * area : (i + 1) * area]
            self._free.put(Stage(t, t.numpy()))
        self._tls = threading.local()
        self._unreleased = Unreleased()  # staging areas of transfers NIXL could not cancel (`staging.retire`)
        self._extra_regs: list = []  # the areas registered in their place
        self._store_agent: str | None = None
        self._registered_gen = -1
        self._tagless = False  # the store takes no model tags or prompt flags (an older store)
        self._conn_lock = threading.Lock()  # registration with the store
        self._regions: list[tuple[int, int, object]] = []  # registered row buffers: (address, bytes, handle)
        self.agent = None
        try:
            from kvstore.transfer import make_agent

            # `_xfer` progresses it while it waits; several I/O threads share it.
            self.agent = make_agent(self.name)
            self._reg = self.agent.register_memory(self._buffer)
        except Exception:
            logger.exception("kv store client %s: no NIXL agent; the store is disabled", self.name)
            self.agent = None

    # The calling thread's staging area (held for the duration of a data-path call).
    @property
    def staging(self) -> torch.Tensor:
        return self._tls.stage.tensor

    @property
    def _np(self) -> np.ndarray:
        return self._tls.stage.np

    # ---------------- queries ----------------
    def chain_keys(self, token_ids: Sequence[int], page_size: int, parent: str | None = None) -> list[str]:
        return chain_keys(token_ids, page_size, self.fingerprint, self.layout, parent)

    def batch_exists(self, chain: Sequence[str]) -> int:
        """Leading pages whose keys for this rank are all in the store (1 key per MLA page,
        2 per MHA page: the denominator of contract 5)."""
        if not chain or not self._valid(chain):
            return 0
        flags = self.link.call("exists", store_keys(chain, self.layout, self.tp_rank))
        return 0 if flags is FAILED else leading_pages(flags, self.kpp)

    def recent(self, limit: int) -> list[str]:
        """Chain keys of up to `limit` pages of this model that the store holds for every rank
        of this one's TP group, prompt pages first, most recently used first ([] when the store
        is unreachable)."""
        if limit <= 0 or not self._connect():
            return []
        keys = self.link.call("recent", model_tag(self.fingerprint), None if self.layout == "mla" else self.tp_size,
                              limit)
        return [] if keys is FAILED else validate_keys(keys)[:limit]

    # ---------------- raw page buffers ----------------
    @serialized
    def batch_set(self, chain: Sequence[str], page_tensors: Sequence[Sequence[torch.Tensor]]) -> bool:
        """Store pages: page_tensors[i] holds page i's keys_per_page tensors (MHA: K, V; MLA:
        the latent), any dtype and device. True when every page is in the store afterwards
        (or this rank skips MLA writes); False on any failure (counted, never raised)."""
        if self.backup_skip:
            self.counters.pages_backup_skipped += len(chain)
            return True
        if not chain or not self._valid(chain):
            return not chain
        ok = True
        for start in range(0, len(chain), self.staging_pages):
            sub = chain[start : start + self.staging_pages]
            sizes = []
            for i, tensors in enumerate(page_tensors[start : start + len(sub)]):
                if len(tensors) != self.kpp:
                    raise ValueError(f"a {self.layout} page has {self.kpp} tensors, got {len(tensors)}")
                sizes.append([t.numel() * t.element_size() for t in tensors])
                if sum(sizes[-1]) > self.page_bytes:
                    raise ValueError(f"page of {sum(sizes[-1])} bytes > page_bytes {self.page_bytes}")
                off = i * self.page_bytes
                for t, n in zip(tensors, sizes[-1]):
                    self.staging[off : off + n].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
                    off += n
            ok = write_areas(self, sub, sizes) and ok
        return ok

    @serialized
    def batch_get(self, chain: Sequence[str], out_tensors: Sequence[Sequence[torch.Tensor]]) -> int:
        """Load the leading pages present into out_tensors (same layout as batch_set's,
        contiguous); returns how many pages were loaded (0 on any failure)."""
        if not chain or not self._valid(chain):
            return 0
        self.counters.query_pages += len(chain)
        loaded = 0
        for start in range(0, len(chain), self.staging_pages):
            sub = chain[start : start + self.staging_pages]
            outs = out_tensors[start : start + len(sub)]
            want = [[t.numel() * t.element_size() for t in ts] for ts in outs]
            n = read_areas(self, sub, want)
            for i in range(n):
                off = i * self.page_bytes
                for t, size in zip(outs[i], want[i]):
                    t.view(-1).view(torch.uint8).copy_(self.staging[off : off + size])
                    off += size
            loaded += n
            if n < len(sub):
                break
        self.counters.pages_read += loaded
        self.counters.hit_pages += loaded
        return loaded

    # ---------------- pages in registered host rows ----------------
    def register_rows(self, rows: torch.Tensor) -> bool:
        """Register a buffer of page rows (a rank's host tier: [n, >= page_bytes] uint8,
        contiguous, pinned on a GPU host) with this client's NIXL agent, so that `read_rows` and
        `write_rows` move pages between its rows and the store with no staging copy. False when
        the agent cannot (the caller keeps to batch_get/batch_set)."""
        if self.agent is None or not rows.is_contiguous() or rows.dtype != torch.uint8 or rows.dim() != 2 \
                or rows.shape[1] < self.page_bytes:
            return False
        try:
            handle = self.agent.register_memory(rows)
        except Exception:
            logger.exception("kv store client %s: registering %d host rows failed", self.name, rows.shape[0])
            return False
        self._regions.append((rows.data_ptr(), rows.numel(), handle))
        return True

    def _areas(self, rows: Sequence[torch.Tensor]) -> list[np.ndarray]:
        areas = []
        for row in rows:
            addr, n = row.data_ptr(), row.numel()
            if row.dtype != torch.uint8 or not row.is_contiguous() or n < self.page_bytes or not any(
                    a <= addr and addr + n <= a + size for a, size, _ in self._regions):
                raise ValueError("a page row must be a contiguous uint8 row of a buffer given to register_rows")
            areas.append(row.numpy())
        return areas

    @serialized
    def read_rows(self, chain: Sequence[str], rows: Sequence[torch.Tensor], key_bytes: Sequence[int]) -> int:
        """Load the leading stored pages of chain straight into host rows (registered with
        `register_rows`), page i's keys packed by `key_bytes` from the start of rows[i];
        returns how many pages arrived intact (0 on any failure). Rows past that hold garbage;
        after a READ NIXL could not cancel they may still be written (`stuck_read`)."""
        self._tls.stuck = None
        if not chain or not self._valid(chain):
            return 0
        areas = self._areas(rows[: len(chain)])
        self.counters.query_pages += len(chain)
        n = read_areas(self, chain, [list(key_bytes)] * len(chain), areas)
        self.counters.pages_read += n
        self.counters.hit_pages += n
        return n

    def stuck_read(self) -> list | None:
        """After `read_rows` on this thread: the handles of a READ into its rows that NIXL could
        not cancel (None: there was none). Those rows may still be written: the caller must not
        reuse them, and hands the client what gives them back (`hold`)."""
        handles, self._tls.stuck = getattr(self._tls, "stuck", None), None
        return handles

    def hold(self, handles: list, give_back) -> None:
        """Run `give_back` once the READ of `handles` (`stuck_read`) has ended: checked before
        each data-path call."""
        self._unreleased.add(self.agent, handles, give_back)

    def stage(self, chain: Sequence[str]) -> None:
        """Ask the store to read these pages from its files into its RAM now, ahead of the
        `read_rows` calls that will fetch them a chunk at a time (fire and forget)."""
        if chain and self._valid(chain) and self._connect():
            self.link.send("stage", self.name, store_keys(chain, self.layout, self.tp_rank))

    @serialized
    def write_rows(self, chain: Sequence[str], rows: Sequence[torch.Tensor], key_bytes: Sequence[int],
                   prompt: int = 0) -> bool:
        """Store pages straight from host rows (registered with `register_rows`), laid out as
        `read_rows` reads them; the first `prompt` pages hold prompt tokens (the store keeps
        that, for a restarted replica's warm). Same result contract as batch_set."""
        if self.backup_skip:
            self.counters.pages_backup_skipped += len(chain)
            return True
        if not chain or not self._valid(chain):
            return not chain
        return write_areas(self, chain, [list(key_bytes)] * len(chain), self._areas(rows[: len(chain)]), prompt)

    # ---------------- KV pool pages ----------------
    @serialized
    def save_pages(self, pool, page_ids: Sequence[int], chain: Sequence[str], prompt: int = 0,
                   wait_s: float = 0.0) -> bool:
        """Store pool pages page_ids[i] under chain[i] (this rank's heads / the latent),
        gathered straight into the staging buffer; the first `prompt` hold prompt tokens.
        Pages the store refuses for want of room (its RAM full of pages on their way to its
        files) are offered again for up to `wait_s` in all (the drain at shutdown: nothing waits
        on it, and a refused page would cut its prefix short). Same result contract as batch_set."""
        if self.backup_skip:
            self.counters.pages_backup_skipped += len(chain)
            return True
        if not chain or not self._valid(chain):
            return not chain
        self._check_pool(pool, len(page_ids), len(chain))
        sizes = pool_key_bytes(pool)
        ok = True
        deadline = time.monotonic() + wait_s
        for start in range(0, len(chain), self.staging_pages):
            sub = chain[start : start + self.staging_pages]
            self._gather(pool, page_ids[start : start + len(sub)])
            tally = [0, 0]  # pages refused by this attempt, attempts before it
            while True:
                tally[0] = 0
                done = write_areas(self, sub, [sizes] * len(sub), None, prompt - start, tally)
                if done or not tally[0] or time.monotonic() > deadline:
                    break
                tally[1] += 1
                time.sleep(0.02)
            self.counters.pages_refused += tally[0]  # those the last attempt left out
            ok = done and ok
        return ok

    @serialized
    def load_pages(self, pool, page_ids: Sequence[int], chain: Sequence[str]) -> int:
        """Load the leading stored pages of chain into pool pages page_ids; returns how many.
        TP ranks then agree with `agree_on_pages`."""
        if not chain or not self._valid(chain):
            return 0
        self._check_pool(pool, len(page_ids), len(chain))
        sizes = pool_key_bytes(pool)
        self.counters.query_pages += len(chain)
        loaded = 0
        for start in range(0, len(chain), self.staging_pages):
            sub = chain[start : start + self.staging_pages]
            n = read_areas(self, sub, [sizes] * len(sub))
            if n:
                self._scatter(pool, page_ids[start : start + n])
            loaded += n
            if n < len(sub):
                break
        self.counters.pages_read += loaded
        self.counters.hit_pages += loaded
        return loaded

    def _check_pool(self, pool, n_pages: int, n_keys: int) -> None:
        if pool_layout(pool) != self.layout:
            raise ValueError(f"a {pool_layout(pool)} pool with a {self.layout} client")
        if pool_page_bytes(pool) > self.page_bytes or n_pages != n_keys:
            raise ValueError(f"{n_pages} pages of {pool_page_bytes(pool)} bytes for {n_keys} keys "
                             f"(page_bytes {self.page_bytes})")

    def _gather(self, pool, page_ids: Sequence[int]) -> None:
        stage = self.staging[: len(page_ids) * self.page_bytes].view(len(page_ids), -1)
        if pool_device(pool).type == "cuda":  # gathered on the device, one copy out (not one per layer)
            dev = torch.empty(stage.shape, dtype=torch.uint8, device=pool_device(pool))
            gather_pages(pool, page_ids, dev)
            stage.copy_(dev)
        else:
            gather_pages(pool, page_ids, stage)

    def _scatter(self, pool, page_ids: Sequence[int]) -> None:
        stage = self.staging[: len(page_ids) * self.page_bytes].view(len(page_ids), -1)
        scatter_pages(pool, page_ids, stage.to(pool_device(pool)) if pool_device(pool).type == "cuda" else stage)

    # ---------------- transfers ----------------
    def _valid(self, chain: Sequence[str]) -> bool:
        try:
            validate_keys(chain)
            return True
        except ValueError as exc:
            logger.warning("kv store client: %s", exc)
            self.counters.errors += 1
            return False

    def _connect(self) -> bool:
        """Register with the store (again after it changed); False when it is unavailable."""
        if self.agent is None:
            self.counters.errors += 1
            return False
        if self._registered_gen == self.link.generation and self._store_agent is not None:
            return True
        with self._conn_lock:
            return self._register()

    def _register(self) -> bool:
        if self._registered_gen == self.link.generation and self._store_agent is not None:
            return True  # another thread did it while this one waited
        reply = self.link.call("register_client", self.name, self.agent.get_agent_metadata(),
                               model_tag(self.fingerprint))
        self._tagless = reply is FAILED and self.link.refused_args
        if self._tagless:  # a store of an older version (it outlived an upgrade): no tags, no warm
            self.counters.errors -= 1  # (that refusal was not a failure)
            reply = self.link.call("register_client", self.name, self.agent.get_agent_metadata())
        if reply is FAILED:
            return False
        store_agent, metadata = reply
        if self._store_agent is not None:
            try:
                self.agent.remove_remote_agent(self._store_agent)
            except Exception:
                pass
        remote = self.agent.add_remote_agent(metadata)
        self._store_agent = remote.decode() if isinstance(remote, bytes) else remote
        assert self._store_agent == store_agent, (self._store_agent, store_agent)
        self._registered_gen = self.link.generation
        return True

    def _data_call(self, method: str, *args):
        """A reserve/locate call; re-registers once when the store does not know us."""
        for _ in range(2):
            if not self._connect():
                return FAILED
            reply = self.link.call(method, self.name, *args)
            if reply is not None:
                return reply
            self._registered_gen = -1  # a restarted store: register again
        self.counters.errors += 1
        return FAILED

    def _xfer(self, op: str, local: list[tuple[int, int, int]], remote: list[tuple[int, int, int]],
              staged: bool = False) -> bool:
        """One NIXL transfer registered memory (`staged`: the calling thread's staging area) <->
        store DRAM; False (counted) on error or deadline."""
        assert self.agent is not None
        nbytes = sum(n for _, n, _ in local)
        unreleased: list = []
        state = nixl_transfer(self.agent, op, local, remote, self._store_agent, self.timeout_s + nbytes / 100e6,
                              unreleased=unreleased)
        # A stuck READ may still land in our memory; a stuck WRITE only reads it (the store's
        # copy may then be wrong, which its checksum catches), and a retry must find the bytes
        # it gathered where they were.
        if state == "stuck" and op == "READ" and staged:
            retire(self, unreleased)
        elif state == "stuck" and op == "READ":  # the caller's rows: `stuck_read` tells it to hold them
            self._tls.stuck = unreleased
        if state != "done":
            self.counters.errors += 1
            self._registered_gen = -1  # reconnect before the next transfer
            return False
        return True

    def _staged(self, n: int) -> list[np.ndarray]:
        """The first n page areas of the calling thread's staging area."""
        return [self._np[i * self.page_bytes : (i + 1) * self.page_bytes] for i in range(n)]

    # ---------------- metrics ----------------
    def stats(self) -> dict:
        return {"name": self.name, "layout": self.layout, "tp_rank": self.tp_rank,
                "connected": self._registered_gen == self.link.generation, **asdict(self.counters)}

    def close(self) -> None:
        if self.agent is not None:
            for handle in [self._reg, *self._extra_regs] + [h for _, _, h in self._regions]:
                try:
                    self.agent.deregister_memory(handle)
                except Exception:
                    pass
            self._regions = []
            self.agent = None
