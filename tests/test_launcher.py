"""The main job end to end: the absl launcher on one and on two processes (127.0.0.1), results, KV files, decode
continuation, a process killed mid-run, and peers missing at start-up."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from support import MALFORMED, MAX_TOKENS, REPO, SHIPPED

from slope_jax import kv, load_checkpoint
from slope_jax.kv import decode
from slope_jax.parallel.config import ParallelConfig
from slope_jax.serve.engine import PrefillEngine

LAYOUT = ["--ring=2", "--ulysses=4"]
# the tiles of tests/test_pd_transformers.py's 2-process worker: the same layout, dtype and tiles compile the same
# programs, so the persistent compilation cache serves them across the launcher runs and that worker
TILES32 = ["--q_tile=32", "--kv_tile=32", "--moe_tile=32"]
COMMON = ["--dtype=float32", *TILES32, "--heartbeat_timeout=10", "--init_timeout=120"]
W = 32  # the shipped checkpoint's sliding window


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the launcher sets the device count itself
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _launch(n: int, args: list[str], tmp, timeout=600):
    port = _free_port()
    procs = []
    for i in reversed(range(n)):
        cmd = [sys.executable, "-m", "slope_jax.launch", f"--num_processes={n}", f"--process_id={i}",
               f"--coordinator_address=127.0.0.1:{port}", f"--cpu_devices={8 // n}", *LAYOUT, *COMMON, *args]
        log = open(tmp / f"p{i}.log", "w")
        procs.append((i, subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT)))
    for i, p in procs:
        p.wait(timeout=timeout)
        assert p.returncode == 0, (tmp / f"p{i}.log").read_text()[-3000:]


def _requests(path):
    """The valid requests (+ one with a bad token) interleaved with every malformed line of request_fuzz: each line
    must give exactly one record. Returns ({id: valid request}, {line number: raw line} of the lines that must fail)."""
    lengths = [5, W - 1, W, W + 1, 47]
    rng = np.random.default_rng(0)
    good = [{"id": f"len-{n}", "tokens": rng.integers(0, 1015, n).tolist()} for n in lengths]
    good.insert(2, {"id": "bad-token", "tokens": [1, 2, 99999]})
    good.append({"id": "text", "text": "It was the best of times, it was the worst of times"})
    raw, bad = [], {}
    for i, line in enumerate(MALFORMED):
        if i % 7 == 0 and good:
            raw.append(json.dumps(good.pop(0)).encode())
        raw.append(line)
        if not line.startswith(b'{"id": "dup-target", "tokens": [9'):
            bad[len(raw)] = line
    raw += [json.dumps(g).encode() for g in good]
    path.write_bytes(b"\n".join(raw) + b"\n")
    reqs = {}
    for n, line in enumerate(raw, 1):
        if n not in bad or b"bad-token" in line:
            reqs[json.loads(line)["id"]] = json.loads(line)
    return reqs, bad, len(raw)


def _check_records(records, reqs, bad, num_lines):
    """Exactly one record per line: results for the valid requests, an error record for every bad line."""
    assert sorted(r["line"] for r in records) == list(range(1, num_lines + 1))
    errors = {r["line"]: r for r in records if "error" in r}
    ok = {r["id"]: r for r in records if "error" not in r}
    assert set(ok) == set(reqs) - {"bad-token"} and len(bad) >= 40 and len(ok) >= 5
    bad_token_line = next(r["line"] for r in records if r.get("id") == "bad-token")
    assert set(errors) == set(bad) | {bad_token_line}
    ids = [r["id"] for r in records if r["id"] is not None]
    assert len(ids) == len(set(ids))  # an id names at most one record (duplicates get id null + duplicate_of)
    return ok, errors


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("launch")
    reqs, bad, num_lines = _requests(base / "requests.jsonl")
    # the two-process run restores a converted (orbax) copy of the shipped checkpoint, saved in another layout
    # (P, R, U) = (2, 2, 2): each process reads only its devices' shards; results must equal the HF-loaded run's
    from slope_jax.checkpoints import orbax_store

    converted = str(base / "shipped-orbax")
    orbax_store.convert(SHIPPED, converted, ParallelConfig(2, 2, 2), "float32", progress=False)
    out = {}
    for name, n in (("two_procs", 2), ("one_proc", 1)):
        d = base / name
        d.mkdir()
        ckpt = [f"--checkpoint={converted}"] if n == 2 else []
        _launch(n, [f"--requests={base / 'requests.jsonl'}", f"--results={d / 'results.jsonl'}",
                    f"--kv_dir={d / 'kv'}", f"--logits_dir={d / 'logits'}", f"--max_tokens={MAX_TOKENS}", *ckpt], d)
        text = (d / "results.jsonl").read_text()
        records = [json.loads(x, parse_constant=lambda c: pytest.fail(f"non-strict JSON: {c}"))  # no NaN/Infinity
                   for x in text.splitlines()]
        ok, _ = _check_records(records, reqs, bad, num_lines)
        out[name] = {**ok, "bad-token": next(r for r in records if r.get("id") == "bad-token")}
    return base, reqs, out


@pytest.fixture(scope="module")
def single():
    """The single-device float32 reference engine on the shipped checkpoint (one per module: its compiled buckets
    serve both tests)."""
    cfg, params = load_checkpoint(SHIPPED, "float32", progress=False)
    return PrefillEngine(cfg, params, ParallelConfig(), "float32")


def test_two_processes_equal_one_process_and_single_device(runs, single):
    """2 processes x 4 devices restoring the orbax conversion == 1 process x 8 devices loading the HF checkpoint
    (bitwise KV, equal logits) == the single-device reference (within 1e-5)."""
    base, reqs, out = runs
    two, one = out["two_procs"], out["one_proc"]
    assert set(two) == set(one) == set(reqs)
    assert "outside the vocabulary" in two["bad-token"]["error"] and "first_token" not in two["bad-token"]
    good = [r for r in reqs if r != "bad-token"]
    for rid in good:
        a, b = two[rid], one[rid]
        assert a["first_token"] == b["first_token"] and a["num_tokens"] == b["num_tokens"]
        assert a["first_token_text"] == b["first_token_text"] != ""  # the shipped checkpoint has a tokenizer
        la, lb = (np.load(base / run / "logits" / f"{rid}.npy") for run in ("two_procs", "one_proc"))
        assert np.abs(la - lb).max() < 1e-5  # measured: 0 (same program, same layout)
        ka, kb = kv.load(a["kv_path"]), kv.load(b["kv_path"])
        for layer in ka:  # KV files bitwise equal in float32 between 2 x 4 and 1 x 8 devices
            np.testing.assert_array_equal(ka[layer].k, kb[layer].k)
            np.testing.assert_array_equal(ka[layer].v, kb[layer].v)
            np.testing.assert_array_equal(ka[layer].positions, kb[layer].positions)
        if rid != "text":
            ref = single.prefill([reqs[rid]["tokens"]])[0]
            assert ref.first_token == a["first_token"]
            assert np.abs(ref.logits - la).max() < 1e-5  # single-device path; measured ~2e-6
            for layer in ka:  # and the single-device KV within 1e-5 (different reduction orders)
                lo = int(ka[layer].positions[0])
                assert np.abs(ref.kv[layer].k[lo:] - ka[layer].k).max() < 1e-5
    files = os.listdir(two["len-47"]["kv_path"])
    assert sorted(files) == ["kv-p0.safetensors", "kv-p1.safetensors", "manifest.json"]  # each process wrote its own


def test_decode_continuation_of_every_export(runs, single):
    base, reqs, out = runs
    cfg = single.cfg
    for rid, rec in out["two_procs"].items():
        if "error" in rec or rid == "text":
            continue
        ids = reqs[rid]["tokens"]
        cache = kv.load(rec["kv_path"])
        logits = decode.decode_step(cfg, single.params, cache, rec["first_token"], len(ids))
        full = single.prefill([ids + [rec["first_token"]]])[0].logits
        assert np.abs(logits - full).max() < 2e-5, rid  # measured ~2e-6 (float32)


def test_killed_process_stops_the_run_cleanly(tmp_path):
    reqs = tmp_path / "many.jsonl"
    reqs.write_text("".join(json.dumps({"id": f"r{i}", "tokens": list(range(1, 22))}) + "\n" for i in range(60)))
    port = _free_port()
    heartbeat = 8
    procs = {}
    for i in (1, 0):
        cmd = [sys.executable, "-m", "slope_jax.launch", "--num_processes=2", f"--process_id={i}",
               f"--coordinator_address=127.0.0.1:{port}", "--cpu_devices=4", *LAYOUT, "--dtype=float32", *TILES32,
               f"--heartbeat_timeout={heartbeat}", f"--requests={reqs}", f"--results={tmp_path / 'res.jsonl'}",
               f"--kv_dir={tmp_path / 'kv'}", "--batch_size=1"]
        procs[i] = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        res = tmp_path / "res.jsonl"
        if res.exists() and res.read_text().count("first_token") >= 2:
            break
        assert procs[0].poll() is None, procs[0].communicate()[1][-2000:]
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGKILL)
    killed = time.time()
    try:
        _, err = procs[0].communicate(timeout=heartbeat + 60)
    finally:
        procs[0].kill()
    waited = time.time() - killed
    assert procs[0].returncode == 2
    # the peer watch names the dead process as soon as its connection drops; JAX's heartbeat is the backstop
    assert waited < heartbeat + 5, waited  # measured: < 1 s
    assert "slope_jax: error: process 0: process 1 died" in err, err[-2000:]
    # every export either has its manifest and loads, or has none (an unfinished export is never valid)
    for d in (tmp_path / "kv").iterdir():
        if (d / "manifest.json").exists():
            kv.load(str(d))
        else:
            with pytest.raises(kv.KVFormatError, match="no manifest.json"):
                kv.load(str(d))


def test_missing_peer_at_startup_is_a_clear_error():
    port = _free_port()
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "slope_jax.launch", "--num_processes=2", "--process_id=1",
                        f"--coordinator_address=127.0.0.1:{port}", "--init_timeout=3"], cwd=REPO, env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and time.time() - t0 < 60
    assert f"coordinator 127.0.0.1:{port} (process 0) is not reachable after 3 s" in r.stderr
    r = subprocess.run([sys.executable, "-m", "slope_jax.launch", "--num_processes=3", "--process_id=0",
                        f"--coordinator_address=127.0.0.1:{port}", "--init_timeout=3"], cwd=REPO, env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "process(es) [1, 2] did not connect" in r.stderr


def test_request_over_the_memory_budget_gets_an_error_record(tmp_path):
    """--device_memory_gib: a prompt whose bucket's step the planner's memory model predicts to need more is refused
    at intake (no compile); the others run. Single device, shipped checkpoint (bf16): predicted 4.9 MiB at 20 tokens,
    32.0 MiB at 4000 (XLA's memory analysis of the compiled steps: ~11 and ~40 MiB)."""
    reqs = tmp_path / "r.jsonl"
    reqs.write_text(json.dumps({"id": "small", "tokens": list(range(20))}) + "\n"
                    + json.dumps({"id": "huge", "tokens": [7] * 4000}) + "\n")
    r = subprocess.run([sys.executable, "-m", "slope_jax.launch", "--cpu_devices=1", f"--requests={reqs}",
                        f"--results={tmp_path / 'out.jsonl'}", "--device_memory_gib=0.02"], cwd=REPO, env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = {json.loads(x)["id"]: json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()}
    assert "first_token" in out["small"]
    err = out["huge"]["error"]
    assert "4000 tokens (bucket 4032) need a predicted 0.031 GiB per device" in err, err
    assert "over the budget of 0.020 GiB (--device_memory_gib)" in err, err
    assert "compile: 1 step program(s)" in r.stderr, r.stderr[-2000:]  # the refused bucket was never compiled


def test_help_explains_the_flags():
    r = subprocess.run([sys.executable, "-m", "slope_jax.launch", "--helpfull"], cwd=REPO, env=_env(),
                       capture_output=True, text=True, timeout=120)
    text = r.stdout + r.stderr
    for flag in ("--checkpoint", "--ring", "--ulysses", "--pipeline", "--requests", "--results", "--kv_dir",
                 "--coordinator_address", "--num_processes", "--process_id", "--init_timeout", "--heartbeat_timeout",
                 "--dtype"):
        assert flag in text, flag
    script = os.path.join(os.path.dirname(sys.executable), "slope-jax")  # the console script of pyproject.toml
    r = subprocess.run([script, "--help"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--coordinator_address" in r.stdout, r.stderr[-2000:]
