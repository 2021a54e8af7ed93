#!/usr/bin/env bash
# A wheelhouse: every wheel that manta and its dependencies need, for machines without internet
# (docs/deploy.md, "Air-gapped"). Run it on a machine with internet and the same OS, CPU
# architecture and Python minor version as the cluster's machines, copy the folder, install with
#   pip install --no-index --find-links WHEELHOUSE -e MANTA_CHECKOUT   (or uv pip install, as
#   deploy/ray-cluster.offline.yaml does)
#
#   scripts/make_wheelhouse.sh [OUT] [extra pip args...]     # OUT defaults to .wheelhouse
#
# torch: the version in .venv (TORCH=... to choose another, e.g. TORCH="torch==2.9.1"); CUDA
# builds come from PyTorch's index: add  --extra-index-url https://download.pytorch.org/whl/cu128
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.wheelhouse}
shift || true
PY=${PYTHON:-.venv/bin/python}
TORCH=${TORCH:-torch==$("$PY" -c 'import torch; print(torch.__version__)')}
mkdir -p "$OUT"
# setuptools: `pip install -e` builds manta's editable wheel from it, offline too. uv: the
# offline cluster file installs with it (deploy/ray-cluster.offline.yaml).
"$PY" -m pip wheel -q --wheel-dir "$OUT" "$@" "$TORCH" "setuptools>=68" wheel uv .
echo "wheelhouse: $(ls "$OUT" | wc -l) wheels, $(du -sh "$OUT" | cut -f1) in $OUT"
