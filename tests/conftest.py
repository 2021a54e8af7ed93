import os
import shutil
import subprocess
import tempfile

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, os.cpu_count() or 1))

# The files that take longest (a durations run under `-n 2`, 2026-11-29), longest first. The
# README's test command runs two xdist workers that take whole files from one queue in
# collection order; a long file that came last would run alone at the end. The rest keep
# pytest's order after these.
LONGEST_FIRST = (
    "test_ray_up.py", "test_pd.py", "test_kvstore_serving.py", "test_ray_cluster.py", "test_serving_path.py",
    "test_routing_bench.py", "test_kvstore.py", "test_faults.py", "test_real_clients.py", "test_serving_e2e.py",
    "test_kvstore_warm.py", "test_prometheus.py", "test_shutdown.py", "test_soak.py", "test_embeddings.py",
    "test_dummy_weights.py",
)


def pytest_configure(config):
    """Each test process gets a cache directory of its own (the embedded default model, the
    embedded KV store): not the user's ~/.cache/manta, and not one that two xdist workers build
    the same model into at once."""
    if "MANTA_CACHE_DIR" not in os.environ:
        config._manta_cache_dir = tempfile.mkdtemp(prefix="manta-test-cache-")
        os.environ["MANTA_CACHE_DIR"] = config._manta_cache_dir


def pytest_unconfigure(config):
    made = getattr(config, "_manta_cache_dir", None)
    if made:
        os.environ.pop("MANTA_CACHE_DIR", None)
        shutil.rmtree(made, ignore_errors=True)


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (the README's test command): two workers on a machine without a GPU, one where
    there is a GPU (its tests size their KV caches from the memory free when they start, so two
    at once would starve each other)."""
    return 1 if torch.cuda.is_available() else min(2, os.cpu_count() or 1)


def pytest_collection_modifyitems(config, items):
    """Longest files first: under `--dist loadfile` a file is one work unit (its module-scoped
    Ray cluster starts once) and the workers take them in this order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    # xdist schedules by node id and runs one item of each: a second item with the same id would
    # silently not run (schemathesis' `parametrize()` made such items under pytest 9).
    seen: set[str] = set()
    for item in items:
        if item.nodeid in seen:
            raise pytest.UsageError(f"two test items share the node id {item.nodeid}: under -n one would not run")
        seen.add(item.nodeid)


@pytest.fixture
def small_fs(tmp_path):
    """A 32 MiB tmpfs (root and `mount` needed, as on the CI machine); unmounted after."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture(autouse=True)
def _free_gpu_memory(request):
    """After each GPU test, collect the engines it left (their pipelines and graph runners
    reference each other, so only the cycle collector frees them) and return their memory to
    the device: every engine sizes its KV cache from the memory free when it starts, so a test
    must not depend on what the tests before it left allocated."""
    yield
    if request.node.get_closest_marker("gpu") is not None and torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()
