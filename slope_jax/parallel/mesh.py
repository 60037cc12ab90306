"""The device mesh for a `ParallelConfig`: axes `(pipeline, ring, ulysses)`, `ulysses` innermost (design §5)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from slope_jax.parallel.config import AXES, LayoutError, ParallelConfig


def make_mesh(parallel: ParallelConfig, devices=None) -> Mesh:
    """A `(pipeline, ring, ulysses)` mesh over `devices` (default: all devices, ordered by process then id, so
    that consecutive devices — the Ulysses group — share a host). Raises LayoutError on a device-count mismatch."""
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) != parallel.num_devices:
        raise LayoutError(f"pipeline*ring*ulysses = {parallel.num_devices} devices, but {len(devices)} are "
                          "available: the mesh must use every device exactly once")
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    grid = np.array(devices, dtype=object).reshape(parallel.pipeline, parallel.ring, parallel.ulysses)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 3)
