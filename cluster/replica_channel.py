"""The replica's end of the serving path: one TCP connection per HTTP server (router), no Ray
call per message (the server's end: `cluster/replica_client.py`).

On a connection, after the server's 32-byte token, each way carries frames (`workers.step_channel`
framing: an 8-byte length, then a pickle):
- server -> replica: `(admissions, aborts)`, one frame per batch the server gathered; each is
  answered in order with `("submitted", replies)`: None for a queued admission, else its error
  as a finished `RequestOutput`;
- replica -> server: `("outputs", outs)`, every output of the engine steps that completed since
  the last such frame (`Outboxes`), sent by one writer thread per connection as soon as a step's
  outputs are handed over, so at most one frame per step, whatever the number of requests.

Why not Ray calls (`submit` / long `poll`, which this replaced): on an H200 at 200 running
requests a Ray round trip put ~4 ms on each of a request's two hops (object refs, the
deserialization thread, the core worker's queues); a frame on a socket costs a `send` and a
`recv`. The address and token come from the actor through Ray (`Replica.serving_channel`), so
only a router that can call the actor can attach, and nothing is unpickled before the token
matched. A connection that closes is a router gone: its requests are aborted at once (their KV
pages freed). A replica that dies closes the connection (the kernel does it for a killed
process); keepalive probes and TCP_USER_TIMEOUT end one whose node is unreachable (`keepalive`).
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from itertools import count

from cluster.engine.request import RequestOutput
from workers.step_channel import FRAME_LEN, MESSAGE_MODULES, decode, encode, recv_exact, send_frame

logger = logging.getLogger(__name__)

TOKEN_BYTES = 32
_HELLO_TIMEOUT_S = 10.0  # a connection that does not prove itself in this long is dropped
# What the frames may rebuild (`workers.step_channel.decode`): the step messages' dataclasses and
# enums, and the admissions and outputs.
SERVING_CLASSES = frozenset({("cluster.replica", "Admission"), ("cluster.engine.request", "RequestOutput")})


def decode_frame(payload: bytes):
    """A frame of either direction back from its bytes (after the token matched)."""
    return decode(payload, MESSAGE_MODULES, SERVING_CLASSES)


def keepalive(sock: socket.socket) -> None:
    """TCP_NODELAY (a frame goes out at once), and an end to a connection whose peer's host went
    away within ~15 s: keepalive probes while it is idle (5 s, then 3 probes 3 s apart), and
    TCP_USER_TIMEOUT while sent data waits unacknowledged (where keepalive sends no probes and
    the kernel would retransmit for ~15 minutes)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 3), ("TCP_KEEPCNT", 3),
                        ("TCP_USER_TIMEOUT", 15_000)):
        opt = getattr(socket, name, None)
        if opt is not None:
            sock.setsockopt(socket.IPPROTO_TCP, opt, value)


class Outboxes:
    """Each connected client's outputs not yet sent, and which client admitted each request.
    The engine's thread `put`s one step's outputs; each connection's writer `take`s all of its
    own at once."""

    def __init__(self, name: str):
        self.name = name
        self._cv = threading.Condition()
        self._boxes: dict[str, list[RequestOutput]] = {}
        self._owner: dict[str, str] = {}  # rid -> client
        self.output_steps = 0  # calls of put (a step's outputs, or an abort's): a connection's frames' bound
        self.output_messages = 0  # frames sent

    def open(self, client: str) -> None:
        with self._cv:
            self._boxes[client] = []

    def own(self, rid: str, client: str) -> None:
        """Route `rid`'s outputs to `client` (called on that client's reader thread, which is
        also the one that closes it: the client is open)."""
        with self._cv:
            self._owner[rid] = client

    def disown(self, rid: str) -> None:
        with self._cv:
            self._owner.pop(rid, None)

    def put(self, outs: list[RequestOutput]) -> None:
        """One step's outputs (the engine's thread): each to its client's box, at once."""
        with self._cv:
            for out in outs:
                client = self._owner.pop(out.rid, None) if out.finished else self._owner.get(out.rid)
                box = self._boxes.get(client) if client is not None else None
                if box is None:
                    continue  # aborted, or its client is gone (its requests were aborted)
                out.replica = self.name
                box.append(out)
            self.output_steps += 1
            self._cv.notify_all()

    def take(self, client: str) -> list[RequestOutput] | None:
        """Every output for `client` once there is one; None when the client is closed."""
        with self._cv:
            while True:
                box = self._boxes.get(client)
                if box is None:
                    return None
                if box:
                    self._boxes[client] = []
                    self.output_messages += 1
                    return box
                self._cv.wait()

    def close(self, client: str) -> list[str]:
        """Forget `client` (its writer's `take` returns None); the requests it still owned."""
        with self._cv:
            self._boxes.pop(client, None)
            rids = [rid for rid, c in self._owner.items() if c == client]
            for rid in rids:
                del self._owner[rid]
            self._cv.notify_all()
            return rids

    def clients(self) -> int:
        with self._cv:
            return len(self._boxes)


