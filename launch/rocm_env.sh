# Environment for slope_jax on AMD Instinct MI250 nodes (ROCm). Source it on every host before the launcher.
# Values are starting points; check them against your ROCm/RCCL versions and your cluster's network.

# One process per node sees all 8 GCDs (4 MI250 cards x 2 GCDs). Ulysses is the innermost mesh axis, so an
# all-to-all group stays inside a node; keep ulysses <= 8.
export HIP_VISIBLE_DEVICES=${HIP_VISIBLE_DEVICES:-0,1,2,3,4,5,6,7}

# XLA: let JAX take most of each GCD's 64 GB (weights + KV + activations are planned against it), and let the
# latency-hiding scheduler overlap ring ppermutes with attention compute.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"

# RCCL (reads the NCCL_* variables): the interface and HCAs used between nodes. Set them to your fabric's names.
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-eth0}
# export NCCL_IB_HCA=mlx5_0,mlx5_1        # InfiniBand / RoCE adapters, if any
# export NCCL_DEBUG=INFO                  # print the topology RCCL picked, once, when debugging
export HSA_FORCE_FINE_GRAIN_PCIE=${HSA_FORCE_FINE_GRAIN_PCIE:-1}  # RCCL peer-to-peer over PCIe/xGMI
export GPU_MAX_HW_QUEUES=${GPU_MAX_HW_QUEUES:-2}

# gRPC (jax.distributed's coordination service) must not go through an HTTP proxy.
unset http_proxy https_proxy HTTP_PROXY HTTPS_PROXY
