#!/usr/bin/env bash
# One prepared GPU run (< 8 minutes on one H200; jax with CUDA already installed, no pip, no network):
#   1. kernel parity on the device (benchmarks/kernel_parity.py): cuDNN's fused attention (attention_impl=cudnn) and
#      the Triton flash-attention kernel (one program per KV head) vs the XLA reference, and the grouped MXFP4 MoE
#      kernel vs the tile loop, float32 and bf16;
#   2. the prefill benchmark (benchmarks/device_prefill.py): gpt-oss-20b dims cut to 2 layers at 8K and 32K tokens,
#      same-run bf16 matmul peak, prefill MFU, one MoE layer's fraction of the peak, the full-attention core's
#      TFLOP/s, then the XLA / loop implementations side by side as the budget allows; issue 21's bars are checked
#      in device_prefill.json's "targets".
# JSON (and logs) go to $OUT (the device tool's output folder) or benchmarks/results/. Run from anywhere:
#   benchmarks/device_check.sh                 # GPU
#   benchmarks/device_check.sh --dry-run       # CPU, tiny sizes, interpret mode: checks the scripts, not the device
# Extra arguments go to device_prefill.py (e.g. --lengths=8192 --budget_s=200).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
DEST="${OUT:-benchmarks/results}"
mkdir -p "$DEST"
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then
  DRY=1
  shift
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import jax; print("jax", jax.__version__, jax.devices())' 2>&1 | tail -n 3
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null || true
# ragged and the XLA attention are left out: measured far slower on an H200 (benchmarks/measured/h200/README.md);
# the first of each list is measured first (the targets): cuDNN's attention and 4096-row loop MoE tiles
IMPLS=(--attention_impls=cudnn,pallas --moe_impls=loop@4096,loop,pallas)
if [[ $DRY == 1 ]]; then
  export JAX_PLATFORMS=cpu
  PARITY_ARGS=(--smoke --budget_s=240)
  PREFILL_ARGS=(--smoke --budget_s=240 "${IMPLS[@]}")
  PARITY_TIMEOUT=300
  PREFILL_TIMEOUT=300
else
  # parity: stops starting cases after 110 s (mostly compiles), hard stop at 150 s
  PARITY_ARGS=(--budget_s=110)
  # prefill: budgets itself to 240 s (+30 s watchdog grace) and writes its JSON after every step; hard stop at 280 s
  PREFILL_ARGS=(--budget_s=240 --grace_s=30 --lengths=8192,32768 "${IMPLS[@]}")
  PARITY_TIMEOUT=150
  PREFILL_TIMEOUT=280
fi
t0=$(date +%s)
timeout -k 5 "$PARITY_TIMEOUT" "$PY" benchmarks/kernel_parity.py --out "$DEST/kernel_parity.json" "${PARITY_ARGS[@]}" \
  2>&1 | tee "$DEST/kernel_parity.log"
parity_rc=${PIPESTATUS[0]}
echo "kernel_parity exit status $parity_rc after $(( $(date +%s) - t0 )) s; JSON at $DEST/kernel_parity.json"
timeout -k 5 "$PREFILL_TIMEOUT" "$PY" benchmarks/device_prefill.py --out "$DEST/device_prefill.json" \
  "${PREFILL_ARGS[@]}" "$@" 2>&1 | tee "$DEST/device_prefill.log"
rc=${PIPESTATUS[0]}
echo "device_prefill exit status $rc after $(( $(date +%s) - t0 )) s in all; JSON at $DEST/device_prefill.json"
if [[ $rc == 0 && $parity_rc != 0 ]]; then
  rc=$parity_rc
fi
exit "$rc"
