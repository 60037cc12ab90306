"""Carrying the CPU profile over to another machine (`slope_jax.plan.machine`) and per-dtype efficiencies: the
rescaling arithmetic, the per-machine cache, the micro-measure itself (seconds), and that predictions follow."""

import dataclasses
import json

import pytest
from support import CONFIG_A

from slope_jax.parallel.config import ParallelConfig
from slope_jax.plan import calibrate, hardware, machine
from slope_jax.plan.model import predict

REF = {"float32": {"gemm_flops": 2.0e11, "element_s": 1.0e-9, "entry_s": 5.0e-10},
       "bfloat16": {"gemm_flops": 4.0e11, "element_s": 2.0e-9, "entry_s": 6.0e-10}}


def _profile():
    hw = hardware.load("cpu")
    base = hardware.Efficiency(matmul=0.5, attention=0.25, overhead_s=0.01, layer_overhead_s=0.002, element_s=3e-9,
                               attention_entry_s=7e-10, weight_byte_s=1e-11, moe_tile_s=5e-5)
    bf16 = dataclasses.replace(base, matmul=0.4, element_s=6e-9)
    return dataclasses.replace(hw, peak_flops={"float32": 2e11, "bfloat16": 4e11}, efficiency=base,
                               efficiency_by_dtype={"bfloat16": bf16}, machine_reference={"kernels": REF})


def test_rescale_follows_each_kernel_ratio_per_dtype():
    hw = _profile()
    here = {"float32": {"gemm_flops": 1.0e11, "element_s": 1.5e-9, "entry_s": 1.0e-9},  # half the GEMM rate, ...
            "bfloat16": {"gemm_flops": 8.0e11, "element_s": 1.0e-9, "entry_s": 6.0e-10}}
    out = machine.rescale(hw, here)
    assert out.peak_flops == pytest.approx({"float32": 1e11, "bfloat16": 8e11})
    e, b = out.efficiency, out.efficiency_by_dtype["bfloat16"]
    assert (e.matmul, e.attention) == (0.5, 0.25)  # fractions of the (rescaled) peak are kept
    assert e.element_s == pytest.approx(4.5e-9) and e.moe_tile_s == pytest.approx(7.5e-5)
    assert e.overhead_s == pytest.approx(0.015) and e.layer_overhead_s == pytest.approx(0.003)
    assert e.attention_entry_s == pytest.approx(1.4e-9) and e.weight_byte_s == pytest.approx(1.5e-11)
    assert b.element_s == pytest.approx(3e-9) and b.attention_entry_s == pytest.approx(7e-10) and b.matmul == 0.4
    # a prefix hit's cached-key entries follow the softmax kernel too; unset (None) stays unset
    assert e.prefix_entry_s is None and e.prefix_entry == pytest.approx(1.4e-9)
    hit = dataclasses.replace(hw, efficiency=dataclasses.replace(hw.efficiency, prefix_entry_s=2e-9))
    assert machine.rescale(hit, here).efficiency.prefix_entry_s == pytest.approx(4e-9)
    assert "gemm x0.50" in out.sources["machine"]
    # the same machine: the same predictions, in both dtypes
    cfg, par = CONFIG_A, ParallelConfig()
    for dt in ("float32", "bfloat16"):
        same = machine.rescale(hw, REF)
        assert predict(cfg, par, 1000, same, dtype=dt).ttft_ms == pytest.approx(predict(cfg, par, 1000, hw,
                                                                                         dtype=dt).ttft_ms)
    # every term twice as slow: every prediction twice as long
    slow = {dt: {"gemm_flops": v["gemm_flops"] / 2, "element_s": v["element_s"] * 2, "entry_s": v["entry_s"] * 2}
            for dt, v in REF.items()}
    for dt in ("float32", "bfloat16"):
        assert predict(cfg, par, 1000, machine.rescale(hw, slow), dtype=dt).ttft_ms == pytest.approx(
            2 * predict(cfg, par, 1000, hw, dtype=dt).ttft_ms)


