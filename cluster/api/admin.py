"""Operator endpoints of `manta serve`: the replicas in rotation, one more, one fewer.

Behind `--api-key` like every route but /health. Routes:

- `GET /admin/replicas`: each replica's name, health, whether it is draining, its requests in
  flight and the stats it last reported.
- `POST /admin/replicas`: start one more replica (its ranks placed and loaded; this answers
  once it serves, 201 with its name) and put it into rotation. An optional JSON body
  `{"role": "mixed" | "prefill" | "decode"}` (default mixed) grows either side of a disaggregated
  deployment, or makes one: once a prefill and a decode replica are in rotation, generation goes
  through both (`cluster.pd_route`). Prefill and decode replicas need the KV store and pages of at
  least 16 tokens, as `--prefill-replicas` does (400 naming `role` otherwise).
- `DELETE /admin/replicas/{name}?drain_timeout_s=S`: take it out of rotation for new requests,
  wait up to S seconds (default 60) for the requests it is serving to finish, then stop it.
  Requests still running after S end with an error. The last replica in rotation is refused
  (409): serving would stop.

The router is not thread-safe: it is changed on the event loop; the blocking cluster calls (start
and stop an actor) run in threads.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Request
from fastapi.responses import Response

from cluster.api.errors import APIError

DEFAULT_DRAIN_TIMEOUT_S = 60.0
START_TIMEOUT_S = 600.0


def _json(body: dict, status: int = 200) -> Response:
    return Response(json.dumps(body, default=str), status_code=status, media_type="application/json")


ROLES = ("mixed", "prefill", "decode")


def _role(body: bytes, engine) -> str:
    """The role a POST asks for (mixed without a body); APIError 400 naming the field."""
    if not body.strip():
        return "mixed"
    try:
        req = json.loads(body)
    except ValueError as exc:
        raise APIError(400, f"the body is not JSON: {exc}") from exc
    if not isinstance(req, dict):
        raise APIError(400, 'the body is a JSON object: {"role": ...}')
    extra = sorted(set(req) - {"role"})
    if extra:
        raise APIError(400, f"unknown field {extra[0]!r} (the body takes \"role\")", param=extra[0])
    role = req.get("role", "mixed")
    if role not in ROLES:
        raise APIError(400, f"role {role!r}: one of {', '.join(ROLES)}", param="role")
    if role != "mixed":
        from cluster.engine.kv_offload import MIN_PAGE_TOKENS

        if engine.kv_store is None or engine.page_size < MIN_PAGE_TOKENS:
            raise APIError(400, f"a {role} replica moves KV pages through the KV store: this server runs "
                                f"{'without it' if engine.kv_store is None else f'pages of {engine.page_size} tokens'}"
                                f" (disaggregation needs the store and pages of >= {MIN_PAGE_TOKENS} tokens)",
                           param="role")
    return role


def add_admin_routes(routes: APIRouter, cluster) -> None:
    """Add the routes to `routes` for `cluster` (a started `cluster.launch.ServingCluster`)."""

    def describe() -> list[dict]:
        return [{"name": h.name, "role": h.role, "healthy": h.healthy, "draining": h.draining, "dead": h.dead,
                 "inflight": h.inflight, "stats": h.stats} for h in cluster.router.replicas.values()]

    @routes.get("/admin/replicas")
    async def list_replicas() -> Response:
        return _json({"replicas": describe()})

    @routes.post("/admin/replicas")
    async def add_replica(request: Request) -> Response:
        role = _role(await request.body(), cluster.options.engine)
        try:
            name, actor = await asyncio.to_thread(cluster.start_replica, START_TIMEOUT_S, role)
        except Exception as exc:
            raise APIError(503, f"a new replica did not start: {type(exc).__name__}: {exc}",
                           "service_unavailable") from exc
        cluster.router.add_replica(name, actor, cluster.infos.get(name))
        return _json({"name": name, "replicas": describe()}, status=201)

    @routes.delete("/admin/replicas/{name}")
    async def remove_replica(name: str, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> Response:
        router = cluster.router
        handle = router.replicas.get(name)
        if handle is None:
            raise APIError(404, f"no replica named {name!r}", param="name", code="replica_not_found")
        if drain_timeout_s < 0:
            raise APIError(400, "drain_timeout_s must be >= 0", param="drain_timeout_s")
        serving = [h for h in router.replicas.values() if h.healthy and not h.draining and not h.dead]
        if serving == [handle]:
            raise APIError(409, f"{name} is the last replica in rotation: add one first", param="name",
                           code="last_replica")
        handle.draining = True  # no new requests; the ones it serves go on
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout_s
        while handle.inflight > 0 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        drained, left = handle.inflight == 0, handle.inflight
        router.remove_replica(name)
        await asyncio.to_thread(cluster.stop_replica, name)
        return _json({"name": name, "drained": drained, "requests_cut": left, "replicas": describe()})
