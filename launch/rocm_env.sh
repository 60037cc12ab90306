# Environment for slope_jax on AMD Instinct MI250 nodes (ROCm). Source it on every host before the launcher.
# Values are starting points; check them against your ROCm/RCCL versions and your cluster's network. Each line names
# its source. SLOPE_HARDWARE (default mi250) names the hardware profile, configs/hardware/<name>.json, whose memory
# figures the SLO planner used.

# One process per node sees all 8 GCDs (4 MI250 cards x 2 GCDs). Ulysses is the innermost mesh axis, so an
# all-to-all group stays inside a node; keep ulysses <= 8.
# Source: HIP environment variables, https://rocm.docs.amd.com/projects/HIP/en/latest/reference/env_variables.html
# (HIP_VISIBLE_DEVICES: the device indices exposed to HIP applications).
export HIP_VISIBLE_DEVICES=${HIP_VISIBLE_DEVICES:-0,1,2,3,4,5,6,7}

# XLA's share of each GCD's memory: the profile's memory_fraction, the same number the planner's memory check uses
# (usable = HBM x memory_fraction - runtime_reserve_gib; slope_jax/plan/hardware.py), read from the profile so the
# two cannot drift apart. The rest stays outside XLA's pool for the HIP context and RCCL's own buffers.
# Source: JAX, GPU memory allocation, https://docs.jax.dev/en/latest/gpu_memory_allocation.html (JAX preallocates
# 75% by default; XLA_PYTHON_CLIENT_MEM_FRACTION sets the fraction; newer JAX also reads XLA_CLIENT_MEM_FRACTION).
# An explicit XLA_PYTHON_CLIENT_MEM_FRACTION in the environment wins; if the profile cannot be read, a warning is
# printed and the variable is left unset (JAX's 75% default, below what the planner assumed).
_slope_root=$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)
_slope_profile="$_slope_root/configs/hardware/${SLOPE_HARDWARE:-mi250}.json"
_slope_fraction=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["memory_fraction"])' \
  "$_slope_profile" 2>/dev/null) || _slope_fraction=
if [ -n "${XLA_PYTHON_CLIENT_MEM_FRACTION:-}" ]; then
  :
elif [ -n "$_slope_fraction" ]; then
  export XLA_PYTHON_CLIENT_MEM_FRACTION=$_slope_fraction
else
  echo "rocm_env.sh: could not read memory_fraction from $_slope_profile; XLA_PYTHON_CLIENT_MEM_FRACTION not set" >&2
fi
unset _slope_root _slope_profile _slope_fraction

# Let the latency-hiding scheduler overlap ring ppermutes with attention compute.
# Source: JAX, GPU performance tips, https://docs.jax.dev/en/latest/gpu_performance_tips.html
# (--xla_gpu_enable_latency_hiding_scheduler).
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"

# RCCL (reads the NCCL_* variables): the interface and HCAs used between nodes. Set them to your fabric's names.
# Source: NCCL environment variables, https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html
# (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_DEBUG); RCCL, https://github.com/ROCm/rccl (the same variables).
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-eth0}
# export NCCL_IB_HCA=mlx5_0,mlx5_1        # InfiniBand / RoCE adapters, if any
# export NCCL_DEBUG=INFO                  # print the topology RCCL picked, once, when debugging
# Source: RCCL README, https://github.com/ROCm/rccl (HSA_FORCE_FINE_GRAIN_PCIE=1 for peer-to-peer over PCIe/xGMI).
export HSA_FORCE_FINE_GRAIN_PCIE=${HSA_FORCE_FINE_GRAIN_PCIE:-1}
# Source: HIP environment variables (above; GPU_MAX_HW_QUEUES: hardware queues allocated per device).
export GPU_MAX_HW_QUEUES=${GPU_MAX_HW_QUEUES:-2}

# gRPC (jax.distributed's coordination service) must not go through an HTTP proxy.
# Source: gRPC environment variables, https://github.com/grpc/grpc/blob/master/doc/environment_variables.md
# (gRPC clients honour http_proxy / https_proxy).
unset http_proxy https_proxy HTTP_PROXY HTTPS_PROXY
