"""The HTTP server's protocol (`cluster/api/http_protocol.py`) through a real uvicorn server and
real sockets: a request's arrival is the moment its bytes reached the kernel, not the moment a
busy event loop read them, on a new connection and on a kept-alive one."""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest
from fastapi import FastAPI, Request

from cluster.api.server import BackgroundServer

BLOCK_S = 0.4


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/block")
    async def block() -> dict:
        time.sleep(BLOCK_S)  # holds the event loop: nothing else is read meanwhile
        return {}

    @app.get("/stamp")
    async def stamp(request: Request) -> dict:
        return {"arrival": request.state.arrival, "handled": time.monotonic()}

    return app


@pytest.fixture
def server():
    srv = BackgroundServer(_app())  # the protocol `manta serve` runs
    yield srv
    srv.stop()


def _get(conn: http.client.HTTPConnection, path: str) -> dict:
    conn.request("GET", path)
    resp = conn.getresponse()
    assert resp.status == 200
    return json.loads(resp.read())


@pytest.mark.parametrize("kept_alive", [False, True])
def test_arrival_is_when_the_bytes_came_not_when_the_loop_read_them(server, kept_alive):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    if kept_alive:
        _get(conn, "/stamp")  # the stamped request below is this connection's second
    else:
        conn.connect()
    blocker = threading.Thread(target=lambda: _get(http.client.HTTPConnection(server.host, server.port, timeout=10),
                                                   "/block"))
    blocker.start()
    time.sleep(0.1)  # the loop is now inside /block
    sent = time.monotonic()
    got = _get(conn, "/stamp")
    blocker.join()
    # The loop read the request only after /block returned, yet its arrival is when it was sent
    # (TCP_INFO's time since the socket last received data is in whole milliseconds).
    assert got["handled"] - sent > BLOCK_S / 2
    assert sent - 0.005 <= got["arrival"] <= sent + 0.05, (got["arrival"] - sent, got["handled"] - sent)
