"""A replica's serving path: the server's end (`ReplicaClient`) over the replica's real channel
(`cluster/replica_channel.py`), with a scripted engine behind it."""

from __future__ import annotations

import asyncio
import socket

import pytest

from cluster.engine.request import RequestOutput
from cluster.replica_client import ReplicaClient, RequestStream
from tests.scripted_replica import ScriptedReplica
from workers.step_channel import FRAME_LEN, encode


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
        # and a second step of a and c behind them (a frame that carries two steps).
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


def test_a_burst_goes_in_few_frames_and_a_lone_request_leaves_in_its_own_turn():
    from cluster.engine.request import ADMITTED
    from workers.sampling_params import SamplingParams

    async def run() -> None:
        replica = ScriptedReplica()
        client = ReplicaClient("r", actor=replica)
        try:
            warm = client.open("warm", [1], SamplingParams())  # connects, then sends
            assert await replica.frame() == (["warm"], [])
            replica.answers.put([None])
            assert await anext(warm) is ADMITTED
            sent = client.submit_calls
            running = [client.open(f"old-{i}", [1, 2], SamplingParams()) for i in range(50)]
            # The line was idle: the first admission left inside open(), without a turn of the
            # loop; the others wait for its answer and go together in the next frame.
            assert client.submit_calls == sent + 1
            assert await replica.frame() == (["old-0"], [])
            replica.answers.put([None])
            rids, _ = await replica.frame()
            assert rids == [f"old-{i}" for i in range(1, 50)]
            replica.answers.put([None] * 49)
            assert [await anext(s) for s in running] == [ADMITTED] * 50
            # One step's outputs for all 51 go in one frame.
            before = client.output_messages
            replica.outboxes.put([_out(s.rid, 0) for s in [warm, *running]])
            assert [(await anext(s)).delta_token_ids for s in running] == [[0]] * 50
            assert client.output_messages == before + 1
        finally:
            await client.aclose()
            replica.close()

    asyncio.run(run())


def test_the_first_token_is_handed_on_in_the_turn_that_brings_it():
    from cluster.engine.client import FanOut
    from cluster.engine.request import ADMITTED

    async def run() -> None:
        client = ReplicaClient("r", actor=None)
        running = [RequestStream(client, f"old-{i}") for i in range(50)]
        new = RequestStream(client, "new")
        client.streams.update({s.rid: s for s in [*running, new]})
        client._deliver([_out(s.rid, 0) for s in running])  # the 50 are running
        new.queue.put_nowait(ADMITTED)
        assert await anext(new) is ADMITTED  # queued: a response may start before any token
        fan = FanOut([(ADMITTED, 0.0)], [new], lambda out, timing, i: None, 0.0, lambda out, ttft: None)
        got: list[int] = []

        async def consume() -> None:
            async for _, out in fan.outputs():
                got.extend(out.delta_token_ids)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0)
        # One step's frame: 50 running streams' next tokens and the new request's first.
        client._deliver([_out(s.rid, 1) for s in running] + [_out("new", 7)])
        await asyncio.sleep(0)
        assert got == [7]  # in the first turn after the frame, not behind the 50 others' turn
        client._deliver([_out("new", 8, finished=True)])
        await asyncio.wait_for(task, 1.0)
        assert got == [7, 8]

    asyncio.run(run())


def test_a_restarted_choice_drops_what_it_had_even_when_it_came_in_one_frame():
    """Two choices collected together; the first's replica failed it right after two tokens,
    which arrive with the restart in one burst (one frame). What it had before the restart is
    dropped, however far the merge lags the streams; the other choice is untouched."""
    from cluster.engine.client import FanOut
    from cluster.engine.request import ADMITTED, RESTARTED

    async def failed_then_again():
        yield _out("c0", 1)
        yield _out("c0", 2)
        yield RESTARTED  # (no pause: the burst of one frame)
        yield _out("c0", 5)
        yield _out("c0", 6, finished=True)

    async def whole():
        for t in (3, 4):
            yield _out("c1", t)
        yield _out("c1", 9, finished=True)

    async def run():
        fan = FanOut([(ADMITTED, 0.0), (ADMITTED, 0.0)], [failed_then_again(), whole()],
                     lambda out, timing, i: None, 0.0, lambda out, ttft: None, n=2)
        return await fan.collect()

    first, second = asyncio.run(run())
    assert first.token_ids == [5, 6] and first.finish_reason == "length"
    assert second.token_ids == [3, 4, 9]


