#!/usr/bin/env bash
# The MI250 (ROCm) host check: one run, one JSON to send back, rocm_check.json (fields: docs/deployment.md, "The ROCm
# host check"; SCHEMA in benchmarks/rocm_check.py). The sibling of device_check.sh (the prepared H200 run). Parts, each
# under its own timeout; a part that fails or times out is recorded as {"error": ...} and the next one runs:
#   1. kernel_parity   the Pallas kernels vs the XLA / loop references on the same device (benchmarks/kernel_parity.py)
#   2. prefill_parity  a small float32 prefill on the device (the engine's "auto" kernels) vs the same prefill on the
#                      CPU (benchmarks/rocm_check.py prefill_parity; tolerance 1e-3 of the logits' scale)
#   3. device_prefill  gpt-oss-20b dims cut to 2 layers at 8K and 32K tokens: MFU against the same-run bf16 matmul
#                      peak, tokens/s, the attention core's FLOP/s (benchmarks/device_prefill.py)
#   4. collective_bw   all_to_all, ring ppermute, all_gather, psum over every local GCD (benchmarks/collective_bw.py)
#   5. memory          allocator limit and use, the prefill's peak, the planner's predicted headroom for the same
#                      config (benchmarks/rocm_check.py memory)
# then merges them (benchmarks/rocm_check.py merge). Sources launch/rocm_env.sh first (not in a dry run). Needs: JAX
# with the ROCm plugin matching the host's ROCm, this repository's dependencies; no network. About 15 minutes.
#   benchmarks/rocm_check.sh              # on the MI250 host; OUT=<dir> (default benchmarks/results/rocm_check)
#   benchmarks/rocm_check.sh --dry-run    # CPU, tiny sizes, 8 virtual devices: checks the scripts (< 3 minutes)
# Exit status 0 when every part exited 0 and both parity checks passed (the JSON's "ok"), 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
DEST="${OUT:-benchmarks/results/rocm_check}"
mkdir -p "$DEST"
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then
  DRY=1
  shift
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ $DRY == 1 ]]; then
  export JAX_PLATFORMS=cpu
  SMOKE=(--smoke)
  T_PARITY=240 T_PREFILL_PARITY=120 T_PREFILL=240 T_COLL=120 T_MEM=120
  PARITY_ARGS=(--smoke --budget_s=150)
  PREFILL_ARGS=(--smoke --budget_s=150)
  COLL_ARGS=(--smoke --cpu_devices=8)
else
  # shellcheck source=../launch/rocm_env.sh
  source launch/rocm_env.sh
  SMOKE=()
  T_PARITY=200 T_PREFILL_PARITY=300 T_PREFILL=420 T_COLL=300 T_MEM=120
  PARITY_ARGS=(--budget_s=150)
  PREFILL_ARGS=(--budget_s=330 --grace_s=45 --lengths=8192,32768)
  COLL_ARGS=(--budget_s=240)
fi
# the engine's own implementations on this backend first (its MFU), then the XLA / loop references for comparison
IMPLS=$("$PY" - <<'EOF' 2>/dev/null
import jax
from slope_jax.model import options
p = jax.default_backend()
a, m = options.resolve_attention("auto", p), options.resolve_moe("auto", p)
print(f"--attention_impls={','.join(dict.fromkeys([a, 'xla']))} --moe_impls={','.join(dict.fromkeys([m, 'loop']))}")
EOF
) || IMPLS=""
"$PY" -c 'import jax; print("jax", jax.__version__, jax.devices())' 2>&1 | tail -n 3
rocm-smi --showproductname 2>/dev/null | head -n 20 || true
: > "$DEST/parts.tsv"

part() {  # part NAME TIMEOUT_S COMMAND...: log to $DEST/NAME.log, status and seconds to parts.tsv
  local name=$1 limit=$2 t0 rc
  shift 2
  t0=$(date +%s)
  echo "== $name (timeout ${limit} s)"
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$DEST/$name.log"
  rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$DEST/parts.tsv"
  echo "== $name: exit status $rc after $(( $(date +%s) - t0 )) s"
}

part kernel_parity "$T_PARITY" "$PY" benchmarks/kernel_parity.py --out "$DEST/kernel_parity.json" "${PARITY_ARGS[@]}"
part prefill_parity "$T_PREFILL_PARITY" "$PY" benchmarks/rocm_check.py prefill_parity \
  --out "$DEST/prefill_parity.json" "${SMOKE[@]}"
# shellcheck disable=SC2086  # IMPLS is two flags
part device_prefill "$T_PREFILL" "$PY" benchmarks/device_prefill.py --out "$DEST/device_prefill.json" \
  "${PREFILL_ARGS[@]}" $IMPLS "$@"
part collective_bw "$T_COLL" "$PY" benchmarks/collective_bw.py --out "$DEST/collective_bw.json" "${COLL_ARGS[@]}"
part memory "$T_MEM" "$PY" benchmarks/rocm_check.py memory --out "$DEST/memory.json" \
  --prefill "$DEST/device_prefill.json" --hardware "${SLOPE_HARDWARE:-mi250}"
MERGE_ARGS=(--dir "$DEST")
[[ $DRY == 1 ]] && MERGE_ARGS+=(--dry_run)
"$PY" benchmarks/rocm_check.py merge "${MERGE_ARGS[@]}"
merge_rc=$?
echo "wrote $DEST/rocm_check.json (send this file back)"
ok=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["ok"])' "$DEST/rocm_check.json" 2>/dev/null)
[[ $merge_rc == 0 && $ok == True ]] && exit 0
exit 1
