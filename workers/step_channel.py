"""The per-step channel between a replica and its TP ranks: one TCP connection per rank.

Each step the replica sends one message (a `StepPlan` or `OverlapCall`, pickled once) to every
rank, and every rank answers in order: rank 0 with its result, the others with an empty ack.
Why not a Ray compiled graph (which this replaced): its shared-memory channel readers spin, so
an idle rank burned a whole core, and every graph left ~40 POSIX semaphores in /dev/shm. A
blocked `recv` on a socket costs nothing while the replica is idle, and a loopback round trip
is ~0.1 ms (`manta bench overhead`), which is what the compiled graph gave.

Framing: an 8-byte little-endian length, then a pickle (protocol 5) of the object, read back by
an unpickler that rebuilds only the step messages' dataclasses and enums (`_MessageUnpickler`).
Replies: `(True, value)`, or `(False, traceback text)` when the rank's handler raised.
Failure model: a rank that dies closes its socket (the kernel does it for a killed process);
the replica's `recv` watches every rank's socket at once, so it raises `RankFailed` as soon as
any rank is gone, even while rank 0 is blocked in a collective with the dead peer. A rank that
is alive but does not answer (a stopped process, a collective stuck on a wedged peer or GPU)
closes nothing: with `step_timeout_s`, a reply that has not come that long after `recv` began
waiting for it fails the channel the same way, naming the ranks that did not answer.
The handshake carries a random token, so nothing but the group's own ranks can attach.
"""

from __future__ import annotations

import dataclasses
import enum
import hmac
import io
import logging
import os
import pickle
import selectors
import socket
import struct
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

FRAME_LEN = struct.Struct("<Q")
_HELLO = struct.Struct("<32sI")  # token, rank


class RankFailed(RuntimeError):
    """A rank raised, or its connection closed: the group cannot run another step."""


def send_frame(sock: socket.socket, payload: bytes) -> None:
    if len(payload) < 65536:  # one segment: header and body together
        sock.sendall(FRAME_LEN.pack(len(payload)) + payload)
    else:  # no copy of a large body
        sock.sendall(FRAME_LEN.pack(len(payload)))
        sock.sendall(payload)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("the peer closed the connection")
        got += k
    return bytes(buf)


# Where the messages' classes live: only their dataclasses and enums may be rebuilt.
MESSAGE_MODULES = ("workers.messages", "workers.kv_messages", "workers.spec_messages", "workers.sampling_params",
                    "workers.structured_output",
                    "workers.forward_batch")
_BUILTINS = {"set", "frozenset", "complex", "slice"}


