"""The default (`last_window`) export works with vLLM's defaults (issue 31 point 1): its sliding layers keep the rows
back to the KV-block boundary at or before n−W for every block size up to `kv.format.VLLM_BLOCK_MAX` (128, what
vLLM-CPU picks for gpt-oss), so vLLM loads n−1 tokens with prefix caching on or off, for every prompt length.

Real vLLM (CPU, float32, in-process engines stepped by tests/vllm_failure_driver.py, hybrid KV manager as the
connector keeps it) over exports of checkpoints/tiny-gpt-oss-hd64 (W = 40) written with `kv_full=False`, three
engines side by side: prefix caching on with vLLM's own block size (none given: vLLM-CPU picks 128, checked in the
connector's log), prefix caching on with block size 16 (vLLM's GPU default), prefix caching off (block 128). Prompt
lengths: 10 and 39 (n ≤ W, shorter than a block), 100 (shorter than a 128-block, n−W = 60 unaligned), 256 (an exact
multiple of both block sizes), 257 (one more), 300 (n−W = 260, unaligned for both), 1000 (n−W = 960: unaligned for
128, aligned for 16). Every export request loads n−1 tokens and decodes the plain run's tokens (its logprobs within
1e-4). Before, with prefix caching on, only n ≤ W (and n−W on a block boundary) loaded.
The vLLM-free arithmetic (every n, every block size ≤ 128) is checked without vLLM below.
"""

import re

import numpy as np
import pytest
from vllm_drivers import run_drivers
from support import random_prompt
from test_vllm_connector import CFG, CKPT

from slope_jax import kv
from slope_jax.kv import format as kvfmt
from slope_jax.kv import vllm_plan as plan

W = CFG.sliding_window
LENGTHS = [10, 39, 100, 256, 257, 300, 1000]
LOGPROB_TOL = 1e-4
# engine name → (prefix caching, block size; None: vLLM's own choice)
ENGINES = {"on-default": (True, None), "on-16": (True, 16), "off-128": (False, 128)}


def _prompt(n):
    return random_prompt(CFG, n, seed=3300 + n)


