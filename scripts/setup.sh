#!/usr/bin/env bash
# Set up manta in .venv at the repository root (idempotent). CPU machines get the CPU build
# of torch; pass MANTA_TORCH=skip where a suitable torch is already importable.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The third-party clients tests/test_real_clients.py runs against the server, each in its own
# venv under .clients/ (their pins clash with ours), at the versions written here; reinstalled
# when the line changes. Best effort: a failed install prints a note and its tests skip. They
# need nothing of .venv, so they install in the background while the rest does (on the 2-core CI
# VM, one after the other: ~120 s for the three, ~160 s for the rest).
client_venv() {  # NAME REQUIREMENT...
  local dir=.clients/$1; shift
  [ -f "$dir/.installed" ] && [ "$(cat "$dir/.installed")" = "$*" ] && return 0
  rm -rf "$dir"
  { "$PY" -m venv "$dir" && "$dir/bin/python" -m pip install -q --no-compile "$@" && echo "$*" > "$dir/.installed"; } \
    >"$dir.log" 2>&1 && rm -f "$dir.log" \
    || { rm -rf "$dir"; echo "note: could not install $* into $dir (see $dir.log; tests/test_real_clients.py skips it)"; }
}
mkdir -p .clients
# lm-eval's API models need transformers only for the tokenizer, not torch; guidellm needs torch;
# aiperf does not (it brings its own transformers for the tokenizer).
client_venv lm-eval "lm_eval[api]==0.4.13" "transformers==5.23.0" &
client_venv guidellm "guidellm==0.8.1" "torch==2.13.0" &
client_venv aiperf "aiperf==0.13.0" &
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
if [ "${MANTA_TORCH:-cpu}" != "skip" ] && ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # A bare `torch` would pull a multi-GB CUDA build; this version is a local CPU build here.
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e ".[test]"
# Debian packages the tests run for real: tests/test_prometheus.py scrapes a live server with
# Prometheus; tests/test_ray_up.py runs `ray up` over SSH (sshd, rsync) on two hosts in network
# namespaces. Best effort: only as root, only where apt-get exists; those tests skip without them.
want=()
command -v prometheus >/dev/null || want+=(prometheus)
[ -x /usr/sbin/sshd ] || want+=(openssh-server)
command -v rsync >/dev/null || want+=(rsync)
if [ ${#want[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${want[@]}"; } \
    >/dev/null 2>&1 || echo "note: could not install ${want[*]} with apt-get (the tests that need them will skip)"
fi
# The wheelhouse tests/test_ray_up.py installs the cluster's hosts from (they have no internet).
if [ -x /usr/sbin/sshd ]; then
  scripts/make_wheelhouse.sh .wheelhouse >/dev/null 2>&1 || { rm -rf .wheelhouse; echo "note: could not build .wheelhouse"; }
fi
wait  # the clients
echo "manta is set up in .venv"
