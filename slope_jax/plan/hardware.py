"""Hardware profiles: the figures the cost model needs about one device and its links, as data
(`configs/hardware/<name>.json`), each with the public source it comes from.

Profile fields (SI units):
  peak_flops {dtype: FLOP/s of one device, dense}, hbm_bytes, hbm_bytes_per_s,
  intra_host_bytes_per_s (one device's link to a peer in its host, per direction),
  inter_host_bytes_per_s (one device's share of the host's network, per direction),
  shared_compute (true when the "devices" are virtual and share one host's cores: the CPU profile),
  memory_fraction (required, in (0, 1]: the fraction of hbm_bytes XLA's allocator may take, the number the launch
  scripts export as XLA_PYTHON_CLIENT_MEM_FRACTION; the rest is left to the driver context and the collective
  library's own buffers), runtime_reserve_gib (required, >= 0, GiB: what the runtime takes from inside that pool
  beyond the planned buffers — BLAS workspaces, collective scratch, allocator fragmentation); the planner's
  capacity per device is `usable_bytes` = hbm_bytes × memory_fraction − runtime_reserve_gib GiB,
  efficiency {matmul, attention: fraction of peak reached; attention_one_device: the attention's fraction of peak in
  the one-device program where it differs from the sharded program's (optional; absent = `attention`, the neutral
  value for every profile measured without that distinction); overhead_s per step; layer_overhead_s per executed
  layer slot; element_s, attention_entry_s, weight_byte_s, moe_tile_s: seconds per activation element, score
  entry, weight byte, MoE tile; prefix_entry_s (optional: seconds per score entry of a prefix hit's attention over
  its cached keys; absent or null = attention_entry_s); source}, compile_s (optional: seconds XLA takes to compile
  one prefill step program on an idle host, the serving loop's compile estimate before it has measured one; layers
  are scanned and tiles looped, so it barely depends on depth or length), sources {field: citation},
  efficiency_by_dtype (optional, {dtype: efficiency}: the efficiency of steps in that activation dtype where it was
  fitted apart — on the CPU bfloat16 steps pay conversions float32 steps do not; absent dtypes use `efficiency`),
  step_options (optional, {StepOptions field: value}: the engine options the efficiencies were fitted with, e.g.
  {"moe_tile": 4096}; `plan.model.predict` uses them when it is given no tiles),
  machine_reference (optional: `plan.machine` micro-measures taken on the calibration machine in the calibration run;
  `plan.machine.adapt` rescales the profile to the machine it runs on by the ratio of its own micro-measures).
`calibrate` fits `efficiency` from measured step times (`python -m slope_jax.plan calibrate`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

HARDWARE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                            "configs", "hardware")


GIB = 2**30


class HardwareError(ValueError):
    """A hardware profile is missing, malformed or lacks a field; the message names it."""


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Fractions of peak reached by matmuls and by attention, fixed costs per step and per executed layer slot.

    `attention_one_device` (None = `attention`): the one-device program's attention efficiency where it is measured
    apart from the sharded program's. The two are different compiled programs whose attention tiles differ in shape:
    one device's tile loop (a `lax.map` over query tiles × a `fori_loop` over key tiles) works on `[bq, N, bk]`
    score tiles of all N heads (4 MiB at 256-token tiles and 16 heads, twice a 2 MiB L2 of the local CPU), the
    sharded full layers on N/U heads after the Ulysses all-to-all. Fitted only from rows of both kinds (the CPU:
    0.051 vs 0.056, configs/hardware/calibration/cpu_tiny.json); not a threading effect — on the quiet 2-core host the
    one-device attention of the tiny config at 4096 tokens runs 1.95× faster on 2 cores than on 1.
    """

    matmul: float
    attention: float
    overhead_s: float = 0.0
    layer_overhead_s: float = 0.0
    source: str = ""
    attention_one_device: float | None = None
    # seconds per activation element a layer reads or writes outside the matmul units (norms, RoPE, SwiGLU, the MoE
    # gather/scatter, GEMM operands streamed: `flops.per_device(...)["elements"]`) and per attention score entry
    # (mask, max, exp, sum: `["attention_entries"]`), per device; 0 where not fitted. These two terms carry a profile
    # over to other widths, head_dims and expert counts: FLOPs alone scale like D², the element work like D, and a
    # score entry costs the same at any head_dim.
    element_s: float = 0.0
    attention_entry_s: float = 0.0
    # seconds per parameter byte a device holds, per tick (weights streamed from memory once per layer pass: what
    # dominates short prompts of wide, many-expert models); 0 where not fitted
    weight_byte_s: float = 0.0
    # seconds per MoE tile (one iteration of the expert loop: weight slice, row gather, scatter-add); 0 where not fitted
    moe_tile_s: float = 0.0
    # seconds per score entry of a prefix hit's attention over its cached keys (`flops.cached_prefix_attention`:
    # `prefix_q_tile` × `prefix_kv_tile` tiles without a causal mask), per device; None = `attention_entry_s`. Apart
    # because on XLA:CPU these tiles (no causal mask, one tall query tile) are bound by the elementwise passes over
    # their float32 scores (max, exp, sum, the bf16 copy of the probabilities), at another cost per entry than the
    # causal attention `attention_entry_s` is fitted on; fitted from measured hits (benchmarks/prefix_hit.py --refit,
    # refitted whenever the prefix tiles change).
    prefix_entry_s: float | None = None

    def attention_for(self, devices: int) -> float:
        """The attention efficiency of a step on `devices` devices."""
        if devices == 1 and self.attention_one_device is not None:
            return self.attention_one_device
        return self.attention

    @property
    def prefix_entry(self) -> float:
        """Seconds per cached-prefix score entry: `prefix_entry_s`, or `attention_entry_s` where not fitted."""
        return self.attention_entry_s if self.prefix_entry_s is None else self.prefix_entry_s


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One device kind and its links (module docstring)."""

    name: str
    description: str
    peak_flops: dict[str, float]
    hbm_bytes: float
    hbm_bytes_per_s: float
    intra_host_bytes_per_s: float
    inter_host_bytes_per_s: float
    efficiency: Efficiency
    shared_compute: bool = False
    sources: dict[str, str] = dataclasses.field(default_factory=dict)
    compile_s: float | None = None
    memory_fraction: float = 1.0
    runtime_reserve_gib: float = 0.0
    efficiency_by_dtype: dict[str, Efficiency] = dataclasses.field(default_factory=dict)
    machine_reference: dict[str, Any] = dataclasses.field(default_factory=dict)
    step_options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def for_dtype(self, dtype: str) -> Hardware:
        """This profile with `efficiency` set to the one fitted for `dtype` steps (`efficiency_by_dtype`), if any."""
        eff = self.efficiency_by_dtype.get(dtype)
        return self if eff is None else dataclasses.replace(self, efficiency=eff, efficiency_by_dtype={})

    @property
    def usable_bytes(self) -> float:
        """Bytes per device the planned buffers may use: HBM × memory_fraction − the runtime reserve."""
        return self.hbm_bytes * self.memory_fraction - self.runtime_reserve_gib * GIB

    def memory_budget(self) -> str:
        """The capacity `usable_bytes` as a sentence with its terms, for tables and documents."""
        return (f"{self.usable_bytes / GIB:.1f} GiB usable per device = {self.hbm_bytes / GIB:.1f} GiB HBM x "
                f"memory_fraction {self.memory_fraction:g} - runtime reserve {self.runtime_reserve_gib:g} GiB")

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s of one device in `dtype` ("bfloat16" or "float32"). Raises HardwareError if unknown."""
        if dtype not in self.peak_flops:
            raise HardwareError(f"hardware {self.name!r} has no peak_flops for dtype {dtype!r} "
                                f"(has {sorted(self.peak_flops)})")
        return float(self.peak_flops[dtype])

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "<dict>") -> Hardware:
        required = ("name", "peak_flops", "hbm_bytes", "hbm_bytes_per_s", "intra_host_bytes_per_s",
                    "inter_host_bytes_per_s", "efficiency", "memory_fraction", "runtime_reserve_gib")
        for key in required:
            if key not in d:
                raise HardwareError(f"{source}: missing field {key!r} (required: {', '.join(required)})")
        if not isinstance(d["name"], str) or not d["name"].strip():
            raise HardwareError(f"{source}: name={d['name']!r} must be a non-empty string (it labels every plan)")
        eff = _efficiency(d["efficiency"], source, "efficiency")
        for key in ("peak_flops", "efficiency_by_dtype", "sources", "machine_reference", "step_options"):
            if d.get(key) is not None and not isinstance(d[key], dict):
                raise HardwareError(f"{source}: {key} must be an object, got {d[key]!r}")
        by_dtype = {k: _efficiency(v, source, f"efficiency_by_dtype.{k}")
                    for k, v in (d.get("efficiency_by_dtype") or {}).items()}
        for k, v in d["peak_flops"].items():
            if not _finite(v) or v <= 0:
                raise HardwareError(f"{source}: peak_flops.{k}={v!r} must be a positive finite number (FLOP/s)")
        for key in ("hbm_bytes", "hbm_bytes_per_s", "intra_host_bytes_per_s", "inter_host_bytes_per_s"):
            if not _finite(d[key]) or d[key] <= 0:
                raise HardwareError(f"{source}: {key}={d[key]!r} must be a positive finite number")
        _check_memory(d, source)
        compile_s = d.get("compile_s")
        if compile_s is not None and (not _finite(compile_s) or compile_s < 0):
            raise HardwareError(f"{source}: compile_s={compile_s!r} must be a finite number >= 0")
        return cls(name=d["name"], description=d.get("description", ""),
                   peak_flops={k: float(v) for k, v in d["peak_flops"].items()}, hbm_bytes=float(d["hbm_bytes"]),
                   hbm_bytes_per_s=float(d["hbm_bytes_per_s"]),
                   intra_host_bytes_per_s=float(d["intra_host_bytes_per_s"]),
                   inter_host_bytes_per_s=float(d["inter_host_bytes_per_s"]),
                   efficiency=eff, efficiency_by_dtype=by_dtype,
                   machine_reference=dict(d.get("machine_reference") or {}),
                   shared_compute=bool(d.get("shared_compute", False)), sources=dict(d.get("sources", {})),
                   compile_s=None if compile_s is None else float(compile_s),
                   memory_fraction=float(d["memory_fraction"]), runtime_reserve_gib=float(d["runtime_reserve_gib"]),
                   step_options=_step_options(d.get("step_options") or {}, source))