def test_a_refused_admission_is_the_streams_only_output_and_a_lost_replica_ends_the_streams():
    from cluster.engine.request import ADMITTED
    from cluster.replica_client import ReplicaGone
    from workers.sampling_params import SamplingParams

    async def run() -> None:
        replica = ScriptedReplica()
        client = ReplicaClient("r", actor=replica)
        try:
            refused = client.open("a", [1], SamplingParams())
            await replica.frame()
            replica.answers.put([RequestOutput("a", finished=True, finish_reason="error",
                                               error_type="queue_full", error="full")])
            out = await anext(refused)
            assert out.error_type == "queue_full" and "a" not in client.streams
            lost = client.open("b", [1], SamplingParams())
            await replica.frame()
            replica.answers.put([None])
            assert await anext(lost) is ADMITTED
            replica.close()  # the replica is gone: its connections close
            with pytest.raises(ReplicaGone):
                await asyncio.wait_for(anext(lost), 5)
            assert not client.streams
            # The next request connects again, and fails at once: nothing listens.
            again = client.open("c", [1], SamplingParams())
            with pytest.raises(ReplicaGone):
                await asyncio.wait_for(anext(again), 5)
        finally:
            await client.aclose()

    asyncio.run(run())


def test_a_router_that_goes_away_has_its_requests_aborted_on_the_replica():
    from workers.sampling_params import SamplingParams

    async def run() -> list[str]:
        replica = ScriptedReplica()
        client = ReplicaClient("r", actor=replica)
        try:
            client.open("x", [1], SamplingParams())
            await replica.frame()
            replica.answers.put([None])
            client.open("y", [1], SamplingParams())
            await replica.frame()
            replica.answers.put([None])
            await asyncio.sleep(0.05)
            client._conn.transport.abort()  # the server process died: no abort frame was sent
            for _ in range(100):
                if len(replica.aborted) == 2:
                    break
                await asyncio.sleep(0.02)
            assert replica.outboxes.clients() == 0
            return sorted(replica.aborted)
        finally:
            await client.aclose()
            replica.close()

    assert asyncio.run(run()) == ["x", "y"]


def test_the_serving_channel_drops_a_connection_without_the_token_unread():
    replica = ScriptedReplica()
    try:
        with socket.create_connection(replica.listener.address, timeout=5) as sock:
            evil = encode((["not", "admissions"], []))
            sock.sendall(b"\0" * 32 + FRAME_LEN.pack(len(evil)) + evil)
            try:
                got = sock.recv(1)
            except ConnectionResetError:  # closed with the frame unread: a reset
                got = b""
            assert got == b""  # closed by the replica
        assert replica.frames.empty() and replica.outboxes.clients() == 0
    finally:
        replica.close()


def test_an_unanswered_admission_ends_the_connection_and_a_closed_client_ends_its_streams():
    from cluster.engine.request import ADMITTED
    from cluster.replica_client import ReplicaGone
    from workers.sampling_params import SamplingParams

    async def run() -> None:
        replica = ScriptedReplica()
        client = ReplicaClient("r", actor=replica, answer_timeout_s=0.3)
        try:
            # A replica that stops answering without closing the connection (hung, not dead).
            stuck = client.open("a", [1], SamplingParams())
            await replica.frame()
            with pytest.raises(ReplicaGone, match="did not answer"):
                await asyncio.wait_for(anext(stuck), 5)
            replica.answers.put([None])  # the late answer goes nowhere: that connection is gone
            # The client connects again; closing it ends the streams it still had.
            live = client.open("b", [1], SamplingParams())
            await replica.frame()
            replica.answers.put([None])
            assert await anext(live) is ADMITTED
            await client.aclose()
            with pytest.raises(ReplicaGone, match="closed"):
                await asyncio.wait_for(anext(live), 5)
            for _ in range(100):  # the replica aborts what the closed connection owned
                if "b" in replica.aborted:
                    break
                await asyncio.sleep(0.02)
            assert "b" in replica.aborted
            again = client.open("c", [1], SamplingParams())  # and it serves again after a close
            await replica.frame()
            replica.answers.put([None])
            assert await asyncio.wait_for(anext(again), 5) is ADMITTED
        finally:
            await client.aclose()
            replica.close()

    asyncio.run(run())
