import os
import subprocess

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, os.cpu_count() or 1))


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
