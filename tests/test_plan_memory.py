"""The planner's memory check against the memory the runtime really has (issue 32 item 1): hardware profiles carry
the fraction XLA may allocate and a runtime reserve, `fits_memory` uses HBM × memory_fraction − reserve, the chosen
layouts of the published scenario fit it with headroom >= 0; and the plan package's 60-line rule (issue 33).
No JAX needed: the planner is numpy only."""

import ast
import re
import json
import os
import subprocess

import pytest

from slope_jax.parallel.config import ParallelConfig
from slope_jax.plan import hardware, scenario, search
from slope_jax.plan.__main__ import load_model
from slope_jax.plan.model import predict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LENGTHS = scenario.LENGTHS  # 32768, 65536, 102400
GIB = 2**30


@pytest.fixture(scope="module")
def big():
    return load_model("gpt-oss-120b")


def test_profiles_carry_memory_fraction_and_reserve():
    for name in hardware.available():
        hw = hardware.load(name)
        assert 0 < hw.memory_fraction <= 1 and hw.runtime_reserve_gib >= 0, name
        assert hw.usable_bytes == hw.hbm_bytes * hw.memory_fraction - hw.runtime_reserve_gib * GIB
        assert {"memory_fraction", "runtime_reserve_gib"} <= set(hw.sources), name  # each figure has its source
        if name != "cpu":  # GPUs: XLA's pool is a fraction of HBM, and the runtime takes a reserve from it
            assert hw.memory_fraction < 1 and hw.runtime_reserve_gib > 0, name
    mi250 = hardware.load("mi250")
    assert mi250.usable_bytes == pytest.approx(64 * GIB * 0.9 - 3 * GIB)
    assert hardware.memory_fraction("mi250") == mi250.memory_fraction


