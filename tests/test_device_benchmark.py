"""The device benchmark's smoke run (CPU, tiny sizes): it runs end to end and writes every field the GPU run reports;
and (slow) the whole prepared GPU check, benchmarks/device_check.sh, in its CPU dry run."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_device_prefill_smoke_writes_all_fields(tmp_path):
    out = tmp_path / "device_prefill.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "device_prefill.py"), "--smoke",
                           f"--out={out}", "--budget_s=240"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["status"] == "done", doc["failures"]
    assert doc["smoke"] and doc["backend"] == "cpu" and doc["auto"] == {"attention_impl": "xla", "moe_impl": "loop"}
    steps = doc["steps"]
    assert steps["matmul_peak"]["bf16_flops_per_s"] > 0
    t = doc["lengths"][0]
    # side by side: both attention cores and the three MoE computes, each jitted alone
    for name in ("attention_full/pallas", "attention_full/xla", "attention_core_full/pallas", "moe/pallas",
                 "moe/ragged", "moe/loop"):
        r = steps[f"T{t}/{name}"]
        assert r["seconds"] > 0 and r["compile_s"] > 0
    assert 0 < steps[f"T{t}/moe/pallas"]["fraction_of_peak"] and steps[f"T{t}/attention_core_full/pallas"][
        "flops_per_s"] > 0
    for variant in ("pallas+pallas", "xla+ragged"):  # the first and the last of each list
        r = steps[f"T{t}/prefill/{variant}"]
        assert r["tokens"] == t and r["tokens_per_s"] > 0 and 0 < r["mfu"]
        assert r["model_flops"] > r["attention_flops"] > 0
    split = doc["split"][str(t)]["pallas+loop"]
    assert 0 < split["attention_share"] < 1
    names = [tg["name"] for tg in doc["targets"]]
    assert names == [f"T{t}/prefill/pallas+pallas/mfu", f"T{t}/moe/pallas/fraction_of_peak",
                     f"T{t}/attention_core_full/pallas/flops_per_s"]
    assert all(tg["value"] > 0 for tg in doc["targets"])
    assert doc["param_bytes"] > 0 and "peak_bytes_in_use" in doc  # null on CPU (no allocator stats)
    assert "tok/s" in proc.stdout  # the table was printed


@pytest.mark.slow
def test_device_check_dry_run(tmp_path):
    """benchmarks/device_check.sh --dry-run: both scripts with the GPU run's flags, tiny sizes on the CPU."""
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    env.pop("JAX_PLATFORMS", None)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([os.path.join(REPO, "benchmarks", "device_check.sh"), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=700)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    parity = json.loads((tmp_path / "kernel_parity.json").read_text())
    assert parity["ok"] and not parity["skipped"] and len(parity["cases"]) == 12
    parts = {k.split("/")[0] for k in parity["cases"]}
    assert parts == {"sdpa", "moe", "attention"}
    assert all(parity["cases"][f"sdpa/{n}/bfloat16"]["max_abs_diff"] < 5e-2 for n in ("causal_12_4_T45",
                                                                                       "sliding_W9_T37_prefix11"))
    doc = json.loads((tmp_path / "device_prefill.json").read_text())
    assert doc["status"] == "done" and doc["moe_impls"] == ["loop@4096", "loop", "pallas"]
    assert doc["attention_impls"] == ["cudnn", "pallas"]
