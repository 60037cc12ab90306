"""SLO planner: which layout meets a TTFT SLO on a cluster, at what goodput (cost model: slope_jax/plan/model.py;
layout search and goodput: slope_jax/plan/search.py; both predict, nothing is measured).

    python -m slope_jax.plan --model=gpt-oss-120b --hardware=mi250 --hosts=4 --devices_per_host=8 \\
        --ttft_slo_ms=1000 --percentile=90 --lengths=32768,65536,102400 --json=plan.json --png=plan.png
    python -m slope_jax.plan calibrate --measured=configs/hardware/calibration/cpu_tiny.json --hardware=cpu
    python -m slope_jax.plan scenario --out=docs/scenario-gpt-oss-120b-mi250.md

Plan: for every layout (pipeline × ring × ulysses, with and without expert parallelism) of hosts × devices_per_host
devices, predicts TTFT, memory per device, bytes per link kind and goodput at each length; prints a table per length
(layouts that fit the usable memory, fastest first, with their headroom), the chosen layout (the one with the highest
goodput among those that fit and meet the SLO) and why — or, when nothing meets the SLO, the fastest there is. --png
draws predicted TTFT (ms) per layout against length with the choice marked at each length (or "none meets the SLO"),
and the goodput of the best layouts per length.
Calibrate: fits a profile's efficiency factors to measured step times and writes the profile.
Scenario: writes the gpt-oss-120b on 4 × 8 MI250 GCDs document (tables, plot, choice, TP8 cross-check).

Table columns (per length):
{columns}
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

from absl import app, flags, logging

from slope_jax.plan import report

# absl prints this module's docstring as --help: the table's column key is filled in from report.COLUMNS
__doc__ = __doc__.replace("{columns}", report.column_key())  # noqa: A001
FLAGS = flags.FLAGS


def _define_flags() -> None:
    """The CLI's flags, defined when the CLI runs (not on import): the launcher, imported in the same process by
    tests or tools, defines flags of the same names (--hardware, --ttft_slo_ms, --dtype)."""
    flags.DEFINE_string("model", "gpt-oss-120b", "Model: a config.json path, a checkpoint directory holding "
                        "config.json, or a name under configs/ (gpt-oss-120b, gpt-oss-20b, tiny).")
    flags.DEFINE_string("hardware", "mi250", "Hardware profile: a name under configs/hardware/ (mi250, mi250x, "
                        "mi300x, a100, h100, h200, cpu) or a profile JSON path.")
    flags.DEFINE_integer("hosts", 4, "Hosts in the cluster.", lower_bound=1)
    flags.DEFINE_integer("devices_per_host", 8, "Devices per host (Ulysses groups stay inside a host).",
                         lower_bound=1)
    flags.DEFINE_float("ttft_slo_ms", 1000.0, "TTFT SLO in milliseconds.", lower_bound=1e-3)
    flags.DEFINE_float("percentile", 90.0, "Percentile of requests that must meet the SLO (e.g. 90 for p90).")
    flags.DEFINE_list("lengths", ["32768", "65536", "102400"], "Context lengths (tokens) to plan for.")
    flags.DEFINE_enum("dtype", None, ["bfloat16", "float32"], "Activation dtype (default: bfloat16; float32 on "
                      "the cpu profile).")
    flags.DEFINE_bool("expert_parallel", True, "Also consider expert-parallel layouts (EP = ring·ulysses).")
    flags.DEFINE_string("json", None, "Write the plan as JSON here (per length: every layout, feasible ones, "
                        "chosen).")
    flags.DEFINE_string("png", None, "Write a figure here: predicted TTFT (ms) vs length per layout with the SLO "
                        "line and the chosen layout marked at each length (or 'none meets the SLO'); goodput of the "
                        "best layouts per length; a caption naming model, cluster, SLO and efficiency source.")
    flags.DEFINE_string("measured", None, "calibrate: JSON of measured rows (benchmarks/plan_measure_cpu.py).")
    flags.DEFINE_string("out", None, "calibrate: profile JSON to write (default configs/hardware/<hardware>.json); "
                        "scenario: markdown path (default docs/scenario-gpt-oss-120b-mi250.md).")


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_model(spec: str):
    """ModelConfig from a config.json path, a checkpoint directory (HF, or converted by slope_jax.convert), or a
    configs/ name. Raises ValueError."""
    from slope_jax.model.config import ModelConfig

    converted = ModelConfig.from_converted(spec) if os.path.isdir(spec) else None
    if converted is not None:
        return converted
    for path in (spec, os.path.join(spec, "config.json"), os.path.join(REPO, "configs", spec + ".json"),
                 os.path.join(REPO, "configs", spec)):
        if os.path.isfile(path):
            return ModelConfig.from_json(path)
    raise FileNotFoundError(f"--model={spec!r}: not a config.json, a checkpoint directory (with config.json, or "
                            f"converted), or a name in {os.path.join(REPO, 'configs')}")


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """The planner CLI's options, one field per flag of `_define_flags` (same name, same default; the flags' help
    says what each means), built once from the parsed flags by `from_flags` and passed to the command that runs.
    `lengths` are the --lengths as integers. Built directly (tests), call `validate()` for the same checks."""

    model: str = "gpt-oss-120b"
    hardware: str = "mi250"
    hosts: int = 4
    devices_per_host: int = 8
    ttft_slo_ms: float = 1000.0
    percentile: float = 90.0
    lengths: tuple[int, ...] = (32768, 65536, 102400)
    dtype: str | None = None
    expert_parallel: bool = True
    json: str | None = None
    png: str | None = None
    measured: str | None = None
    out: str | None = None

    @classmethod
    def from_flags(cls, fv: flags.FlagValues) -> PlanConfig:
        """The options the parsed flags `fv` give, validated (app.UsageError names the flag and its limit)."""
        values = {f.name: fv[f.name].value for f in dataclasses.fields(cls)}
        try:
            lengths = tuple(int(x) for x in values["lengths"])
        except ValueError:
            raise app.UsageError(f"--lengths={','.join(values['lengths'])}: must be integers") from None
        config = cls(**{**values, "lengths": lengths})
        config.validate()
        return config

    def validate(self) -> None:
        """Raises app.UsageError naming the flag and its limit."""
        if not 1 <= self.percentile < 100:  # NaN fails too
            raise app.UsageError(f"--percentile={self.percentile}: must be a percent in [1, 100), e.g. 90 for p90 "
                                 "(p100 admits no queueing at all: every layout's goodput would be 0)")
        if not math.isfinite(self.ttft_slo_ms):
            raise app.UsageError(f"--ttft_slo_ms={self.ttft_slo_ms}: must be a finite number of milliseconds")
        from slope_jax.atomic import unwritable_ancestor

        if self.png and os.path.splitext(self.png)[1].lower() != ".png":
            raise app.UsageError(f"--png={self.png}: the figure is a PNG; give a path ending in .png")
        for flag in ("json", "png"):  # written after planning (directories are created): checked before it
            base = getattr(self, flag) and unwritable_ancestor(os.path.dirname(os.path.abspath(getattr(self, flag))))
            if base:
                raise app.UsageError(f"--{flag}={getattr(self, flag)}: {base} is not a writable directory")
        if not self.lengths or min(self.lengths) < 1:
            raise app.UsageError("--lengths: need at least one positive length")
        for name, low in (("hosts", 1), ("devices_per_host", 1), ("ttft_slo_ms", 1e-3)):
            if getattr(self, name) < low:
                raise app.UsageError(f"--{name}={getattr(self, name)}: must be >= {low}")

    @property
    def quantile(self) -> float:
        """--percentile as a fraction (90 -> 0.9): what the search and the report take."""
        return self.percentile / 100


def run_plan(cfg, hw, hosts, dph, lengths, slo_ms, pct, dtype=None, expert_parallel=True):
    from slope_jax.plan import search

    layouts = search.enumerate_layouts(cfg, hosts * dph, dph, with_expert=expert_parallel)
    if not layouts:
        raise app.UsageError(f"no valid layout of {hosts * dph} devices for this model")
    kw = {"dtype": dtype} if dtype else {}
    return search.plan(cfg, hw, hosts * dph, dph, lengths, slo_ms=slo_ms, percentile=pct, layouts=layouts, **kw)


def cmd_plan(c: PlanConfig):
    from slope_jax.plan import hardware, machine

    cfg = load_model(c.model)
    hw = machine.adapt(hardware.load(c.hardware))  # a CPU profile: carried over to this machine (plan.machine)
    entries = run_plan(cfg, hw, c.hosts, c.devices_per_host, list(c.lengths), c.ttft_slo_ms, c.quantile, c.dtype,
                       c.expert_parallel)
    print(f"{c.model} on {c.hosts} host(s) x {c.devices_per_host} {hw.name} ({hw.description})")
    print(f"efficiency: matmul {hw.efficiency.matmul:.3g}, attention {hw.efficiency.attention:.3g} — "
          f"{hw.efficiency.source or 'no source given'}")
    print(f"memory: {hw.memory_budget()} (the profile's memory_fraction and runtime_reserve_gib, sources in it)"
          + (f"\nthis machine: {hw.sources['machine']}" if "machine" in hw.sources else "") + "\n")
    for e in entries:
        print(report.table(e) + "\n")
    print("columns:\n" + report.column_key() + "\n")
    result = {"model": c.model, "hardware": hw.to_dict(), "hosts": c.hosts, "devices_per_host": c.devices_per_host,
              "ttft_slo_ms": c.ttft_slo_ms, "percentile": c.quantile, "lengths": entries}
    if c.json:
        report.write_json(c.json, result)
        print(f"wrote {c.json}")
    if c.png:
        cluster = f"{c.hosts} host(s) x {c.devices_per_host} {hw.name} ({hw.description})"
        report.write_png(c.png, entries, c.ttft_slo_ms,
                         f"{c.model} on {c.hosts} x {c.devices_per_host} {hw.name} (predicted)",
                         report.caption(c.model, cluster, c.ttft_slo_ms, c.quantile, hw.efficiency))
        print(f"wrote {c.png}")


def _measured_rows(path: str) -> dict:
    """The measured-rows JSON of `calibrate` (an object with a "rows" list); UsageError naming the file otherwise."""
    try:
        with open(path) as fh:
            measured = json.load(fh)
    except (OSError, ValueError) as e:
        raise app.UsageError(f"--measured={path}: {e}") from e
    if not isinstance(measured, dict) or not isinstance(measured.get("rows"), list):
        raise app.UsageError(f"--measured={path}: must be a JSON object with a \"rows\" list (the output of "
                             "benchmarks/plan_measure_cpu.py)")
    return measured


def cmd_calibrate(c: PlanConfig):
    from slope_jax.atomic import atomic_json, unwritable_ancestor
    from slope_jax.plan import calibrate, hardware

    if not c.measured:
        raise app.UsageError("calibrate needs --measured=PATH (rows from benchmarks/plan_measure_cpu.py)")
    measured = _measured_rows(c.measured)
    cfg = load_model(measured.get("config", c.model))
    path = c.out or os.path.join(hardware.HARDWARE_DIR, f"{c.hardware}.json")
    blocked = unwritable_ancestor(path)
    if blocked:
        raise app.UsageError(f"--out={path}: {blocked} is not a writable directory")
    base = hardware.load(path if os.path.isfile(path) else c.hardware)
    if "peak_flops_float32" in measured:  # measured in the same run: the CPU's own peak and copy bandwidth
        base = dataclasses.replace(base, peak_flops={"float32": measured["peak_flops_float32"],
                                                     "bfloat16": measured["peak_flops_float32"]},
                                   intra_host_bytes_per_s=measured["memcpy_bytes_per_s"],
                                   inter_host_bytes_per_s=measured["memcpy_bytes_per_s"])
    try:
        eff, rows = calibrate.fit(cfg, base, measured["rows"], source=f"fitted by `python -m slope_jax.plan "
                                  f"calibrate` to {os.path.relpath(c.measured, REPO)}")
    except (ValueError, KeyError, TypeError) as e:
        raise app.UsageError(f"--measured={c.measured}: {type(e).__name__}: {e}") from e
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fitted = calibrate.normalised(base, eff)
    eff = fitted.efficiency
    out = fitted.to_dict()
    atomic_json(path, out, indent=2)
    print(f"{'layout':<14} {'tokens':>7} {'measured ms':>12} {'predicted ms':>13} {'error':>7}")
    for r in rows:
        print(f"{r['layout']:<14} {r['length']:>7} {r['measured_ms']:>12.1f} {r['predicted_ms']:>13.1f} "
              f"{r['error']:>+7.1%}")
    one = "" if eff.attention_one_device is None else f" (one-device program {eff.attention_one_device:.3g})"
    print(f"efficiency matmul {eff.matmul:.3g}, attention {eff.attention:.3g}{one}, overhead "
          f"{eff.overhead_s * 1e3:.2f} ms"
          f" per step + {eff.layer_overhead_s * 1e3:.3f} ms per layer slot; wrote {path}")


def cmd_scenario(c: PlanConfig):
    from slope_jax.plan import scenario

    out = c.out or os.path.join(REPO, "docs", "scenario-gpt-oss-120b-mi250.md")
    scenario.write(out)
    print(f"wrote {out}")


def main(argv):
    commands = {"calibrate": cmd_calibrate, "scenario": cmd_scenario, "plan": cmd_plan}
    if len(argv) > 2 or (len(argv) == 2 and argv[1] not in commands):
        raise app.UsageError(f"unknown command {' '.join(argv[1:])!r}: use one of {', '.join(commands)} (default "
                             "plan)")
    logging.set_verbosity(logging.WARNING)
    from slope_jax.model.config import ConfigError
    from slope_jax.parallel.config import LayoutError
    from slope_jax.plan.hardware import HardwareError

    config = PlanConfig.from_flags(FLAGS)  # the only read of the flags
    try:
        commands[argv[1] if len(argv) == 2 else "plan"](config)
    except (ConfigError, HardwareError, LayoutError, OSError) as e:
        raise app.UsageError(str(e)) from None


def run():
    """Console-script entry (`slope-plan`) and `python -m slope_jax.plan`."""
    from slope_jax import cli

    _define_flags()
    cli.run(main, name="slope_jax.plan")  # absl's app.run, with --help exiting 0


if __name__ == "__main__":
    run()