def _step_options(opts: dict[str, Any], source: str) -> dict[str, Any]:
    """The profile's `step_options`: the `model.options.StepOptions` fields its efficiencies were fitted with (e.g.
    the H200's moe_tile 4096), which the planner predicts with unless told otherwise; HardwareError for a field or
    value StepOptions refuses."""
    from slope_jax.model.options import StepOptions

    try:
        StepOptions(**opts)
    except (TypeError, ValueError) as e:
        raise HardwareError(f"{source}: step_options {opts!r}: {e}") from None
    return dict(opts)


def _finite(v) -> bool:
    """A JSON number that is finite (not a bool, a string, NaN or ±Infinity: Python's json reads those literals)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _efficiency(eff: dict[str, Any], source: str, where: str) -> Efficiency:
    """An `Efficiency` from its JSON object; raises HardwareError naming `where` and the bad field."""
    if not isinstance(eff, dict):
        raise HardwareError(f"{source}: {where} must be an object, got {eff!r}")
    for key in ("matmul", "attention", "attention_one_device"):
        v = eff.get(key)
        if key == "attention_one_device" and v is None:
            continue  # optional: absent = the same as `attention`
        if not _finite(v) or not 0 < v <= 1:
            raise HardwareError(f"{source}: {where}.{key}={v!r} must be a number in (0, 1]")
    for key in ("element_s", "attention_entry_s", "weight_byte_s", "moe_tile_s", "overhead_s", "layer_overhead_s"):
        v = eff.get(key, 0.0)
        if not _finite(v) or v < 0:
            raise HardwareError(f"{source}: {where}.{key}={v!r} must be a finite number >= 0 (seconds)")
    prefix = eff.get("prefix_entry_s")
    if prefix is not None and (not _finite(prefix) or prefix < 0):
        raise HardwareError(f"{source}: {where}.prefix_entry_s={prefix!r} must be a number >= 0 (seconds) or null")
    one = eff.get("attention_one_device")
    return Efficiency(float(eff["matmul"]), float(eff["attention"]), float(eff.get("overhead_s", 0.0)),
                      float(eff.get("layer_overhead_s", 0.0)), str(eff.get("source", "")),
                      None if one is None else float(one), float(eff.get("element_s", 0.0)),
                      float(eff.get("attention_entry_s", 0.0)), float(eff.get("weight_byte_s", 0.0)),
                      float(eff.get("moe_tile_s", 0.0)), None if prefix is None else float(prefix))


def _check_memory(d: dict[str, Any], source: str) -> None:
    """Raise HardwareError unless memory_fraction is in (0, 1], runtime_reserve_gib >= 0 and the two leave a
    positive usable capacity."""
    frac, reserve = d["memory_fraction"], d["runtime_reserve_gib"]
    if not _finite(frac) or not 0 < frac <= 1:
        raise HardwareError(f"{source}: memory_fraction={frac!r} must be a number in (0, 1] (the fraction of "
                            "hbm_bytes XLA may allocate)")
    if not _finite(reserve) or reserve < 0:
        raise HardwareError(f"{source}: runtime_reserve_gib={reserve!r} must be a number >= 0 (GiB)")
    if d["hbm_bytes"] * frac - reserve * GIB <= 0:
        raise HardwareError(f"{source}: runtime_reserve_gib={reserve!r} must be less than hbm_bytes x "
                            f"memory_fraction = {d['hbm_bytes'] * frac / GIB:.3g} GiB")


def memory_fraction(hardware: str | Hardware) -> float:
    """The fraction of a device's memory XLA may allocate on this profile (name, JSON path or Hardware): the value
    for XLA_PYTHON_CLIENT_MEM_FRACTION, which must be set before JAX initialises its GPU backend."""
    return load(hardware).memory_fraction


def available() -> list[str]:
    """Names of the profiles in configs/hardware/."""
    if not os.path.isdir(HARDWARE_DIR):
        return []
    return sorted(f[:-5] for f in os.listdir(HARDWARE_DIR) if f.endswith(".json"))


def load(hardware: str | Hardware) -> Hardware:
    """A profile by name (configs/hardware/<name>.json), by JSON path, or passed through.

    Raises HardwareError naming the available profiles when the name is unknown.
    """
    if isinstance(hardware, Hardware):
        return hardware
    path = hardware if hardware.endswith(".json") else os.path.join(HARDWARE_DIR, f"{hardware}.json")
    if not os.path.isfile(path):
        raise HardwareError(f"unknown hardware {hardware!r}: no file {path} (available: {', '.join(available())})")
    with open(path) as fh:
        try:
            d = json.load(fh)
        except json.JSONDecodeError as e:
            raise HardwareError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise HardwareError(f"{path}: a hardware profile is a JSON object, got {type(d).__name__}")
    return Hardware.from_dict(d, source=path)
