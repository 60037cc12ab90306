"""Synchronous loads fail closed, and a preempted request with external tokens loads again (issue 31 items 4–5), on the
real vLLM (CPU, float32, in-process engine stepped by tests/vllm_failure_driver.py), checkpoints/tiny-gpt-oss-hd64.

One engine with one KV cache group (hybrid manager off, prefix caching off, block size 32), so exports below
`async_min_bytes` load synchronously, before the forward pass, and a failure is reported by block id
(`get_block_ids_with_load_errors`); a KV cache of only NUM_BLOCKS blocks, so three requests decoding together do not
fit and vLLM preempts one (and later resumes it: its prompt's KV is loaded again). Phases:
- plain: the references, one request at a time (no preemption);
- preempt: three export requests decoding 100 tokens at once: one is preempted (vLLM's own count); all three decode
  the plain tokens with n−1 tokens loaded, and the connector logs the second load;
- fail / recompute: an export truncated or one byte flipped right after validation (the driver's hook), next to a
  healthy request: under `fail` that request ends with an error, under `recompute` vLLM prefills it (the plain
  tokens, status "recomputed: the KV load failed: …", 0 tokens loaded); the healthy one loads.
The asynchronous paths are tests/test_vllm_failures.py's.
"""

import re

import numpy as np
import pytest
from vllm_drivers import run_drivers
from support import random_prompt
from test_vllm_connector import CKPT, CFG
from test_vllm_failures import LOGPROB_TOL, REASONS

from slope_jax.kv import vllm_plan as plan
from slope_jax.serve.engine import PrefillEngine

B = 32  # vLLM-CPU's attention needs a multiple of 32 with one KV cache group
NUM_BLOCKS = 20  # 640 token slots: three requests of 150 + 100 tokens (8 blocks each) do not fit together
N = 150
MAX_TOKENS = 100
NAMES = ["p0", "p1", "p2", "healthy"]
FAULTS = [("fail/truncate", "truncate"), ("fail/flip", "flip"), ("recompute/truncate", "truncate"),
          ("recompute/flip", "flip")]  # (a deleted file no longer fails a load: the connector holds it open)


def _prompt(name):
    seed = 4100 + (NAMES.index(name) if name in NAMES else 10 + [f for f, _ in FAULTS].index(name))
    return random_prompt(CFG, N, seed=seed).tolist()


def _req(rid, name, export=None, **kw):
    return {"id": rid, "prompt": _prompt(name), "params": {plan.PATH_KEY: str(export)} if export else None,
            "max_tokens": MAX_TOKENS, **kw}


def _phases(exports, go):
    names = NAMES + [f for f, _ in FAULTS]
    plain = [{"requests": [_req(f"plain/{n}", n)]} for n in names]
    plain[0]["wait_for"] = str(go)
    faults = {p: [_req(rid, rid, exports[rid], tamper=action) for rid, action in FAULTS if rid.startswith(p)]
              for p in ("fail", "recompute")}
    return [*plain, {"requests": [_req(f"preempt/{n}", n, exports[n]) for n in ("p0", "p1", "p2")]},
            {"policy": "fail", "requests": faults["fail"] + [_req("fail/healthy", "healthy", exports["healthy"])]},
            {"policy": "recompute", "requests": faults["recompute"] + [_req("recompute/healthy", "healthy",
                                                                           exports["healthy"])]}]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Exports (last_window) of every prompt and the vLLM engine over them. Returns (results, out, engine log)."""
    base = tmp_path_factory.mktemp("vllm_failures_sync")
    go, kv_dir = base / "exports-ready", base / "kv"
    names = NAMES + [f for f, _ in FAULTS]
    exports = {n: kv_dir / n.replace("/", "-") for n in names}
    spec = {"model": CKPT, "hybrid": False, "prefix_caching": False, "block_size": B,
            "max_model_len": N + MAX_TOKENS + 16, "num_gpu_blocks": NUM_BLOCKS, "phases": _phases(exports, go)}

    def make_exports():
        eng = PrefillEngine.from_checkpoint(CKPT, dtype="float32", progress=False)
        eng.prefill([np.asarray(_prompt(n)) for n in names], str(kv_dir), ids=[e.name for e in exports.values()])

    data, text = run_drivers(base, {"engine": spec}, make_exports, go)["engine"]
    return data["results"], data, text


def _same_as_plain(results, rid, name, loaded):
    got, ref = results[rid], results[f"plain/{name}"]
    assert got["tokens"] == ref["tokens"] and len(got["tokens"]) == MAX_TOKENS, rid
    err = float(np.max(np.abs(np.asarray(got["logprobs"]) - np.asarray(ref["logprobs"]))))
    assert err <= LOGPROB_TOL, (rid, err)
    params = got["kv_transfer_params"]
    assert params[plan.LOADED_KEY] == loaded, (rid, params)
    return params


def test_preempted_request_loads_again(run):
    """vLLM preempts one of three requests with external tokens and resumes it: the connector loads its prompt's KV
    again, and all three decode the plain run's 100 tokens with n−1 tokens loaded."""
    results, data, log = run
    preempted = [rid for rid in data["preemptions"] if rid.startswith("preempt/")]
    assert preempted, f"expected vLLM to preempt a request (KV cache of {NUM_BLOCKS} blocks): {data['preemptions']}"
    for name in ("p0", "p1", "p2"):
        params = _same_as_plain(results, f"preempt/{name}", name, N - 1)
        assert params[plan.STATUS_KEY] == "loaded"
    for rid in preempted:
        assert len(re.findall(rf"request {rid}-\w+: preempted after loading {N - 1} tokens; loading its KV again",
                              log)) == data["preemptions"][rid]
    print(f"preempted (times): {data['preemptions']}")
    assert re.search(r"validated, 150 tokens, sync load", log)


def test_sync_load_failures_follow_the_policy(run):
    """Synchronous loads, failures reported by block id: under `fail` the request ends with an error and no token,
    under `recompute` vLLM prefills it (plain tokens, status names the failure, 0 loaded); healthy requests load."""
    results, data, log = run
    for rid, action in FAULTS:
        got = results[rid]
        assert re.search(rf"request {rid}-\w+: loading \S+ failed \(.*{REASONS[action]}", log), rid
        if rid.startswith("fail/"):
            assert got["finish_reason"] == "error" and got["tokens"] == [], (rid, got)
        else:
            params = _same_as_plain(results, rid, rid, 0)
            assert re.fullmatch(rf"recomputed: the KV load failed: .*{REASONS[action]}.*", params[plan.STATUS_KEY])
    for rid in ("fail/healthy", "recompute/healthy"):
        assert _same_as_plain(results, rid, "healthy", N - 1)[plan.STATUS_KEY] == "loaded"
    assert data["free_blocks"]["end"] == data["free_blocks"]["start"], data["free_blocks"]