def _enum_member(cls: Any, name: Any) -> enum.Enum:
    """What `getattr` may do in a message: early Python 3.11 releases (3.11.2, Debian 12's python3)
    pickle an enum member as `getattr(EnumClass, "NAME")`, later ones by value. Only that: a
    member of an enum this unpickler let through, by name."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls.__members__[name]
    raise pickle.UnpicklingError(f"the step channel does not carry getattr({cls!r}, {name!r})")


class _MessageUnpickler(pickle.Unpickler):
    """Rebuilds the step messages and nothing else: plain data and the dataclasses and enums of
    `modules` (by default `MESSAGE_MODULES`) and of `classes`. Any other global (a function, a class elsewhere:
    what a hostile pickle would call) is refused, so a byte stream can never run code here."""

    def __init__(self, file, modules: tuple[str, ...], classes: frozenset[tuple[str, str]] = frozenset()):
        super().__init__(file)
        self.modules, self.classes = modules, classes

    def find_class(self, module: str, name: str):
        if module == "builtins" and name in _BUILTINS:
            return super().find_class(module, name)
        if module == "builtins" and name == "getattr":
            return _enum_member
        if module in self.modules or (module, name) in self.classes:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        raise pickle.UnpicklingError(f"the step channel does not carry {module}.{name}")


def encode(msg: Any) -> bytes:
    return pickle.dumps(msg, protocol=5)


def decode(payload: bytes, modules: tuple[str, ...] = MESSAGE_MODULES,
           classes: frozenset[tuple[str, str]] = frozenset()) -> Any:
    """`msg` back from `encode(msg)`, where it is built of plain data and the dataclasses and
    enums of `modules`, and those named in `classes` as (module, name) (else
    `pickle.UnpicklingError`)."""
    return _MessageUnpickler(io.BytesIO(payload), modules, classes).load()


def _recv(sock: socket.socket) -> Any:
    (n,) = FRAME_LEN.unpack(recv_exact(sock, FRAME_LEN.size))
    return decode(recv_exact(sock, n))


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class StepChannel:
    """The replica's end. `listen` first, hand `address` and `token` to the ranks, then
    `accept` their connections. `send` a message to every rank; `recv` one reply from every
    rank per message sent (FIFO), returning rank 0's value. `step_timeout_s` (0: none): how long
    `recv` waits for a reply before it counts the ranks that did not answer as hung."""

    def __init__(self, host: str, num_ranks: int, step_timeout_s: float = 0.0):
        self.num_ranks = num_ranks
        self.step_timeout_s = step_timeout_s
        self.token = os.urandom(32)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.bind((host, 0))
        self._listener.listen(num_ranks)
        self.address = (host, self._listener.getsockname()[1])
        self.socks: list[socket.socket | None] = [None] * num_ranks
        self._sel = selectors.DefaultSelector()
        self.failed: str | None = None

    def accept(self, timeout_s: float) -> None:
        """Wait until every rank connected and proved it holds the token."""
        deadline = time.monotonic() + timeout_s
        try:
            while any(s is None for s in self.socks):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [r for r, s in enumerate(self.socks) if s is None]
                    raise RankFailed(f"TP ranks {missing} did not connect to the step channel in {timeout_s:.0f}s")
                self._listener.settimeout(left)
                conn, _ = self._listener.accept()
                conn.settimeout(max(1.0, left))
                try:
                    token, rank = _HELLO.unpack(recv_exact(conn, _HELLO.size))
                except (OSError, ConnectionError, struct.error):
                    conn.close()
                    continue
                if not hmac.compare_digest(token, self.token) or not 0 <= rank < self.num_ranks \
                        or self.socks[rank] is not None:
                    conn.close()  # not one of ours
                    continue
                conn.settimeout(None)
                _tune(conn)
                self.socks[rank] = conn
                self._sel.register(conn, selectors.EVENT_READ, rank)
        finally:
            self._listener.close()

    def send(self, msg: Any) -> None:
        if self.failed:
            raise RankFailed(self.failed)
        payload = encode(msg)
        for rank, sock in enumerate(self.socks):
            try:
                assert sock is not None
                send_frame(sock, payload)
            except OSError as exc:
                self._fail(f"TP rank {rank}'s step channel closed: {exc}")

    def recv(self) -> Any:
        """One reply from every rank (for the oldest message without replies); rank 0's value.
        Raises RankFailed the moment any rank's reply is an error or its socket closes."""
        if self.failed:
            raise RankFailed(self.failed)
        waiting = set(range(self.num_ranks))
        value = None
        deadline = time.monotonic() + self.step_timeout_s if self.step_timeout_s > 0 else None
        while waiting:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self._fail(f"TP rank{'s' if len(waiting) > 1 else ''} {', '.join(map(str, sorted(waiting)))} "
                           f"did not answer a step within {self.step_timeout_s:.0f} s (hung)")
            for key, _ in self._sel.select(left):
                rank = key.data
                if rank not in waiting:
                    continue  # already answered this message; its next reply waits
                try:
                    ok, payload = _recv(key.fileobj)
                except (OSError, ConnectionError, EOFError, pickle.UnpicklingError) as exc:
                    self._fail(f"TP rank {rank} is gone ({type(exc).__name__}: {exc})")
                if not ok:
                    self._fail(f"TP rank {rank} failed:\n{payload}")
                if rank == 0:
                    value = payload
                waiting.discard(rank)
        return value

    def _fail(self, why: str) -> None:
        self.failed = self.failed or why
        raise RankFailed(self.failed)

    def close(self) -> None:
        """Close every connection: each rank's serving loop ends at its next read."""
        for sock in self.socks:
            if sock is not None:
                try:
                    self._sel.unregister(sock)
                except (KeyError, ValueError):
                    pass
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
        self.socks = [None] * self.num_ranks
        self._sel.close()


def serve_rank(address: tuple[str, int], token: bytes, rank: int, handler: Callable[[Any], Any],
               stop: threading.Event) -> threading.Thread:
    """A rank's end: connect, then answer every message with `handler(msg)` on a daemon thread
    until the replica closes the channel (or `stop` is set). Rank 0 sends the handler's value,
    the others an empty ack (the value is the same on every rank)."""
    sock = socket.create_connection(address, timeout=60)
    sock.settimeout(None)
    _tune(sock)
    sock.sendall(_HELLO.pack(token, rank))

    def loop() -> None:
        try:
            while not stop.is_set():
                try:
                    msg = _recv(sock)
                except (OSError, ConnectionError, EOFError):
                    return  # the replica closed the channel (shutdown) or died
                try:
                    value = handler(msg)
                    reply = (True, value if rank == 0 else None)
                except Exception:
                    logger.exception("TP rank %d: step failed", rank)
                    reply = (False, traceback.format_exc())
                try:
                    send_frame(sock, encode(reply))
                except OSError:
                    return
        finally:
            sock.close()

    thread = threading.Thread(target=loop, name=f"step-channel-r{rank}", daemon=True)
    thread.start()
    return thread
