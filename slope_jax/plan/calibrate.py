"""Fit a hardware profile's efficiency factors to measured step times.

Model (`model.predict`): `time = F_matmul/(peak·e_mm) + F_attention/(peak·e_att) + communication
+ overhead_s + layer_overhead_s · (layer slots executed)`, where e_att is `attention` for sharded steps and
`attention_one_device` for one-device steps (`hardware.Efficiency`: different programs with differently shaped
attention tiles). With `x = (1/e_mm, 1/e_att, 1/e_att1, overhead_s, layer_overhead_s)` this is linear in x; the fit
minimises the squared *relative* error over the measured rows subject to x ≥ 0 (an exhaustive active-set search over
the subsets of free coefficients: exact). `attention_one_device` is fitted only when the rows hold both one-device and
sharded steps; otherwise the one attention efficiency covers every row.
Rows: JSON `{"rows": [{"pipeline", "ring", "ulysses", "length", "batch", "ms"}, ...]}` (benchmarks/plan_measure_cpu.py).
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from slope_jax.model.config import ModelConfig
from slope_jax.parallel.config import ParallelConfig
from slope_jax.plan.hardware import Efficiency, Hardware
from slope_jax.plan.model import predict

_UNIT = Efficiency(matmul=1.0, attention=1.0)
_N = 5  # coefficients: 1/e_mm, 1/e_att (sharded), 1/e_att (one device), overhead_s, layer_overhead_s


def _features(cfg: ModelConfig, hw: Hardware, row: dict, devices_per_host: int) -> tuple[np.ndarray, float]:
    """Row of the linear system at unit efficiency, and its communication time; the exposed part of the ring
    transfer (max(compute, transfer) − compute) depends on the efficiency, so it is taken at `hw`'s."""
    par = ParallelConfig.from_row(row)
    kw = dict(batch=row.get("batch", 1), devices_per_host=devices_per_host)
    p = predict(cfg, par, row["length"], dataclasses.replace(hw, efficiency=_UNIT), **kw)
    tb = p.time_breakdown_ms
    comm = sum(v for k, v in tb.items() if k not in ("matmul", "attention", "overhead", "ring_ppermute_exposed"))
    comm += predict(cfg, par, row["length"], hw, **kw).time_breakdown_ms["ring_ppermute_exposed"]
    one = par.num_devices == 1
    att = tb["attention"] / 1e3
    return np.array([tb["matmul"] / 1e3, 0.0 if one else att, att if one else 0.0, 1.0, float(p.layer_slots)]), (
        comm / 1e3)


def fit(cfg: ModelConfig, hw: Hardware, rows: list[dict], *, devices_per_host: int = 8, source: str = ""
        ) -> tuple[Efficiency, list[dict]]:
    """Efficiency fitted to `rows` (module docstring) and a per-row table of measured vs predicted ms.

    Raises ValueError with fewer than 4 rows or when no non-negative fit exists.
    """
    if len(rows) < 4:
        raise ValueError(f"calibration needs >= 4 measured rows, got {len(rows)}")
    eff = hw.efficiency
    for _ in range(4):  # fixed point: the exposed ring transfer depends on the fitted efficiency
        eff = _fit_once(cfg, dataclasses.replace(hw, efficiency=eff), rows, devices_per_host, source)
    fitted = dataclasses.replace(hw, efficiency=eff)
    table = []
    for r in rows:
        par = ParallelConfig.from_row(r)
        p = predict(cfg, par, r["length"], fitted, batch=r.get("batch", 1), devices_per_host=devices_per_host)
        table.append({"layout": p.layout, "length": r["length"], "measured_ms": r["ms"], "predicted_ms": p.ttft_ms,
                      "error": p.ttft_ms / r["ms"] - 1})
    return eff, table


def _fit_once(cfg, hw, rows, devices_per_host, source) -> Efficiency:
    feats = [_features(cfg, hw, r, devices_per_host) for r in rows]
    A = np.stack([f for f, _ in feats])
    y = np.array([r["ms"] / 1e3 - c for r, (_, c) in zip(rows, feats)])
    w = 1.0 / np.array([r["ms"] / 1e3 for r in rows])  # relative error
    both = bool(A[:, 1].any() and A[:, 2].any())
    if not both:  # one kind of step only: one attention efficiency for all rows
        A = A.copy()
        A[:, 1] += A[:, 2]
        A[:, 2] = 0.0
    needed = {0, 1, 2} if both else {0, 1}  # every efficiency the rows can tell must be fitted
    best, best_err = None, np.inf
    for k in range(len(needed), _N + 1):
        for free in itertools.combinations(range(_N), k):
            if not needed <= set(free) or (not both and 2 in free):
                continue
            x = np.zeros(_N)
            sol, *_ = np.linalg.lstsq(A[:, free] * w[:, None], y * w, rcond=None)
            if (sol <= 0).any():
                continue
            x[list(free)] = sol
            err = float(((((A @ x) - y) * w) ** 2).sum())
            if err < best_err:
                best, best_err = x, err
    if best is None:
        raise ValueError("no non-negative fit: the measured times do not grow with the predicted work")
    # may exceed 1 when the profile's peak was measured low (a loaded machine); `normalised` rescales the peak
    return Efficiency(matmul=1 / best[0], attention=1 / best[1], overhead_s=float(best[3]),
                      layer_overhead_s=float(best[4]), source=source,
                      attention_one_device=1 / best[2] if both else None)


def normalised(hw: Hardware, eff: Efficiency) -> Hardware:
    """`hw` with `eff`, the peak raised so that both efficiencies are <= 1 (same predictions)."""
    one = eff.attention_one_device
    scale = max(1.0, eff.matmul, eff.attention, one or 0.0)
    scaled = dataclasses.replace(eff, matmul=eff.matmul / scale, attention=eff.attention / scale,
                                 attention_one_device=None if one is None else one / scale)
    return dataclasses.replace(hw, peak_flops={k: v * scale for k, v in hw.peak_flops.items()}, efficiency=scaled)
