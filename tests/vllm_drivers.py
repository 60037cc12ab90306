"""Host side of tests/vllm_failure_driver.py: start the in-process vLLM engines, write the exports they wait for, and
collect what they decoded (tests/test_vllm_failures.py, test_vllm_failures_sync.py, test_vllm_last_window.py)."""

import json
import os
import subprocess

import pytest
from support import REPO
from test_vllm_connector import VLLM_PYTHON, _vllm_env


def run_drivers(base, specs: dict, make_exports, go) -> dict:
    """One `vllm_failure_driver.py` per spec (`{name: spec}`, written to `base/<name>.json`; its phases wait for the
    file `go`), started before `make_exports()` runs here, then `go` written and every driver awaited (900 s).
    Returns `{name: (out dict, engine log text)}`; the test fails when the vLLM venv is missing or a driver exits
    non-zero (with its log's tail)."""
    if not os.path.exists(VLLM_PYTHON):
        pytest.fail(f"no vLLM venv at {VLLM_PYTHON}: create it with launch/vllm_venv.sh or set SLOPE_VLLM_PYTHON")
    procs = {}
    try:
        for name, spec in specs.items():
            (base / f"{name}.json").write_text(json.dumps(spec))
            procs[name] = subprocess.Popen(
                [VLLM_PYTHON, os.path.join(REPO, "tests", "vllm_failure_driver.py"), str(base / f"{name}.json"),
                 str(base / f"{name}.out.json")], cwd=str(base), env=_vllm_env(),
                stdout=open(base / f"{name}.log", "w"), stderr=subprocess.STDOUT)
        make_exports()
        go.write_text("go")
        for proc in procs.values():
            proc.wait(timeout=900)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    out = {}
    for name, proc in procs.items():
        text = (base / f"{name}.log").read_text()
        assert proc.returncode == 0, (name, text[-5000:])
        out[name] = json.loads((base / f"{name}.out.json").read_text()), text
    return out
