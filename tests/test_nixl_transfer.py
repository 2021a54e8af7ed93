"""One NIXL transfer between two real agents in this process (`kvstore.transfer`): a READ whose
peer stops answering and that the backend could not cancel is held, with the memory it may still
write, until it ends; then that memory is given back once."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from kvstore.transfer import Unreleased, make_agent, nixl_transfer

PAGE = 1 << 20


def _pair(nbytes: int):
    """A reader agent and a source agent (neither progressed by a thread of its own), each with
    `nbytes` registered: the source's random, the reader's zeros."""
    tag = uuid.uuid4().hex[:8]
    reader, source = make_agent(f"reader-{tag}"), make_agent(f"source-{tag}")
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    dst = torch.zeros_like(src)
    reader.register_memory(dst)
    source.register_memory(src)
    name = reader.add_remote_agent(source.get_agent_metadata())
    name = name.decode() if isinstance(name, bytes) else name
    n = nbytes // PAGE
    local = [(dst.data_ptr() + i * PAGE, PAGE, 0) for i in range(n)]
    remote = [(src.data_ptr() + i * PAGE, PAGE, 0) for i in range(n)]
    return reader, source, name, src, dst, local, remote


def _refuse_first_release(agent) -> list:
    """The backend refuses to cancel `agent`'s next transfer (NIXL cancels it on this loopback; a
    wedged network path is where it cannot): its handle's first release fails. Returns the list
    the refused handle goes into."""
    real_release, refused = agent.release_xfer_handle, []

    def refuse_once(handle):
        if not refused:
            refused.append(handle)
            raise RuntimeError("injected: the backend cannot cancel this transfer")
        return real_release(handle)

    agent.release_xfer_handle = refuse_once
    return refused


def _wedged_store(client, seed: int):
    """An agent standing for the store's, added to `client` as its store, with 4 random pages
    registered; wedged: nothing progresses it until the test calls its `get_new_notifs`."""
    peer = make_agent(f"store-{uuid.uuid4().hex[:8]}")
    src = torch.randint(0, 256, (4 * PAGE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    peer.register_memory(src)
    name = client.agent.add_remote_agent(peer.get_agent_metadata())
    client._store_agent = name.decode() if isinstance(name, bytes) else name
    return peer, src


def test_a_read_that_cannot_be_cancelled_keeps_its_memory_until_it_ends():
    reader, source, name, src, dst, local, remote = _pair(64 * PAGE)
    refused = _refuse_first_release(reader)
    unreleased: list = []
    # Nothing progresses the source's worker: the READ is still in progress at its deadline.
    state = nixl_transfer(reader, "READ", local, remote, name, 0.2, unreleased=unreleased)
    if state == "done":
        pytest.skip("this machine's UCX transport completed the READ without the source's progress")
    assert state == "stuck" and unreleased == refused and len(unreleased) == 1

    freed, attempts = [], []

    def give_back():  # the first attempt fails (its owner's bookkeeping raised): it is tried again
        attempts.append(dst)
        if len(attempts) == 1:
            raise RuntimeError("injected: giving the memory back failed")
        freed.append(dst)

    held = Unreleased()
    held.add(reader, unreleased, give_back)
    assert held.reap() == 0 and not attempts and len(held) == 1  # in progress: its memory stays out of use

    deadline = time.monotonic() + 30
    while not attempts and time.monotonic() < deadline:
        held.reap()
        source.get_new_notifs()  # the source answers again: the READ ends, late
    assert attempts == [dst] and not freed and len(held) == 1 and held.freed == 0
    assert torch.equal(dst, src)  # its bytes landed in the memory that was held for them
    assert held.reap() == 1 and freed == [dst] and len(held) == 0 and held.freed == 1  # (the handle not touched again)
    assert held.reap() == 0 and freed == [dst]  # given back once


def test_a_read_the_backend_cancels_is_not_held():
    """The usual timeout: NIXL cancels the READ at its deadline, so nothing is held."""
    reader, _source, name, _src, _dst, local, remote = _pair(16 * PAGE)
    unreleased: list = []
    state = nixl_transfer(reader, "READ", local, remote, name, 0.2, unreleased=unreleased)
    if state == "done":
        pytest.skip("this machine's UCX transport completed the READ without the source's progress")
    assert state == "failed" and unreleased == []
    # A stuck transfer whose handle is not known is held for good: nothing says it has ended.
    held, freed = Unreleased(), []
    held.add(reader, [], lambda: freed.append(1))
    assert held.reap() == 0 and held.reap() == 0 and not freed and len(held) == 1


def test_stuck_reads_show_as_a_failure_kind_and_the_memory_still_held():
    """A decode replica's ranks report `pd_stuck` / `pd_stuck_freed` (workers/kv_peer.py): the
    metrics show every stuck READ as a transfer failure of kind "stuck", and the ones whose
    memory is still held as a gauge that falls when they end."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from cluster.api.kvstore_metrics import KVStoreCollector

    collector = KVStoreCollector()
    registry = CollectorRegistry()
    registry.register(collector)

    def samples():
        text = generate_latest(registry).decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    ranks = [{"pd_stuck": 2, "pd_stuck_freed": 1, "pd_failures": 1}, {"pd_stuck": 1, "pd_stuck_freed": 0}]
    collector.set("decode-0", {"ranks": ranks})
    got = samples()
    assert got[("manta:pd_transfer_failures_total", (("kind", "stuck"), ("replica", "decode-0")))] == 3
    assert got[("manta:pd_transfer_failures_total", (("kind", "failed"), ("replica", "decode-0")))] == 1
    assert got[("manta:pd_stuck_reads", (("replica", "decode-0"),))] == 2
    ranks[0]["pd_stuck_freed"], ranks[1]["pd_stuck_freed"] = 2, 1  # both ended since: their memory came back
    collector.set("decode-0", {"ranks": ranks})
    got = samples()
    assert got[("manta:pd_stuck_reads", (("replica", "decode-0"),))] == 0
    assert got[("manta:pd_transfer_failures_total", (("kind", "stuck"), ("replica", "decode-0")))] == 3


