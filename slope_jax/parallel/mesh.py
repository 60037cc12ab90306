"""The device mesh for a `ParallelConfig`: axes `(pipeline, ring, ulysses)`, `ulysses` innermost (docs/design.md §5).

Each Ulysses group (the devices of one (stage, ring rank), which exchange all-to-alls every full-attention layer) must
sit inside one host: crossing hosts would put the heaviest collective on the slowest links. A host here is a JAX
process (the launcher runs one process per host with all its local devices); a run with several processes per host
(e.g. one per GPU) may opt in with `allow_cross_host_ulysses=True`.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from slope_jax.parallel.config import AXES, LayoutError, ParallelConfig


def device_grid(parallel: ParallelConfig, devices) -> np.ndarray:
    """Devices as a `[P, R, U]` object array: ordered by (process, id), so consecutive devices — a Ulysses group —
    share a process whenever each process holds a multiple of U devices."""
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    return np.array(devices, dtype=object).reshape(parallel.pipeline, parallel.ring, parallel.ulysses)


def check_ulysses_hosts(grid: np.ndarray, allow_cross_host_ulysses: bool = False) -> None:
    """Raise LayoutError if a Ulysses group of `grid` `[P, R, U]` spans several processes (hosts), unless allowed."""
    if allow_cross_host_ulysses:
        return
    for p in range(grid.shape[0]):
        for r in range(grid.shape[1]):
            procs = sorted({d.process_index for d in grid[p, r]})
            if len(procs) > 1:
                per = sorted({sum(d.process_index == q for d in grid.reshape(-1)) for q in procs})
                raise LayoutError(
                    f"ulysses={grid.shape[2]}: the Ulysses group of stage {p}, ring rank {r} would span processes "
                    f"(hosts) {procs}; every process must hold a multiple of ulysses devices (they hold {per}). "
                    "Use a ulysses degree that divides the devices per host (and more ring ranks), or pass "
                    "allow_cross_host_ulysses=True when several processes share one host")


def make_mesh(parallel: ParallelConfig, devices=None, *, allow_cross_host_ulysses: bool = False) -> Mesh:
    """A `(pipeline, ring, ulysses)` mesh over `devices` (default: all devices; see `device_grid`).

    Raises LayoutError on a device-count mismatch, or when a Ulysses group would cross hosts (`check_ulysses_hosts`).
    """
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) != parallel.num_devices:
        raise LayoutError(f"pipeline*ring*ulysses = {parallel.num_devices} devices, but {len(devices)} are "
                          "available: the mesh must use every device exactly once")
    grid = device_grid(parallel, devices)
    check_ulysses_hosts(grid, allow_cross_host_ulysses)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 3)


def device_map(mesh: Mesh) -> list[dict]:
    """Where each device sits: `[{"device", "process", "stage", "ring", "ulysses"}]`, in mesh order."""
    out = []
    for (p, r, u), d in np.ndenumerate(mesh.devices):
        out.append({"device": int(d.id), "process": int(d.process_index), "stage": p, "ring": r, "ulysses": u})
    return out


def format_device_map(mesh: Mesh) -> str:
    """One log line: `device -> (process, stage, ring, ulysses)` for every device of the mesh."""
    return "; ".join(f"{e['device']}->(p{e['process']} s{e['stage']} r{e['ring']} u{e['ulysses']})"
                     for e in device_map(mesh))