def test_the_calibration_machines_kind_is_not_rescaled(monkeypatch):
    """On the calibration machine's kind (same CPU, ISA flags, cores, jax; other XLA flags) the profile is used as
    calibrated, whatever a micro-measure says; another kind is rescaled; without a fingerprint the rule is off."""
    fp = {"cpu": "Some CPU", "flags": ["avx2", "avx512f"], "cores": 2, "jax": "0.10.2", "jaxlib": "0.10.2",
          "xla_flags": "--xla_force_host_platform_device_count=1", "bf16_matmul": "native", "id": "a"}
    hw = dataclasses.replace(_profile(), machine_reference={"kernels": REF, "fingerprint": fp})
    slow = {dt: {"gemm_flops": v["gemm_flops"] / 2, "element_s": v["element_s"] * 2, "entry_s": v["entry_s"] * 2}
            for dt, v in REF.items()}
    here = {**fp, "flags": tuple(fp["flags"]), "xla_flags": "--xla_force_host_platform_device_count=8", "id": "b"}
    same = machine.rescale(hw, slow, here)
    assert same.peak_flops == hw.peak_flops and same.efficiency == hw.efficiency and "not rescaled" in \
        same.sources["machine"]
    other = machine.rescale(hw, slow, {**here, "flags": ["avx2"]})
    assert other.peak_flops["float32"] == pytest.approx(hw.peak_flops["float32"] / 2)
    assert machine.rescale(hw, slow).peak_flops["float32"] == pytest.approx(hw.peak_flops["float32"] / 2)
    assert not machine.same_kind(None, fp) and not machine.same_kind({}, {})
    monkeypatch.setattr(machine, "fingerprint", lambda: here)
    monkeypatch.setattr(machine, "measured", lambda refresh=False: pytest.fail("no micro-measure on this kind"))
    adapted, kernels = machine.adapt_measured(hw)
    assert kernels is None and adapted.peak_flops == hw.peak_flops


def test_dtype_efficiency_is_used_and_round_trips_through_json(tmp_path):
    hw = _profile()
    f32 = predict(CONFIG_A, ParallelConfig(), 1000, hw, dtype="float32")
    b16 = predict(CONFIG_A, ParallelConfig(), 1000, hw, dtype="bfloat16")
    assert b16.time_breakdown_ms["elementwise"] == pytest.approx(2 * f32.time_breakdown_ms["elementwise"])
    path = tmp_path / "p.json"
    path.write_text(json.dumps(hw.to_dict()))
    back = hardware.load(str(path))
    assert back.efficiency_by_dtype == hw.efficiency_by_dtype and back.machine_reference == hw.machine_reference
    bad = hw.to_dict()
    bad["efficiency_by_dtype"]["bfloat16"]["matmul"] = 1.5
    path.write_text(json.dumps(bad))
    with pytest.raises(hardware.HardwareError, match=r"efficiency_by_dtype.bfloat16.matmul=1.5"):
        hardware.load(str(path))


def test_fit_by_dtype_fits_each_dtype_apart():
    """Rows generated from known per-dtype coefficients are fitted back: the bfloat16 rows get their own efficiency
    (`efficiency_by_dtype`), and both dtypes' rows are predicted within 2 %."""
    truth = _profile()
    rows = [{"pipeline": 1, "ring": 1, "ulysses": 1, "length": t, "batch": 1, "dtype": dt,
             "ms": predict(CONFIG_A, ParallelConfig(), t, truth, dtype=dt).ttft_ms}
            for dt in ("float32", "bfloat16") for t in (256, 384, 512, 1024, 2048)]
    fitted, table = calibrate.fit_by_dtype(CONFIG_A, dataclasses.replace(truth, efficiency_by_dtype={}), rows,
                                           max_efficiency=1.0)
    assert set(fitted.efficiency_by_dtype) == {"bfloat16"}
    assert {r["dtype"] for r in table} == {"float32", "bfloat16"}
    assert max(abs(r["error"]) for r in table) < 0.02


