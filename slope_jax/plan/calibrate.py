"""Fit a hardware profile's efficiency factors to measured step times.

Model (`model.predict`): `time = F_matmul/(peak·e_mm) + F_attention/(peak·e_att) + elements·element_s +
score_entries·attention_entry_s + moe_tiles·moe_tile_s + weight_bytes·ticks·weight_byte_s + communication + overhead_s
+ layer_overhead_s · (layer slots executed)`, where e_att is `attention` for sharded steps and `attention_one_device`
for one-device steps (`hardware.Efficiency`: different programs with differently shaped attention tiles), `elements` /
`score_entries` are the activation elements and attention score entries of `flops.per_device` and weight_bytes the
parameter bytes a device holds. With `x = (1/e_mm, 1/e_att, 1/e_att1, element_s, attention_entry_s, weight_byte_s,
overhead_s, layer_overhead_s, moe_tile_s)` this is linear in x; the fit minimises the squared *relative* error over
the measured rows subject to x ≥ 0 (an exhaustive active-set search over the subsets of free coefficients: exact).
`attention_one_device` is fitted only when the rows hold both one-device and sharded steps; otherwise the one
attention efficiency covers every row. Rows of several model configs (a row's own `"config"`) let the fit tell the
FLOP terms from the element terms, so that the profile carries over to configs it was not fitted on
(benchmarks/plan_holdout_cpu.py checks that on held-out configs).
Rows: JSON `{"rows": [{"pipeline", "ring", "ulysses", "length", "batch", "ms", "config"?, "dtype"?}, ...]}`
(benchmarks/plan_measure_cpu.py, benchmarks/plan_holdout_cpu.py); `config`: a config.json path (relative paths are
read from the repository root) or an HF config dict, default the `cfg` passed to `fit`; `dtype`: the step's
activation dtype (default the profile's, float32 on the CPU). `fit_by_dtype` fits each dtype's rows apart (the
profile's `efficiency` and `efficiency_by_dtype`). `fit_prefix_entry` fits `prefix_entry_s` (a prefix hit's score
entries over its cached keys) to measured hits (benchmarks/prefix_hit.py --refit), which cold rows cannot tell.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os

import numpy as np

from slope_jax.model.config import ModelConfig
from slope_jax.parallel.config import ParallelConfig
from slope_jax.plan.hardware import Efficiency, Hardware
from slope_jax.plan.model import predict

_UNIT = Efficiency(matmul=1.0, attention=1.0, element_s=1.0, attention_entry_s=1.0, weight_byte_s=1.0,
                   moe_tile_s=1.0)
# coefficients: 1/e_mm, 1/e_att (sharded), 1/e_att (one device), element_s, attention_entry_s, weight_byte_s,
# overhead_s, layer_overhead_s, moe_tile_s
_N = 9
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@functools.lru_cache(maxsize=64)
def _config(spec: str) -> ModelConfig:
    if spec.startswith("{"):
        return ModelConfig.from_hf_dict(json.loads(spec), source="calibration row")
    return ModelConfig.from_json(spec if os.path.isabs(spec) or os.path.exists(spec) else os.path.join(REPO, spec))


def row_config(cfg: ModelConfig, row: dict) -> ModelConfig:
    """The row's own model config (`"config"`: a config.json path, or an HF config dict) or `cfg`.
    Raises ConfigError (from the config reader) naming the bad field."""
    spec = row.get("config")
    if not spec:
        return cfg
    return _config(json.dumps(spec, sort_keys=True) if isinstance(spec, dict) else spec)


def _features(cfg: ModelConfig, hw: Hardware, row: dict, devices_per_host: int) -> tuple[np.ndarray, float]:
    """Row of the linear system at unit efficiency, and its communication time; the exposed part of the ring
    transfer (max(compute, transfer) − compute) depends on the efficiency, so it is taken at `hw`'s."""
    cfg = row_config(cfg, row)
    par = ParallelConfig.from_row(row)
    kw = dict(batch=row.get("batch", 1), devices_per_host=devices_per_host, dtype=row.get("dtype"))
    p = predict(cfg, par, row["length"], dataclasses.replace(hw, efficiency=_UNIT, efficiency_by_dtype={}), **kw)
    tb = p.time_breakdown_ms
    own = ("matmul", "attention", "elementwise", "attention_entries", "prefix_entries", "moe_tiles", "weights",
           "overhead", "ring_ppermute_exposed")
    comm = sum(v for k, v in tb.items() if k not in own)
    comm += predict(cfg, par, row["length"], dataclasses.replace(hw, efficiency_by_dtype={}),
                    **kw).time_breakdown_ms["ring_ppermute_exposed"]
    one = par.num_devices == 1
    att = tb["attention"] / 1e3
    return np.array([tb["matmul"] / 1e3, 0.0 if one else att, att if one else 0.0, tb["elementwise"] / 1e3,
                     tb["attention_entries"] / 1e3, tb["weights"] / 1e3, 1.0, float(p.layer_slots),
                     tb["moe_tiles"] / 1e3]), comm / 1e3


