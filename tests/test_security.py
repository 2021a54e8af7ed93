"""Security properties of the server, checked without a model:

- `--api-key`: every route of the app answers 401 without the right Bearer token, except
  /health (and /metrics with --metrics-public); wrong schemes and near-miss keys are refused;
- the server binds to 127.0.0.1 unless told otherwise (CLI default, `run_server`,
  `BackgroundServer`);
- nothing that comes from the network is unpickled, eval'd or exec'd: an AST scan of the
  packages for `pickle`/`marshal`/`dill` loads, `eval`/`exec`, unsafe `yaml.load`, `torch.load`
  without `weights_only=True` and `shell=True` subprocesses;
- KV store keys are hashes, never paths from a request (`kvstore.keys`);
- request size limits: a chunked body without Content-Length is cut at the limit (413).
"""

from __future__ import annotations

import argparse
import ast
import inspect
from pathlib import Path

import httpx
import pytest
from fastapi.routing import APIRoute

from cluster.api.metrics import ServerMetrics
from cluster.api.server import BackgroundServer, build_app, run_server
from kvstore.keys import chain_keys, is_valid_key, validate_key

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cluster", "workers", "attention", "kvstore")
KEY = "s3cret-key"


class _NoClient:
    """A ServingClient that must never be reached by an unauthenticated request."""

    model_name, max_context_len, vocab_size, tokenizer = "m", 64, 100, None
    is_encoder_decoder, matryoshka_dimensions, embedding_size = False, None, None

    def generate_stream(self, *a, **kw):
        raise AssertionError("an unauthenticated request reached the serving client")

    def health(self):
        from cluster.engine.client import HealthStatus

        return HealthStatus(True)

    async def aclose(self):
        pass


def _api_routes(routes) -> list[APIRoute]:
    """Every endpoint, also those of included routers (FastAPI >= 0.165 keeps them nested)."""
    out = []
    for r in routes:
        if isinstance(r, APIRoute):
            out.append(r)
        elif hasattr(r, "original_router"):
            out += _api_routes(r.original_router.routes)
    return out


@pytest.mark.parametrize("metrics_public", [False, True])
def test_every_route_but_health_needs_the_key(metrics_public):
    app = build_app(_NoClient(), ServerMetrics(), api_key=KEY, metrics_public=metrics_public)
    server = BackgroundServer(app)
    try:
        routes = [(m, r.path.replace("{model:path}", "x").replace("{model}", "x"))
                  for r in _api_routes(app.routes) for m in r.methods]
        assert ("POST", "/v1/chat/completions") in routes and ("GET", "/metrics") in routes
        open_paths = {"/health"} | ({"/metrics"} if metrics_public else set())
        bad_auth = [{}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}, {"Authorization": "Bearer"},
                    {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Bearer {KEY[:-1]}"},
                    {"Authorization": f"Token {KEY}"}]
        for method, path in routes:
            for headers in bad_auth:
                r = httpx.request(method, server.url + path, headers=headers, json={"prompt": "x"})
                if path in open_paths:
                    assert r.status_code == 200, (method, path, r.text)
                else:
                    assert r.status_code == 401, (method, path, headers, r.status_code)
                    assert r.json()["error"]["code"] == "invalid_api_key"
            ok = httpx.request(method, server.url + path, headers={"Authorization": f"Bearer {KEY}"},
                               json={"prompt": ""})
            assert ok.status_code != 401, (method, path)
        # Unknown routes are 404 either way (nothing to protect, nothing leaked).
        assert httpx.get(server.url + "/admin").status_code == 404
    finally:
        server.stop()


def test_binds_to_loopback_unless_told_otherwise():
    from cluster.serve_cli import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve"])
    assert args.host == "127.0.0.1" and args.api_key is None and not args.metrics_public
    assert inspect.signature(run_server).parameters["host"].default == "127.0.0.1"
    assert inspect.signature(BackgroundServer).parameters["host"].default == "127.0.0.1"
    server = BackgroundServer(build_app(_NoClient(), ServerMetrics()))
    try:
        assert server.host == "127.0.0.1" and server.url.startswith("http://127.0.0.1:")
    finally:
        server.stop()


# Calls that turn bytes into code or objects: never on anything in these packages.
_FORBIDDEN_CALLS = {("pickle", "loads"), ("pickle", "load"), ("cloudpickle", "loads"), ("cloudpickle", "load"),
                    ("marshal", "loads"), ("marshal", "load"), ("dill", "loads"), ("dill", "load"),
                    ("shelve", "open"), ("jsonpickle", "decode")}
_FORBIDDEN_NAMES = {"eval", "exec", "__import__"}


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            out += [f"import {m}" for m in mods if m.split(".")[0] in {"pickle", "cloudpickle", "dill", "marshal",
                                                                       "shelve", "jsonpickle"}]
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        kwargs = {k.arg: k.value for k in node.keywords}
        if isinstance(f, ast.Name) and f.id in _FORBIDDEN_NAMES:
            out.append(f"{f.id}()")
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            if (f.value.id, f.attr) in _FORBIDDEN_CALLS:
                out.append(f"{f.value.id}.{f.attr}()")
            if (f.value.id, f.attr) == ("yaml", "load") and "Loader" not in kwargs:
                out.append("yaml.load() without a safe Loader")
            if (f.value.id, f.attr) == ("torch", "load"):
                wo = kwargs.get("weights_only")
                if not (isinstance(wo, ast.Constant) and wo.value is True):
                    out.append("torch.load() without weights_only=True")
        if "shell" in kwargs and isinstance(kwargs["shell"], ast.Constant) and kwargs["shell"].value is True:
            out.append("subprocess with shell=True")
    return [f"{path.relative_to(ROOT)}:{line}" for line in out]


