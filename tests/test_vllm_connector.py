"""Prefill here, vLLM decodes there: the real vLLM (CPU, offline `vllm.LLM`, float32, enforce_eager) continues from
slope_jax KV exports through `slope_jax.kv.vllm_connector.SlopeJaxConnector`.

Model: the shipped head_dim-64 checkpoint (checkpoints/tiny-gpt-oss-hd64: W=40, 5 layers S/F/S/F/S, 2 KV heads,
dense experts; vLLM-CPU's attention needs head_dim ∈ {32, 64, …}). Exports: layouts (1,1,1) and (2,2,2) with 2
sequence chunks (in this process, one engine per layout); in the slow suite (`-m slow`) also (1,2,4) in this process
and 2 processes × 4 devices (ring 2 × Ulysses 4, in the background) — tests/test_pd_vllm.py decodes a 2-process export
with vLLM in the default suite; both sliding policies; prompt lengths 1, W−1, W+1, one vLLM block (128) + 1 and 1000.
The reference is a plain vLLM run of the same prompt in the same engine (no export). vLLM runs in its own venv
(`SLOPE_VLLM_PYTHON`, default `.venv-vllm/bin/python` as `.ci/run` creates it), one engine per fixture: it starts
while the exports are computed and first decodes the plain references.

Identity (issue 31): the same run decodes exports computed with other weights of the same config and exports of
another tenant's cache_salt, by kv_transfer_params and by the kv_dir lookup: vLLM computes those prompts itself (the
plain run's tokens, 0 external tokens, the reason in the status); the request with the export's own salt loads it, and
so does an export computed from a converted (orbax, float32) copy of the checkpoint vLLM serves.

The vLLM-free decisions (`slope_jax.kv.vllm_plan`: slots, rows per layer kind and KV manager, refusals) are also
checked directly, without vLLM (the identity refusals in tests/test_vllm_identity.py).
"""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from support import REPO, SHIPPED, free_port as _free_port, random_prompt
from test_pd_transformers import WORKER
from test_vllm_identity import other_weights_checkpoint

from slope_jax import kv, xla_env
from slope_jax.kv import vllm_plan as plan
from slope_jax.model.config import ModelConfig
from slope_jax.parallel.config import ParallelConfig
from slope_jax.serve.engine import PrefillEngine

CKPT = os.path.join(REPO, "checkpoints", "tiny-gpt-oss-hd64")
CFG = ModelConfig.from_json(os.path.join(CKPT, "config.json"))
W = CFG.sliding_window
BLOCK = 128  # vLLM-CPU's KV block size (pinned in tests/vllm_driver.py; the connector logs it, checked below)
LENGTHS = [1, W - 1, W + 1, BLOCK + 1, 1000]
POLICIES = {"last_window": False, "full": True}
LOGPROB_TOL = 1e-4  # max |Δ logprob| of the 16 greedy tokens vs the plain run; measured max: see the test's print
LAYOUTS = {"1x1x1": ParallelConfig(), "2x2x2-c2": ParallelConfig(pipeline=2, ring=2, ulysses=2, seq_chunks=2)}
SLOW_LAYOUTS = {"1x2x4": ParallelConfig(ring=2, ulysses=4)}  # plus "2proc-2x4" (`run_slow`)
TAMPER_LEN = W + 1
SALT = "tenant-a"
# (request id, prompt length, export (None: the kv_dir lookup), cache_salt, refusal reason or None: loads n−1)
IDENTITY_CASES = [
    ("identity/other-weights/params", W + 1, "other-weights/len-41", None, r"model\.weights_digest: the export was "
     r"computed with weights [0-9a-f]+, vLLM serves weights [0-9a-f]+"),
    ("identity/other-weights/lookup", W - 1, None, None, r"model\.weights_digest: the export was computed with"),
    ("identity/salt-b/params", W + 1, "salted/len-41", "tenant-b", r"cache_salt: .*computed for another cache_salt"),
    ("identity/no-salt/params", W + 1, "salted/len-41", None, r"cache_salt: .*the request has no cache_salt"),
    ("identity/salt-a/params", W + 1, "salted/len-41", SALT, None),
    ("identity/salt-b/lookup", BLOCK + 1, None, "tenant-b", r"cache_salt: .*computed for another cache_salt"),
    ("identity/salt-a/lookup", BLOCK + 1, None, SALT, None),
    # from a converted (orbax, float32: every value kept) copy of the checkpoint vLLM serves: the same weights
    ("identity/converted/params", W + 1, "converted/len-41", None, None),
]
VLLM_PYTHON = os.environ.get("SLOPE_VLLM_PYTHON", os.path.join(REPO, ".venv-vllm", "bin", "python"))


