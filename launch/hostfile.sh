#!/usr/bin/env bash
# Start slope_jax on every host of a hostfile over ssh: one process per host, process i on line i, process 0 (the
# coordinator, which reads requests and writes results) on the first line.
#
#   launch/hostfile.sh hosts.txt --ring=4 --ulysses=8 --requests=/shared/reqs.jsonl \
#       --results=/shared/results.jsonl --kv_dir=/shared/kv
#
# hosts.txt: one reachable host name or address per line ('#' comments allowed). Every host must see the same
# checkout (REMOTE_DIR) and Python environment (REMOTE_PYTHON), and the --kv_dir must be on a shared filesystem for a
# decode engine to read whole exports. Environment: PORT (coordinator port, default 23456), REMOTE_DIR (default: this
# checkout's path), REMOTE_PYTHON (default: python3), ENV_FILE (a file sourced on each host first, e.g.
# launch/rocm_env.sh).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 HOSTFILE [launcher flags...]" >&2; exit 2; }
hostfile=$1; shift
[ -r "$hostfile" ] || { echo "$0: error: HOSTFILE=$hostfile: no such readable file" >&2; exit 2; }
mapfile -t hosts < <(grep -v '^\s*#' "$hostfile" | awk 'NF {print $1}')
n=${#hosts[@]}
[ "$n" -ge 1 ] || { echo "$0: error: HOSTFILE=$hostfile lists no host" >&2; exit 2; }
port=${PORT:-23456}
dir=${REMOTE_DIR:-$(cd "$(dirname "$0")/.." && pwd)}
py=${REMOTE_PYTHON:-python3}
envfile=${ENV_FILE:-}
coord="${hosts[0]}:$port"
args=$(printf ' %q' "$@")
pids=()
for i in "${!hosts[@]}"; do
  pre="cd $(printf %q "$dir")"
  [ -n "$envfile" ] && pre="$pre && source $(printf %q "$envfile")"
  ssh -o BatchMode=yes "${hosts[$i]}" \
    "$pre && exec $py -m slope_jax.launch --num_processes=$n --process_id=$i --coordinator_address=$coord$args" &
  pids+=("$!")
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=$?; done
exit "$status"
