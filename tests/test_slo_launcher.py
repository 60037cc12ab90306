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
import time

from support import REPO, launcher_env

from slope_jax.model.config import ModelConfig
from slope_jax.plan import choose_layout
from slope_jax.serve import slo


def test_auto_layout_admission_and_slo_summary(tmp_path):
    reqs = tmp_path / "reqs.jsonl"
    lines = [{"id": f"tight-{i}", "tokens": list(range(5, 45 + i)), "ttft_slo_ms": 0.5} for i in range(3)]
    # 400 ms is ample for the compute of 40 tokens (predicted in ms) but not for getting their bucket's program first
    # (the CPU profile's compile_s = 8 s times the host's load, or a tenth of it when the persistent compilation cache
    # holds entries): refused on arrival, as a first request of a bucket not compiled in this process
    lines.append({"id": "compile-bound", "tokens": list(range(5, 45)), "ttft_slo_ms": 400})
    # the same for a length no other request shares: refused, and its shape is then compiled while the engine is idle
    # (a refused request runs nothing, so its shape would otherwise be refused again on every run)
    lines.append({"id": "compile-bound-200", "tokens": list(range(5, 205)), "ttft_slo_ms": 400})
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
    assert set(recs) == {"tight-0", "tight-1", "tight-2", "compile-bound", "compile-bound-200", "loose"}
    for i in range(3):  # a 0.5 ms SLO cannot be met by any prediction: rejected at admission, before any compute
        rec = recs[f"tight-{i}"]
        assert rec["rejected"] is True and rec["ttft_slo_ms"] == 0.5, rec
        assert re.search(r"rejected: predicted TTFT [0-9.]+ ms exceeds the allowed 0\.5 ms", rec["error"]), rec
    bound = recs["compile-bound"]
    assert bound["rejected"] is True and bound["slo_met"] is False, bound
    predicted = float(re.search(r"predicted TTFT ([0-9.]+) ms exceeds the allowed 400\.0 ms", bound["error"])[1])
    compiling = float(re.search(r"([0-9.]+) ms compiling step shapes not compiled yet", bound["error"])[1])
    # its bucket is not compiled in this process: the prediction charges at least a persistent-cache load (a tenth of
    # the 8 s idle compile) when the compilation cache holds entries, a whole compile when it is cold
    assert compiling >= 800.0 and predicted - compiling < 400.0, bound  # refused for the compile alone
    assert recs["compile-bound-200"]["rejected"] is True, recs["compile-bound-200"]
    warmed = re.search(r"warming (\d+) step shape\(s\) admission refused requests for while they were not compiled: "
                       r"(.*?) \(later", r.stderr)
    assert warmed and warmed[1] == "1" and re.fullmatch(r"T=\d+ x 1", warmed[2]), r.stderr[-3000:]
    t = int(warmed[2][2:].split()[0])
    assert 200 <= t < 400 and re.search(rf"bucket T={t} x 1 ready in", r.stderr), r.stderr[-3000:]  # 200's bucket
    loose = recs["loose"]
    assert "error" not in loose and loose["slo_met"] is True and loose["ttft_slo_ms"] == 1e7
    assert loose["predicted_ttft_ms"] > 0 and loose["ttft_ms"] > 0
    assert all(x.get("late", False) == ("error" not in x and x["slo_met"] is False) for x in recs.values())
    # strict JSON only, and the SLO summary: 1 of the 6 requests with an SLO met it, 5 rejected
    assert "NaN" not in res.read_text() and "Infinity" not in res.read_text()
    assert "SLO attainment 16.7% (1/6)" in r.stderr and "rejected 5" in r.stderr, r.stderr[-2000:]
    # the counts of the summary's last lines are the records', and each error is there whole (wrapped, not cut)
    assert "6 records: 1 ok (1 SLO met, 0 late), 5 rejected, 0 failed;" in r.stderr, r.stderr[-2000:]
    assert " ".join(recs["tight-2"]["error"].split()) in " ".join(r.stderr.split())
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


def test_summary_keeps_whole_errors_and_counts_the_records():
    from slope_jax.serve.summary import format_summary

    long_error = ("line 6 (invalid-token): prompt 0: token id 5000 at index 2 is outside the vocabulary [0, 1024); "
                  "every token id must be below vocab_size (the checkpoint's config.json)")
    served = {"num_tokens": 40, "first_token": 7, "ttft_ms": 1.0, "queue_ms": 0.5, "compile_ms": 0.0,
              "compute_ms": 0.5, "export_ms": 0.0}
    records = [{"id": "met", **served, "ttft_slo_ms": 2.0, "slo_met": True},
               {"id": "late", **served, "ttft_slo_ms": 0.5, "slo_met": False, "late": True},
               {"id": "free", **served},
               {"id": "no", "line": 4, "error": "rejected: predicted TTFT 9.0 ms exceeds the allowed 1.0 ms",
                "rejected": True, "ttft_slo_ms": 1.0, "slo_met": False},
               {"id": "failed-with-slo", "line": 5, "error": "prefill failed: boom", "ttft_slo_ms": 1.0,
                "slo_met": False},
               {"id": "invalid-token", "line": 6, "error": long_error}]
    text = format_summary(records, wall_s=2.0, width=60)
    assert all(len(line) <= 60 for line in text.splitlines() if line.startswith("    "))  # wrapped errors
    assert " ".join(long_error.split()) in " ".join(text.split())  # ... whole
    last = text.splitlines()[-2:]
    assert last[0].startswith("6 records: 3 ok (1 SLO met, 1 late), 1 rejected, 2 failed; 120 prompt tokens")
    # attainment counts every record with an SLO, the failed one as a miss
    assert last[1].startswith("SLO attainment 25.0% (1/4);") and "served 3, late 1, rejected 1, failed 2" in last[1]


def test_persistent_cache_warm_reads_jax_config(tmp_path):
    import jax

    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "absent"))
        assert not slo.persistent_cache_warm()
        (tmp_path / "absent").mkdir()
        assert not slo.persistent_cache_warm()  # empty: cold
        (tmp_path / "absent" / "entry").write_bytes(b"x")
        assert not slo.persistent_cache_warm(since=0.0)  # written by this run (after `since`): still cold
        assert slo.persistent_cache_warm(since=time.time() + 1)  # an earlier run's entry: warm
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
