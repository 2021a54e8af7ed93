"""A Ray actor's process that gets Ray's SIGTERM while its main thread runs a weakref callback
(a garbage collection) exits quietly (`workers.actor_exit`); without the hook Ray's handler's
`SystemExit` is swallowed there, printed with a traceback into the log the driver streams, and the
process lives on. Real Ray, Ray's own SIGTERM handler, a real signal."""

from __future__ import annotations

import glob
import os
import signal
import time

import pytest
import ray

from tests.fixtures import local_ray
from workers import actor_exit


class Collected:
    """A plain (single-threaded) actor: its methods run on the process's main thread, where
    Python runs signal handlers."""

    def __init__(self, hook: bool):
        self.hooked = actor_exit.install() if hook else False

    def pid(self) -> tuple[int, bool]:
        return os.getpid(), self.hooked

    def sigterm_inside_a_weakref_callback(self) -> str:
        import weakref

        class Box:
            pass

        box = Box()

        def freed(_):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs here, inside the callback

        self.ref = weakref.ref(box, freed)
        del box
        return "lived on"


@pytest.fixture(scope="module")
def ray_local():
    with local_ray(2, log_to_driver=False):
        yield


def err_log(pid: int) -> str:
    from ray._private.worker import _global_node

    paths = glob.glob(os.path.join(_global_node.get_logs_dir_path(), f"worker-*-{pid}.err"))
    assert len(paths) == 1, paths
    return open(paths[0]).read()


def test_not_installed_outside_an_actor():
    assert actor_exit.install() is False


@pytest.mark.parametrize("hook", [False, True])
def test_sigterm_in_a_weakref_callback(ray_local, hook):
    actor = ray.remote(Collected).remote(hook)
    pid, hooked = ray.get(actor.pid.remote(), timeout=60)
    assert hooked == hook
    if hook:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.sigterm_inside_a_weakref_callback.remote(), timeout=60)
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{pid}")
        assert "Traceback" not in err_log(pid) and "SystemExit" not in err_log(pid)
    else:  # what the hook is for: Ray's SystemExit swallowed and printed, the process alive
        assert ray.get(actor.sigterm_inside_a_weakref_callback.remote(), timeout=60) == "lived on"
        deadline = time.monotonic() + 10
        while "SystemExit" not in err_log(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        log = err_log(pid)
        assert "Exception ignored in" in log and "Traceback" in log and "SystemExit" in log, log
        assert os.path.exists(f"/proc/{pid}")
        ray.kill(actor)


def test_the_kv_store_actor_gets_the_hook(ray_local, tmp_path_factory):
    """The store actor `manta serve` starts (`cluster.kv_store_setup.ensure_kv_store`) installs
    the hook in its own process, though `kvstore` cannot import `workers`."""
    import sys

    from cluster.engine.config import EngineConfig
    from cluster.kv_store_setup import ensure_kv_store
    from tests.fixtures import tiny_model_dir

    config = EngineConfig(model=str(tiny_model_dir(tmp_path_factory, "llama")), page_size=16,
                          kv_store=str(tmp_path_factory.mktemp("store")), kv_store_host_gb=0.01, kv_store_disk_gb=0.01)
    store, created = ensure_kv_store(config)
    assert created
    try:
        hooked = ray.get(store.__ray_call__.remote(lambda _self: getattr(sys.unraisablehook, actor_exit._INSTALLED, False)))
        assert hooked is True
    finally:
        ray.kill(store)
