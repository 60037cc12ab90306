"""The device benchmark's smoke run (CPU, tiny sizes): it runs end to end and writes every field the GPU run reports."""

import json
import os
import subprocess
import sys

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
    # side by side: both attention cores and both MoE computes, each jitted alone
    for name in ("attention_full/pallas", "attention_full/xla", "moe/ragged", "moe/loop"):
        r = steps[f"T{t}/{name}"]
        assert r["seconds"] > 0 and r["compile_s"] > 0
    for variant in ("pallas+loop", "xla+ragged"):  # the first and the last of each list: all four impls run
        r = steps[f"T{t}/prefill/{variant}"]
        assert r["tokens"] == t and r["tokens_per_s"] > 0 and 0 < r["mfu"]
        assert r["model_flops"] > r["attention_flops"] > 0
    split = doc["split"][str(t)]["pallas+loop"]
    assert 0 < split["attention_share"] < 1
    assert doc["param_bytes"] > 0 and "peak_bytes_in_use" in doc  # null on CPU (no allocator stats)
    assert "tok/s" in proc.stdout  # the table was printed
