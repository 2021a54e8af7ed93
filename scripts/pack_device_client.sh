#!/usr/bin/env bash
# Packs the `openai` client and what it needs beyond the device image and ../shared/gpu's two
# archives (jiter, httpx2, httpcore2, truststore, ...), as cp312 wheels unpacked, into
# .devdeps/client.tar.xz (~2 MB), for the GPU tests that talk to `manta serve` the way users do
# (`scripts/gpu_bench.sh servetests`). pydantic and its kin stay out: rest.tar.xz has them, at the
# versions Ray and FastAPI were packed with.
#
# Usage, from the project root: scripts/pack_device_client.sh
# On the device, beside ../shared/gpu's archives (carry it with either of their calls):
#   mkdir -p /tmp/client && tar xJf .devdeps/client.tar.xz -C /tmp/client
#   export PYTHONPATH=/tmp/site:$PWD:/tmp/client   # after /tmp/site: rest's pydantic and kin win
# (PYTHONPATH comes before site-packages, so the client's own anyio, h11, idna and sniffio are used
# over the image's; they are the versions `openai` was resolved with.)
set -euo pipefail
OUTD=$(pwd)/.devdeps; mkdir -p "$OUTD"
version=$(.venv/bin/python -c "import openai; print(openai.__version__)" 2>/dev/null || echo 3.57.0)
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$W/whl" "openai==$version" 2> >(grep -v "is ignored" >&2)  # (a failed download stops here: set -e)
mkdir -p "$W/site"
for f in "$W"/whl/*.whl; do
  case $(basename "$f") in pydantic*|annotated_types*|typing_inspection*|typing_extensions*) continue ;; esac
  unzip -q -o "$f" -d "$W/site"
done
python3 -c "import sys; sys.path.insert(0, sys.argv[1]); import truststore, jiter" "$W/site" 2>/dev/null \
  || echo "note: jiter is a cp312 build; it imports on the device, not under this Python"
tar cJf "$OUTD/client.tar.xz" -C "$W/site" .
ls -la "$OUTD/client.tar.xz"