def fit(cfg: ModelConfig, hw: Hardware, rows: list[dict], *, devices_per_host: int = 8, source: str = "",
        max_efficiency: float | None = None) -> tuple[Efficiency, list[dict]]:
    """Efficiency fitted to `rows` (module docstring) and a per-row table of measured vs predicted ms.

    `max_efficiency`: when `hw`'s peak was measured in the same run as the rows, no FLOP term can run faster than
    it: pass 1.0 and the matmul and attention efficiencies are fitted within (0, 1] (1/e ≥ 1 as a lower bound of
    the linear coefficient). Without it they may exceed 1 (a peak measured low on a loaded machine; `normalised`
    rescales the peak). Bounding them keeps the small calibration configs, whose times the element terms dominate,
    from buying a matmul rate above the peak that a matmul-heavy held-out config then cannot reach
    (benchmarks/plan_holdout_cpu.py: worst held-out error 29.1 % → 22.3 % on the same rows).

    Raises ValueError with fewer than 4 rows or when no non-negative fit exists.
    """
    if len(rows) < 4:
        raise ValueError(f"calibration needs >= 4 measured rows, got {len(rows)}")
    eff = hw.efficiency
    for _ in range(4):  # fixed point: the exposed ring transfer depends on the fitted efficiency
        eff = _fit_once(cfg, dataclasses.replace(hw, efficiency=eff), rows, devices_per_host, source, max_efficiency)
    fitted = dataclasses.replace(hw, efficiency=eff)
    table = []
    for r in rows:
        table.append(check_row(cfg, fitted, r, devices_per_host))
    return eff, table


def fit_by_dtype(cfg: ModelConfig, hw: Hardware, rows: list[dict], *, devices_per_host: int = 8, source: str = "",
                 max_efficiency: float | None = None, base_dtype: str = "float32") -> tuple[Hardware, list[dict]]:
    """`hw` with one efficiency per activation dtype of `rows` (`row["dtype"]`, default the profile's): `efficiency`
    fitted to the `base_dtype` rows (or to the only dtype there is), `efficiency_by_dtype` to each other dtype's rows;
    and the per-row table of `fit`. Each dtype needs >= 4 rows (ValueError from `fit` otherwise)."""
    default = "float32" if hw.shared_compute else "bfloat16"
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r.get("dtype") or default, []).append(r)
    base = base_dtype if base_dtype in groups else next(iter(groups))
    fitted, by_dtype = {}, {}
    for dtype, group in groups.items():
        eff, _ = fit(cfg, dataclasses.replace(hw, efficiency_by_dtype={}), group, devices_per_host=devices_per_host,
                     source=f"{source} ({dtype} rows)" if source else "", max_efficiency=max_efficiency)
        # cold rows tell nothing of a prefix hit's cached-key entries: keep the profile's (fit_prefix_entry)
        eff = dataclasses.replace(eff, prefix_entry_s=hw.for_dtype(dtype).efficiency.prefix_entry_s)
        fitted[dtype] = eff
        if dtype != base:
            by_dtype[dtype] = eff
    out = dataclasses.replace(hw, efficiency=fitted[base], efficiency_by_dtype=by_dtype)
    return out, [check_row(cfg, out, r, devices_per_host) for r in rows]


def check_row(cfg: ModelConfig, hw: Hardware, row: dict, devices_per_host: int = 8) -> dict:
    """Measured vs predicted ms of one row under `hw`: {"config", "layout", "length", "measured_ms", "predicted_ms",
    "error"} (error = predicted / measured − 1)."""
    par = ParallelConfig.from_row(row)
    p = predict(row_config(cfg, row), par, row["length"], hw, batch=row.get("batch", 1),
                devices_per_host=devices_per_host, dtype=row.get("dtype"))
    return {"config": row.get("config"), "layout": p.layout, "length": row["length"],
            "dtype": row.get("dtype") or ("float32" if hw.shared_compute else "bfloat16"), "measured_ms": row["ms"],
            "predicted_ms": p.ttft_ms, "error": p.ttft_ms / row["ms"] - 1}


