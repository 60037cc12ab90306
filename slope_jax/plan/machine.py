"""Carry a CPU profile over to the machine it runs on: a few-second micro-measure of the kernels the cost model's
terms stand for, cached per machine, and the profile rescaled by the ratio to the same micro-measure taken on the
calibration machine in the calibration run (`Hardware.machine_reference`).

    from slope_jax.plan import machine
    hw = machine.adapt(hardware.load("cpu"))        # measured once per machine (~3-6 s), then read from the cache

Why: a CPU profile fitted on one host (e.g. with AMX tiles) mispredicts another (AVX-512 without AMX: a 32K prompt
predicted at 77 s took 47 s). The fitted coefficients are per-kernel costs; what differs between hosts is how fast each
kind of kernel runs, which three micro-kernels per activation dtype measure:
  gemm_flops   a `[1024, 512] @ [512, 1024]` matmul (FLOP/s)          → scales `peak_flops[dtype]`; in bfloat16 as the
               step runs it here (`options.resolve_bf16_matmul`: widened to float32 on CPUs without bf16 dots)
  element_s    an RMS norm + SwiGLU chain over `[2048, 1024]` (s per element) → scales element_s, moe_tile_s,
               weight_byte_s, overhead_s, layer_overhead_s
  entry_s      a softmax over `[8, 256, 1024]` score tiles (s per entry) → scales attention_entry_s and
               prefix_entry_s (a prefix hit's cached-key attention: bound by the same float32 score-tile passes)
Each is the best of several runs (a busy neighbour slows some, not the best). Cached in
`$XDG_CACHE_HOME/slope_jax/machine/<fingerprint>.json` (default `~/.cache/slope_jax/machine/`); the fingerprint
hashes the CPU model, the ISA flags that change kernel choice (AVX-512, AMX, …), the usable cores and the jax/jaxlib
versions. A result measured on a busy host (1-minute load average > cores / 2) is measured again at the next starts
(at most `MAX_MEASURES` in all) and merged per kernel with the earlier ones (`best_of`: the quiet machine).
On a machine of the calibration machine's kind (same CPU model, ISA flags, cores and jax: `same_kind`) the profile
is used as calibrated, without a micro-measure: there the kernels' scatter between runs exceeds what they correct.
`SLOPE_JAX_MACHINE_CALIBRATION=off` turns the adaptation off (the profile as shipped).
Profiles without `machine_reference` (the accelerator ones) are returned unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time

from slope_jax import cpuinfo
from slope_jax.plan.hardware import Hardware

log = logging.getLogger(__name__)

ENV = "SLOPE_JAX_MACHINE_CALIBRATION"
DTYPES = ("float32", "bfloat16")
KERNELS = ("gemm_flops", "element_s", "entry_s")
# the per-step and per-element coefficients follow the element kernel; attention_entry_s the softmax kernel
MAX_MEASURES = 8  # micro-measures merged into one machine's entry while the host stays busy
_ELEMENT_TERMS = ("element_s", "moe_tile_s", "weight_byte_s", "overhead_s", "layer_overhead_s")


def cache_dir() -> str:
    """`$XDG_CACHE_HOME/slope_jax/machine`, or `~/.cache/slope_jax/machine`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "slope_jax", "machine")


def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def fingerprint() -> dict:
    """What identifies this machine's kernel speeds: CPU model, ISA flags, usable cores, jax/jaxlib versions, XLA
    flags; `["id"]` is a 16-hex-digit hash of the rest."""
    import jax
    import jaxlib

    name, flags = cpuinfo.cpu()
    fp = {"cpu": name, "flags": flags, "cores": cores(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
          "xla_flags": os.environ.get("XLA_FLAGS", ""), "bf16_matmul": _bf16_matmul()}
    fp["id"] = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]
    return fp


