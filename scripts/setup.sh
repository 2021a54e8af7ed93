#!/usr/bin/env bash
# Set up manta in .venv at the repository root (idempotent). CPU machines get the CPU build
# of torch; pass MANTA_TORCH=skip where a suitable torch is already importable.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
if [ "${MANTA_TORCH:-cpu}" != "skip" ] && ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # A bare `torch` would pull a multi-GB CUDA build; this version is a local CPU build here.
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e ".[test]"
# tests/test_prometheus.py scrapes a live server with a real Prometheus (Debian's package).
# Best effort: only as root, only where apt-get exists; the test skips without the binary.
if ! command -v prometheus >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; } \
    >/dev/null 2>&1 || echo "note: could not install prometheus with apt-get (tests/test_prometheus.py will skip)"
fi
echo "manta is set up in .venv"