# The step channel between a replica and its ranks pickles its messages; it reads them back
# with an unpickler that rebuilds only the messages' dataclasses and enums (checked below).
_RESTRICTED_UNPICKLERS = {"workers/step_channel.py"}


def test_no_unpickling_eval_or_exec_in_the_packages():
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 20
    bad = [v for p in files if str(p.relative_to(ROOT)) not in _RESTRICTED_UNPICKLERS for v in _violations(p)]
    assert bad == [], bad
    step_channel = _violations(ROOT / "workers/step_channel.py")
    assert step_channel == ["workers/step_channel.py:import pickle"], step_channel  # no pickle.loads


def test_the_step_channel_rebuilds_messages_and_refuses_anything_else():
    import os
    import pickle

    from workers.forward_batch import ForwardMode
    from workers.kv_messages import KVSave
    from workers.messages import NewRequest, ScheduledReq, StepPlan, StepResult, TokenLogprobs
    from workers.sampling_params import SamplingParams
    from workers.step_channel import decode

    plan = StepPlan(3, ForwardMode.MIXED, [ScheduledReq("r", 0, [1, 2], 0, [4, 5])],
                    [NewRequest("r", SamplingParams(max_tokens=4, stop=("x",)), [1, 2])], kv_saves=[KVSave([1], ["k"])])
    result = StepResult(3, ["r"], [7], [TokenLogprobs(-0.5, [(7, -0.5)])])
    for msg in (plan, result, (True, None), (False, "Traceback ...")):
        assert decode(pickle.dumps(msg, protocol=5)) == msg

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    with pytest.raises(pickle.UnpicklingError, match="does not carry"):
        decode(pickle.dumps(Evil(), protocol=5))
    with pytest.raises(pickle.UnpicklingError, match="does not carry"):
        decode(pickle.dumps(Path("/etc"), protocol=5))

    # Python 3.11.0-3.11.4 (Debian 12's python3 is 3.11.2) pickle an enum member as
    # getattr(cls, name): that, and only that, comes through (tests/test_ray_up.py's hosts run it).
    class ByName:
        def __init__(self, obj, name):
            self.obj, self.name = obj, name

        def __reduce__(self):
            return (getattr, (self.obj, self.name))

    assert decode(pickle.dumps(ByName(ForwardMode, "MIXED"), protocol=5)) is ForwardMode.MIXED
    assert decode(pickle.dumps([ByName(ForwardMode, "DECODE")] * 2, protocol=5)) == [ForwardMode.DECODE] * 2
    for obj, name in ((ForwardMode, "__init__"), (ForwardMode, "_member_map_"), (StepPlan, "__init__"),
                      (ForwardMode, "NO_SUCH_MODE")):
        with pytest.raises(pickle.UnpicklingError, match="does not carry"):
            decode(pickle.dumps(ByName(obj, name), protocol=5))


def test_the_scan_catches_what_it_looks_for(tmp_path):
    sample = tmp_path / "x.py"
    sample.write_text("import pickle\nimport torch\npickle.loads(b'')\neval('1')\nexec('x=1')\n"
                      "torch.load('f')\nimport subprocess\nsubprocess.run('ls', shell=True)\nmodel.eval()\n")
    found = [v.split(":", 1)[1] for v in _violations_at(sample, tmp_path)]
    assert found == ["import pickle", "pickle.loads()", "eval()", "exec()", "torch.load() without weights_only=True",
                     "subprocess with shell=True"], found


def _violations_at(path: Path, root: Path) -> list[str]:
    global ROOT
    saved, ROOT = ROOT, root
    try:
        return _violations(path)
    finally:
        ROOT = saved


def test_kv_store_keys_are_hashes_never_paths():
    for bad in ("../../etc/passwd", "/tmp/x", "a" * 64 + "/../x", "A" * 64, "a" * 63, "", "a" * 64 + "-r0-x",
                "a" * 64 + "\x00", None, 5, b"a" * 64):
        assert not is_valid_key(bad)
        with pytest.raises(ValueError, match="not a KV store key"):
            validate_key(bad)
    # Whatever tokens a request brings, the keys derived from them are hex digests.
    hostile = [0, 46, 46, 47, 2**31 - 1, 10**12] * 8
    keys = chain_keys(hostile, 4, "fingerprint", "mha")
    assert len(keys) == len(hostile) // 4 and all(is_valid_key(k) for k in keys)


def test_chunked_body_over_the_limit_is_cut():
    server = BackgroundServer(build_app(_NoClient(), ServerMetrics(), max_body_bytes=1000))
    try:
        def chunks():
            for _ in range(100):
                yield b"x" * 100  # 10 kB, no Content-Length: only the streamed size tells

        r = httpx.post(server.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    finally:
        server.stop()
