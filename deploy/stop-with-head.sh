#!/usr/bin/env bash
# Stops this worker machine's Ray once the head's GCS has been unreachable for 15 s.
#
# The worker_start_ray_commands of ray-cluster.local.yaml and ray-cluster.offline.yaml start it
# after `ray start`. `ray down` of a local-provider cluster runs `ray stop` on the head alone
# (Ray 2.60; ray-project/ray#43232): a worker's raylet then lingers for 60 s and its agents for
# minutes (tests/test_ray_up.py saw them still running 4 minutes after `ray down`). This ends
# them ~15 s after the head's Ray. Costs one TCP connect every 5 s, no Python.
#
#   stop-with-head.sh HEAD_IP [PORT]      # PORT: the head's GCS port, 6379
set -u
host=${1:?usage: stop-with-head.sh HEAD_IP [PORT]}
port=${2:-6379}
pidfile=/tmp/manta-stop-with-head.pid
# One per machine: a new `ray start` replaces the watcher of the previous one.
if [ -f "$pidfile" ]; then kill "$(cat "$pidfile")" 2>/dev/null; fi
echo $$ > "$pidfile"
misses=0
while [ "$misses" -lt 3 ]; do
  sleep 5
  if (exec 3<>"/dev/tcp/$host/$port") 2>/dev/null; then misses=0; else misses=$((misses + 1)); fi
done
rm -f "$pidfile"
echo "$(date -Is) the head's GCS at $host:$port is gone: ray stop"
exec ray stop --force
