"""What the host CPU is: its model name and the instruction-set flags that change which kernels are fast.

Read from `/proc/cpuinfo` (Linux; x86 `flags`, Arm `Features`); elsewhere the name is `platform.processor()` and no
flags are known. Used by the CPU cost model's machine fingerprint (`plan.machine`) and by `StepOptions.resolve`
("auto" choices that depend on the CPU: `options.resolve_bf16_matmul`). No JAX needed.
"""

from __future__ import annotations

import functools
import platform

# the flags that change kernel choice or speed (AVX-512, AMX, Arm SVE / bf16 dot instructions, …)
FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
         "amx_int8", "sve", "asimd", "bf16")
# bfloat16 dot-product instructions: x86 AVX512_BF16 (VDPBF16PS) or AMX-BF16 tiles; Arm FEAT_BF16 ("bf16": BFDOT,
# BFMMLA). Without one of them a CPU GEMM library multiplies bfloat16 by widening it to float32 in its inner loop.
BF16_DOT_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


@functools.lru_cache(maxsize=1)
def cpu() -> tuple[str, tuple[str, ...]]:
    """(CPU model name, the `FLAGS` it has, in `FLAGS` order); ("<platform name>", ()) where /proc/cpuinfo is not
    readable."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and value.strip():
                    name = value.strip()
                elif key in ("flags", "Features"):
                    flags.update(value.split())
    except OSError:
        pass
    return name, tuple(f for f in FLAGS if f in flags)


def has_bf16_dot() -> bool | None:
    """Whether the CPU has bfloat16 dot-product instructions (`BF16_DOT_FLAGS`); None when its flags are unknown
    (no /proc/cpuinfo)."""
    _, flags = cpu()
    if not flags:
        return None
    return any(f in flags for f in BF16_DOT_FLAGS)
