#!/usr/bin/env bash
# A two-node Ray cluster on one machine (a head with the dashboard, one worker node): try
# `shoal submit`, `shoal sweep --address` and elastic training without a second machine.
#   cluster_configs/local/start.sh            # prints the addresses
#   .venv/bin/shoal submit workloads/quickstart.yaml --address http://127.0.0.1:8265
#   cluster_configs/local/stop.sh             # stops these two nodes only (not `ray stop`)
set -euo pipefail
cd "$(dirname "$0")/../.."
RAY=${RAY:-.venv/bin/ray}
STATE=${SHOAL_LOCAL_CLUSTER:-.shoal-local-cluster}
PORT=${PORT:-6380}
DASHBOARD_PORT=${DASHBOARD_PORT:-8265}
HEAD_CPUS=${HEAD_CPUS:-2}
NODE_CPUS=${NODE_CPUS:-2}
mkdir -p "$STATE"
export RAY_AUTH_MODE=token  # Ray 2.60's default for new clusters; clients read ~/.ray/auth_token

setsid "$RAY" start --head --block --port="$PORT" --dashboard-port="$DASHBOARD_PORT" \
  --dashboard-host=127.0.0.1 --num-cpus="$HEAD_CPUS" --disable-usage-stats >"$STATE/head.log" 2>&1 &
echo $! >"$STATE/head.pid"
for _ in $(seq 60); do grep -q "ray start --address=" "$STATE/head.log" && break; sleep 1; done
ADDRESS=$(grep -o "ray start --address='[^']*'" "$STATE/head.log" | head -1 | cut -d"'" -f2)
[ -n "$ADDRESS" ] || { echo "the head did not start; see $STATE/head.log" >&2; exit 1; }
setsid "$RAY" start --block --address="$ADDRESS" --num-cpus="$NODE_CPUS" --disable-usage-stats \
  >"$STATE/node.log" 2>&1 &
echo $! >"$STATE/node.pid"
echo "$ADDRESS" >"$STATE/address"
echo "Ray cluster: $ADDRESS (shoal run/sweep --address $ADDRESS)"
echo "Jobs API:    http://127.0.0.1:$DASHBOARD_PORT (shoal submit/jobs --address http://127.0.0.1:$DASHBOARD_PORT)"
