#!/usr/bin/env bash
# Stops the two nodes that start.sh started, by their process groups (never `ray stop`, which
# would stop every Ray on this machine).
set -uo pipefail
cd "$(dirname "$0")/../.."
STATE=${SHOAL_LOCAL_CLUSTER:-.shoal-local-cluster}
for name in node head; do
  [ -f "$STATE/$name.pid" ] || continue
  pid=$(cat "$STATE/$name.pid")
  kill -TERM -- "-$pid" 2>/dev/null
  for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$pid" 2>/dev/null
  rm -f "$STATE/$name.pid"
done
echo "stopped the local cluster of $STATE"
