"""benchmarks/rocm_check.sh's JSON: the merge step on canned part outputs (every documented field, with its type; a
failed part recorded, not fatal), the schema table in docs/deployment.md equal to `SCHEMA`, collective_bw.py on 4
virtual CPU devices (its bandwidth formulas), and (slow) the whole `--dry-run`."""

import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import rocm_check  # noqa: E402  (benchmarks/rocm_check.py)

MIB = 2**20


def _canned(d, drop=(), status=None):
    """Part JSONs as the scripts write them (trimmed to what the merge reads) and parts.tsv; `drop`: parts whose
    JSON is missing; `status`: exit statuses that differ from 0."""
    status = status or {}
    cases = {"attention/causal_64_8_T1000/float32": {"max_abs_diff": 2.5e-6, "ring_continuation_max_abs_diff": 3e-6,
                                                     "finite": True, "same_empty_rows": True},
             "moe/20b_T1000/float32": {"max_abs_diff_over_scale": 4e-6, "finite": True, "pad_tokens_zero": True},
             "attention/causal_64_8_T1000/bfloat16": {"max_abs_diff": 2e-2, "ring_continuation_max_abs_diff": 2e-2,
                                                      "finite": True, "same_empty_rows": True}}
    steps = {"matmul_peak": {"bf16_flops_per_s": 150e12},
             "T8192/prefill/pallas+pallas": {"mfu": 0.31, "tokens_per_s": 2.0e4, "peak_bytes_in_use": 20 * 2**30},
             "T32768/prefill/pallas+pallas": {"mfu": 0.36, "tokens_per_s": 1.5e4, "peak_bytes_in_use": 30 * 2**30},
             "T8192/prefill/xla+loop": {"mfu": 0.12},
             "T8192/attention_core_full/pallas": {"flops_per_s": 90e12}}
    rows = [{"bytes": MIB, "seconds": 1e-4, "algbw_GBps": 10.5, "busbw_GBps": 9.2},
            {"bytes": 64 * MIB, "seconds": 2e-3, "algbw_GBps": 33.5, "busbw_GBps": 29.3}]
    parts = {
        "kernel_parity": {"backend": "rocm", "device": "AMD Instinct MI250X", "ok": True, "tol_f32": 1e-5,
                          "cases": cases, "skipped": ["moe/20b_skew_T700/bfloat16"]},
        "prefill_parity": {"ok": True, "tol": 1e-3, "logits_max_abs_diff": 4e-5, "logits_scale": 3.2,
                           "kv_max_abs_diff": 1e-5, "argmax_equal": True, "tokens": 640, "finite": True,
                           "impls": {"attention_impl": "pallas", "moe_impl": "pallas"}},
        "device_prefill": {"status": "done", "dtype": "bfloat16", "layers": 2, "lengths": [8192, 32768],
                           "attention_impls": ["pallas", "xla"], "moe_impls": ["pallas", "loop"], "steps": steps,
                           "failures": {}, "skipped": {}, "targets": [], "peak_bytes_in_use": 31 * 2**30,
                           "config": {}},
        "collective_bw": {"device_count": 8, "single_device": False, "smoke": False,
                          "results": {op: rows for op in ("all_to_all", "ppermute", "all_gather", "psum")}},
        "memory": {"hardware": "mi250", "bytes_limit": 55 * 2**30, "bytes_in_use": 2**20,
                   "prefill_peak_bytes_in_use": 31 * 2**30, "measured_headroom_bytes": 24 * 2**30,
                   "planned_usable_bytes": 54.6 * 2**30, "profile_pool_bytes": 57.6 * 2**30,
                   "runtime_reserve_gib": 3.0,
                   "predicted": [{"length": 8192, "memory_bytes_per_device": 19e9, "headroom_bytes": 39e9,
                                  "fits_memory": True}]},
    }
    for name, doc in parts.items():
        if name not in drop:
            (d / f"{name}.json").write_text(json.dumps({**doc, "provenance": {"machine": {
                "jax_backend": "rocm", "device_count": 8}}}))
        (d / f"{name}.log").write_text(f"log of {name}\nTraceback: boom in {name}\n")
    (d / "parts.tsv").write_text("".join(f"{n}\t{status.get(n, 0)}\t{7 + i}\n" for i, n in enumerate(parts)))


