"""The launcher's SLO loop end to end (shipped checkpoint, 8 virtual CPU devices): `--layout=auto` takes the
planner's layout, admission rejects at once what the cost model predicts will miss its deadline (an error record
naming predicted vs allowed ms, written before any compute), a request whose SLO the model can meet is served with
its prediction written next to the measured TTFT, and the summary reports SLO attainment, goodput and percentiles.
The scheduler's policy itself is tested in test_scheduler.py, the planner in test_plan.py."""

import json
import os
import re
import subprocess
import sys

from conftest import REPO, launcher_env

from slope_jax.model.config import ModelConfig
from slope_jax.plan import choose_layout
from slope_jax.serve import slo


def test_auto_layout_admission_and_slo_summary(tmp_path):
    reqs = tmp_path / "reqs.jsonl"
    lines = [{"id": f"tight-{i}", "tokens": list(range(5, 45 + i)), "ttft_slo_ms": 0.5} for i in range(3)]
    lines.append({"id": "loose", "tokens": list(range(5, 45)), "ttft_slo_ms": 1e7})
    reqs.write_text("".join(json.dumps(x) + "\n" for x in lines))
    res = tmp_path / "res.jsonl"
    r = subprocess.run([sys.executable, "-m", "slope_jax.launch", "--cpu_devices=8", "--layout=auto",
                        "--ttft_slo_ms=60000", "--expected_lengths=64,512", "--dtype=float32",
                        f"--requests={reqs}", f"--results={res}"], cwd=REPO, env=launcher_env(), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    # the layout the planner picks for this machine is the one the launcher runs (and logs, with the reason)
    cfg = ModelConfig.from_json(os.path.join(REPO, "checkpoints", "tiny-gpt-oss", "config.json"))
    par, _, _ = choose_layout(cfg, "cpu", 8, 8, [64, 512], 60000.0, 0.9)
    logged = re.search(r"--layout=auto on 8 cpu device\(s\).*pipeline=(\d+) ring=(\d+) ulysses=(\d+) expert=\S+ "
                       r"seq_chunks=(\d+)", r.stderr)
    assert logged, r.stderr[-3000:]
    assert tuple(int(x) for x in logged.groups()) == (par.pipeline, par.ring, par.ulysses, par.seq_chunks)
    recs = {x["id"]: x for x in map(json.loads, res.read_text().splitlines())}
    assert set(recs) == {"tight-0", "tight-1", "tight-2", "loose"}
    for i in range(3):  # a 0.5 ms SLO cannot be met by any prediction: rejected at admission, before any compute
        rec = recs[f"tight-{i}"]
        assert rec["rejected"] is True and rec["ttft_slo_ms"] == 0.5, rec
        assert re.search(r"rejected: predicted TTFT [0-9.]+ ms exceeds the allowed 0\.5 ms", rec["error"]), rec
    loose = recs["loose"]
    assert "error" not in loose and loose["slo_met"] is True and loose["ttft_slo_ms"] == 1e7
    assert loose["predicted_ttft_ms"] > 0 and loose["ttft_ms"] > 0
    # strict JSON only, and the SLO summary: 1 of the 4 requests with an SLO met it, 3 rejected
    assert "NaN" not in res.read_text() and "Infinity" not in res.read_text()
    assert "SLO attainment 25.0% (1/4)" in r.stderr and "rejected 3" in r.stderr, r.stderr[-2000:]
    assert re.search(r"TTFT p50/p90/p99 [0-9.]+/[0-9.]+/[0-9.]+ ms", r.stderr)


def test_hardware_profile_from_device_kind():
    assert slo.hardware_for("NVIDIA H200", "gpu") == "h200"
    assert slo.hardware_for("AMD Instinct MI250X", "rocm") == "mi250x"
    assert slo.hardware_for("AMD Instinct MI250", "rocm") == "mi250"
    assert slo.hardware_for("cpu", "cpu") == "cpu"
    try:
        slo.hardware_for("TPU v5 lite", "tpu")
    except ValueError as e:
        assert "--hardware" in str(e) and "TPU v5 lite" in str(e)
    else:
        raise AssertionError("an unknown device kind must name --hardware")
