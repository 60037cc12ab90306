"""The process environment JAX must see before it starts its backends: XLA flags and the platform.

XLA reads `XLA_FLAGS` once, when the first backend starts, so the entry points (launcher, convert, benchmarks) call
`configure` before they touch JAX; Python API users who want the same set `XLA_FLAGS` themselves (README, "Python
API") or call `configure` first.

CPU default, `--xla_cpu_use_fusion_emitters=false`: XLA:CPU (jaxlib 0.10) then generates fused loops with its
elemental IR emitters instead of the MLIR fusion emitters. Measured on this 2-core host: the README's main job
(bf16, 2 processes x 4 devices, 4 buckets) compiles in 33-34 s instead of 45-46 s (two runs each, same TTFT compute
within run-to-run noise); a float32 CP step (9 layers, 8 devices, one core) in 4.1 s instead of 8.2 s, 1.5 instead
of 5.1 s at the tests' -O0; the peer config on one device (bf16) in 1.3 instead of 2.2 s, with the same step time at
2048 tokens (1.9-2.2 s either way) and a faster one at 600 (0.74-0.83 vs 0.92-1.02 s). The parity suites pass
either way. The flag only concerns the CPU backend; a value the user set in `XLA_FLAGS` wins.
"""

from __future__ import annotations

import os

CPU_DEFAULT_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def _name(flag: str) -> str:
    return flag.split("=", 1)[0]


def xla_flags(current: str, cpu_devices: int | None = None) -> str:
    """`current` (an `XLA_FLAGS` value) plus the CPU defaults the user did not set, plus the virtual CPU device count
    when `cpu_devices` is given (replacing any count in `current`). Pure; see `configure`."""
    flags = current.split()
    if cpu_devices:
        flags = [f for f in flags if _name(f) != DEVICE_COUNT_FLAG]
    have = {_name(f) for f in flags}
    flags += [f for f in CPU_DEFAULT_FLAGS if _name(f) not in have]
    if cpu_devices:
        flags.append(f"{DEVICE_COUNT_FLAG}={int(cpu_devices)}")
    return " ".join(flags)


def configure(cpu_devices: int | None = None, platform: str | None = None) -> None:
    """Set `XLA_FLAGS` (`xla_flags`) and `JAX_PLATFORMS` for this process and its children.

    `cpu_devices`: split the host CPU into this many virtual devices (and default the platform to cpu); `platform`:
    force a JAX platform (cpu, cuda, rocm). Call before JAX starts a backend; later calls have no effect on a started
    backend. Raises nothing.
    """
    os.environ["XLA_FLAGS"] = xla_flags(os.environ.get("XLA_FLAGS", ""), cpu_devices)
    if cpu_devices:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if platform:
        os.environ["JAX_PLATFORMS"] = platform