def test_merge_has_every_documented_field(tmp_path, monkeypatch):
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    monkeypatch.setenv("UNRELATED_VAR", "x")
    _canned(tmp_path)
    doc = rocm_check.merge(str(tmp_path), dry_run=False)
    assert json.loads((tmp_path / "rocm_check.json").read_text()) == doc
    assert rocm_check.check_schema(doc) == []
    assert doc["ok"] is True and doc["schema_version"] == 1 and doc["dry_run"] is False
    assert (doc["device"]["backend"], doc["device"]["kind"], doc["device"]["count"]) == ("rocm", "AMD Instinct MI250X",
                                                                                         8)
    assert doc["parts"]["memory"] == {"exit_status": 0, "seconds": 11, "log": "memory.log"}
    k = doc["parity"]["kernels"]
    assert k["max_diff_f32"] == 4e-6 and k["failed"] == [] and k["skipped"] == ["moe/20b_skew_T700/bfloat16"]
    assert doc["parity"]["prefill_vs_cpu"]["logits_max_abs_diff"] == 4e-5
    p = doc["prefill"]
    assert p["mfu"] == {"8192": 0.31, "32768": 0.36} and p["tokens_per_s"]["32768"] == 1.5e4
    assert p["attention_core_flops_per_s"] == {"8192": 90e12, "32768": None}
    assert p["mfu_by_variant"] == {"pallas+pallas": {"8192": 0.31, "32768": 0.36}, "xla+loop": {"8192": 0.12}}
    assert p["peak_bytes_in_use"] == 31 * 2**30 and p["matmul_peak_flops_per_s"] == 150e12
    assert doc["collectives"]["busbw_GBps"] == dict.fromkeys(("all_to_all", "ppermute", "all_gather", "psum"), 29.3)
    assert doc["memory"]["measured_headroom_bytes"] == 24 * 2**30
    assert doc["env"]["HIP_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7" and doc["env"]["NCCL_SOCKET_IFNAME"] == "ib0"
    assert "UNRELATED_VAR" not in doc["env"] and doc["env"].get("XLA_FLAGS") == os.environ.get("XLA_FLAGS")


def test_merge_records_a_failed_part_and_goes_on(tmp_path):
    _canned(tmp_path, drop=("device_prefill",), status={"device_prefill": 124, "kernel_parity": 1})
    doc = rocm_check.merge(str(tmp_path), dry_run=True)
    assert rocm_check.check_schema(doc) == []
    assert doc["ok"] is False
    assert doc["prefill"]["error"] == "device_prefill: no JSON written (exit status 124 after 9 s)"
    assert "boom in device_prefill" in doc["prefill"]["log_tail"]
    assert doc["collectives"]["device_count"] == 8 and doc["parts"]["kernel_parity"]["exit_status"] == 1
    # a mistyped field is named
    doc["memory"]["bytes_limit"] = "55 GiB"
    del doc["parity"]["prefill_vs_cpu"]["tokens"]
    assert rocm_check.check_schema(doc) == ["parity.prefill_vs_cpu.tokens: missing (parity.prefill_vs_cpu.tokens)",
                                            "memory.bytes_limit: str '55 GiB' is not int|null"]


def test_docs_table_is_the_schema():
    text = open(os.path.join(REPO, "docs", "deployment.md")).read()
    section = text.split("### The ROCm host check", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            for line in section.splitlines() if line.startswith("| `")]
    assert [(r[0].strip("`"), r[1], r[2], r[3]) for r in rows] == [tuple(s) for s in rocm_check.SCHEMA]


def test_collective_bw_on_four_cpu_devices(tmp_path):
    out = tmp_path / "collective_bw.json"
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "collective_bw.py"), "--smoke",
                           "--cpu_devices=4", "--sizes_mib=0.0625", f"--out={out}"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["device_count"] == 4 and doc["backend"] == "cpu" and not doc["failures"]
    n = 4
    factor = {"all_to_all": (n - 1) / n, "ppermute": 1.0, "all_gather": (n - 1) / n, "psum": 2 * (n - 1) / n}
    for op, f in factor.items():
        (row,) = doc["results"][op]
        assert row["bytes"] == 64 * 1024  # 0.0625 MiB per device: [4, 4096] float32
        alg = (n if op == "all_gather" else 1) * row["bytes"] / row["seconds"] / 1e9
        assert row["algbw_GBps"] == pytest.approx(alg) and row["busbw_GBps"] == pytest.approx(alg * f)
    assert doc["provenance"]["machine"]["device_count"] == 4


@pytest.mark.slow
def test_rocm_check_dry_run(tmp_path):
    """benchmarks/rocm_check.sh --dry-run: every part on the CPU (tiny sizes, 8 virtual devices), merged."""
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    env.pop("JAX_PLATFORMS", None)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([os.path.join(REPO, "benchmarks", "rocm_check.sh"), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "rocm_check.json").read_text())
    assert rocm_check.check_schema(doc) == []
    assert doc["ok"] and doc["dry_run"] and doc["device"]["backend"] == "cpu"
    assert set(doc["parts"]) == set(rocm_check.PARTS)
    assert all(p["exit_status"] == 0 for p in doc["parts"].values())
    assert doc["parity"]["prefill_vs_cpu"]["logits_max_abs_diff"] <= 1e-3 and doc["parity"]["kernels"]["ok"]
    assert doc["collectives"]["device_count"] == 8 and all(v > 0 for v in doc["collectives"]["busbw_GBps"].values())
    assert doc["prefill"]["mfu"]["40"] > 0 and doc["memory"]["predicted"][0]["length"] == 40
    assert doc["env"]["JAX_PLATFORMS"] == "cpu"