def test_a_store_client_transfer_that_cannot_be_cancelled_retires_its_staging_area():
    """The KV store client (`kvstore.client`) READs into its staging area; when NIXL cannot
    cancel a READ whose peer stopped answering, that area leaves the pool until the READ ends
    (late bytes must not land after a later call checksummed it), the call goes on in a new
    one, and no later call waits for it."""
    from kvstore.client import KVStoreClient
    from kvstore.staging import serialized

    client = KVStoreClient(None, "mha", 0, 1, page_bytes=PAGE, fingerprint="test", staging_pages=4,
                           timeout_s=0.2, staging_slots=1)
    try:
        peer, src = _wedged_store(client, seed=9)
        refused = _refuse_first_release(client.agent)

        @serialized
        def read_staged(self):
            before = self.staging
            local = [(before.data_ptr() + i * PAGE, PAGE, 0) for i in range(4)]
            remote = [(src.data_ptr() + i * PAGE, PAGE, 0) for i in range(4)]
            return before, self._xfer("READ", local, remote, staged=True), self.staging

        @serialized
        def area(self):
            return self.staging

        old, ok, now = read_staged(client)
        if ok:
            pytest.skip("this machine's UCX transport completed the READ without the peer's progress")
        assert refused and client.counters.stuck_transfers == 1 and client.counters.errors == 1
        assert now.data_ptr() != old.data_ptr()  # the call went on in a new area
        assert area(client).data_ptr() == now.data_ptr()  # the next call did not wait: the new area
        assert len(client._unreleased) == 1  # the READ is still in progress: the old area is held
        deadline = time.monotonic() + 30
        while len(client._unreleased) and time.monotonic() < deadline:
            peer.get_new_notifs()  # the peer answers again: the READ ends, late
            area(client)  # (each call checks the held areas first)
        assert not len(client._unreleased) and client._free.qsize() == 2  # the old area is back, beside the new
        assert torch.equal(old, src)  # the late bytes landed in the area that was held for them
    finally:
        client.close()


def test_a_stuck_read_into_host_rows_holds_them_until_it_ends():
    """`read_rows` reads straight into a rank's host-tier rows: a READ NIXL cannot cancel leaves
    them to the caller, told by `stuck_read`, which hands the client what gives them back
    (`hold`, as workers/kv_offload_io.py and workers/host_warm.py do); that runs once the READ has
    ended, checked before the next data-path call."""
    from kvstore.client import KVStoreClient
    from kvstore.staging import serialized

    client = KVStoreClient(None, "mha", 0, 1, page_bytes=PAGE, fingerprint="test", staging_pages=1,
                           timeout_s=0.2, staging_slots=1)
    try:
        rows = torch.zeros(4, PAGE, dtype=torch.uint8)
        assert client.register_rows(rows)
        peer, src = _wedged_store(client, seed=3)
        refused = _refuse_first_release(client.agent)

        @serialized
        def read_into_rows(self):  # what read_rows does once the store located the pages
            self._tls.stuck = None
            local = [(rows[i].data_ptr(), PAGE, 0) for i in range(4)]
            remote = [(src.data_ptr() + i * PAGE, PAGE, 0) for i in range(4)]
            return self._xfer("READ", local, remote)

        @serialized
        def nothing(self):
            return None

        if read_into_rows(client):
            pytest.skip("this machine's UCX transport completed the READ without the peer's progress")
        handles = client.stuck_read()
        assert handles == refused and client.stuck_read() is None  # (told once)
        given: list = []
        client.hold(handles, lambda: given.append(True))
        nothing(client)
        assert not given  # still in progress: the rows stay out of use
        deadline = time.monotonic() + 30
        while not given and time.monotonic() < deadline:
            peer.get_new_notifs()
            nothing(client)
        assert given == [True] and torch.equal(rows.view(-1), src)
        nothing(client)
        assert given == [True]
    finally:
        client.close()