def _ids():
    return [f"len-{n}" for n in LENGTHS]


def _prompts():
    return [random_prompt(CFG, n, seed=900 + n) for n in LENGTHS]


def _vllm_env():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(PYTHONPATH=REPO, VLLM_CPU_ATTN_SPLIT_KV="0", PYTHONUNBUFFERED="1")
    return env


def _start_driver(base, name, *, hybrid, prefix_caching, phases, extra_config=None):
    """Start tests/vllm_driver.py in the vLLM venv; returns a function waiting for it → (results, log text)."""
    if not os.path.exists(VLLM_PYTHON):
        pytest.fail(f"no vLLM venv at {VLLM_PYTHON}: create it with launch/vllm_venv.sh (as .ci/run "
                    "does) or set SLOPE_VLLM_PYTHON")
    spec, out, log = base / f"{name}.spec.json", base / f"{name}.out.json", base / f"{name}.log"
    spec.write_text(json.dumps({"model": CKPT, "hybrid": hybrid, "prefix_caching": prefix_caching,
                                "extra_config": extra_config or {}, "phases": phases}))
    proc = subprocess.Popen([VLLM_PYTHON, os.path.join(REPO, "tests", "vllm_driver.py"), str(spec), str(out)],
                            cwd=str(base), env=_vllm_env(), stdout=open(log, "w"), stderr=subprocess.STDOUT)

    def wait():
        try:
            proc.wait(timeout=1500)
        finally:
            if proc.poll() is None:
                proc.kill()
        text = log.read_text()
        assert proc.returncode == 0, text[-5000:]
        return json.loads(out.read_text())["results"], text

    return wait


def _plain_phase():
    return {"requests": [{"id": f"plain/{rid}", "prompt": p.tolist(), "params": None}
                         for rid, p in zip(_ids(), _prompts())]}


def _export_phase(exports, go_file, tampered=(), lookups=(), identity_dir=None):
    reqs = []
    for (layout, policy), d in exports.items():
        for rid, p in zip(_ids(), _prompts()):
            reqs.append({"id": f"{layout}/{policy}/{rid}", "prompt": p.tolist(),
                         "params": {plan.PATH_KEY: str(d / rid)}})
    for name, path in tampered:
        reqs.append({"id": f"tampered/{name}", "prompt": _prompts()[LENGTHS.index(TAMPER_LEN)].tolist(),
                     "params": {plan.PATH_KEY: str(path)}})
    for rid in lookups:
        reqs.append({"id": f"lookup/{rid}", "prompt": _prompts()[_ids().index(rid)].tolist(), "params": None})
    for rid, n, export, salt, _ in IDENTITY_CASES if identity_dir else ():
        reqs.append({"id": rid, "prompt": _prompts()[LENGTHS.index(n)].tolist(), "cache_salt": salt,
                     "params": {plan.PATH_KEY: str(identity_dir / export)} if export else None})
    return {"wait_for": str(go_file), "requests": reqs}