def _best(fn, args, repeats: int) -> float:
    """Best wall time in s of `fn(*args)` over `repeats` runs."""
    import jax

    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def micro_measure(dtypes=DTYPES, rounds: int = 10, repeats: int = 5) -> dict:
    """{dtype: {"gemm_flops": FLOP/s, "element_s": s per element, "entry_s": s per score entry}} on this process's
    default JAX device (module docstring: the three kernels): each kernel's best of `repeats` runs in each of
    `rounds` rounds over all kernels (spread over the ~2 s, so that one busy stretch spoils no kernel). Takes
    ~2-5 s on 2 cores."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from slope_jax.model import matmul

    rng = np.random.default_rng(0)
    kernels = []  # (dtype, figure, jitted fn, args, work units per call)
    for dt in dtypes:
        a = jnp.asarray(rng.standard_normal((1024, 512)), dt)
        b = jnp.asarray(rng.standard_normal((512, 1024)), dt)
        x = jnp.asarray(rng.standard_normal((2048, 1024)), dt)
        w = jnp.asarray(rng.standard_normal((1024,)), dt)
        s = jnp.asarray(rng.standard_normal((8, 256, 1024)), dt)
        pet = None if dt == "float32" else jnp.float32  # the model's einsums accumulate bfloat16 in float32
        wide = dt == "bfloat16" and _bf16_matmul() == "float32"  # the step widens bf16 operands on this CPU

        def gemm(a, b, pet=pet, wide=wide):
            return jnp.dot(matmul.widen(a, wide), matmul.widen(b, wide), preferred_element_type=pet)

        kernels += [(dt, "gemm_flops", jax.jit(gemm), (a, b), 2 * 1024 * 512 * 1024),
                    (dt, "element_s", jax.jit(_element_chain), (x, w), x.size),
                    (dt, "entry_s", jax.jit(lambda s: jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(s.dtype)),
                     (s,), s.size)]
    for _, _, fn, args, _ in kernels:
        jax.block_until_ready(fn(*args))  # compile
    best = [_best(fn, args, repeats) for _, _, fn, args, _ in kernels]
    for _ in range(rounds - 1):
        best = [min(t, _best(fn, args, repeats)) for t, (_, _, fn, args, _) in zip(best, kernels)]
    out: dict = {dt: {} for dt in dtypes}
    for t, (dt, figure, _, _, units) in zip(best, kernels):
        out[dt][figure] = units / t if figure == "gemm_flops" else t / units
    return out


def _bf16_matmul() -> str:
    """How the step runs bf16 matmuls on this CPU by default (`options.resolve_bf16_matmul`: "native" or
    "float32"), which the bf16 GEMM micro-kernel follows."""
    from slope_jax.model import options

    return options.resolve_bf16_matmul("auto", "cpu")


def _element_chain(x, w):
    """RMS norm (float32 statistics) then SwiGLU of the two halves: the model's per-element work in miniature."""
    import jax
    import jax.numpy as jnp

    xf = x.astype(jnp.float32)
    y = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-5)).astype(x.dtype) * w
    g, u = jnp.split(y, 2, axis=-1)
    return jnp.concatenate([jax.nn.silu(g) * (u + 1), g * u], axis=-1)


def measured(refresh: bool = False) -> dict:
    """This machine's micro-measure `{"fingerprint", "measured_at", "loadavg", "cores", "kernels": {dtype: ...}}`,
    from the cache when it holds one for this fingerprint taken on a host at most half loaded, else measured now
    (merged with the cached one by `best_of`: the quiet machine; `MAX_MEASURES` at most) and cached (atomic write;
    a cache that cannot be written is logged and skipped). `refresh`: measure now in any case."""
    fp = fingerprint()
    path = os.path.join(cache_dir(), f"{fp['id']}.json")
    n, load, previous = cores(), os.getloadavg()[0], None
    try:
        with open(path) as f:
            entry = json.load(f)
        if entry.get("fingerprint", {}).get("id") == fp["id"] and set(DTYPES) <= set(entry["kernels"]):
            previous = entry
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    # a busy host's figures (load above half the cores then) are measured again at the next starts, merged by
    # `best_of`, until one start finds the host quiet or MAX_MEASURES were taken
    busy = previous is not None and previous["loadavg"] > n / 2 and previous.get("measures", 1) < MAX_MEASURES
    if previous is not None and not refresh and not busy:
        return previous
    t0 = time.perf_counter()
    entry = {"fingerprint": fp, "measured_at": time.time(), "loadavg": load, "cores": n,
             "kernels": micro_measure(), "seconds": 0.0, "measures": 1}
    if previous is not None:  # measured again (busier then, or asked): the best of both is this machine when quiet
        entry["kernels"] = best_of(previous["kernels"], entry["kernels"])
        entry["measures"] = previous.get("measures", 1) + 1
        entry["loadavg"] = min(load, previous["loadavg"])
    entry["seconds"] = time.perf_counter() - t0
    log.info("machine micro-measure %s in %.1f s (load %.1f on %d cores): %s", fp["id"], entry["seconds"], load, n,
             entry["kernels"])
    try:
        from slope_jax.atomic import atomic_json

        os.makedirs(cache_dir(), exist_ok=True)
        atomic_json(path, entry)
    except OSError as e:
        log.warning("machine micro-measure not cached (%s): %s", path, e)
    return entry


def best_of(*measures: dict) -> dict:
    """Per dtype and kernel the best of several `micro_measure` results of one machine (highest GEMM rate, lowest
    seconds per element or entry): its speed when quiet, as calibration rows keep their best run."""
    out: dict = {}
    for m in measures:
        for dt, figures in m.items():
            for k, v in figures.items():
                old = out.setdefault(dt, {}).get(k)
                out[dt][k] = v if old is None else (max(old, v) if k == "gemm_flops" else min(old, v))
    return out


