"""`until_disconnect`: a non-streaming answer (and a request's admission) runs in the handler's own
task, and ends early with ClientGone when the client leaves, or ServerShuttingDown at the
shutdown deadline; a cancel from outside stays a cancel."""

from __future__ import annotations

import asyncio
import time

import pytest
from starlette.requests import Request

from cluster.api.shutdown import ServerShuttingDown, ShutdownGate
from cluster.api.sse import ClientGone, until_disconnect


def _request(disconnect: asyncio.Event) -> Request:
    async def receive() -> dict:
        await disconnect.wait()
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


async def _work(log: list[str], seconds: float) -> str:
    log.append(f"ran in {asyncio.current_task().get_name()}")
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        log.append("cancelled")
        raise
    return "answer"


def test_work_runs_in_the_callers_task_and_its_answer_comes_back():
    async def run() -> tuple[str, list[str], int]:
        log: list[str] = []
        asyncio.current_task().set_name("handler")
        before = len(asyncio.all_tasks())
        out = await until_disconnect(_request(asyncio.Event()), _work(log, 0.01), ShutdownGate())
        return out, log, len(asyncio.all_tasks()) - before

    out, log, left = asyncio.run(run())
    assert out == "answer" and log == ["ran in handler"]
    assert left == 0  # the watchers are gone with it


@pytest.mark.parametrize("why", ["client", "shutdown"])
def test_a_client_that_leaves_or_the_shutdown_deadline_cancels_the_work(why):
    async def run() -> tuple[type, list[str]]:
        log: list[str] = []
        gone, gate = asyncio.Event(), ShutdownGate()
        if why == "client":
            asyncio.get_running_loop().call_later(0.05, gone.set)
        else:
            gate.begin(0.05)  # the deadline comes 50 ms from now
        try:
            await until_disconnect(_request(gone), _work(log, 10), gate)
        except (ClientGone, ServerShuttingDown) as exc:
            # The task is not left cancelling: it can go on awaiting (to answer, to clean up).
            await asyncio.sleep(0)
            return type(exc), log
        raise AssertionError("until_disconnect returned")

    kind, log = asyncio.run(run())
    assert kind is (ClientGone if why == "client" else ServerShuttingDown)
    assert log[1:] == ["cancelled"]


def test_a_cancel_from_outside_is_not_turned_into_client_gone():
    async def run() -> list[str]:
        log: list[str] = []
        task = asyncio.ensure_future(until_disconnect(_request(asyncio.Event()), _work(log, 10), ShutdownGate()))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return log

    assert asyncio.run(run())[1:] == ["cancelled"]


def test_a_second_signal_brings_the_deadline_forward():
    """`end_now` (the second signal) ends what is in flight at once, however far the deadline
    was: the work is cancelled as at the deadline and `drained` returns; before any `begin` it
    starts the shutdown with a deadline of now; twice is the same as once."""

    async def run(first: float | None):
        log: list[str] = []
        gate = ShutdownGate()
        task = asyncio.ensure_future(until_disconnect(_request(asyncio.Event()), _work(log, 30), gate))
        await asyncio.sleep(0.05)
        if first is not None:
            gate.begin(first)
        t0 = time.monotonic()
        gate.end_now()
        gate.end_now()
        with pytest.raises(ServerShuttingDown):
            await task
        await asyncio.wait_for(gate.drained(), 5)
        return time.monotonic() - t0, gate.closing, log

    for first in (60.0, None):
        took, closing, log = asyncio.run(run(first))
        assert closing and log[-1] == "cancelled", log
        assert took < 2.0, took  # not the 60 s deadline (drained() allows the streams 1.5 s past it)
