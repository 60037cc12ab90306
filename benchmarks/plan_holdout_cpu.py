"""Does the CPU cost model carry over to configs it was not fitted on, and to this machine? Predict held-out configs.

    python benchmarks/plan_holdout_cpu.py                          # held-out configs vs the committed profile, ~2 min
    python benchmarks/plan_holdout_cpu.py --held_configs=a.json,b.json          # your own configs instead
    python benchmarks/plan_holdout_cpu.py --refit --write_profile               # re-measure CAL, refit cpu.json
    python benchmarks/plan_holdout_cpu.py --refit --cal_rows=a.json,b.json --write_profile  # refit: best of saved runs

Measures single-device prefill (`PrefillEngine`, random dense weights, one request, KV export off; compile first,
then `--repeats` rounds over all points, best kept; prefix reuse off, so every round is a cold prefill) in each of
`--dtypes` (float32, and bfloat16: the launcher's default) of the held-out configs HELD (or `--held_configs`) —
sizes, heads, head_dims, expert counts, top-k, windows and depths that no CAL config has — and compares them with
the CPU profile's predictions carried over to this machine as the launcher carries them at start (`plan.machine`: on
the calibration machine's kind the profile as calibrated; on another kind rescaled by this run's micro-measures —
the best of one at the start and one after each round — against the calibration's). The check is
|error| <= `--tolerance` (25 %) on every held-out row (exit status 1 otherwise). `--merge=a.json,...` first takes each
held-out point's best time over this run and earlier ones: the profile describes the machine at its quietest (its
rows are best-of too), and this shared machine's speed drifts by up to ~40 % between runs minutes apart.

`--refit` first measures the calibration configs CAL (the shipped tiny config and six 2-layer cuts) at
`--cal_lengths` in each dtype, fits the profile's coefficients per dtype (`plan.calibrate.fit_by_dtype`: matmul and
attention efficiencies at most 1 of the matmul peak measured in this run per dtype, per-element, per-score-entry,
per-MoE-tile and per-weight-byte seconds, overheads) on the CAL rows only, and records the best of the
micro-measures taken between its rounds (`plan.machine.micro_measure`; the rows keep their best round too) as the
profile's `machine_reference` (a prefix hit's `prefix_entry_s`, which cold rows cannot fit, is carried over from
the committed profile into the new reference's units: refit it with `benchmarks/prefix_hit.py --refit`);
`--write_profile` writes configs/hardware/cpu.json and the rows to
configs/hardware/calibration/cpu_multi.json. Writes JSON (default benchmarks/results/plan_holdout_cpu.json) with the
rows, the table, the micro-measure and the load average.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from slope_jax import xla_env  # noqa: E402  (no JAX)

xla_env.configure(cpu_devices=1)  # virtual CPU devices as the launcher sets them

from absl import app, flags  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from common import matmul_peak, start_load, write_result  # noqa: E402  (benchmarks/common.py)

from slope_jax.plan import machine  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("lengths", ["1024", "4096"], "Prompt lengths of the held-out check.")
flags.DEFINE_list("cal_lengths", ["256", "512", "1024", "2048", "4096", "8192"],
                  "Prompt lengths of the calibration (--refit): the short ones tell the per-step costs (weights, "
                  "overheads) that a prefix hit's few new tokens and short prompts pay.")
flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "Activation dtypes (the launcher's default is bfloat16).")
flags.DEFINE_integer("repeats", 3, "Rounds over all points (best kept).")
flags.DEFINE_float("tolerance", 0.25, "Allowed |predicted/measured − 1| on held-out rows.")
flags.DEFINE_bool("refit", False, "Measure the CAL configs and fit the profile first (else: the committed profile).")
flags.DEFINE_list("cal_rows", [], "With --refit: fit to the CAL rows, peaks and micro-measure of earlier runs' "
                  "JSON (this script's --out) instead of measuring them; several runs: each point's best time over "
                  "them (this machine's speed drifts by up to ~40 % between runs minutes apart).")
flags.DEFINE_list("merge", [], "Earlier runs' JSON (this script's --out, on a machine of this kind) whose held-out "
                  "rows are merged with this run's before the check: each point's best time over the runs, as the "
                  "calibration takes its rows (this machine's speed drifts by up to ~40 % between runs).")
flags.DEFINE_list("held_configs", [], "config.json paths to check instead of HELD (any GPT-OSS-style config; dense "
                  "float32 weights drawn at random).")
flags.DEFINE_bool("write_profile", False, "With --refit: write the fit to configs/hardware/cpu.json and the measured "
                  "rows to configs/hardware/calibration/cpu_multi.json.")
flags.DEFINE_string("out", "benchmarks/results/plan_holdout_cpu.json", "JSON output path.")

# HF config.json fields over configs/tiny.json; pairwise different widths, heads, head_dims, experts, windows
CAL = {
    "tiny": {},
    "cal-d512": dict(num_hidden_layers=2, hidden_size=512, intermediate_size=512, num_attention_heads=8,
                     num_key_value_heads=2, head_dim=64, num_local_experts=8, num_experts_per_tok=2,
                     sliding_window=128),
    "cal-d896": dict(num_hidden_layers=2, hidden_size=896, intermediate_size=448, num_attention_heads=14,
                     num_key_value_heads=2, head_dim=64, num_local_experts=24, num_experts_per_tok=4,
                     sliding_window=64),
    "cal-e48": dict(num_hidden_layers=2, hidden_size=256, intermediate_size=192, num_attention_heads=4,
                    num_key_value_heads=1, head_dim=32, num_local_experts=48, num_experts_per_tok=2,
                    sliding_window=48),
    # the held-out configs of the earlier check, now calibration configs (new held-out ones below)
    "peer-hd64-2l": dict(num_hidden_layers=2, hidden_size=1152, intermediate_size=1152, num_attention_heads=16,
                         num_key_value_heads=4, head_dim=64, num_local_experts=16, num_experts_per_tok=4,
                         sliding_window=128),
    "cal-hd128": dict(num_hidden_layers=2, hidden_size=640, intermediate_size=768, num_attention_heads=10,
                      num_key_value_heads=2, head_dim=128, num_local_experts=12, num_experts_per_tok=3,
                      sliding_window=256),
    "cal-e32": dict(num_hidden_layers=2, hidden_size=384, intermediate_size=256, num_attention_heads=6,
                    num_key_value_heads=3, head_dim=48, num_local_experts=32, num_experts_per_tok=4,
                    sliding_window=96),
}
# held out: depths, widths, FFN sizes, heads, KV heads, head_dims, experts, top-k and windows no CAL config has
HELD = {
    "held-d768-l4": dict(num_hidden_layers=4, hidden_size=768, intermediate_size=640, num_attention_heads=12,
                         num_key_value_heads=4, head_dim=56, num_local_experts=20, num_experts_per_tok=3,
                         sliding_window=160),
    "held-hd80-l3": dict(num_hidden_layers=3, hidden_size=320, intermediate_size=896, num_attention_heads=5,
                         num_key_value_heads=5, head_dim=80, num_local_experts=40, num_experts_per_tok=5,
                         sliding_window=72),
    "held-d1536": dict(num_hidden_layers=2, hidden_size=1536, intermediate_size=384, num_attention_heads=24,
                       num_key_value_heads=8, head_dim=40, num_local_experts=6, num_experts_per_tok=2,
                       sliding_window=200),
}


def hf_config(overrides: dict, base: str = "configs/tiny.json") -> dict:
    """`base` (a config.json) with `overrides`; layer types alternate sliding/full over the layers unless the config
    lists one per layer; dense experts (the engine's path without MXFP4 decoding)."""
    with open(base if os.path.isabs(base) else os.path.join(REPO, base)) as f:
        d = json.load(f)
    d.update(overrides)
    d["experts_per_token"] = d["num_experts_per_tok"]
    n = d["num_hidden_layers"]
    if overrides or len(d.get("layer_types") or []) != n:
        d["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    d.pop("quantization_config", None)
    return d


def measure(names: dict[str, dict], lengths: list[int], dtypes: list[str], micro: list | None = None) -> list[dict]:
    """Rows {"config": HF dict, "name", "dtype", "pipeline", "ring", "ulysses", "length", "batch", "ms", "raw_ms"}.
    `micro`: a list that gets one `machine.micro_measure()` after each round (the rows keep each point's best round,
    the machine's figures are taken as the best of these: both then describe the machine at its quietest)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from slope_jax.kv.prefix import ReuseOptions
    from slope_jax.model import gpt_oss as model_lib
    from slope_jax.model.config import ModelConfig
    from slope_jax.serve.engine import PrefillEngine

    points = []
    for name, hf in names.items():
        cfg = ModelConfig.from_hf_dict(hf, source=name)
        params = model_lib.init_params(cfg, jax.random.key(0), jnp.float32)
        for dt in dtypes:
            # prefix reuse off: every round is a cold prefill, not a hit on the previous round's prompt
            eng = PrefillEngine(cfg, params, dtype=dt, reuse=ReuseOptions(enabled=False))
            for t in lengths:
                ids = np.random.default_rng(t).integers(0, cfg.vocab_size, t)
                eng.precompile([t])
                points.append({"name": name, "hf": hf, "dtype": dt, "engine": eng, "ids": ids, "length": t,
                               "raw": []})
        print(f"compiled {name} (load {os.getloadavg()[0]:.1f})", flush=True)
    for r in range(FLAGS.repeats):
        for pt in points:
            res = pt["engine"].prefill([pt["ids"]], return_kv=False)[0]
            pt["raw"].append(res.compute_ms)
            print(f"round {r} {pt['name']:>13} {pt['dtype']:>8} {pt['length']:>6} {res.compute_ms:9.1f} ms  "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
        if micro is not None:
            micro.append(machine.micro_measure())
    return [{"name": pt["name"], "config": pt["hf"], "dtype": pt["dtype"], "pipeline": 1, "ring": 1, "ulysses": 1,
             "length": pt["length"], "batch": 1, "ms": min(pt["raw"]), "raw_ms": pt["raw"]} for pt in points]


def refit(kernels: dict, load0) -> tuple:
    """Fit the profile per dtype to the CAL rows — measured now, or read from `--cal_rows` (an earlier run's JSON
    with its rows, peaks and micro-measure) — against the peaks: the best of the 2048³ matmul and the micro-measure's
    GEMM per dtype (one noisy peak caps the fitted efficiencies). Returns (fitted Hardware, CAL rows, peaks)."""
    from slope_jax.model.config import ModelConfig
    from slope_jax.plan import calibrate, hardware

    if FLAGS.cal_rows:
        rows, peaks, fp, load, kernels = saved_runs(FLAGS.cal_rows)
    else:
        peaks = {dt: matmul_peak(2048, dt, 5) for dt in ("float32", "bfloat16")}
        micro = [kernels]
        rows = measure({k: hf_config(v) for k, v in CAL.items()}, [int(x) for x in FLAGS.cal_lengths], FLAGS.dtypes,
                       micro)
        fp, load, kernels = machine.fingerprint(), load0[0], machine.best_of(*micro)
    peaks = {dt: max(v, kernels.get(dt, {}).get("gemm_flops", 0.0)) for dt, v in peaks.items()}
    print("peak " + ", ".join(f"{dt} {v / 1e9:.1f} GFLOP/s" for dt, v in peaks.items()), flush=True)
    base = dataclasses.replace(hardware.load("cpu"), peak_flops=peaks, efficiency_by_dtype={}, machine_reference={})
    source = ("fitted by benchmarks/plan_holdout_cpu.py --refit to configs/hardware/calibration/cpu_multi.json "
              "(calibration configs " + ", ".join(CAL) + ")")
    tiny = ModelConfig.from_hf_dict(hf_config({}))
    fitted, _ = calibrate.fit_by_dtype(tiny, base, rows, source=source, max_efficiency=1.0)
    fitted = dataclasses.replace(fitted, machine_reference={
        "kernels": kernels, "fingerprint": fp, "loadavg": load,
        "note": REFERENCE_SOURCE})
    return carry_prefix_entry(hardware.load("cpu"), fitted), rows, peaks


def load_runs(paths: list[str], flag: str, fingerprint: dict | None = None) -> list[dict]:
    """Earlier runs' JSON (this script's --out), all measured on the kind of machine of `fingerprint` (default: the
    first run's; `plan.machine.same_kind`). Raises ValueError naming `flag` and the run otherwise."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
        if not machine.same_kind(runs[-1].get("fingerprint"), fingerprint or runs[0].get("fingerprint")):
            raise ValueError(f"--{flag}: {path} was measured on another kind of machine")
    return runs


def best_per_point(rows: list[dict]) -> list[dict]:
    """One row per point (config name, dtype, length, layout), in first-seen order: its best time over `rows` ("ms"),
    every round of every run ("raw_ms") and how many runs measured it ("runs"). The profile describes the machine at
    its quietest, so calibration and held-out rows alike keep each point's best."""
    groups: dict = {}
    for r in rows:
        key = (r["name"], r["dtype"], r["length"], r.get("pipeline", 1), r.get("ring", 1), r.get("ulysses", 1))
        groups.setdefault(key, []).append(r)
    return [{**g[0], "ms": min(r["ms"] for r in g), "raw_ms": [x for r in g for x in r.get("raw_ms", [r["ms"]])],
             "runs": sum(r.get("runs", 1) for r in g)} for g in groups.values()]


def saved_runs(paths: list[str]) -> tuple:
    """(CAL rows, peaks, fingerprint, load average, micro-measure) of earlier runs' JSON (`load_runs`): each point's
    best time (`best_per_point`), each peak's best and the best of the runs' micro-measures (`machine.best_of`). Only
    the runs' own micro-measures: one taken now, at another moment of a machine whose speed drifts, would describe
    other conditions than the rows'."""
    saved = load_runs(paths, "cal_rows")
    rows = best_per_point([r for d in saved for r in d["rows"] if r["name"] in CAL])
    peaks = {dt: max(d["peak_flops"][dt] for d in saved) for dt in saved[0]["peak_flops"]}
    measured = machine.best_of(*(d.get("cal_micro_measure") or d["micro_measure"] for d in saved))
    return rows, peaks, saved[0]["fingerprint"], saved[0].get("loadavg_before", [None])[0], measured


def merged_rows(rows: list[dict], paths: list[str]) -> list[dict]:
    """This run's held-out `rows`, each point's time the best over them and the same points in the earlier runs at
    `paths` (`best_per_point`; runs on this kind of machine only: `load_runs`)."""
    points = {(r["name"], r["dtype"], r["length"]) for r in rows}
    earlier = [r for d in load_runs(paths, "merge", machine.fingerprint()) for r in d["rows"]
               if (r["name"], r["dtype"], r["length"]) in points]
    return best_per_point(list(rows) + earlier)


def carry_prefix_entry(old, fitted):
    """`fitted` with each dtype's `prefix_entry_s` of the `old` profile, converted from `old`'s machine reference to
    `fitted`'s (× the softmax micro-kernel ratio of the two references: the same prediction on every machine). Cold
    rows cannot fit it (`benchmarks/prefix_hit.py --refit` does); dtypes `old` has no reference for keep theirs."""
    from slope_jax.plan import calibrate

    k = machine.scales(old.machine_reference.get("kernels") or {}, fitted.machine_reference["kernels"])
    base = "float32" if fitted.shared_compute else "bfloat16"  # the dtype of `efficiency` (calibrate.fit_by_dtype)
    for dt in [base, *(d for d in fitted.efficiency_by_dtype if d != base)]:
        seconds = old.for_dtype(dt).efficiency.prefix_entry_s
        if seconds is not None:
            seconds = seconds * k[dt]["entry"] if dt in k else seconds
            fitted = calibrate.with_prefix_entry(fitted, dt, seconds)
            print(f"{dt} prefix_entry_s carried over: {seconds * 1e9:.3f} ns (in the new reference's units)")
    return fitted


PEAK_SOURCE = ("measured per dtype in the calibration run by benchmarks/plan_holdout_cpu.py --refit: the best of an "
               "XLA 2048^3 matmul (best of 5) and plan.machine's 1024x512x1024 GEMM (bfloat16 accumulating in "
               "float32)")
REFERENCE_SOURCE = ("plan.machine micro-measure on the calibration machine (the best of the calibration run's and, on "
                    "the same machine fingerprint, the refit run's): the launcher rescales the profile to its own "
                    "machine by the ratio of its own micro-measure (plan.machine.adapt)")


def write_profile(fitted, rows, peaks, load0) -> None:
    from slope_jax.atomic import atomic_json
    from slope_jax.plan import hardware

    write_result(os.path.join(REPO, "configs", "hardware", "calibration", "cpu_multi.json"),
                 {"hardware": "cpu", "dtypes": FLAGS.dtypes, "peak_flops": peaks, "rows": rows,
                  "runs": FLAGS.cal_rows or ["this run"]}, load_start=load0)
    out = fitted.to_dict()
    out["sources"] = {**out.get("sources", {}), "peak_flops": PEAK_SOURCE, "machine_reference": REFERENCE_SOURCE}
    out["sources"].pop("machine", None)
    atomic_json(os.path.join(hardware.HARDWARE_DIR, "cpu.json"), out, indent=2)
    print("wrote configs/hardware/cpu.json and configs/hardware/calibration/cpu_multi.json")


def table_of(hw, rows: list[dict], cal_names) -> list[dict]:
    from slope_jax.model.config import ModelConfig
    from slope_jax.plan import calibrate

    tiny = ModelConfig.from_hf_dict(hf_config({}))
    table = []
    print(f"\n{'config':>13} {'set':>5} {'dtype':>8} {'tokens':>7} {'measured ms':>12} {'predicted ms':>13} "
          f"{'error':>7}")
    for r in rows:
        c = calibrate.check_row(tiny, hw, r)
        c.update(name=r["name"], set="cal" if r["name"] in cal_names else "held")
        c.pop("config")
        table.append(c)
        print(f"{c['name']:>13} {c['set']:>5} {c['dtype']:>8} {c['length']:>7} {c['measured_ms']:>12.1f} "
              f"{c['predicted_ms']:>13.1f} {c['error']:>+7.1%}")
    return table


def main(argv):
    del argv
    from slope_jax.plan import hardware

    load0 = start_load()
    kernels = machine.micro_measure()  # this run's: the reference (--refit) and what the held-out check adapts to
    print(f"micro-measure: {json.dumps(kernels)}", flush=True)
    cal_rows, peaks = [], None
    if FLAGS.refit:
        profile, cal_rows, peaks = refit(kernels, load0)
    else:
        profile = hardware.load("cpu")
    held_specs = ({os.path.splitext(os.path.basename(p))[0]: hf_config({}, p) for p in FLAGS.held_configs}
                  if FLAGS.held_configs else {k: hf_config(v) for k, v in HELD.items()})
    micro = [kernels]
    held = measure(held_specs, [int(x) for x in FLAGS.lengths], FLAGS.dtypes, micro)
    kernels = machine.best_of(*micro)  # the held-out rows' conditions: the best of the measures between rounds
    if FLAGS.merge:
        held = merged_rows(held, FLAGS.merge)
    print(f"micro-measure, best of {len(micro)}: {json.dumps(kernels)}", flush=True)
    hw = machine.rescale(profile, kernels, machine.fingerprint())  # as calibrated on the calibration machine's kind
    table = table_of(hw, cal_rows + held, set(CAL))
    worst = max(abs(c["error"]) for c in table if c["set"] == "held")
    print(f"\nheld-out worst |error| {worst:.1%} (tolerance {FLAGS.tolerance:.0%}); load average {load0[0]:.1f} -> "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {hw.sources.get('machine', 'not rescaled')}")
    result = {"lengths": FLAGS.lengths, "dtypes": FLAGS.dtypes, "repeats": FLAGS.repeats, "refit": FLAGS.refit,
              "micro_measure": kernels, "fingerprint": machine.fingerprint(), "peak_flops": peaks,
              "cal_micro_measure": profile.machine_reference.get("kernels") if FLAGS.refit else None,
              "merged_runs": FLAGS.merge,
              "profile": hw.to_dict(), "table": table, "rows": cal_rows + held, "held_out_worst_error": worst,
              "loadavg_before": load0, "loadavg_after": os.getloadavg(), "cpus": os.cpu_count()}
    write_result(FLAGS.out, result, load_start=load0)
    if FLAGS.refit and FLAGS.write_profile:
        write_profile(profile, cal_rows, peaks, load0)
    print(f"wrote {FLAGS.out}")
    if worst > FLAGS.tolerance:
        raise SystemExit(1)


if __name__ == "__main__":
    app.run(main)
