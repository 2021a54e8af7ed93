"""The server's end of a replica's serving path: how one `poll` reply reaches the streams."""

from __future__ import annotations

import asyncio

from cluster.engine.request import RequestOutput
from cluster.replica_client import ReplicaClient, RequestStream


def _out(rid: str, token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, delta_token_ids=[token], finished=finished, finish_reason="length" if finished else None)


def test_a_reply_wakes_new_requests_first_and_keeps_each_streams_order():
    async def run() -> tuple[list[tuple[str, int]], dict]:
        client = ReplicaClient("r", actor=None)
        woken: list[tuple[str, int]] = []

        async def consume(stream: RequestStream) -> None:
            async for out in stream:
                woken.append((out.rid, out.delta_token_ids[0]))

        streams = {rid: RequestStream(client, rid) for rid in ("a", "b", "c", "d")}
        client.streams.update(streams)
        tasks = [asyncio.create_task(consume(s)) for s in streams.values()]
        await asyncio.sleep(0)
        await client._deliver([_out("a", 0), _out("b", 0)])  # a and b have started
        await asyncio.sleep(0)
        woken.clear()
        # One step's reply: the running a and b, then the new c and d (d's first output ends it),
        # and a second step of a and c behind them (a poll that lagged a step).
        await client._deliver([_out("a", 1), _out("b", 1), _out("c", 0), _out("d", 0, finished=True),
                         _out("a", 2), _out("c", 1), _out("gone", 0)])
        for _ in range(4):
            await asyncio.sleep(0)
        left = dict(client.streams)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return woken, left

    woken, left = asyncio.run(run())
    firsts = max(woken.index(("c", 0)), woken.index(("d", 0)))
    assert all(rid not in "ab" for rid, _ in woken[:firsts + 1]), woken  # first tokens before running streams'
    for rid in "abc":
        assert [t for r, t in woken if r == rid] == sorted(t for r, t in woken if r == rid)
    assert sorted(woken) == [("a", 1), ("a", 2), ("b", 1), ("c", 0), ("c", 1), ("d", 0)]
    assert set(left) == {"a", "b", "c"}  # d finished; "gone" was never open


def test_a_large_reply_lets_the_loop_run_between_slices():
    """A reply for many streams is handed over a slice at a time: other work on the event loop
    (a new request's read) runs between slices, not after every stream of the step."""
    from cluster.replica_client import DELIVER_SLICE

    async def run() -> list[int]:
        client = ReplicaClient("r", actor=None)
        n = 4 * DELIVER_SLICE + 5
        for i in range(n):
            client.streams[f"s{i}"] = RequestStream(client, f"s{i}")
        handed: list[int] = []  # streams with an output queued, each time the other task ran

        async def other_work() -> None:
            for _ in range(n):
                handed.append(sum(not s.queue.empty() for s in client.streams.values()))
                await asyncio.sleep(0)

        other = asyncio.create_task(other_work())
        await asyncio.sleep(0)
        await client._deliver([_out(f"s{i}", 0) for i in range(n)])
        other.cancel()
        return handed

    handed = asyncio.run(run())
    assert DELIVER_SLICE in handed and 2 * DELIVER_SLICE in handed, handed  # it ran after each slice
