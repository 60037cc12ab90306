"""Fit a hardware profile's efficiency factors to measured step times.

Model (design §7, `model.predict`): `time = F_matmul/(peak·e_mm) + F_attention/(peak·e_att) + communication
+ overhead_s + layer_overhead_s · (layer slots executed)`. With `x = (1/e_mm, 1/e_att, overhead_s, layer_overhead_s)`
this is linear in x; the fit minimises the squared *relative* error over the measured rows subject to x ≥ 0 (an
exhaustive active-set search over the 16 subsets of free coefficients: exact for 4 unknowns).
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


def _features(cfg: ModelConfig, hw: Hardware, row: dict, devices_per_host: int) -> tuple[np.ndarray, float]:
    """Row of the linear system at unit efficiency, and its communication time; the exposed part of the ring
    transfer (max(compute, transfer) − compute) depends on the efficiency, so it is taken at `hw`'s."""
    par = ParallelConfig(pipeline=row["pipeline"], ring=row["ring"], ulysses=row["ulysses"],
                         expert=row.get("expert"))
    kw = dict(batch=row.get("batch", 1), devices_per_host=devices_per_host)
    p = predict(cfg, par, row["length"], dataclasses.replace(hw, efficiency=_UNIT), **kw)
    tb = p.time_breakdown_ms
    comm = sum(v for k, v in tb.items() if k not in ("matmul", "attention", "overhead", "ring_ppermute_exposed"))
    comm += predict(cfg, par, row["length"], hw, **kw).time_breakdown_ms["ring_ppermute_exposed"]
    return np.array([tb["matmul"] / 1e3, tb["attention"] / 1e3, 1.0, float(p.layer_slots)]), comm / 1e3


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
        par = ParallelConfig(pipeline=r["pipeline"], ring=r["ring"], ulysses=r["ulysses"], expert=r.get("expert"))
        p = predict(cfg, par, r["length"], fitted, batch=r.get("batch", 1), devices_per_host=devices_per_host)
        table.append({"layout": p.layout, "length": r["length"], "measured_ms": r["ms"], "predicted_ms": p.ttft_ms,
                      "error": p.ttft_ms / r["ms"] - 1})
    return eff, table


def _fit_once(cfg, hw, rows, devices_per_host, source) -> Efficiency:
    feats = [_features(cfg, hw, r, devices_per_host) for r in rows]
    A = np.stack([f for f, _ in feats])
    y = np.array([r["ms"] / 1e3 - c for r, (_, c) in zip(rows, feats)])
    w = 1.0 / np.array([r["ms"] / 1e3 for r in rows])  # relative error
    best, best_err = None, np.inf
    for k in range(1, 5):
        for free in itertools.combinations(range(4), k):
            if 0 not in free or 1 not in free:
                continue  # both efficiencies must be fitted
            x = np.zeros(4)
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
    return Efficiency(matmul=1 / best[0], attention=1 / best[1], overhead_s=float(best[2]),
                      layer_overhead_s=float(best[3]), source=source)


def normalised(hw: Hardware, eff: Efficiency) -> Hardware:
    """`hw` with `eff`, the peak raised so that both efficiencies are <= 1 (same predictions)."""
    scale = max(1.0, eff.matmul, eff.attention)
    return dataclasses.replace(hw, peak_flops={k: v * scale for k, v in hw.peak_flops.items()},
                               efficiency=dataclasses.replace(eff, matmul=eff.matmul / scale,
                                                              attention=eff.attention / scale))