def scales(reference: dict, here: dict) -> dict:
    """{dtype: {"flops": gemm rate here / reference, "element": element time here / reference, "entry": ...}} for
    each dtype both hold (kernel figures as `micro_measure` returns them)."""
    out = {}
    for dt in set(reference) & set(here):
        r, h = reference[dt], here[dt]
        out[dt] = {"flops": h["gemm_flops"] / r["gemm_flops"], "element": h["element_s"] / r["element_s"],
                   "entry": h["entry_s"] / r["entry_s"]}
    return out


KIND_FIELDS = ("cpu", "flags", "cores", "jax", "jaxlib", "bf16_matmul")


def same_kind(a: dict | None, b: dict | None) -> bool:
    """Whether two `fingerprint()`s name the same kind of machine: CPU model, ISA flags, usable cores, jax/jaxlib
    versions and bf16 matmul mode all equal (the XLA flags may differ: another count of virtual devices)."""
    def norm(v):  # flags: a tuple when measured, a list when read back from JSON
        return list(v) if isinstance(v, (list, tuple)) else v

    return bool(a) and bool(b) and all(norm(a.get(k)) == norm(b.get(k)) for k in KIND_FIELDS)


def rescale(hw: Hardware, here: dict, fingerprint: dict | None = None) -> Hardware:
    """`hw` rescaled from its `machine_reference["kernels"]` to the kernel figures `here` (per dtype: peak × gemm
    ratio; per-element, per-tile, per-weight-byte and fixed terms × element ratio; attention_entry_s and
    prefix_entry_s × softmax ratio). Dtypes absent from either side keep their figures. The efficiencies (fractions
    of peak) are kept.

    `fingerprint`: the machine `here` was measured on; when it is the calibration machine's kind (`same_kind` as
    `machine_reference["fingerprint"]`) `hw` is returned as calibrated: there the micro-kernels' run-to-run scatter
    (the bf16 GEMM's 1.1 vs 1.65 TFLOP/s minutes apart on one AMX host, while the steps' times moved far less)
    exceeds any difference they could correct — on that host the held-out worst error of five runs was 13-30 %
    without the rescale and 17-65 % with it (benchmarks/measured/cpu/README.md, fourteenth session)."""
    if same_kind(fingerprint, hw.machine_reference.get("fingerprint")):
        return dataclasses.replace(hw, sources={**hw.sources, "machine": "not rescaled: this machine is the "
                                                "calibration machine's kind (plan.machine.same_kind)"})
    ref = hw.machine_reference.get("kernels") or {}
    k = scales(ref, here)
    if not k:
        return hw
    peak = {dt: v * k[dt]["flops"] if dt in k else v for dt, v in hw.peak_flops.items()}

    def scaled(eff, dt):
        if dt not in k:
            return eff
        terms = {t: getattr(eff, t) * k[dt]["element"] for t in _ELEMENT_TERMS}
        prefix = None if eff.prefix_entry_s is None else eff.prefix_entry_s * k[dt]["entry"]
        return dataclasses.replace(eff, attention_entry_s=eff.attention_entry_s * k[dt]["entry"],
                                   prefix_entry_s=prefix, **terms)

    default = "float32" if hw.shared_compute else "bfloat16"
    by_dtype = {dt: scaled(e, dt) for dt, e in hw.efficiency_by_dtype.items()}
    note = ", ".join(f"{dt} gemm x{v['flops']:.2f} element x{v['element']:.2f} softmax x{v['entry']:.2f}"
                     for dt, v in sorted(k.items()))
    return dataclasses.replace(hw, peak_flops=peak, efficiency=scaled(hw.efficiency, default),
                               efficiency_by_dtype=by_dtype,
                               sources={**hw.sources, "machine": f"rescaled to this machine by plan.machine: {note}"})


def adapt(hw: Hardware, refresh: bool = False) -> Hardware:
    """`hw` carried over to this machine (`rescale` by `measured()`), or `hw` unchanged when it has no
    `machine_reference`, does not share the host's cores (accelerator profiles), or `SLOPE_JAX_MACHINE_CALIBRATION`
    is `off`. The micro-measure runs on JAX's default device: call it where that is the CPU."""
    return adapt_measured(hw, refresh)[0]


def adapt_measured(hw: Hardware, refresh: bool = False) -> tuple[Hardware, dict | None]:
    """`adapt`, and the kernel figures it rescaled by (`measured()["kernels"]`; None where it left `hw` as it is:
    no reference, an accelerator profile, the calibration machine's kind (`rescale`), or adaptation off)."""
    if not hw.machine_reference or not hw.shared_compute or os.environ.get(ENV, "").lower() in ("off", "0", "no"):
        return hw, None
    import jax

    if jax.default_backend() != "cpu":  # the kernels would run on the accelerator, not the host the profile models
        return hw, None
    here = fingerprint()
    if same_kind(here, hw.machine_reference.get("fingerprint")):
        return rescale(hw, {}, here), None  # as calibrated: no micro-measure needed
    kernels = measured(refresh)["kernels"]
    return rescale(hw, kernels, here), kernels
