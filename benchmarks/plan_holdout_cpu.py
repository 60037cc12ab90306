"""Does the CPU cost model carry over to configs it was not fitted on? Fit on some configs, predict held-out ones.

    python benchmarks/plan_holdout_cpu.py                                       # 1K-8K, best of 3, ~8 min idle
    python benchmarks/plan_holdout_cpu.py --lengths=1024,2048 --repeats=2       # quick look
    python benchmarks/plan_measure_cpu.py && python benchmarks/plan_holdout_cpu.py --write_profile \
        --extra_rows=configs/hardware/calibration/cpu_tiny.json              # refit configs/hardware/cpu.json

Measures single-device float32 prefill (`PrefillEngine`, random dense weights, one request, KV export off; compile
first, then `--repeats` rounds over all points, best kept) of
  calibration configs  CAL (the shipped tiny config, two wider ones, a 48-expert one), and
  held-out configs     HELD (other hidden size, heads, head_dim, expert count, top-k and window than any CAL one:
                       the issue-21 peer config cut to 2 layers, a head_dim-128 one, a 32-expert one),
fits the profile's coefficients (`plan.calibrate.fit`: matmul and attention efficiencies, at most 1 of the peak
measured in this run, per-element and per-score-entry seconds, overheads) on the CAL rows only — plus `--extra_rows`
(none by default; the committed profile adds configs/hardware/calibration/cpu_tiny.json, the sharded and one-device
rows `plan_measure_cpu.py` measured with the same tree's kernels just before) —, against the float32 matmul peak
measured in the same run, and prints measured vs predicted for every row; the check is |error| ≤ `--tolerance` (25 %)
on the held-out rows (exit status 1 otherwise). Writes JSON (default benchmarks/results/plan_holdout_cpu.json) with
the rows, the fit and the load average; `--write_profile` writes the fitted profile to configs/hardware/cpu.json and
the rows to configs/hardware/calibration/cpu_multi.json.
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

FLAGS = flags.FLAGS
flags.DEFINE_list("lengths", ["1024", "2048", "4096", "8192"], "Prompt lengths.")
flags.DEFINE_integer("repeats", 3, "Rounds over all points (best kept).")
flags.DEFINE_float("tolerance", 0.25, "Allowed |predicted/measured − 1| on held-out rows.")
flags.DEFINE_list("extra_rows", [], "Measured-row JSON files to add to the fit (e.g. "
                  "configs/hardware/calibration/cpu_tiny.json from benchmarks/plan_measure_cpu.py).")
flags.DEFINE_bool("write_profile", False, "Write the fit to configs/hardware/cpu.json and the measured rows to "
                  "configs/hardware/calibration/cpu_multi.json.")
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
}
HELD = {
    "peer-hd64-2l": dict(num_hidden_layers=2, hidden_size=1152, intermediate_size=1152, num_attention_heads=16,
                         num_key_value_heads=4, head_dim=64, num_local_experts=16, num_experts_per_tok=4,
                         sliding_window=128),
    "held-hd128": dict(num_hidden_layers=2, hidden_size=640, intermediate_size=768, num_attention_heads=10,
                       num_key_value_heads=2, head_dim=128, num_local_experts=12, num_experts_per_tok=3,
                       sliding_window=256),
    "held-e32": dict(num_hidden_layers=2, hidden_size=384, intermediate_size=256, num_attention_heads=6,
                     num_key_value_heads=3, head_dim=48, num_local_experts=32, num_experts_per_tok=4,
                     sliding_window=96),
}


def hf_config(overrides: dict) -> dict:
    """configs/tiny.json with `overrides`; layer types alternate sliding/full over the layers, vocabulary 1024."""
    with open(os.path.join(REPO, "configs", "tiny.json")) as f:
        d = json.load(f)
    d.update(overrides)
    d["experts_per_token"] = d["num_experts_per_tok"]
    n = d["num_hidden_layers"]
    d["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    d.pop("quantization_config", None)  # dense experts: the engine's float32 path without MXFP4 decoding
    return d


def measure(names: dict[str, dict], lengths: list[int]) -> tuple[list[dict], float]:
    """Rows {"config": HF dict, "name", "pipeline", "ring", "ulysses", "length", "batch", "ms", "raw_ms"} and the
    float32 matmul peak (2048³, best of 5) measured first."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from slope_jax.model import gpt_oss as model_lib
    from slope_jax.model.config import ModelConfig
    from slope_jax.serve.engine import PrefillEngine

    peak = matmul_peak(2048, "float32", 5)
    print(f"XLA float32 matmul peak {peak / 1e9:.1f} GFLOP/s", flush=True)
    points = []
    for name, hf in names.items():
        cfg = ModelConfig.from_hf_dict(hf, source=name)
        params = model_lib.init_params(cfg, jax.random.key(0), jnp.float32)
        eng = PrefillEngine(cfg, params, dtype="float32")
        for t in lengths:
            ids = np.random.default_rng(t).integers(0, cfg.vocab_size, t)
            eng.precompile([t])
            points.append({"name": name, "hf": hf, "engine": eng, "ids": ids, "length": t, "raw": []})
    for r in range(FLAGS.repeats):
        for pt in points:
            res = pt["engine"].prefill([pt["ids"]], return_kv=False)[0]
            pt["raw"].append(res.compute_ms)
            print(f"round {r} {pt['name']:>13} {pt['length']:>6} {res.compute_ms:9.1f} ms  "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
    rows = [{"name": pt["name"], "config": pt["hf"], "pipeline": 1, "ring": 1, "ulysses": 1, "length": pt["length"],
             "batch": 1, "ms": min(pt["raw"]), "raw_ms": pt["raw"]} for pt in points]
    return rows, peak


def main(argv):
    del argv
    from slope_jax.atomic import atomic_json
    from slope_jax.model.config import ModelConfig
    from slope_jax.plan import calibrate, hardware

    lengths = [int(x) for x in FLAGS.lengths]
    load0 = start_load()
    rows, peak = measure({k: hf_config(v) for k, v in {**CAL, **HELD}.items()}, lengths)
    cal = [r for r in rows if r["name"] in CAL]
    held = [r for r in rows if r["name"] in HELD]
    extra = []
    for path in FLAGS.extra_rows:
        with open(path) as f:
            m = json.load(f)
        extra += [{**r, "config": r.get("config") or m.get("config")} for r in m["rows"]]
    base = hardware.load("cpu")
    base = dataclasses.replace(base, peak_flops={"float32": peak, "bfloat16": peak})
    source = ("fitted by benchmarks/plan_holdout_cpu.py to configs/hardware/calibration/cpu_multi.json (calibration "
              "configs " + ", ".join(CAL) + (" + " + ", ".join(FLAGS.extra_rows) if FLAGS.extra_rows else "") + ")")
    tiny = ModelConfig.from_hf_dict(hf_config({}))
    eff, _ = calibrate.fit(tiny, base, cal + extra, source=source, max_efficiency=1.0)  # peak: this run's
    fitted = calibrate.normalised(base, eff)
    table = []
    print(f"\n{'config':>13} {'set':>5} {'tokens':>7} {'measured ms':>12} {'predicted ms':>13} {'error':>7}")
    for r in cal + held:
        c = calibrate.check_row(tiny, fitted, r)
        c.update(name=r["name"], set="cal" if r["name"] in CAL else "held")
        c.pop("config")
        table.append(c)
        print(f"{c['name']:>13} {c['set']:>5} {c['length']:>7} {c['measured_ms']:>12.1f} {c['predicted_ms']:>13.1f} "
              f"{c['error']:>+7.1%}")
    worst = max(abs(c["error"]) for c in table if c["set"] == "held")
    e = fitted.efficiency
    print(f"\nfit: matmul {e.matmul:.3g}, attention {e.attention_for(1):.3g} of {fitted.peak('float32') / 1e9:.1f} "
          f"GFLOP/s; {e.element_s * 1e12:.1f} ps/element, {e.attention_entry_s * 1e12:.1f} ps/score entry, overhead "
          f"{e.overhead_s * 1e3:.2f} ms + {e.layer_overhead_s * 1e3:.3f} ms/layer")
    print(f"held-out worst |error| {worst:.1%} (tolerance {FLAGS.tolerance:.0%}); load average {load0[0]:.1f} -> "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    result = {"lengths": lengths, "repeats": FLAGS.repeats, "peak_flops_float32": peak, "efficiency":
              dataclasses.asdict(e), "table": table, "rows": rows, "extra_rows": FLAGS.extra_rows,
              "held_out_worst_error": worst, "loadavg_before": load0, "loadavg_after": os.getloadavg(),
              "cpus": os.cpu_count()}
    write_result(FLAGS.out, result, load_start=load0)
    if FLAGS.write_profile:
        write_result(os.path.join(REPO, "configs", "hardware", "calibration", "cpu_multi.json"),
                     {"hardware": "cpu", "dtype": "float32", "peak_flops_float32": peak, "rows": rows},
                     load_start=load0)
        out = fitted.to_dict()
        scale = fitted.peak("float32") / peak
        out["sources"] = {**out.get("sources", {}), "peak_flops": f"measured: XLA float32 2048^3 matmul, best of 5, "
                          f"{peak / 1e9:.1f} GFLOP/s, by benchmarks/plan_holdout_cpu.py in the calibration run"
                          + (f"; raised x{scale:.3g} so that every fitted efficiency is <= 1 (plan.calibrate."
                             f"normalised: same predictions)" if scale > 1 else "")}
        atomic_json(os.path.join(hardware.HARDWARE_DIR, "cpu.json"), out, indent=2)
        print("wrote configs/hardware/cpu.json and configs/hardware/calibration/cpu_multi.json")
    print(f"wrote {FLAGS.out}")
    if worst > FLAGS.tolerance:
        raise SystemExit(1)


if __name__ == "__main__":
    app.run(main)