Submit = Callable[[str, list, list], list]


class ServingListener:
    """Accepts the routers' connections; per connection a reader thread (admissions in, their
    replies out, on the calling thread: no hand-off) and a writer thread (outputs out).
    `submit(client, admissions, aborts)` is the replica's admission; `abort(rid)` its abort."""

    def __init__(self, host: str, outboxes: Outboxes, submit: Submit, abort: Callable[[str], None]):
        self.outboxes, self._submit, self._abort = outboxes, submit, abort
        self.token = os.urandom(TOKEN_BYTES)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, 0))
        self._listener.listen(64)
        self.address = (host, self._listener.getsockname()[1])
        self._ids = count()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept_loop, name="serving-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
                threading.Thread(target=self._serve, args=(conn,), name="serving-conn", daemon=True).start()
            except Exception as exc:  # out of file descriptors or threads: keep listening
                if self._closed:
                    return
                logger.warning("serving channel: accept failed (%s: %s)", type(exc).__name__, exc)
                time.sleep(0.1)

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(_HELLO_TIMEOUT_S)
            token = recv_exact(conn, TOKEN_BYTES)
        except (OSError, ConnectionError):
            conn.close()
            return
        if not hmac.compare_digest(token, self.token):
            logger.warning("serving channel: a connection without the token was dropped")
            conn.close()
            return
        conn.settimeout(None)
        keepalive(conn)
        client = f"conn-{next(self._ids)}"
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._conns.add(conn)
        self.outboxes.open(client)
        send_lock = threading.Lock()
        writer = threading.Thread(target=self._write_loop, args=(conn, client, send_lock),
                                  name="serving-out", daemon=True)
        try:
            writer.start()
            while True:
                (n,) = FRAME_LEN.unpack(recv_exact(conn, FRAME_LEN.size))
                admissions, aborts = decode_frame(recv_exact(conn, n))
                replies = self._submit(client, admissions, aborts)
                payload = encode(("submitted", replies))
                with send_lock:
                    send_frame(conn, payload)
        except (OSError, ConnectionError, EOFError):
            pass  # the router closed the connection, or went away
        except Exception:
            logger.exception("serving channel: %s failed", client)
        finally:
            for rid in self.outboxes.close(client):  # wakes the writer: it returns
                self._abort(rid)
            with self._lock:
                self._conns.discard(conn)
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            if writer.is_alive():
                writer.join(timeout=5)
            conn.close()

    def _write_loop(self, conn: socket.socket, client: str, send_lock: threading.Lock) -> None:
        try:
            while True:
                outs = self.outboxes.take(client)
                if outs is None:
                    return
                payload = encode(("outputs", outs))
                with send_lock:
                    send_frame(conn, payload)
        except OSError:
            pass  # the connection closed: the reader sees it too and cleans up
        except Exception:  # outputs that cannot be sent: end the connection, not just this thread
            logger.exception("serving channel: sending %s's outputs failed", client)
        try:
            conn.shutdown(socket.SHUT_RDWR)  # the reader's recv ends: it aborts the client's requests
        except OSError:
            pass

    def close(self) -> None:
        """Stop accepting and close every connection (their routers see the replica gone)."""
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept thread
        except OSError:
            pass
        self._listener.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
