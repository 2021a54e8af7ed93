"""Fuzzing the HTTP API with schemathesis from its own OpenAPI document (`cluster.api.openapi`).

The real app over a tiny in-process engine (context 64 tokens, so any generation it accepts is
short) is served on 127.0.0.1; schemathesis generates valid and invalid bodies for every route
and checks that the server never answers 5xx, answers only documented statuses and content
types, and that every 4xx is the OpenAI error body. A bounded number of examples per route keeps
this under a minute on two cores.
"""

from __future__ import annotations

import asyncio
import collections
import json
import re

import pytest
import schemathesis
from hypothesis import HealthCheck, settings  # schemathesis brings hypothesis
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from cluster.api.metrics import ServerMetrics
from cluster.api.openapi import openapi_schema
from cluster.api.server import BackgroundServer, build_app
from cluster.engine.client import LocalEngineClient
from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from tests.fixtures import tiny_model_dir

EXAMPLES = 50  # per route and generation mode

schema = schemathesis.openapi.from_dict(openapi_schema())


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    d = tiny_model_dir(tmp_path_factory, "llama")
    engine = Engine(EngineConfig(model=str(d), served_model_name="tiny", kv_cache_tokens=4096,
                                 max_context_len=64, max_running_requests=32))
    metrics = ServerMetrics()
    client = LocalEngineClient(engine, metrics=metrics)
    server = BackgroundServer(build_app(client, metrics, max_body_bytes=64 * 1024))
    try:
        yield server, engine
    finally:
        server.stop()
        asyncio.run(client.aclose())


def openai_error_body(ctx, response, case) -> bool | None:
    """Every 4xx/5xx answer is `{"error": {message, type, param, code}}` with a message."""
    if response.status_code < 400 or response.status_code == 499:
        return None
    err = json.loads(response.content)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    return True


SEEN: dict[str, collections.Counter] = {}  # operation -> status -> count, read by the last test

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          openai_error_body]


def _fuzz_test(method: str, path: str):
    """The fuzz test of one route. One test function per route, not one `schema.parametrize()`
    over all: under pytest 9 the items schemathesis makes from that share one node id, and
    pytest-xdist (the README's test command) runs one item per node id."""
    @schema.include(method=method, path=path).parametrize()
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def test(case, fuzz_server):
        server, _ = fuzz_server
        response = case.call_and_validate(base_url=server.url, checks=CHECKS, timeout=30)
        SEEN.setdefault(case.operation.label, collections.Counter())[response.status_code] += 1

    return test


for _op in (result.ok() for result in schema.get_all_operations()):
    globals()["test_api_fuzz_" + re.sub(r"\W+", "_", f"{_op.method} {_op.path}").strip("_")] = _fuzz_test(_op.method, _op.path)


def test_fuzzing_leaves_no_request_or_page_behind(fuzz_server):
    """Runs after the fuzz cases (file order): everything they started has finished and freed
    its KV pages."""
    import time

    _, engine = fuzz_server
    print(SEEN)
    # The fuzzing reached the engine (200s) and its validation (400s) on the generation routes.
    for op in ("POST /v1/completions", "POST /v1/chat/completions", "POST /generate"):
        assert SEEN[op][200] and SEEN[op][400], (op, SEEN.get(op))
    deadline = time.monotonic() + 10
    while engine.has_work() and time.monotonic() < deadline:
        time.sleep(0.05)
    sched = engine.scheduler
    assert not sched.running and not sched.waiting
    assert sched.kv_usage() == 0.0
    sched.check_integrity()
