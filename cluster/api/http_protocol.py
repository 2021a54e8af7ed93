"""uvicorn's HTTP protocol, stamping each request with the moment its first bytes arrived (and
sending each streamed chunk at once: TCP_NODELAY).

`StampedProtocol` is uvicorn's httptools protocol where httptools is installed (a C parser, and
a streamed chunk framed by joining bytes), else its h11 one (pure Python: each chunk goes through
h11's event machinery). The server's one event loop frames every token of every stream, and a new
request's bytes wait behind that work.

The server's latencies (TTFT, end to end) count from there: the time a request waits for the
event loop to parse it and route it, behind a burst of others, is the server's, and clients
see it. The moment is the kernel's, not the event loop's: under a burst the loop reads a new
request's bytes long after they arrived (a 500-request burst on 2 cores: 90 ms at p50, 460 ms
at p90 after the connection was accepted), so the stamp is taken back by the time TCP_INFO says
has passed since the socket last received data. (The time a new connection waits in the
kernel's accept queue before its first bytes stays outside: it is the client's connect.)
"""

from __future__ import annotations

import socket
import struct
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

# struct tcp_info (linux/tcp.h): 8 one-byte fields, 9 u32 (rto ... fackets), then the times in
# milliseconds: last_data_sent, last_ack_sent, last_data_recv.
_TCP_INFO_LEN = 64
_LAST_DATA_RECV = struct.Struct("=I")
_LAST_DATA_RECV_OFFSET = 8 + 9 * 4 + 2 * 4
_TCP_INFO = getattr(socket, "TCP_INFO", None)


def received_ago_s(sock) -> float:
    """Seconds since `sock` last received data, by the kernel's clock (0 where unknown)."""
    if sock is None or _TCP_INFO is None:
        return 0.0
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _TCP_INFO_LEN)
    except OSError:  # not TCP (a Unix socket)
        return 0.0
    if len(info) < _LAST_DATA_RECV_OFFSET + 4:
        return 0.0
    return _LAST_DATA_RECV.unpack_from(info, _LAST_DATA_RECV_OFFSET)[0] / 1000.0


class _Stamped:
    """The stamp and TCP_NODELAY, over either uvicorn protocol (both keep `cycle` and `scope`)."""

    _arrival: float | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        # Streamed tokens go out as they come: with Nagle's algorithm on (asyncio's server sockets
        # had TCP_NODELAY 0 here), a keep-alive connection's second response waited for the
        # client's delayed ACK and arrived in one piece ~40 ms later (found by aiperf's ITL).
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # not TCP (a Unix socket)
                pass
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._arrival is None or self.cycle is None or self.cycle.response_complete:
            # The first bytes of a new request on this connection: when the kernel received them.
            now = time.monotonic()
            ago = received_ago_s(self.transport.get_extra_info("socket"))
            self._arrival = now - min(ago, 60.0)
        super().data_received(data)
        scope = getattr(self, "scope", None)
        if scope is not None:
            scope.setdefault("state", {}).setdefault("arrival", self._arrival)


class StampedH11Protocol(_Stamped, H11Protocol):
    pass


StampedProtocol: type = StampedH11Protocol
try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is not installed: h11
    pass
else:

    class StampedHttpToolsProtocol(_Stamped, HttpToolsProtocol):
        pass

    StampedProtocol = StampedHttpToolsProtocol