def _spec(kv_dir, prefix_caching, block_size, go):
    reqs = [{"id": f"plain/{n}", "prompt": _prompt(n).tolist(), "params": None} for n in LENGTHS]
    loads = [{"id": f"export/{n}", "prompt": _prompt(n).tolist(), "params": {plan.PATH_KEY: str(kv_dir / f"len-{n}")}}
             for n in LENGTHS]
    return {"model": CKPT, "hybrid": True, "prefix_caching": prefix_caching, "block_size": block_size,
            "max_model_len": 1100, "kv_cache_bytes": 1 << 27,
            "phases": [{"wait_for": str(go), "requests": reqs}, {"requests": loads}]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The `last_window` exports of every prompt and each engine's results over them: {engine: (results, log)}."""
    from slope_jax.serve.engine import PrefillEngine

    base = tmp_path_factory.mktemp("last_window")
    go, kv_dir = base / "exports-ready", base / "kv"

    def exports():
        eng = PrefillEngine.from_checkpoint(CKPT, dtype="float32", progress=False)
        eng.prefill([_prompt(n) for n in LENGTHS], str(kv_dir), ids=[f"len-{n}" for n in LENGTHS], kv_full=False)

    done = run_drivers(base, {name: _spec(kv_dir, pc, bs, go) for name, (pc, bs) in ENGINES.items()}, exports, go)
    out = {name: (data["results"], text) for name, (data, text) in done.items()}
    return kv_dir, out


def test_exports_keep_the_block_boundary_rows(runs):
    """Each export is `last_window` and its sliding layers hold [max(0, n−W−127), n); full layers [0, n)."""
    kv_dir, _ = runs
    for n in LENGTHS:
        m = kv.read_manifest(str(kv_dir / f"len-{n}"))
        sf = max(0, n - W - (kvfmt.VLLM_BLOCK_MAX - 1))
        assert m["sliding_policy"] == "last_window" and m["sliding_from"] == sf, (n, m["sliding_from"])
        for rec in m["layers"]:
            assert rec["token_range"] == [sf if rec["kind"] == kvfmt.SLIDING else 0, n]


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_vllm_loads_n_minus_1_and_decodes_like_plain(runs, engine):
    """Prefix caching on (vLLM's block size, and 16) or off: every prompt loads n−1 tokens and decodes the plain
    run's tokens, logprobs within 1e-4."""
    _, out = runs
    results, log = out[engine]
    if engine == "on-default":  # vLLM-CPU's own block size for this model, as the connector reports it
        assert re.search(r"SlopeJaxConnector \(SCHEDULER\).*\('sliding', 128\).*\('full', 128\)|"
                         r"SlopeJaxConnector \(SCHEDULER\).*\('full', 128\).*\('sliding', 128\)", log)
    worst = 0.0
    for n in LENGTHS:
        got, ref = results[f"export/{n}"], results[f"plain/{n}"]
        params = got["kv_transfer_params"]
        assert params[plan.LOADED_KEY] == n - 1 and params[plan.STATUS_KEY] == "loaded", (engine, n, params)
        assert got["num_cached_tokens"] == n - 1, (engine, n, got["num_cached_tokens"])
        assert got["tokens"] == ref["tokens"], (engine, n)
        worst = max(worst, float(np.max(np.abs(np.asarray(got["logprobs"]) - np.asarray(ref["logprobs"])))))
    assert worst <= LOGPROB_TOL, (engine, worst)
    print(f"{engine}: n−1 loaded for lengths {LENGTHS}, max |Δlogprob| {worst:.2e}")


def test_every_block_size_up_to_the_max_is_covered():
    """Without vLLM: for every n and every block size B ≤ VLLM_BLOCK_MAX, what vLLM needs under prefix caching on
    (hybrid manager: the whole block holding n−W) and off lies within what a `last_window` export keeps; a block size
    above the max can need more, and is refused naming the covered size; an export written before `sliding_from`
    (the last W rows only) is still read and refused where it falls short, as before."""
    cover = kvfmt.VLLM_BLOCK_MAX
    for n in range(1, 3 * cover + W + 2):
        sf = kvfmt.kept_range(n, kvfmt.SLIDING, W, False)[0]
        export = plan.Validated("x", "0" * 16, {}, n, "float32", sf)
        for b in range(1, cover + 1):
            for mode in (plan.BLOCK, plan.WINDOW):
                plan.check_sliding(export, *plan.layer_rows(kvfmt.SLIDING, 0, n, W, b, mode), mode)
    export = plan.Validated("x", "0" * 16, {}, 240, "float32", kvfmt.kept_range(240, kvfmt.SLIDING, W, False)[0])
    with pytest.raises(plan.ExportRefused, match=rf"tokens \[73, 240\), vLLM needs \[0, 239\) \(with prefix caching "
                                                 rf"on.*blocks of up to {cover} tokens"):
        plan.check_sliding(export, *plan.layer_rows(kvfmt.SLIDING, 0, 240, W, 256, plan.BLOCK), plan.BLOCK)
    old = {"sliding_policy": "last_window", "num_tokens": 300, "model": {"sliding_window": W}}
    assert kvfmt.sliding_from(old) == 260 and kvfmt.sliding_from({**old, "sliding_from": 133}) == 133
    assert kvfmt.sliding_from({**old, "sliding_policy": "full"}) == 0
    legacy = plan.Validated("x", "0" * 16, {}, 300, "float32", kvfmt.sliding_from(old))
    with pytest.raises(plan.ExportRefused, match=r"sliding layers hold tokens \[260, 300\), vLLM needs \[256, 299\)"):
        plan.check_sliding(legacy, *plan.layer_rows(kvfmt.SLIDING, 0, 300, W, 128, plan.BLOCK), plan.BLOCK)
