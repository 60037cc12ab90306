#!/usr/bin/env bash
# One-GPU device check (at most ~8 minutes): kernel parity (benchmarks/kernel_parity.py), then the prefill
# benchmark (benchmarks/device_prefill.py), with the jax already installed on the
# machine (no pip, no network). Run from the repository root; JSON goes to $OUT (the device tool's output folder) or
# benchmarks/results/. Extra arguments are passed to the benchmark (e.g. --budget_s=300 --lengths=8192).
#   benchmarks/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
DEST="${OUT:-benchmarks/results}"
mkdir -p "$DEST"
"$PY" -c 'import jax; print("jax", jax.__version__, jax.devices())' 2>&1 | tail -n 3
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null || true
# 1. the compiled kernel against the pure-JAX reference on the device (~2 minutes on an H200, mostly compiles)
PYTHONPATH=. timeout -k 5 150 "$PY" benchmarks/kernel_parity.py --out "$DEST/kernel_parity.json" 2>&1 \
  | tee "$DEST/kernel_parity.log"
# 2. hard stop at 320 s: the benchmark budgets itself to 270 s (+30 s watchdog grace) and writes its JSON after every step
PYTHONPATH=. timeout -k 5 320 "$PY" benchmarks/device_prefill.py --out "$DEST/device_prefill.json" "$@" \
  2>&1 | tee "$DEST/device_prefill.log"
rc=${PIPESTATUS[0]}
echo "device_prefill exit status $rc; JSON at $DEST/device_prefill.json"
exit "$rc"
