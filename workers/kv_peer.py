"""Rank-to-rank KV page transfer for prefill/decode disaggregation, over NIXL.

Pull, not push: the decode rank reads the prompt's pages from the prefill rank's hand-off rows
when it has room for them (its own hand-off rows, taken for the read), so a decode replica that
is full never has pages pushed at it, and every failure is seen and handled on the one side
that must act on it (the decode side computes what it could not read).

Both sides keep the pages in their ranks' hand-off rows (`workers/handoff_rows.py`: on the KV
pool's GPU, under a NIXL agent of their own), so on GPUs a READ moves them from GPU memory to
GPU memory (NIXL "VRAM": CUDA IPC on one host, GPUDirect RDMA between hosts), never through
host memory; on CPUs (or `--pd-memory host`), host memory to host memory.

The prefill side (`PeerLeases`, beside a rank's `RankKVOffload`): the replica copies a
handed-off request's prompt pages into its hand-off rows (`KVSave.store=False`), their
checksums taken beside the copy (on a GPU `kvstore.transfer.page_sums`, on the device; crc32s
in host memory). A decode rank asks for them by chain key (`locate`, a Ray call to the
rank actor, off the step's thread): the rows of the leading keys present are pinned under a
lease and their addresses returned with their checksums and the rank's NIXL agent metadata.
`release` (or the lease's expiry) unpins them. A lease outlives the reader's deadline, so no
read ever races a reuse of a row.

The decode side (`PeerReader`, on a rank's read I/O thread): locate, NIXL READs from the
prefill rank's rows into this rank's hand-off rows (in host memory a chunk of pages at a time,
each chunk's checksums computed beside the next READ; in GPU memory one READ), verify every
page's checksum, publish the leading good pages under this replica's own chain keys (the normal
`KVLoad` then scatters them into device pages), release the lease. Which prefill ranks a decode
rank reads from:
- MLA: the latent is the same on every rank, so all decode ranks read from prefill rank 0
  (contract 5: one copy of a page, one key, written by rank 0 alone);
- MHA, same TP size: rank r from rank r, bytes as they are;
- MHA, different TP sizes: from every prefill rank whose kv heads overlap this rank's, into a
  scratch buffer, then this rank's heads are cut out of each and laid out as its own page
  (`[K | V]`, each `[layers, P, heads, head_dim]`).
Failures (the prefill rank dead or restarted, a deadline, a crc mismatch) end the read at
the last good page: the scheduler loads what every rank holds and the prefill computes the
rest. A restarted prefill rank comes back with a new agent name: the old remote agent is
removed when the new one is added.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections import OrderedDict

import torch

from workers.handoff_rows import dev_of, mem_of, same_memory
from workers.handoff_speed import ReadSpeed

logger = logging.getLogger(__name__)

LEASE_MARGIN_S = 5.0  # a lease outlives the reader's deadline by this much
LOCATE_WAIT_S = 1.0  # how long `locate` waits for a hand-off's pages still being saved (default)
LATE_S = 0.1  # `locate` past its wait by this much: the caller has given up
UNHEARD_WAIT_S = 0.5  # how long `locate` waits for a page whose save has not even started
CALL_MARGIN_S = 0.3  # a decode rank waits this much longer than it lets the prefill rank wait
# Pages per NIXL READ of a hand-off in host memory (an 8B page is 2 MiB: 16 MiB a READ), so the
# crc32s of one chunk run while the next is read. In GPU memory the sums take 0.7 ms for 256 MiB
# and a READ costs its launch: one READ, then the sums, took 1.6 ms where 8-page chunks took 3.2
# (H200, `scripts/nixl_read_bench.py --device cuda`, BENCHMARKS.md 2026-11-28), so it is one READ.
READ_CHUNK_PAGES = 8


class StuckRead(RuntimeError):
    """A READ that NIXL could not cancel (`handles`: its transfer handles): its destination
    memory stays out of use until the READ ends (`PeerReader.stuck` gives it back then), and the
    lease is left to expire (a late write must land in memory nobody reads and rows nobody reuses)."""

    def __init__(self, message: str, handles: list | None = None):
        super().__init__(message)
        self.handles = handles or []


class PeerLeases:
    """The prefill rank's side: pages lent to decode ranks. Thread-safe (Ray calls arrive on
    the actor's threads while the step runs)."""

    def __init__(self, offload):
        self.off = offload
        self.leases: dict[str, tuple[list[int], float]] = {}
        self.lock = threading.Lock()
        # fault injection for tests: ("delay", s) | ("corrupt", 0): a checksum | ("corrupt_bytes", 0): a page
        self.fault: tuple[str, float] | None = None
        self.counters = {"pd_leases": 0, "pd_pages_lent": 0, "pd_leases_expired": 0,
                         "pd_lend_wait_s": 0.0, "pd_lend_crc_s": 0.0}  # waiting for the save; checksums
        self._progress: threading.Thread | None = None
        self._last_lease = 0.0
        self._crcs: OrderedDict[tuple[str, int], int] = OrderedDict()  # (key, row) -> checksum, taken at the save
        self._pending: dict[str, int] = {}  # hand-off keys whose save is on its way to the host tier

    def expect(self, keys: list[str]) -> None:
        """A hand-off's save of `keys` started (the step's thread): `locate` waits for them."""
        with self.lock:
            for k in keys:
                self._pending[k] = self._pending.get(k, 0) + 1

    def arrived(self, keys: list[str]) -> None:
        """... and ended, published or not."""
        with self.lock:
            for k in keys:
                left = self._pending.pop(k, 0) - 1
                if left > 0:
                    self._pending[k] = left

    def publish_checksummed(self, keys: list[str], rows: list[int], sums: list[int] | None = None) -> None:
        """Publish a hand-off's pages in the hand-off rows with their checksums (`sums`, taken
        beside the copy on a GPU; else taken now, on its I/O thread: either way off the path of
        the decode rank that will ask for them). A key the rows held already keeps its own
        row, whose checksum `locate` takes itself."""
        host = self.off.lend
        crcs = sums if sums is not None else self._sums(rows)
        held = host.publish(keys, rows)
        self.arrived(keys)
        self.forget(rows)
        with self.lock:
            self._crcs.update(((k, r), c) for k, r, h, c in zip(keys, rows, held, crcs) if r == h)
            while len(self._crcs) > host.capacity:
                self._crcs.popitem(last=False)

    def forget(self, rows: list[int]) -> None:
        """Rows filled anew (a save, or a read from another prefill replica): their old checksums go."""
        gone = set(rows)
        with self.lock:
            for k in [k for k in self._crcs if k[1] in gone]:
                del self._crcs[k]

    def _sums(self, rows: list[int]) -> list[int]:
        return self.off.handoff.sums_now(rows, sum(self.off.key_bytes))

    def locate(self, keys: list[str], ttl_s: float, wait_s: float = LOCATE_WAIT_S) -> dict | None:
        """Pin the rows of the leading `keys` in the hand-off rows (waiting up to wait_s for pages
        whose save is still on its way: the caller waits a little longer, then gives up) for
        ttl_s; None without hand-off rows. Lends nothing once wait_s has passed (its caller has
        stopped waiting: a lease it never hears of would only pin rows until it expires)."""
        self.sweep()
        rows_of = self.off.handoff
        if rows_of is None:
            return None
        host = rows_of.tier
        fault = self.fault
        if fault is not None and fault[0] == "delay":
            time.sleep(fault[1])
        t0 = time.monotonic()
        deadline = t0 + wait_s
        while True:
            rows = host.leading(keys)  # pinned
            if len(rows) == len(keys) or time.monotonic() >= deadline:
                break
            # Wait for a page still on its way; one not heard of yet only for a moment (the step
            # that saves it may not have started), and one the save dropped never comes.
            with self.lock:
                coming = keys[len(rows)] in self._pending or time.monotonic() - t0 < UNHEARD_WAIT_S
            if not coming:
                break
            host.unpin(rows)
            time.sleep(0.002)
        t1 = time.monotonic()
        with self.lock:  # taken at the save (kept while lent: a shared prefix's rows stay known)
            known = [self._crcs.get((k, r)) for k, r in zip(keys, rows)]
            for k, r, c in zip(keys, rows, known):
                if c is not None:
                    self._crcs.move_to_end((k, r))
        todo = [i for i, c in enumerate(known) if c is None]
        for i, c in zip(todo, self._sums([rows[i] for i in todo])):  # (dropped: computed now)
            known[i] = c
        if todo:
            with self.lock:
                self._crcs.update(((keys[i], rows[i]), known[i]) for i in todo)
        crcs = known
        self.counters["pd_lend_wait_s"] += t1 - t0
        self.counters["pd_lend_crc_s"] += time.monotonic() - t1
        if fault is not None and fault[0] == "corrupt" and crcs:
            crcs[len(crcs) // 2] ^= 0x5A5A  # as if the page's bytes changed on the way
        if fault is not None and fault[0] == "corrupt_bytes" and rows:
            flat = host.data[rows[len(rows) // 2]].view(-1).view(torch.uint8)
            flat[:64] += 1  # the page's bytes changed after their checksum was taken (never back)
        if time.monotonic() > deadline + LATE_S:
            host.unpin(rows)
            rows, crcs = [], []
        lease = uuid.uuid4().hex
        with self.lock:
            self.leases[lease] = (rows, time.monotonic() + ttl_s)
            self.counters["pd_leases"] += 1
            self.counters["pd_pages_lent"] += len(rows)
            if self._progress is None or not self._progress.is_alive():
                self._progress = threading.Thread(target=self._drive, name="kv-peer-progress", daemon=True)
                self._progress.start()
        return {"agent": rows_of.name, "meta": rows_of.agent.get_agent_metadata(), "lease": lease,
                "addrs": [host.data[r].data_ptr() for r in rows], "crcs": crcs,
                "key_bytes": list(self.off.key_bytes), "mem": rows_of.mem, "dev": rows_of.dev}

    def _drive(self) -> None:
        """Progress this rank's UCX worker while pages are lent: the reader's connection set-up
        and its READs over a transport that is not one-sided need the target to progress (the
        store does the same). Ends a moment after the last lease: an idle rank uses no CPU."""
        rows_of = self.off.handoff
        if rows_of is not None:
            rows_of.stream()  # (this thread's CUDA device: UCX may move GPU memory from here)
        polls = 0
        while rows_of is not None and not rows_of.closed:
            try:
                rows_of.agent.get_new_notifs()
            except Exception:
                logger.exception("kv peer: NIXL progress")
                return
            polls += 1
            if polls % 1000 == 0:
                self.sweep()  # leases whose reader vanished expire here too, not only at the next step
            if self.leases:
                self._last_lease = time.monotonic()
            elif time.monotonic() - self._last_lease > 1.0:
                return
            time.sleep(0.0001)

    def release(self, lease: str) -> None:
        with self.lock:
            held = self.leases.pop(lease, None)
        if held is not None:
            self.off.lend.unpin(held[0])

    def sweep(self) -> None:
        """Unpin the rows of expired leases (a reader that died or gave up)."""
        if not self.leases:
            return
        now = time.monotonic()
        with self.lock:
            old = [k for k, (_, until) in self.leases.items() if until <= now]
            held = [self.leases.pop(k)[0] for k in old]
            self.counters["pd_leases_expired"] += len(old)
        for rows in held:
            self.off.lend.unpin(rows)


class PeerReader:
    """The decode rank's side: reads a prefetch's pages from the prefill replica's ranks."""

    def __init__(self, offload, pool, tp):
        self.off, self.tp = offload, tp
        self.actors: dict[str, object] = {}  # rank actor name -> handle
        from kvstore.transfer import Unreleased

        self.stuck = Unreleased()  # READs NIXL could not cancel, with their memory until they end
        self.agents: dict[str, str] = {}  # rank actor name -> its NIXL agent, added as a remote
        if pool.use_mla:
            self.heads, self.head_bytes = 1, []
        else:  # per key (K, V): this rank's kv heads and the bytes of one head's row
            self.heads = pool.k_buffer[0].shape[1]
            self.head_bytes = [pool.k_buffer[0].shape[2] * pool.k_buffer[0].element_size(),
                               pool.v_buffer[0].shape[2] * pool.v_buffer[0].element_size()]
        self.counters = {"pd_pages": 0, "pd_bytes": 0, "pd_transfer_s": 0.0, "pd_failures": 0, "pd_corrupt": 0,
                         "pd_timeouts": 0, "pd_no_rows": 0,
                         "pd_agents_replaced": 0,  # a prefill rank restarted: its old agent removed
                         # READs NIXL could not cancel, and those whose memory came back once they ended
                         "pd_stuck": 0, "pd_stuck_freed": 0,
                         # where the time goes: the prefill rank's answer, the NIXL reads, and the
                         # checksums' time after the last read (the rest runs beside the reads)
                         "pd_locate_s": 0.0, "pd_read_s": 0.0, "pd_verify_s": 0.0,
                         "pd_slow_reads": 0}  # GPU memory read at TCP's pace (workers/handoff_speed.py)
        self.speed = ReadSpeed()

    # ---------------- one prefetch ----------------
    def fetch(self, job, source) -> None:
        """Read job.keys' pages (source.keys on the prefill side) into this rank's hand-off
        rows, publishing each good page to the job; stops at the first page it cannot vouch for."""
        if len(self.stuck):  # READs given up on earlier that have ended since: their memory comes back
            self.counters["pd_stuck_freed"] += self.stuck.reap()
        start = time.monotonic()
        deadline = job.queued_at + source.timeout_s  # the scheduler's clock started when it set it aside
        keys = list(job.keys)
        if job.cancelled or start >= deadline:  # given up (or stale in the queue): read nothing
            return
        if self.off.handoff is None:  # (a replica started with no prefill replica beside it: computes the prompt)
            self.counters["pd_no_rows"] += 1
            return
        self.off.handoff.stream()  # (this thread's CUDA device: NIXL's GPU transfers need a context)
        try:
            if source.layout == "mla" or source.tp_size == self.tp.size:
                self._direct(job, source, 0 if source.layout == "mla" else self.tp.rank, keys, deadline)
            else:
                self._resharded(job, source, keys, deadline)
        except Exception as exc:
            logger.warning("kv peer: reading %d pages from %s failed: %s", len(keys), source.replica, exc)
            if time.monotonic() < deadline:  # (past it: counted as a timeout below)
                self.counters["pd_failures"] += 1
        finally:
            self.counters["pd_transfer_s"] += time.monotonic() - start
            if time.monotonic() >= deadline:
                self.counters["pd_timeouts"] += 1

    def _direct(self, job, source, src_rank: int, keys: list[str], deadline: float) -> None:
        """The source rank's pages are this rank's pages byte for byte: read into the rows."""
        used = sum(self.off.key_bytes)
        lend = self.off.lend
        reply, actor = self._locate(source, src_rank, list(source.keys[: len(keys)]), deadline)
        stuck = False
        try:
            if reply["key_bytes"] != list(self.off.key_bytes):
                raise ValueError(f"page layout {reply['key_bytes']} != this rank's {self.off.key_bytes}")
            same_memory(reply, lend.data)
            n = len(reply["addrs"])
            rows = self.off._take_rows(n, job) if n else []
            n = len(rows)
            if not n:
                return
            dev = dev_of(lend.data)
            local = [(lend.data[r].data_ptr(), used, dev) for r in rows]
            remote = [(a, used, reply.get("dev", 0)) for a in reply["addrs"][:n]]
            try:
                good = self._read(source, reply["agent"], local, remote, deadline, reply["crcs"][:n],
                                  lend.data, rows, used)
            except StuckRead as exc:  # the rows stay taken until the READ ends: a late write lands in rows nobody uses
                stuck = True
                self.counters["pd_stuck"] += 1
                self.stuck.add(self.off.handoff.agent, exc.handles, functools.partial(lend.give, rows))
                raise
            except Exception:
                lend.give(rows)  # (no READ is left in flight: nixl_transfer released it)
                raise
            lend.give(rows[good:])
            self._publish(job, keys[:good], rows[:good])
        finally:
            if not stuck:  # (else the lease expires: the prefill side's rows stay lent until then)
                actor.pd_release.remote(reply["lease"])

    def _resharded(self, job, source, keys: list[str], deadline: float) -> None:
        """MHA across TP sizes: this rank's kv heads from every prefill rank that holds some.
        On a GPU everything here runs on this thread's stream: the scratch a READ lands in comes
        from that stream's memory, idle before the READ (memory the step's stream just freed may
        still be read by its kernels in flight, and a READ is in no stream's order)."""
        if self.heads * self.tp.size % source.tp_size:
            raise ValueError(f"{self.heads * self.tp.size} kv heads do not split over prefill TP {source.tp_size}")
        rows_of = self.off.handoff
        lend, stream = rows_of.tier, rows_of.stream()
        device = lend.data.device
        total = self.heads * self.tp.size
        src_heads = total // source.tp_size
        lo, hi = self.tp.rank * self.heads, (self.tp.rank + 1) * self.heads
        n = len(keys)
        with rows_of.on_stream():
            out = torch.zeros((n, sum(self.off.key_bytes)), dtype=torch.uint8, device=device)
            for p in range(lo // src_heads, (hi - 1) // src_heads + 1):
                reply, actor = self._locate(source, p, list(source.keys[:n]), deadline)
                stuck = False
                try:
                    same_memory(reply, lend.data)
                    n = min(n, len(reply["addrs"]))
                    if not n:
                        return
                    src_bytes = sum(reply["key_bytes"])
                    scratch = torch.empty((n, src_bytes), dtype=torch.uint8, device=device)
                    if stream is not None:
                        stream.synchronize()
                    handle = rows_of.agent.register_memory(scratch)
                    try:
                        local = [(scratch[i].data_ptr(), src_bytes, dev_of(scratch)) for i in range(n)]
                        remote = [(a, src_bytes, reply.get("dev", 0)) for a in reply["addrs"][:n]]
                        n = min(n, self._read(source, reply["agent"], local, remote, deadline, reply["crcs"][:n],
                                              scratch, list(range(n)), src_bytes))
                    except StuckRead as exc:  # kept registered and alive until the READ ends: a late write lands here
                        stuck = True
                        self.counters["pd_stuck"] += 1
                        self.stuck.add(rows_of.agent, exc.handles, functools.partial(_drop, rows_of.agent, handle, scratch))
                        raise
                    finally:
                        if not stuck:
                            rows_of.agent.deregister_memory(handle)
                    # this rank's heads [lo, hi) within prefill rank p's [p * src_heads, ...)
                    a, b = max(lo, p * src_heads), min(hi, (p + 1) * src_heads)
                    src_off = dst_off = 0
                    for kb, sb, hb in zip(self.off.key_bytes, reply["key_bytes"], self.head_bytes):
                        rows = kb // (self.heads * hb)  # layers x P
                        src = scratch[:n, src_off : src_off + sb].view(n, rows, src_heads, hb)
                        dst = out[:n, dst_off : dst_off + kb].view(n, rows, self.heads, hb)
                        dst[:, :, a - lo : b - lo] = src[:, :, a - p * src_heads : b - p * src_heads]
                        src_off, dst_off = src_off + sb, dst_off + kb
                finally:
                    if not stuck:
                        actor.pd_release.remote(reply["lease"])
            rows = self.off._take_rows(n, job) if n else []
            n = len(rows)
            for i, r in enumerate(rows):
                lend.data[r, : out.shape[1]].copy_(out[i])
            if stream is not None:
                stream.synchronize()  # in the rows before they are published
        self._publish(job, keys[:n], rows)

    # ---------------- pieces ----------------
    def _locate(self, source, rank: int, keys: list[str], deadline: float):
        import ray

        name = source.rank_actors[rank]
        actor = self.actors.get(name)
        if actor is None:
            actor = ray.get_actor(name, namespace=source.namespace)
            self.actors[name] = actor
        t0 = time.monotonic()
        left = deadline - t0
        if left <= 0:
            raise TimeoutError("transfer deadline passed before the pages were located")
        try:
            reply = ray.get(actor.pd_locate.remote(keys, source.timeout_s + LEASE_MARGIN_S,
                                                   max(0.0, left - CALL_MARGIN_S)), timeout=left)
        except Exception:
            self.actors.pop(name, None)  # dead or restarted: look it up again next time
            raise
        finally:
            self.counters["pd_locate_s"] += time.monotonic() - t0
        if reply is None:
            raise RuntimeError(f"{name} has no hand-off rows (no NIXL agent, or not a prefill replica's rank)")
        try:
            self._connect(name, reply)
        except Exception:
            actor.pd_release.remote(reply["lease"])
            raise
        return reply, actor

    def _connect(self, name: str, reply: dict) -> None:
        """Know the prefill rank's agent; a new one (the rank restarted) replaces the old."""
        agent = self.off.handoff.agent
        old = self.agents.get(name)
        if old == reply["agent"]:
            return
        if old is not None:
            try:
                agent.remove_remote_agent(old)
            except Exception:
                pass
            self.counters["pd_agents_replaced"] += 1
        agent.add_remote_agent(reply["meta"])
        self.agents[name] = reply["agent"]

    def _read(self, source, remote_agent: str, local, remote, deadline: float, crcs: list[int],
              data: torch.Tensor, rows: list[int], width: int) -> int:
        """READ every page into `data`'s `rows` (their first `width` bytes): in host memory
        READ_CHUNK_PAGES at a time, each chunk's crc32s computed on the checksum threads while
        the next one is read (one READ, then every crc32, took 78 + 37 ms for a 2,048-token 8B
        prompt through an H200's host); in GPU memory in one READ, then the sums on this
        reader's stream. Returns the leading pages whose checksum matches, 0 if a READ failed."""
        from kvstore.transfer import nixl_transfer
        from workers.handoff_rows import results, row_sums

        t0 = time.monotonic()
        rows_of = self.off.handoff
        state, sums, mem = "done", [], mem_of(data)
        chunk = READ_CHUNK_PAGES if mem == "DRAM" else max(1, len(local))
        unreleased: list = []
        with rows_of.on_stream():  # the sums on this thread's stream, read back on it
            try:
                for lo in range(0, len(local), chunk):
                    hi = lo + chunk
                    left = deadline - time.monotonic()
                    state = nixl_transfer(rows_of.agent, "READ", local[lo:hi], remote[lo:hi], remote_agent,
                                          left, mem, unreleased) if left > 0 else "failed"
                    if state != "done":
                        break
                    sums += row_sums(data, rows[lo:hi], width)
            finally:  # the caller gives the rows back (or keeps them, stuck): no checksum still reads them
                t1 = time.monotonic()
                self.counters["pd_read_s"] += t1 - t0
                got = results(sums)  # (waits for the checksums still running)
        self.counters["pd_verify_s"] += time.monotonic() - t1  # what the reads did not hide
        if state == "stuck":
            raise StuckRead(f"a READ from {source.replica} could not be cancelled", unreleased)
        if state != "done":
            if t1 < deadline:  # (past it: a timeout, counted by `fetch`)
                self.counters["pd_failures"] += 1
            return 0
        self.speed.add(source.replica, mem, sum(n for _, n, _ in local), t1 - t0, time.monotonic())
        self.counters["pd_slow_reads"] = self.speed.slow
        good = next((i for i, (a, b) in enumerate(zip(got, crcs)) if a != b), len(crcs))
        if good < len(crcs):
            logger.warning("kv peer: page %d from %s fails its checksum; the rest is computed here",
                           good, source.replica)
            self.counters["pd_corrupt"] += 1
        self.counters["pd_bytes"] += sum(n for _, n, _ in local[:good])
        return good

    def _publish(self, job, keys: list[str], rows: list[int]) -> None:
        self.counters["pd_pages"] += len(rows)
        self.off.leases.forget(rows)
        if rows:
            job.add(self.off.lend.publish(keys, rows, pin=True))
            self.off._note_progress()


def _drop(agent, handle, scratch) -> None:
    """Deregister a stuck READ's scratch once the READ has ended. `scratch` is held by the
    caller's reference until this returns: a failed deregistration raises, and the memory stays
    referenced (and is tried again) rather than reused while still registered."""
    agent.deregister_memory(handle)