def test_measured_is_cached_per_machine_and_quick(tmp_path, monkeypatch):
    """The first call measures (a few seconds) and caches under the fingerprint; the next reads the cache; a busy
    measurement is repeated when the host is quieter; `adapt` rescales by it, or not at all when turned off."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = machine.measured()
    assert first["seconds"] < 15 and set(first["kernels"]) == {"float32", "bfloat16"}
    for k in first["kernels"].values():
        assert k["gemm_flops"] > 1e9 and 0 < k["element_s"] < 1e-6 and 0 < k["entry_s"] < 1e-6
    path = tmp_path / "slope_jax" / "machine" / f"{machine.fingerprint()['id']}.json"
    assert json.loads(path.read_text())["kernels"] == first["kernels"]
    calls = []
    monkeypatch.setattr(machine, "micro_measure", lambda: calls.append(1) or REF)
    entry = json.loads(path.read_text())
    path.write_text(json.dumps({**entry, "loadavg": 0.0}))  # measured on a quiet host
    assert machine.measured()["kernels"] == first["kernels"] and not calls  # cached
    path.write_text(json.dumps({**entry, "loadavg": 50.0}))  # measured on a busy host: measured again now
    again = machine.measured()  # merged with the cached one: the quieter of the two per kernel
    assert calls == [1] and again["kernels"] == machine.best_of(first["kernels"], REF) and again["measures"] == 2
    assert again["kernels"]["float32"]["gemm_flops"] == max(REF["float32"]["gemm_flops"],
                                                            first["kernels"]["float32"]["gemm_flops"])
    path.write_text(json.dumps({**again, "loadavg": 50.0, "measures": machine.MAX_MEASURES}))
    assert machine.measured()["measures"] == machine.MAX_MEASURES and calls == [1]  # busy, but measured enough
    hw = _profile()
    monkeypatch.setattr(machine, "measured", lambda refresh=False: {"kernels": REF})
    assert machine.adapt(hw).peak_flops == pytest.approx(hw.peak_flops)  # REF is the reference: unchanged
    monkeypatch.setenv(machine.ENV, "off")
    assert machine.adapt(hw) is hw
    monkeypatch.delenv(machine.ENV)
    h200 = hardware.load("h200")
    assert machine.adapt(h200) is h200  # no machine_reference (accelerator profiles): never rescaled


def test_committed_profile_predicts_the_measured_held_out_rows():
    """The committed cpu.json, rescaled by the check run's own micro-measure (as the launcher rescales it), predicts
    every held-out row of benchmarks/measured/cpu/plan_holdout_cpu.json (configs outside the calibration set,
    float32 and bfloat16, 1K and 4K tokens) within 25 % — and the calibration rows too."""
    import os

    from support import REPO

    from slope_jax.model.config import ModelConfig

    with open(os.path.join(REPO, "benchmarks", "measured", "cpu", "plan_holdout_cpu.json")) as f:
        run = json.load(f)
    hw = machine.rescale(hardware.load("cpu"), run["micro_measure"], run.get("fingerprint"))
    tiny = ModelConfig.from_json(os.path.join(REPO, "configs", "tiny.json"))
    held = [r for r in run["rows"] if r["name"].startswith("held-")]
    assert {r["dtype"] for r in held} == {"float32", "bfloat16"} and {r["length"] for r in held} >= {1024, 4096}
    assert len({r["name"] for r in held}) >= 3
    for r in run["rows"]:
        assert abs(calibrate.check_row(tiny, hw, r)["error"]) < 0.25, (r["name"], r["dtype"], r["length"])




def test_committed_profile_predicts_the_measured_prefix_hits():
    """The committed cpu.json, carried over to each run's machine as the launcher that ran it did (`hit_ms`: rescaled
    by the run's micro-measure, or as calibrated on the calibration machine's kind when the run records its
    fingerprint), predicts the measured prefix hits of benchmarks/prefix_hit.py (peer config, bfloat16, one device:
    32K tokens with 512 new — issue 30's must-show —, a 9.5K follow-up turn and a 20K prompt with 1024 new) within
    25 %: the profile's prefix term is fitted to the fourteenth session's `prefix_hit_amx_s14.json` and
    `_amx_9472_s14` runs and the twelfth's `_amx_20480`; every other run is held out, those of two AMD EPYC hosts
    (AVX-512; AVX2 only) too. Each run that records the profile it predicted with (`summary.profile`) reproduces its
    recorded prediction exactly."""
    import glob
    import os

    from support import REPO

    from slope_jax.model.config import ModelConfig

    cfg = ModelConfig.from_json(os.path.join(REPO, "configs", "peer-hd64.json"))  # each run carries its own
    hw = hardware.load("cpu")
    paths = sorted(glob.glob(os.path.join(REPO, "benchmarks", "measured", "cpu", "prefix_hit*.json")))
    shapes = set()
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        s = d["summary"]
        run = {"new": s["new"], "cached": s["cached"], "bucket": s["hit_step_key"][0], "dtype": d["dtype"],
               "micro_measure": d["micro_measure"], "config": d["config"], "fingerprint": d.get("fingerprint")}
        predicted = calibrate.hit_ms(cfg, hw, run) / 1e3
        assert abs(predicted / s["hit_s"] - 1) < 0.25, (path, predicted, s["hit_s"])
        if "profile" in s:  # the profile the run predicted with: its recorded prediction is recomputed exactly
            then = calibrate.hit_ms(cfg, hardware.Hardware.from_dict(s["profile"]), run) / 1e3
            assert then == pytest.approx(s["predicted_hit_s"], rel=1e-6), path
        shapes.add((s["tokens"], s["new"]))
    assert {(32768, 512), (9472, 512), (20480, 1024)} <= shapes
