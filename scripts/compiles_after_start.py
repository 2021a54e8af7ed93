"""List the Triton kernels that compile after an engine has started (a compile met by a serving
step stalls every request of that step): `python scripts/compiles_after_start.py [ARCH]`.

Builds a tiny random checkpoint, starts an in-process engine on CUDA with an empty Triton cache,
then serves staggered greedy requests of odd and even prompt lengths (prefill, MIXED and decode
steps) and prints every kernel compiled after start-up; exits 1 if there is any.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

cache = tempfile.mkdtemp(prefix="triton-cache-")
os.environ["TRITON_CACHE_DIR"] = cache  # before triton is imported


def compiled() -> set[str]:
    return {str(p.relative_to(cache)) for p in Path(cache).rglob("*.json") if not p.name.startswith("__grp__")}


def main() -> int:
    from cluster.engine.config import EngineConfig
    from cluster.engine.loop import Engine
    from tests.fixtures import tiny_model_dir
    from tests.test_engine import PROMPTS, greedy, run_staggered

    arch = sys.argv[1] if len(sys.argv) > 1 else "llama"
    engine = Engine(EngineConfig(model=str(tiny_model_dir(None, arch)), device="cuda", page_size=16,
                                 max_running_requests=16))
    at_start = compiled()
    run_staggered(engine, PROMPTS, greedy())
    run_staggered(engine, [p + p[:3] for p in PROMPTS], greedy())  # other lengths and parities
    late = sorted(compiled() - at_start)
    engine.shutdown()
    print(f"{arch}: {len(at_start)} kernels compiled at start-up, {len(late)} after: "
          + ", ".join(Path(n).name for n in late))
    return 1 if late else 0


if __name__ == "__main__":
    sys.exit(main())
