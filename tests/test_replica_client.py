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


class _Method:
    """One method of a stand-in replica actor: `.remote(...)` records the call and returns the
    future its reply will come on, as a Ray actor handle returns an awaitable ref."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.replies: list[asyncio.Future] = []

    def remote(self, *args):
        self.calls.append(args)
        self.replies.append(asyncio.get_running_loop().create_future())
        return self.replies[-1]


class _Actor:
    def __init__(self):
        self.submit, self.poll = _Method(), _Method()


def test_a_request_leaves_at_once_and_its_first_token_is_handed_on_in_the_turn_that_brings_it():
    from cluster.engine.client import FanOut
    from cluster.engine.request import ADMITTED
    from workers.sampling_params import SamplingParams

    async def run() -> None:
        actor = _Actor()
        client = ReplicaClient("r", actor=actor)
        running = [client.open(f"old-{i}", [1, 2], SamplingParams()) for i in range(50)]
        # The line was idle: the first admission left inside open(), without a turn of the loop;
        # the others wait for its reply and go together in the next call.
        assert len(actor.submit.calls) == 1 and [a.rid for a in actor.submit.calls[0][1]] == ["old-0"]
        actor.submit.replies[0].set_result([None])
        await asyncio.sleep(0)
        assert len(actor.submit.calls) == 2 and len(actor.submit.calls[1][1]) == 49
        actor.submit.replies[1].set_result([None] * 49)
        await asyncio.sleep(0)
        assert [await anext(s) for s in running] == [ADMITTED] * 50
        client._deliver([_out(s.rid, 0) for s in running])  # the 50 are running

        new = client.open("new", [1, 2, 3], SamplingParams())
        actor.submit.replies[2].set_result([None])
        assert await anext(new) is ADMITTED  # queued: a response may start before any token
        fan = FanOut([(ADMITTED, 0.0)], [new], lambda out, timing: None, 0.0, lambda out, ttft: None)
        got: list[int] = []

        async def consume() -> None:
            async for _, out in fan.outputs():
                got.extend(out.delta_token_ids)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0)
        # One step's reply: 50 running streams' next tokens and the new request's first.
        client._deliver([_out(s.rid, 1) for s in running] + [_out("new", 7)])
        await asyncio.sleep(0)
        assert got == [7]  # in the first turn after the reply, not behind the 50 others' turn
        client._deliver([_out("new", 8, finished=True)])
        await asyncio.wait_for(task, 1.0)
        assert got == [7, 8]

    asyncio.run(run())


def test_a_refused_admission_is_the_streams_only_output_and_a_failed_call_ends_the_stream():
    from workers.sampling_params import SamplingParams

    async def run() -> None:
        actor = _Actor()
        client = ReplicaClient("r", actor=actor)
        refused = client.open("a", [1], SamplingParams())
        actor.submit.replies[0].set_result([RequestOutput("a", finished=True, finish_reason="error",
                                                          error_type="queue_full", error="full")])
        out = await anext(refused)
        assert out.error_type == "queue_full" and "a" not in client.streams
        lost = client.open("b", [1], SamplingParams())
        actor.submit.replies[1].set_exception(ConnectionError("replica unreachable"))
        try:
            await anext(lost)
        except Exception as exc:  # ReplicaGone: the router retries elsewhere
            assert "replica unreachable" in str(exc)
        else:
            raise AssertionError("a failed submit must end the stream")
        assert not client.streams

    asyncio.run(run())
