#!/usr/bin/env bash
# Run slope_jax on N processes of this machine (127.0.0.1), each with its own share of virtual CPU devices, as a
# multi-host run would on N hosts. All arguments after N go to every process; process 0 reads --requests and writes
# --results; every process writes its KV pieces under --kv_dir.
#
#   launch/local.sh 2 --cpu_devices=4 --ring=2 --ulysses=4 --requests=reqs.jsonl --results=out.jsonl --kv_dir=kv
#
# Environment: PORT (coordinator port, default 23456), PYTHON (default python3).
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 NUM_PROCESSES [launcher flags...]" >&2
  exit 2
fi
if ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "$0: error: NUM_PROCESSES=$1: must be a positive integer (usage: $0 NUM_PROCESSES [launcher flags...])" >&2
  exit 2
fi
n=$1
shift
port=${PORT:-23456}
py=${PYTHON:-python3}
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup INT TERM
for ((i = n - 1; i >= 0; i--)); do
  "$py" -m slope_jax.launch --num_processes="$n" --process_id="$i" --coordinator_address="127.0.0.1:$port" "$@" &
  pids+=("$!")
done
status=0
for p in "${pids[@]}"; do
  wait "$p" || status=$?
done
exit "$status"
