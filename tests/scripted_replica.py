"""A replica's real serving channel (`cluster.replica_channel`: `ServingListener`, `Outboxes`) in
front of a scripted engine, for the server-side tests of the serving path without Ray or a model.
`serving_channel.remote()` is what a Ray actor handle gives the client: the address and token, as
an awaitable."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Callable

from cluster.replica_channel import Outboxes, ServingListener


class ScriptedReplica:
    """Each admission frame is recorded (`frames`, `frame()`; a frame of aborts alone is applied
    and answered at once), then answered by `answer(rids)`
    (a list of replies, one per admission) or, without one, by the next list the test puts on
    `answers`. The replica owns every admission it answered None, so the test can `outboxes.put`
    their outputs; `emit(rids)`, if given, makes the outputs of those admissions at once (as the
    engine's next step would)."""

    def __init__(self, answer: Callable[[list[str]], list] | None = None,
                 emit: Callable[[list[str]], list] | None = None):
        self.outboxes = Outboxes("r")
        self.frames: queue.Queue = queue.Queue()  # (rids, aborts) of each frame, as it came
        self.answers: queue.Queue = queue.Queue()
        self.aborted: list[str] = []
        self.admitted = 0
        self._answer, self._emit = answer, emit
        self.listener = ServingListener("127.0.0.1", self.outboxes, self._submit, self.aborted.append)
        self.serving_channel = self

    def remote(self):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result((*self.listener.address, self.listener.token))
        return fut

    def _submit(self, client: str, admissions: list, aborts: list[str]) -> list:
        rids = [a.rid for a in admissions]
        for rid in aborts:  # as `Replica.submit`: the engine aborts it
            self.outboxes.disown(rid)
            self.aborted.append(rid)
        if not rids:
            return []
        self.frames.put((rids, aborts))
        replies = self._answer(rids) if self._answer is not None else self.answers.get(timeout=10)
        queued = [rid for rid, reply in zip(rids, replies) if reply is None]
        for rid in queued:
            self.outboxes.own(rid, client)
        self.admitted += len(queued)
        if self._emit is not None and queued:
            self.outboxes.put(self._emit(queued))
        return replies

    async def frame(self) -> tuple[list[str], list[str]]:
        return await asyncio.to_thread(self.frames.get, timeout=10)

    def close(self) -> None:
        self.listener.close()