def _export_layouts(layouts, exports, salted=None):
    """Prefill every prompt from each layout (one engine at a time) and policy into exports[(layout, policy)]; and
    (`salted`) from the first layout the prompts of W+1 and BLOCK+1 tokens with cache_salt SALT."""
    for layout, par in layouts.items():
        eng = PrefillEngine.from_checkpoint(CKPT, par, dtype="float32", progress=False)
        for policy, full in POLICIES.items():
            res = eng.prefill(_prompts(), str(exports[(layout, policy)]), ids=_ids(), kv_full=full)
            if full:  # the second pass over the same prompts: the BLOCK+1 and 1000-token prompts are prefix hits of
                # the first (host tier), so vLLM decodes hit exports (cached rows beside computed ones) like cold ones
                assert [r.cached_tokens for r in res] == [(n - 1) // BLOCK * BLOCK for n in LENGTHS], layout
        if salted is not None:
            lens = [W + 1, BLOCK + 1]
            eng.prefill([_prompts()[LENGTHS.index(n)] for n in lens], str(salted), ids=[f"len-{n}" for n in lens],
                        cache_salt=SALT)
            salted = None
        del eng


def _export_other_weights(base, out):
    """The prompts of W±1 tokens prefilled with other weights of the same config (test_vllm_identity) into out."""
    eng = PrefillEngine.from_checkpoint(other_weights_checkpoint(base / "other-ckpt"), dtype="float32", progress=False)
    lens = [W + 1, W - 1]
    eng.prefill([_prompts()[LENGTHS.index(n)] for n in lens], str(out), ids=[f"len-{n}" for n in lens])
    del eng


def _export_converted(base, out):
    """The W+1 prompt prefilled from a float32 orbax conversion of CKPT into out: the restored engine names the
    source's weights (`orbax_store.weights_digest`), so vLLM serving CKPT loads it."""
    from slope_jax.checkpoints import orbax_store

    orbax_store.convert(CKPT, str(base / "converted-ckpt"), dtype="float32", progress=False)
    eng = PrefillEngine.from_checkpoint(str(base / "converted-ckpt"), dtype="float32", progress=False)
    eng.prefill([_prompts()[LENGTHS.index(W + 1)]], str(out), ids=[f"len-{W + 1}"])
    del eng


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Exports from every default layout and policy, the tampered copies, and the hybrid-manager vLLM engine over
    them. Returns (exports {(layout, policy): dir}, results, engine log)."""
    base = tmp_path_factory.mktemp("vllm")
    go = base / "exports-ready"
    exports = {(layout, policy): base / layout / policy for layout in LAYOUTS for policy in POLICIES}
    kv_dir = base / "kv_dir"
    tamper_dir = base / "tampered"
    # the directory name is the manifest's request_id: copies keep it
    tampered = [(name, tamper_dir / name / (f"len-{TAMPER_LEN}" if name != "wrong-model" else "x"))
                for name in ("manifest", "wrong-model", "missing-file", "truncated")]
    lookups = ["len-41", "len-1000"]
    identity = base / "identity"
    wait_vllm = _start_driver(base, "hybrid", hybrid=True, prefix_caching=False, extra_config={"kv_dir": str(kv_dir)},
                              phases=[_plain_phase(), _export_phase(exports, go, tampered, lookups, identity)])
    _export_layouts(LAYOUTS, exports, salted=identity / "salted")
    _export_other_weights(base, identity / "other-weights")
    _export_converted(base, identity / "converted")
    # another model's KV of the same prompt: the shipped head_dim-24 checkpoint (6 layers)
    other = PrefillEngine.from_checkpoint(SHIPPED, dtype="float32", progress=False)
    other.prefill([_prompts()[LENGTHS.index(TAMPER_LEN)]], str(base / "other-model"), ids=["x"])
    del other
    _make_tampered(exports[("1x1x1", "last_window")] / f"len-{TAMPER_LEN}", base / "other-model" / "x", tamper_dir)
    kv_dir.mkdir()  # exports found by token hash: published after the engine started (the index rescans on a miss)
    shutil.copytree(exports[("2x2x2-c2", "last_window")] / "len-41", kv_dir / "len-41")
    shutil.copytree(exports[("1x1x1", "full")] / "len-1000", kv_dir / "len-1000")
    # identity: the only export of the W−1 prompt is from other weights; the BLOCK+1 prompt's is salted
    shutil.copytree(identity / "other-weights" / f"len-{W - 1}", kv_dir / f"len-{W - 1}")
    shutil.copytree(identity / "salted" / f"len-{BLOCK + 1}", kv_dir / f"len-{BLOCK + 1}")
    go.write_text("go")
    results, log = wait_vllm()
    return exports, results, log


@pytest.fixture(scope="module")
def run_slow(tmp_path_factory):
    """The slow suite's exports — SLOW_LAYOUTS in this process and 2 processes × 4 devices in the background — and
    their own hybrid-manager vLLM engine. Returns (exports {(layout, policy): dir}, results, engine log)."""
    base = tmp_path_factory.mktemp("vllm_slow")
    go = base / "exports-ready"
    exports = {(layout, policy): base / layout / policy for layout in [*SLOW_LAYOUTS, "2proc-2x4"]
               for policy in POLICIES}
    wait_vllm = _start_driver(base, "hybrid-slow", hybrid=True, prefix_caching=False,
                              phases=[_plain_phase(), _export_phase(exports, go)])
    wait_2proc = _start_two_process(base / "2proc-2x4")
    _export_layouts(SLOW_LAYOUTS, exports)
    wait_2proc()
    go.write_text("go")
    results, log = wait_vllm()
    return exports, results, log


def _start_two_process(out):
    out.mkdir(parents=True)
    (out / "spec.json").write_text(json.dumps({"checkpoint": CKPT, "ids": _ids(),
                                               "prompts": [p.tolist() for p in _prompts()]}))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # the XLA flags the launcher sets for --cpu_devices=4 (its programs, served by the cache)
    env.update(XLA_FLAGS=xla_env.xla_flags("", cpu_devices=4), JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    port = _free_port()
    procs = [(i, subprocess.Popen([sys.executable, "-c", WORKER, "2", str(i), str(port), str(out)], cwd=REPO, env=env,
                                  stdout=open(out / f"p{i}.log", "w"), stderr=subprocess.STDOUT)) for i in (1, 0)]

    def wait():
        for i, p in procs:
            p.wait(timeout=900)
            assert p.returncode == 0, (out / f"p{i}.log").read_text()[-3000:]

    return wait


def _make_tampered(src, other_model, base):
    """Four broken exports of one prompt (n = W+1), each caught by a different check."""
    for name in ("manifest", "missing-file", "truncated"):
        shutil.copytree(src, base / name / src.name)
    shutil.copytree(other_model, base / "wrong-model" / other_model.name)
    base = {name: base / name / src.name for name in ("manifest", "missing-file", "truncated")}
    m = json.loads((base["manifest"] / kv.MANIFEST).read_text())
    m["layers"][1]["token_range"] = [0, TAMPER_LEN - 1]  # a full layer that claims fewer tokens than the prompt has
    (base["manifest"] / kv.MANIFEST).write_text(json.dumps(m))
    os.remove(base["missing-file"] / "kv-p0.safetensors")
    path = base["truncated"] / "kv-p0.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 4096])  # the last tensor loses its tail


TAMPER_REASONS = {"manifest": r"layers\[1\]\.token_range",
                  "wrong-model": "num_hidden_layers is 6 in the export, 5 in the model",
                  "missing-file": "kv-p0.safetensors, which does not exist", "truncated": r"checksums\.kv-p0"}


def _check_against_plain(results, key, rid, n, worst):
    got, ref = results[key], results[f"plain/{rid}"]
    assert got["tokens"] == ref["tokens"], key
    assert len(got["tokens"]) == 16
    err = float(np.max(np.abs(np.asarray(got["logprobs"]) - np.asarray(ref["logprobs"]))))
    assert err <= LOGPROB_TOL, (key, err)
    worst[0] = max(worst[0], err)
    # vLLM's own count of tokens it did not compute (prefix caching is off: all external) and the connector's
    assert got["num_cached_tokens"] == n - 1, key
    assert got["kv_transfer_params"][plan.LOADED_KEY] == n - 1, (key, got["kv_transfer_params"])


def _check_exports(exports, results, log, worst):
    """Every export × length decodes the plain run's 16 tokens with n−1 tokens loaded; the first token equals the
    prefill's; the connector logs the hybrid manager's sliding and full groups (block size 128)."""
    assert re.search(r"SlopeJaxConnector \(SCHEDULER\).*\('sliding', 128\).*\('full', 128\)|"
                     r"SlopeJaxConnector \(SCHEDULER\).*\('full', 128\).*\('sliding', 128\)", log), \
        "expected the hybrid manager's sliding and full groups with block size 128"
    for (layout, policy), d in exports.items():
        for rid, n in zip(_ids(), LENGTHS):
            _check_against_plain(results, f"{layout}/{policy}/{rid}", rid, n, worst)
            first = kv.read_manifest(str(d / rid))["first_token"]
            assert results[f"plain/{rid}"]["tokens"][0] == first, (layout, policy, rid)
            if n == 1:
                assert "1-token prompt" in results[f"{layout}/{policy}/{rid}"]["kv_transfer_params"][plan.STATUS_KEY]


def test_vllm_decodes_from_every_export_like_a_plain_run(run):
    """Hybrid KV manager (the default): every layout × policy × length decodes the plain run's 16 tokens with n−1
    tokens loaded; the first token equals the prefill's."""
    exports, results, log = run
    worst = [0.0]
    _check_exports(exports, results, log, worst)
    for rid in ("len-41", "len-1000"):  # found by token hash under kv_dir
        _check_against_plain(results, f"lookup/{rid}", rid, int(rid[4:]), worst)
    print(f"hybrid manager: max |Δlogprob| {worst[0]:.2e} over {len(exports)} exports x {len(LENGTHS)} lengths")


@pytest.mark.slow
def test_vllm_decodes_from_slow_layouts_like_a_plain_run(run, run_slow):
    """The slow suite's layouts (1,2,4) and 2 processes × 4 devices, hybrid manager: as the default test, and the
    plain runs of both engines decode the same tokens."""
    exports, results, log = run_slow
    worst = [0.0]
    _check_exports(exports, results, log, worst)
    for rid in _ids():
        assert results[f"plain/{rid}"]["tokens"] == run[1][f"plain/{rid}"]["tokens"]
    print(f"hybrid manager (slow layouts): max |Δlogprob| {worst[0]:.2e} over {len(exports)} exports")


def test_broken_exports_are_prefilled_by_vllm(run):
    """Tampered manifest, wrong model, missing file, truncated file: 0 external tokens, the plain run's tokens
    exactly, the reason in the request's output and in the engine log; the same batch's other requests loaded."""
    _, results, log = run
    ref = results[f"plain/len-{TAMPER_LEN}"]
    for name, reason in TAMPER_REASONS.items():
        got = results[f"tampered/{name}"]
        assert got["tokens"] == ref["tokens"] and got["logprobs"] == pytest.approx(ref["logprobs"], abs=LOGPROB_TOL)
        assert got["num_cached_tokens"] == 0
        params = got["kv_transfer_params"]
        assert params[plan.LOADED_KEY] == 0 and re.search(reason, params[plan.STATUS_KEY]), (name, params)
        assert re.search(rf"export not used, vLLM prefills it itself: .*tampered/{name}/.*{reason}", log), name
    assert results[f"1x1x1/last_window/len-{TAMPER_LEN}"]["num_cached_tokens"] == TAMPER_LEN - 1


def test_identity_mismatches_are_prefilled_by_vllm(run):
    """Other weights of the same config, another tenant's cache_salt or none, by kv_transfer_params and by the kv_dir
    lookup: 0 external tokens, the plain run's tokens, the reason (naming model.weights_digest or cache_salt) in the
    status and the log; the request with the export's own salt loads n−1 tokens, by either path."""
    _, results, log = run
    worst = [0.0]
    for rid, n, _, _, reason in IDENTITY_CASES:
        got, ref = results[rid], results[f"plain/len-{n}"]
        if reason is None:
            _check_against_plain(results, rid, f"len-{n}", n, worst)
            continue
        assert got["tokens"] == ref["tokens"] and got["logprobs"] == pytest.approx(ref["logprobs"], abs=LOGPROB_TOL)
        assert got["num_cached_tokens"] == 0, rid
        params = got["kv_transfer_params"]
        assert params[plan.LOADED_KEY] == 0 and re.search(reason, params[plan.STATUS_KEY]), (rid, params)
        assert params[plan.STATUS_KEY].startswith("not used: "), (rid, params)
    assert re.search(r"served weights digest [0-9a-f]{32}", log)
    assert re.search(r"export not used, vLLM prefills it itself: .*other-weights.*model\.weights_digest", log)
    assert re.search(r"export not used, vLLM prefills it itself: .*salted.*cache_salt", log)


def test_plain_vllm_equals_transformers(run):
    """The shipped head_dim-64 checkpoint: plain vLLM's 16 greedy tokens equal transformers' (float32, eager)."""
    import torch
    import transformers

    _, results, _ = run
    model = transformers.AutoModelForCausalLM.from_pretrained(CKPT, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    for rid, p in zip(_ids(), _prompts()):
        with torch.no_grad():
            ref = model.generate(torch.tensor(p, dtype=torch.long)[None], max_new_tokens=16, do_sample=False,
                                 eos_token_id=None, min_new_tokens=16)[0, len(p):].tolist()
        assert results[f"plain/{rid}"]["tokens"] == ref, rid


@pytest.mark.slow
def test_plain_kv_manager(run, tmp_path):
    """Hybrid manager off (sliding layers own a block per token; prefix caching off, so their early slots are never
    read): every export decodes the plain run's tokens with n−1 tokens loaded."""
    exports, hybrid_results, _ = run
    go = tmp_path / "go"
    go.write_text("go")
    wait = _start_driver(tmp_path, "plain-manager", hybrid=False, prefix_caching=False,
                         phases=[_plain_phase(), _export_phase(exports, go)])
    results, log = wait()
    assert re.search(r"SlopeJaxConnector \(SCHEDULER\).*1 KV cache group\(s\) \(kind, block size\) \[\('full', 128\)\]",
                     log)
    worst = [0.0]
    for (layout, policy) in exports:
        for rid, n in zip(_ids(), LENGTHS):
            _check_against_plain(results, f"{layout}/{policy}/{rid}", rid, n, worst)
    for rid in _ids():  # both managers decode the same tokens
        assert results[f"plain/{rid}"]["tokens"] == hybrid_results[f"plain/{rid}"]["tokens"]
    print(f"plain manager: max |Δlogprob| {worst[0]:.2e}")


def test_connector_imports_no_jax():
    """The decode side needs no JAX: importing the connector in the vLLM venv loads no jax module."""
    code = ("import sys, slope_jax.kv.vllm_connector; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax', 'orbax')); "
            "assert not bad, bad")
    if not os.path.exists(VLLM_PYTHON):
        pytest.fail(f"no vLLM venv at {VLLM_PYTHON} (see .ci/run) or set SLOPE_VLLM_PYTHON")
    subprocess.run([VLLM_PYTHON, "-c", code], env=_vllm_env(), check=True, timeout=300)


@pytest.mark.slow
def test_prefix_caching_on(run, tmp_path):
    """vLLM's default, prefix caching on, hybrid manager: `kv_full` and `last_window` exports load n−1 tokens (a
    `last_window` export holds the rows back to every block boundary ≤ 128 before n−W) and decode the plain run's
    tokens. The prefix cache is emptied before each phase, so no request hits another's
    blocks."""
    exports, hybrid_results, _ = run
    layout = "2x2x2-c2"
    phases = [{**_plain_phase(), "reset_prefix_cache": True}]
    for policy in POLICIES:
        phases.append({"reset_prefix_cache": True, "requests": [
            {"id": f"{policy}/{rid}", "prompt": p.tolist(),
             "params": {plan.PATH_KEY: str(exports[(layout, policy)] / rid)}} for rid, p in zip(_ids(), _prompts())]})
    results, log = _start_driver(tmp_path, "prefix-caching", hybrid=True, prefix_caching=True, phases=phases)()
    worst = [0.0]
    for rid, n in zip(_ids(), LENGTHS):
        assert results[f"plain/{rid}"]["tokens"] == hybrid_results[f"plain/{rid}"]["tokens"]
        _check_against_plain(results, f"full/{rid}", rid, n, worst)
        _check_against_plain(results, f"last_window/{rid}", rid, n, worst)
    print(f"prefix caching on: max |Δlogprob| {worst[0]:.2e}")


# ---------------------------------------------------------------------------------------------------------------
# vllm_plan without vLLM
def test_slots_and_rows():
    assert plan.slots([7, 3, 9], 4, 2, 9, null_block=0).tolist() == [30, 31, 12, 13, 14, 15, 36]
    with pytest.raises(plan.ExportRefused, match="token 3 maps to the null block"):
        plan.slots([0, 5], 4, 3, 6, null_block=0)
    with pytest.raises(plan.ExportRefused, match="token 8 needs block 2, the request has 2"):
        plan.slots([1, 5], 4, 0, 9, null_block=0)
    rows = plan.layer_rows
    for mode in (plan.WINDOW, plan.BLOCK, plan.ALL):
        assert rows("full_attention", 0, 100, W, 16, mode) == (0, 99)
        assert rows("full_attention", 0, 1, W, 16, mode) == (0, 0)  # 1 token: nothing to load
    assert rows("sliding_attention", 0, 100, W, 16, plan.WINDOW) == (60, 99)  # keys of position 99: 60 … 99
    assert rows("sliding_attention", 0, 100, W, 16, plan.BLOCK) == (48, 99)   # the block [48, 64) holds 60
    assert rows("sliding_attention", 0, 100, W, 16, plan.ALL) == (0, 99)
    assert rows("sliding_attention", 64, 100, W, 16, plan.WINDOW) == (64, 99)  # vLLM's own prefix hit: from 64
    assert rows("sliding_attention", 0, 104, W, 16, plan.BLOCK) == (64, 103)  # n−W = 64 block-aligned


def test_validate_refusals(run):
    """Each refusal names its field; a valid export passes; the index finds exports by token hash."""
    import dataclasses

    exports = run[0]
    d = exports[("1x1x1", "last_window")]
    served = plan.weights_digest(CKPT)
    a, p41, p39 = str(d / "len-41"), _prompts()[LENGTHS.index(41)], _prompts()[LENGTHS.index(39)]
    ok = plan.validate(a, p41, CFG, "float32", None, weights=served)
    assert ok.num_tokens == 41 and ok.dtype == "float32"
    with pytest.raises(plan.ExportRefused, match="num_tokens: the export holds 41 tokens, the prompt has 39"):
        plan.validate(a, p39, CFG, "float32", None, weights=served)
    other = p41.copy()
    other[3] = (other[3] + 1) % CFG.vocab_size
    with pytest.raises(plan.ExportRefused, match="token_ids_sha256"):
        plan.validate(a, other, CFG, "float32", None, weights=served)
    with pytest.raises(plan.ExportRefused, match="dtype: the export is float32, vLLM's KV cache is bfloat16"):
        plan.validate(a, p41, CFG, "bfloat16", None, weights=served)
    assert ok.sliding_from == 0  # last_window: [max(0, n−W−127), n) (kv.format.VLLM_BLOCK_MAX)
    full = plan.validate(str(exports[("1x1x1", "full")] / "len-41"), p41, CFG, "float32", None, weights=served)
    assert full.sliding_from == 0
    plan.check_sliding(ok, *plan.layer_rows("sliding_attention", 0, 41, W, BLOCK, plan.WINDOW), plan.WINDOW)
    for mode in (plan.BLOCK, plan.ALL):  # prefix caching on: the block of position n−W = 1 starts at 0
        lo, hi = plan.layer_rows("sliding_attention", 0, 41, W, BLOCK, mode)
        assert (lo, hi) == (0, 40)
        plan.check_sliding(ok, lo, hi, mode)
        plan.check_sliding(full, lo, hi, mode)
    # 1000 tokens: the export covers the block of n−W = 960 (from 833), not every token (the plain manager)
    long = plan.validate(str(d / "len-1000"), _prompts()[LENGTHS.index(1000)], CFG, "float32", None, weights=served)
    assert long.sliding_from == 1000 - W - 127
    plan.check_sliding(long, *plan.layer_rows("sliding_attention", 0, 1000, W, BLOCK, plan.BLOCK), plan.BLOCK)
    with pytest.raises(plan.ExportRefused, match=r"sliding_policy: sliding layers hold tokens \[833, 1000\), vLLM "
                                                 r"needs \[0, 999\) \(with prefix caching on and the plain"):
        plan.check_sliding(long, *plan.layer_rows("sliding_attention", 0, 1000, W, BLOCK, plan.ALL), plan.ALL)
    plan.check_sliding(ok, *plan.layer_rows("sliding_attention", 128, 41, W, BLOCK, plan.BLOCK), plan.BLOCK)
    with pytest.raises(plan.ExportRefused, match="kv_transfer_params.slope_jax_first_token"):
        plan.validate(a, p41, CFG, "float32", {plan.FIRST_TOKEN_KEY: -1}, weights=served)
    with pytest.raises(plan.ExportRefused, match="kv_transfer_params.num_tokens=40"):
        plan.validate(a, p41, CFG, "float32", {plan.NUM_TOKENS_KEY: 40}, weights=served)
    with pytest.raises(plan.ExportRefused, match="absolute directory"):
        plan.find_path({plan.PATH_KEY: "kv/a"}, "", None)
    with pytest.raises(plan.ExportRefused, match="sliding_window is 40 in the export, 41 in the model"):
        plan.validate(a, p41, dataclasses.replace(CFG, sliding_window=41), "float32", None, weights=served)
    index = plan.ExportIndex(str(d))
    assert index.lookup(kv.token_hash(p39)) == str(d / "len-39")
    assert index.lookup(kv.token_hash(other)) is None


def test_an_older_vllm_gets_an_error_naming_the_versions(tmp_path):
    """Importing the connector where vLLM's v1 connector API predates it (vLLM < MIN_VLLM; vLLM 0.29 lacks
    KVConnectorTransferResults) raises ImportError naming the version needed and the version found, not a missing
    name deep inside vLLM. The older vLLM is a stand-in package with 0.29's version and without those two names."""
    base = tmp_path / "vllm" / "distributed" / "kv_transfer" / "kv_connector" / "v1"
    base.mkdir(parents=True)
    (tmp_path / "vllm" / "__init__.py").write_text('__version__ = "0.29.0"\n')
    for d in (tmp_path / "vllm" / "distributed", base.parent.parent, base.parent, base):
        (d / "__init__.py").touch()
    (tmp_path / "vllm" / "logger.py").write_text("import logging\ninit_logger = logging.getLogger\n")
    (base / "base.py").write_text("class KVConnectorBase_V1: pass\nclass KVConnectorMetadata: pass\n"
                                  "class KVConnectorRole: pass\nclass SupportsHMA: pass\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), REPO])}
    out = subprocess.run([sys.executable, "-c", "import slope_jax.kv.vllm_connector"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: slope_jax.kv.vllm_connector needs vLLM >= 0.30"), out.stderr[-2000:]
    assert "this environment has vLLM 0.29.0" in last and "KVConnectorTransferResults" in last


_LORA_CHECK = r"""
import json, sys, types
from transformers import AutoConfig
from slope_jax.kv import compat, vllm_connector as vc, vllm_plan as plan
ckpt, path, prompt = json.loads(sys.stdin.read())
conn = object.__new__(vc.SlopeJaxConnector)  # the scheduler side's decision only: no engine needed
conn._cfg = compat.model_config(AutoConfig.from_pretrained(ckpt))
conn._cache_dtype, conn._check_fp, conn._index = "float32", True, None
conn._weights, conn._weights_unknown = plan.weights_digest(ckpt), ""
conn._groups, conn._async_min_bytes, conn._model_differs = [(128, False), (128, True)], 1 << 20, None
out = {}
for rid, lora in (("base", None), ("adapter", types.SimpleNamespace(lora_name="sql-ad", lora_int_id=7))):
    req = types.SimpleNamespace(request_id=rid, prompt_token_ids=prompt, kv_transfer_params={plan.PATH_KEY: path},
                                cache_salt=None, lora_request=lora)
    d = conn._decide(req)
    out[rid] = [d.export is not None, d.status]
print("@@" + json.dumps(out))
"""


def test_a_lora_request_is_prefilled_by_vllm(run):
    """The connector gives no export to a request that runs a LoRA adapter (vLLM's `lora_request`): its status says
    so and vLLM prefills it; the same request on the base model loads it. A stand-in request through the connector's
    scheduler-side decision, in the vLLM venv: vLLM-CPU 0.32 cannot run gpt-oss with LoRA enabled (its LoRA MoE
    path is a Triton kernel), so no engine can serve the adapter here."""
    exports, _, _ = run
    path = str(exports[("1x1x1", "last_window")] / f"len-{W + 1}")
    prompt = _prompts()[LENGTHS.index(W + 1)].tolist()
    out = subprocess.run([VLLM_PYTHON, "-c", _LORA_CHECK], input=json.dumps([CKPT, path, prompt]), env=_vllm_env(),
                         capture_output=True, text=True, timeout=300)
    lines = [x for x in out.stdout.splitlines() if x.startswith("@@")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    got = json.loads(lines[-1][2:])
    assert got["base"] == [True, "validated"], got
    assert got["adapter"][0] is False and re.search(r"^not used: .*len-41: lora: the request runs LoRA adapter "
                                                    r"'sql-ad', the export holds the base model's KV",
                                                    got["adapter"][1]), got