def test_rocm_env_exports_the_profiles_fraction():
    """launch/rocm_env.sh sets XLA_PYTHON_CLIENT_MEM_FRACTION from the profile the planner checks against (and keeps
    an explicit setting)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"}
    script = "source launch/rocm_env.sh && echo $XLA_PYTHON_CLIENT_MEM_FRACTION"
    out = subprocess.run(["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip()) == hardware.memory_fraction("mi250")
    out = subprocess.run(["bash", "-c", script], cwd=REPO, env=env | {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"},
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "0.5"


@pytest.mark.parametrize("field,value,message", [
    ("memory_fraction", 1.5, r"memory_fraction=1\.5 must be a number in \(0, 1\]"),
    ("memory_fraction", 0, r"memory_fraction=0 must be a number in \(0, 1\]"),
    ("memory_fraction", "0.9", r"memory_fraction='0\.9' must be a number in \(0, 1\]"),
    ("runtime_reserve_gib", -1, r"runtime_reserve_gib=-1 must be a number >= 0"),
    ("runtime_reserve_gib", 100, r"runtime_reserve_gib=100 must be less than hbm_bytes x memory_fraction"),
    ("memory_fraction", None, r"missing field 'memory_fraction'"),
])
def test_bad_memory_fields_are_refused_naming_the_field(tmp_path, field, value, message):
    with open(os.path.join(hardware.HARDWARE_DIR, "mi250.json")) as fh:
        d = json.load(fh)
    if value is None:
        del d[field]
    else:
        d[field] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(hardware.HardwareError, match=message):
        hardware.load(str(path))


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["peak_flops"].update(bfloat16=0), r"peak_flops\.bfloat16=0 must be a positive finite number"),
    (lambda d: d["peak_flops"].update(bfloat16="fast"), r"peak_flops\.bfloat16='fast'"),
    (lambda d: d["peak_flops"].update(bfloat16=float("nan")), r"peak_flops\.bfloat16=nan"),
    (lambda d: d.update(peak_flops=5), r"peak_flops must be an object"),
    (lambda d: d.update(hbm_bytes=float("inf")), r"hbm_bytes=inf must be a positive finite number"),
    (lambda d: d.update(hbm_bytes=True), r"hbm_bytes=True must be a positive finite number"),
    (lambda d: d.update(intra_host_bytes_per_s=float("nan")), r"intra_host_bytes_per_s=nan"),
    (lambda d: d["efficiency"].update(overhead_s=float("inf")), r"efficiency\.overhead_s=inf must be a finite"),
    (lambda d: d.update(efficiency_by_dtype=[1]), r"efficiency_by_dtype must be an object"),
    (lambda d: d.update(sources=[1]), r"sources must be an object"),
    (lambda d: d.update(name=None), r"name=None must be a non-empty string"),  # plans were labelled "None"
])
def test_bad_numbers_in_a_profile_are_refused_naming_the_field(tmp_path, edit, message):
    """Values a hand-edited profile may hold (JSON's NaN/Infinity literals, zero, strings, wrong containers) are one
    HardwareError naming the field; they gave tracebacks, or a plan with 'nan ms' / a negative TTFT chosen."""
    with open(os.path.join(hardware.HARDWARE_DIR, "mi250.json")) as fh:
        d = json.load(fh)
    edit(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(hardware.HardwareError, match=message):
        hardware.load(str(path))
    path.write_text("5")
    with pytest.raises(hardware.HardwareError, match="a hardware profile is a JSON object, got int"):
        hardware.load(str(path))


@pytest.mark.parametrize("name,hosts", [("mi250", 4), ("h200", 4), ("h200", 1)])
def test_scenario_choices_fit_the_usable_memory(big, name, hosts):
    """At every scenario length, every layout the planner lists as fitting — and so the chosen one, or the fallback
    `choose_layout` takes when none meets the SLO — has predicted memory (one request and pipeline full) within HBM
    × memory_fraction − reserve, and reports that headroom; a layout outside it is never chosen."""
    hw = hardware.load(name)
    table = search.plan(big, hw, hosts * 8, 8, LENGTHS, slo_ms=scenario.SLO_MS, percentile=scenario.PCT)
    for entry in table:
        assert entry["memory_limit_bytes"] == hw.usable_bytes and entry["fitting"], (name, entry["length"])
        for r in entry["layouts"]:
            used = max(r["memory_bytes_per_device"], r["loaded_memory_bytes_per_device"])
            assert r["headroom_bytes"] == pytest.approx(hw.usable_bytes - used)
            assert r["fits_memory"] == (r["headroom_bytes"] >= 0)
        row = entry["chosen"] or min((r for r in entry["layouts"] if r["fits_memory"]), key=lambda r: r["ttft_ms"])
        assert row["fits_memory"] and row["headroom_bytes"] >= 0
        assert max(row["memory_bytes_per_device"], row["loaded_memory_bytes_per_device"]) <= hw.usable_bytes
        assert "headroom" in entry["reason"]
        par = ParallelConfig.from_row(row)  # the same figure from a fresh prediction
        assert predict(big, par, entry["length"], hw).memory_bytes_per_device <= hw.usable_bytes
    par, _, _ = search.choose_layout(big, hw, hosts * 8, 8, LENGTHS, scenario.SLO_MS, scenario.PCT)
    loaded = predict(big, par, LENGTHS[-1], hw, batch=par.in_flight)
    assert loaded.fits_memory and loaded.headroom_bytes >= 0


def test_mi250_scenario_uses_split_weights(big):
    """On 4 × 8 MI250 the replicated layouts (pipeline 1, no EP: ~62 GiB per GCD) exceed the 54.6 GiB usable; the
    32K and 64K choices are pipelined or expert-parallel and still meet the 1 s SLO."""
    hw = hardware.load("mi250")
    table = search.plan(big, hw, 32, 8, LENGTHS, slo_ms=scenario.SLO_MS, percentile=scenario.PCT)
    for entry in table:
        replicated = [r for r in entry["layouts"] if r["pipeline"] == 1 and r["expert"] == 1]
        assert replicated and not any(r["fits_memory"] for r in replicated)
        assert all(r["memory_bytes_per_device"] > hw.usable_bytes for r in replicated)
    for entry in table[:2]:
        c = entry["chosen"]
        assert c is not None and (c["pipeline"] > 1 or c["expert"] > 1)


def test_scenario_document_states_the_slo_and_headroom(tmp_path):
    out = tmp_path / "scenario.md"
    scenario.write(str(out))
    text = out.read_text()
    assert "## Which lengths meet the SLO" in text and hardware.load("mi250").memory_budget() in text
    assert "The 1000 ms SLO is met at 32768, 65536 tokens and missed at 102400" in text
    assert "| headroom |" in text and (tmp_path / "scenario.png").read_bytes()[:4] == b"\x89PNG"
    # the committed document and the README's row are what the planner predicts now (both kept 230 ms at 32K after
    # a cost-model change made it 247 ms with another chunk count)
    committed = os.path.join(REPO, "docs", "scenario-gpt-oss-120b-mi250.md")
    with open(committed) as f:
        assert f.read() == text.replace("scenario.png", "scenario-gpt-oss-120b-mi250.png"), (
            "docs/scenario-gpt-oss-120b-mi250.md is stale: python -m slope_jax.plan scenario")
    ms = [re.search(rf"\| {n} \| \*\*\w+\*\*: [^|]*?(\d+) ms", text).group(1) for n in LENGTHS]
    with open(os.path.join(REPO, "README.md")) as f:
        assert f"{ms[0]} ms at 32K, {ms[1]} ms at 64K, {ms[2]} ms at 100K" in f.read(), ms


def test_plan_functions_are_at_most_60_lines():
    """Issue 33: no function in slope_jax/plan/ longer than 60 lines (def to last line)."""
    plan_dir = os.path.join(REPO, "slope_jax", "plan")
    long = []
    for name in sorted(os.listdir(plan_dir)):
        if name.endswith(".py"):
            with open(os.path.join(plan_dir, name)) as fh:
                tree = ast.parse(fh.read())
            long += [f"{name}:{n.name} ({n.end_lineno - n.lineno + 1})" for n in ast.walk(tree)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60]
    assert not long, long
