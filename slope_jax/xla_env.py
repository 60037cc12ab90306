"""The process environment JAX must see before it starts its backends: the virtual CPU device count and the platform.

XLA reads `XLA_FLAGS` once, when the first backend starts, so the entry points (launcher, convert, CPU benchmarks)
call `configure` before they touch JAX. Flags the user set in `XLA_FLAGS` are kept.

No other XLA flag is changed from XLA's defaults. Measured and left at the default: XLA:CPU's elemental emitters
(`--xla_cpu_use_fusion_emitters=false`) compile this project's steps in about half the time (main job's 4 buckets,
2-core host: 33–34 s vs 45–46 s) but run the peer config's 8192-token prefill 1.5× slower (bf16, one device: 12.6 s
vs 8.4 s; the CPU cost model's attention term 3× slower per score entry), and a prefill engine is judged by its
TTFT. The test process uses them (`tests/conftest.py`), where compiling dominates and prompts are short.
"""

from __future__ import annotations

import os

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def xla_flags(current: str, cpu_devices: int | None = None) -> str:
    """`current` (an `XLA_FLAGS` value) with the virtual CPU device count set to `cpu_devices` (replacing any count
    in `current`; unchanged when `cpu_devices` is None or 0). Pure; see `configure`."""
    flags = current.split()
    if cpu_devices:
        flags = [f for f in flags if f.split("=", 1)[0] != DEVICE_COUNT_FLAG]
        flags.append(f"{DEVICE_COUNT_FLAG}={int(cpu_devices)}")
    return " ".join(flags)


def configure(cpu_devices: int | None = None, platform: str | None = None) -> None:
    """Set `XLA_FLAGS` (`xla_flags`) and `JAX_PLATFORMS` for this process and its children.

    `cpu_devices`: split the host CPU into this many virtual devices (and default the platform to cpu); `platform`:
    force a JAX platform (cpu, cuda, rocm). Call before JAX starts a backend: a started backend keeps its flags.
    Raises nothing.
    """
    if cpu_devices:
        os.environ["XLA_FLAGS"] = xla_flags(os.environ.get("XLA_FLAGS", ""), cpu_devices)
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if platform:
        os.environ["JAX_PLATFORMS"] = platform
