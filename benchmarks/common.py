"""The benchmark library: best-of timing, the same-run matmul peak, free local ports, and the result writer that stamps
every result JSON with its provenance.

Every benchmark that writes JSON writes it with `write_result(path, payload, load_start=...)`: atomically
(`slope_jax.atomic.atomic_json`: strict JSON, a reader never sees a torn file), with a `provenance` object beside the
payload's own keys —

    commit    `git rev-parse HEAD` of this tree, and `dirty` (uncommitted changes to tracked files)
    date      UTC, ISO 8601, when the result was written
    versions  python, jax, jaxlib, numpy, slope_jax; torch, transformers, vllm where installed (package metadata:
              nothing is imported for this)
    machine   platform, CPU model, logical cores, memory; the JAX backend and device kind if the run imported JAX
    load      `os.getloadavg()` at the start of the run (`load_start`) and at the end: on a shared machine the
              absolute numbers move with it
    argv      the command line

so a committed number says which code and which machine produced it. Results committed before this library existed
carry a provenance stamped from git history instead (`benchmarks/stamp_provenance.py`, `stamped_later: true`).

Imports only the standard library at module level: scripts import it before they set XLA flags. Run from a script in
benchmarks/ (its directory is on sys.path): `from common import best_seconds, write_result`.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
import time
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # slope_jax importable from a plain `python benchmarks/<name>.py`

VERSION_PACKAGES = ("jax", "jaxlib", "numpy", "slope_jax", "torch", "transformers", "vllm")


# --- timing ---------------------------------------------------------------------------------------------------------

def seconds(fn: Callable[[], object]) -> float:
    """Wall seconds of one call of `fn` (which must block until its work is done)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Wall seconds of the fastest of `repeats` calls of `fn` (which must block until its work is done)."""
    return min(seconds(fn) for _ in range(max(1, repeats)))


def best_jax_seconds(fn: Callable, args: tuple, repeats: int) -> float:
    """Best of `repeats` timed calls of the JAX function `fn(*args)`, each blocked until ready, after one untimed call
    (compilation, autotuning, first allocation)."""
    import jax

    jax.block_until_ready(fn(*args))
    return best_seconds(lambda: jax.block_until_ready(fn(*args)), repeats)


# --- the same-run matmul peak ---------------------------------------------------------------------------------------

def matmul_peak(n: int = 2048, dtype: str = "float32", repeats: int = 5) -> float:
    """FLOP/s (2n³ per call) of the best of `repeats` jitted n×n×n `jnp.dot`s on JAX's default device, measured in
    this run so that every rate a benchmark reports is divided by a peak of the same machine under the same load.
    `dtype` is the inputs' type ("float32" or "bfloat16"); bfloat16 accumulates in float32
    (`preferred_element_type`), as the model's einsums do. Inputs: standard normal, seed 0; the first call is not
    timed."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    dt = jnp.dtype(dtype)
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), np.float32), dt)
    pet = jnp.float32 if dt != jnp.float32 else None
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=pet))
    return 2 * n ** 3 / best_jax_seconds(f, (a, a), repeats)


def matmul_peaks(n: int = 2048, dtypes=("float32", "bfloat16"), repeats: int = 5) -> dict[str, float]:
    """{dtype: FLOP/s} of `matmul_peak` for each dtype."""
    return {dt: matmul_peak(n, dt, repeats) for dt in dtypes}


def numpy_matmul_peak(n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` float32 n×n×n NumPy matmuls (the host BLAS: a second opinion on the CPU)."""
    import numpy as np

    a = np.random.default_rng(0).standard_normal((n, n), np.float32)
    return 2 * n ** 3 / best_seconds(lambda: a @ a, repeats)


# --- ports ----------------------------------------------------------------------------------------------------------

def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it; the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- provenance and the result writer -------------------------------------------------------------------------------

def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def commit() -> dict:
    """{"commit": HEAD's 40-hex id or None outside a git checkout, "dirty": tracked files differ from HEAD}."""
    head = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": head, "dirty": bool(status) if status is not None else None}


def versions() -> dict:
    """Python and the installed versions of the packages in VERSION_PACKAGES (absent ones left out), from package
    metadata: nothing is imported."""
    out = {"python": platform.python_version()}
    for name in VERSION_PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _cpu() -> tuple[str | None, list[str]]:
    """(CPU model, its kernel-relevant ISA flags: `slope_jax.cpuinfo.FLAGS`, e.g. whether it has bf16 dots)."""
    from slope_jax import cpuinfo  # no JAX

    name, flags = cpuinfo.cpu()
    return name or None, list(flags)


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def machine() -> dict:
    """Platform, CPU model and ISA flags, logical cores (and those this process may use), physical memory; the JAX
    backend and device kinds when the run has imported JAX (it is not imported here)."""
    cpu, flags = _cpu()
    out = {"platform": platform.platform(), "cpu": cpu, "cpu_flags": flags,
           "cores": os.cpu_count(), "memory_bytes": _memory_bytes()}
    if hasattr(os, "sched_getaffinity"):
        out["cores_usable"] = len(os.sched_getaffinity(0))
    jax = sys.modules.get("jax")
    if jax is not None:
        try:
            devices = jax.devices()
            out["jax_backend"] = jax.default_backend()
            out["devices"] = sorted({f"{d.platform}:{getattr(d, 'device_kind', '?')}" for d in devices})
            out["device_count"] = len(devices)
        except Exception:  # a backend that failed to start is not this writer's failure
            pass
    return out


def start_load() -> list[float]:
    """The load average (1, 5, 15 min) now: pass it to `write_result` as `load_start` at the start of a run."""
    return list(os.getloadavg())


def provenance(load_start=None) -> dict:
    """The `provenance` object of a result written now (see the module docstring)."""
    load = {"end": list(os.getloadavg())}
    if load_start is not None:
        load = {"start": list(load_start), **load}
    return {**commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "versions": versions(), "machine": machine(), "load": load, "argv": list(sys.argv)}


def _plain(obj):
    """`obj` with NumPy scalars and arrays, tuples and non-string keys made plain JSON values."""
    if isinstance(obj, dict):
        return {k if isinstance(k, str) else str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, (str, int, float, bool, type(None))):
        return obj
    if hasattr(obj, "tolist"):  # NumPy / JAX scalars and arrays
        return _plain(obj.tolist())
    if hasattr(obj, "__float__"):
        return float(obj)
    return obj


def write_result(path: str, payload: dict, *, load_start=None, indent: int = 1) -> dict:
    """Write `payload` (a dict) plus its `provenance` to `path` atomically as strict JSON; creates the directory.
    Returns what was written. A payload key `provenance` is refused (it would be overwritten)."""
    from slope_jax.atomic import atomic_json

    if "provenance" in payload:
        raise ValueError("payload already has a 'provenance' key")
    doc = {**_plain(payload), "provenance": provenance(load_start)}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_json(path, doc, indent=indent)
    return doc
