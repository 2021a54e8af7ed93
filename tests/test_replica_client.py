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
        client._deliver([_out("a", 0), _out("b", 0)])  # a and b have started
        await asyncio.sleep(0)
        woken.clear()
        # One step's reply: the running a and b, then the new c and d (d's first output ends it),
        # and a second step of a and c behind them (a poll that lagged a step).
        streams["c"].submitted_wall = 1.0
        reply = [_out("a", 1), _out("b", 1), _out("c", 0), _out("d", 0, finished=True),
                 _out("a", 2), _out("c", 1), _out("gone", 0)]
        client._deliver(reply)
        # A stream's first output carries when its admission left and when this reply came.
        assert reply[2].submitted_wall == 1.0 and reply[2].received_wall is not None
        assert reply[3].received_wall == reply[2].received_wall and reply[3].submitted_wall is None
        assert all(out.received_wall is None for out in (reply[0], reply[1], reply[4], reply[5]))
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
