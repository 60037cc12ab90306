"""Timing helper shared by the CPU calibration benchmarks (plan_measure_cpu.py, plan_holdout_cpu.py)."""

from __future__ import annotations

import time
from typing import Callable


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Wall seconds of the fastest of `repeats` calls of `fn` (which must block until its work is done)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
