"""Shared test helpers: tiny random checkpoints built by `workers.make_model`, cached.

    from tests.fixtures import tiny_model_dir

    @pytest.fixture(scope="session")
    def llama_dir(tmp_path_factory):
        return tiny_model_dir(tmp_path_factory, "llama")

A checkpoint is built once per (arch, kwargs, make_model source, library versions) and reused: under
`<pytest base temp>/manta-models/` when given pytest's `tmp_path_factory` (once per session), under a
given directory, or under `/tmp/manta-test-models/` (shared across sessions) when `base` is None.
Builds are atomic (written to a temporary directory, then renamed), so parallel test processes never
see a half-written checkpoint. Treat the returned directory as read-only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

DEFAULT_CACHE = Path(tempfile.gettempdir()) / "manta-test-models"

_built: dict[tuple[str, str], Path] = {}


def _root(base: Any) -> Path:
    if base is None:
        return DEFAULT_CACHE
    if hasattr(base, "getbasetemp"):  # pytest TempPathFactory
        return Path(base.getbasetemp()) / "manta-models"
    return Path(base)


def _cache_key(arch: str, kw: dict[str, Any]) -> str:
    import tokenizers
    import torch
    import transformers

    import workers.make_model as mm

    src = Path(mm.__file__).read_bytes()
    blob = json.dumps(
        {
            "arch": arch,
            "kw": kw,
            "src": hashlib.sha256(src).hexdigest(),
            "versions": [transformers.__version__, torch.__version__, tokenizers.__version__],
        },
        sort_keys=True,
        default=repr,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def tiny_model_dir(base: Any, arch: str, **kw: Any) -> Path:
    """Path of a checkpoint made by `make_model(dir, arch, **kw)`, built on first use.

    base: pytest's `tmp_path_factory`, a directory, or None for the cross-session cache.
    """
    from workers.make_model import make_model

    root = _root(base)
    key = _cache_key(arch, kw)
    memo = (str(root), key)
    if memo in _built:
        return _built[memo]
    final = root / f"{arch}-{key}"
    if not (final / "config.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{arch}-{key}-", dir=root))
        try:
            make_model(tmp, arch, **kw)
            tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache may be shared
            os.rename(tmp, final)
        except OSError:
            # Another process renamed its build into place first: use that one.
            if not (final / "config.json").exists():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _built[memo] = final
    return final


@contextlib.contextmanager
def gloo_rank(rank: int, port: int, world_size: int):
    """One rank of a gloo process group on loopback (for `torch.multiprocessing.spawn`ed test
    workers). On success every rank meets at a barrier and then leaves the process at once
    (`os._exit(0)`, after flushing its output): tearing the group down — explicitly or by the
    interpreter's exit — while the other rank's gloo threads still hold their connections
    aborted a rank now and then ("terminate called without an active exception", SIGABRT),
    even after the barrier. On failure the group is torn down and the error propagates."""
    import sys

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        yield
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def kill_named_actor(handle, name: str, namespace: str | None = None, timeout_s: float = 60.0) -> None:
    """`ray.kill` an actor and wait until its name is free and its process gone, without one
    more call to it once killed.

    The KV store is restartable (`max_restarts=-1`): a call to it once it is killed asks the GCS
    to restart it for lineage reconstruction, and Ray 2.60's GCS can die of that request (a
    failed check in GcsActorManager::HandleRestartActorForLineageReconstruction; it took a CI
    run's whole Ray instance, and the test process with it).

    The name is freed when the GCS marks the actor dead, before the kill reaches its process;
    a caller that has not heard of the death yet still sends its calls to that process, which
    answers them while it lives (a CI run's "dead" store answered `exists` with its pages). So
    the actor's pid is asked before the kill (tests run one node: the pid is on this host) and
    the wait goes on until that process has exited."""
    import time

    import ray

    from tests.serve_process import alive

    try:
        pid = ray.get(handle.__ray_call__.remote(lambda actor: os.getpid()), timeout=timeout_s)
    except ray.exceptions.RayActorError:
        pid = None  # dead already: only its name is left to wait for
    ray.kill(handle)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _name_held(handle, name, namespace) and (pid is None or not alive(pid)):
            return
        time.sleep(0.05)
    raise AssertionError(f"actor {name} (pid {pid}) did not die within {timeout_s:.0f}s")


def _name_held(handle, name: str, namespace: str | None) -> bool:
    import ray

    try:
        found = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    return found._actor_id == handle._actor_id


@contextlib.contextmanager
def local_ray(num_cpus: int, num_gpus: int = 0, **init):
    """A Ray cluster of this process only, for a test module's fixture (shut down after; one
    left running by an earlier module is shut down first). `init`: more of `ray.init`'s options."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, **init)
    try:
        yield
    finally:
        ray.shutdown()