def _fit_once(cfg, hw, rows, devices_per_host, source, max_efficiency=None) -> Efficiency:
    feats = [_features(cfg, hw, r, devices_per_host) for r in rows]
    A = np.stack([f for f, _ in feats])
    y = np.array([r["ms"] / 1e3 - c for r, (_, c) in zip(rows, feats)])
    w = 1.0 / np.array([r["ms"] / 1e3 for r in rows])  # relative error
    both = bool(A[:, 1].any() and A[:, 2].any())
    if not both:  # one kind of step only: one attention efficiency for all rows
        A = A.copy()
        A[:, 1] += A[:, 2]
        A[:, 2] = 0.0
    # x = lower + x' with x' >= 0: a ceiling on the efficiencies is a floor on their inverses
    lower = np.zeros(_N)
    if max_efficiency is not None:
        lower[:3] = 1.0 / max_efficiency
    y = y - A @ lower
    needed = set() if max_efficiency is not None else {0, 1, 2} if both else {0, 1}  # efficiencies the rows tell
    best, best_err = None, np.inf
    for k in range(len(needed), _N + 1):
        for free in itertools.combinations(range(_N), k):
            if not needed <= set(free) or (not both and 2 in free):
                continue
            x = np.zeros(_N)
            if free:
                # columns scaled to unit size: the coefficients span ~12 orders (1/efficiency vs s per element)
                Af = A[:, free] * w[:, None]
                col = np.abs(Af).max(axis=0)
                col[col == 0] = 1.0
                sol, *_ = np.linalg.lstsq(Af / col, y * w, rcond=None)
                sol = sol / col
                if (sol <= 0).any():
                    continue
                x[list(free)] = sol
            err = float(((((A @ x) - y) * w) ** 2).sum())
            # subsets grow in size: a larger one must fit measurably better (not by rounding), so among exact fits
            # the fewest coefficients win — terms the rows cannot tell apart stay 0 instead of splitting the time
            if best is None or err < best_err - max(1e-12, 1e-6 * best_err):
                best, best_err = x, err
    if best is None:
        raise ValueError("no non-negative fit: the measured times do not grow with the predicted work")
    best = best + lower
    # may exceed 1 without `max_efficiency` (a peak measured low on a loaded machine); `normalised` rescales the peak
    return Efficiency(matmul=1 / best[0], attention=1 / best[1], overhead_s=float(best[6]),
                      layer_overhead_s=float(best[7]), source=source,
                      attention_one_device=1 / best[2] if both else None, element_s=float(best[3]),
                      attention_entry_s=float(best[4]), weight_byte_s=float(best[5]), moe_tile_s=float(best[8]))


def normalised(hw: Hardware, eff: Efficiency) -> Hardware:
    """`hw` with `eff`, the peak raised so that both efficiencies are <= 1 (same predictions)."""
    one = eff.attention_one_device
    scale = max(1.0, eff.matmul, eff.attention, one or 0.0)
    scaled = dataclasses.replace(eff, matmul=eff.matmul / scale, attention=eff.attention / scale,
                                 attention_one_device=None if one is None else one / scale)
    return dataclasses.replace(hw, peak_flops={k: v * scale for k, v in hw.peak_flops.items()}, efficiency=scaled)


def with_prefix_entry(hw: Hardware, dtype: str, seconds: float | None) -> Hardware:
    """`hw` with `prefix_entry_s` = `seconds` in the efficiency of `dtype` steps (`efficiency_by_dtype[dtype]` where
    the profile has one, else `efficiency`)."""
    if dtype in hw.efficiency_by_dtype:
        eff = dataclasses.replace(hw.efficiency_by_dtype[dtype], prefix_entry_s=seconds)
        return dataclasses.replace(hw, efficiency_by_dtype={**hw.efficiency_by_dtype, dtype: eff})
    return dataclasses.replace(hw, efficiency=dataclasses.replace(hw.efficiency, prefix_entry_s=seconds))


def hit_ms(cfg: ModelConfig, hw: Hardware, run: dict, prefix_entry_s: float | None = None) -> float:
    """Predicted ms of one measured prefix hit `run` ({"new", "cached", "bucket", "dtype", "micro_measure"?,
    "config"?, "fingerprint"?}: one device) under `hw` (with `prefix_entry_s` for the run's dtype unless None), carried
    over to the run's machine by its own `plan.machine` micro-measure and fingerprint where it has them
    (`machine.rescale`), as the launcher that ran it predicted; the run's `config` (`row_config`), else `cfg`."""
    from slope_jax.plan import machine

    cfg = row_config(cfg, run)

    if prefix_entry_s is not None:
        hw = with_prefix_entry(hw, run["dtype"], prefix_entry_s)
    if run.get("micro_measure") or run.get("fingerprint"):
        hw = machine.rescale(hw, run.get("micro_measure") or {}, run.get("fingerprint"))
    return predict(cfg, ParallelConfig(), run["new"], hw, bucket=run["bucket"], dtype=run["dtype"],
                   cached=run["cached"], devices_per_host=1).ttft_ms


def fit_prefix_entry(cfg: ModelConfig, hw: Hardware, runs: list[dict]) -> tuple[float, list[float]]:
    """`prefix_entry_s` (s per cached-prefix score entry, in `hw`'s reference units) fitted to measured prefix hits
    `runs` (`hit_ms`'s fields and "ms", the measured hit) by least squares of the relative errors — the prediction
    is linear in it — and each run's error (predicted / measured − 1) under it. Raises ValueError when the runs do
    not leave a positive cost per entry."""
    a = np.array([hit_ms(cfg, hw, r, 0.0) / r["ms"] for r in runs])
    b = np.array([hit_ms(cfg, hw, r, 1e-9) / r["ms"] for r in runs]) - a  # per ns of prefix_entry_s
    ns = float(b @ (1.0 - a) / (b @ b))
    if not ns > 0:
        raise ValueError(f"the measured hits leave no positive cost per cached-prefix entry (fit {ns:.3g} ns)")
    return ns * 1e-9, list(a + b * ns - 1.0)
