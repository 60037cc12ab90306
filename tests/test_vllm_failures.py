"""The vLLM connector never blocks vLLM and fails closed (issue 31 items 3–5), checked on the real vLLM (CPU, float32,
in-process engine stepped by tests/vllm_failure_driver.py) with exports of checkpoints/tiny-gpt-oss-hd64.

One engine, vLLM's defaults where they matter: hybrid KV manager, prefix caching on (emptied before each phase, so no
request hits another's blocks), block size 16; exports with kv_full. `async_min_bytes` is 4 MiB: the BIG export
(~40 MB) loads in the background thread, the others inline (asynchronous too: with two KV cache groups vLLM can fail
a load closed only by request id). Phases:
- plain: every prompt without an export (the references);
- async: request A decodes 48 tokens; once it has 8, B (BIG export) arrives: B decodes the plain tokens with n−1 tokens
  loaded while A keeps decoding (A's token times during B's load);
- edges: prompt lengths 2·B and 2·B+1, one shorter than a block, the same prompt twice at once, max_tokens=1 whose
  first token is a stop token (as EOS would be);
- nixl: the BIG export and a 2·B+1 one published in the driver's NIXL pool and pulled by the connector (XXH3 per
  layer, background); one published with the manifest known before its export is written (no files, no path: as
  the P/D endpoint answers early); the BIG and the 2·B+1 exports as composed records (each layer split over two
  pools, as a 2-process prefill answers); one whose pull starts after its lease expired, with the file export beside the
  record: read from the file instead (the status says so);
- fail (vLLM's default kv_load_failure_policy): the export's file truncated, or one byte flipped, right after the
  scheduler validated it (the driver's hook in `update_state_after_alloc`), inline and background, a NIXL pull after
  the lease expired (no file) and a pool entry with a flipped byte: that request ends with an error and no token; a
  file or the whole export removed right after validation (the /v1/kv/release race): those load; a healthy request
  in the same batch loads and decodes the plain tokens;
- recompute: flipped and truncated files and an expired lease: vLLM prefills those requests, the plain tokens,
  status "recomputed: the KV load failed: <reason>" with 0 tokens loaded, never "loaded";
- abort: a BIG load aborted one step after it started; then the same export loads whole for another request; idle,
  the engine has as many free blocks as before the first request (the aborted load's blocks came back).
The policy is switched between phases in the one engine (the scheduler's `recompute_kv_load_failures`, which vLLM sets
from `kv_load_failure_policy` at start-up, and the connector's copy): one engine start for the module.
Another cache_salt and other weights are tests/test_vllm_identity.py's and tests/test_vllm_connector.py's.
"""

import re
import shutil

import numpy as np
import pytest
from vllm_drivers import run_drivers
from support import random_prompt
from test_vllm_connector import CKPT, CFG

from slope_jax import kv
from slope_jax.kv import vllm_handoff as handoff
from slope_jax.kv import vllm_plan as plan
from slope_jax.serve.engine import PrefillEngine

B = 16  # vLLM block size here
STAGING_MIB = 64  # the NIXL staging buffer, sized at start-up: above every pull here (the largest ~40 MB)
N_BIG = 8000  # kv_full float32: ~40 MB, above async_min_bytes
LENGTHS = {"short": B - 6, "2B": 2 * B, "2B1": 2 * B + 1, "mid": 300, "eos": 77, "dup": 150, "big": N_BIG,
           "a": 200}
LOGPROB_TOL = 1e-4
# (request id, prompt, tampering): each tampered request gets its own copy of the export
FAULTS = [("fail/truncate", "mid", "truncate"), ("fail/flip-big", "big", "flip"),
          ("recompute/flip-big", "big", "flip"), ("recompute/flip", "mid", "flip"),
          ("recompute/truncate", "2B1", "truncate")]
# removed after validation (a file, or the whole export as /v1/kv/release does): the connector's pin keeps the
# validated files readable, so these load (policy fail)
RACES = [("race/delete", "mid", "delete"), ("race/reclaim-big", "big", "reclaim"), ("race/reclaim", "2B1", "reclaim")]
REASONS = {"flip": r"checksums\.kv-p0\.safetensors\.xxh3_128: the bytes read differ",
           "truncate": r"checksums\.kv-p0\.safetensors\.bytes: read \d+ bytes, the manifest records \d+"}
LEASE = {"lease_s": 0.3, "delay_s": 0.8}  # a decode queue longer than the lease: the pull starts after it expired
LEASE_GONE = r"entry '\S+' is gone from pool 'driver-pool': its lease expired before a reader released it"


def _prompt(name):
    return random_prompt(CFG, LENGTHS[name], seed=3100 + LENGTHS[name]).tolist()


def _req(rid, name, export=None, **kw):
    return {"id": rid, "prompt": _prompt(name), "params": {plan.PATH_KEY: str(export)} if export else None, **kw}


def _phases(exports, tampered, go):
    e = exports
    plain = [_req(f"plain/{name}", name, max_tokens=48 if name == "a" else 16) for name in LENGTHS]
    async_ = [_req("a", "a", max_tokens=48), _req("async/big", "big", e["big"], after={"id": "a", "tokens": 8})]
    edges = [_req(f"edge/{name}", name, e[name]) for name in ("short", "2B", "2B1")]
    edges += [_req("dup/1", "dup", e["dup"]), _req("dup/2", "dup", e["dup"]),
              _req("eos", "eos", e["eos"], max_tokens=1, ignore_eos=False, stop_at_first_token_of="plain/eos")]
    faults = {p: [_req(rid, name, tampered[rid], tamper=action) for rid, name, action in FAULTS + RACES
                  if rid.startswith(p)] for p in ("fail", "recompute", "race")}
    nixl = [_req("nixl/big", "big", e["big"], nixl={}), _req("nixl/2B1", "2B1", e["2B1"], nixl={}),
            _req("nixl/pre-export", "mid", e["mid"], nixl={"pre_export": True}),
            _req("nixl/fallback", "mid", e["mid"], nixl={**LEASE, "file": True}),
            _req("nixl/composed-big", "big", e["big"], nixl={"composed": True}),
            _req("nixl/composed-2B1", "2B1", e["2B1"], nixl={"composed": True})]
    faults["fail"] += [_req("fail/nixl-lease", "mid", e["mid"], nixl=LEASE),
                       _req("fail/nixl-flip", "short", e["short"], nixl={"flip": True})]
    faults["recompute"] += [_req("recompute/nixl-lease", "2B", e["2B"], nixl=LEASE)]
    return [{"wait_for": str(go), "requests": plain},
            {"requests": async_}, {"requests": edges}, {"requests": nixl},
            {"policy": "fail", "requests": faults["fail"] + faults["race"] + [_req("fail/healthy", "2B", e["2B"])]},
            {"policy": "recompute", "requests": faults["recompute"] + [_req("recompute/healthy", "2B", e["2B"])]},
            {"requests": [_req("abort/big", "big", e["big"], abort_after_steps=1)]},
            {"requests": [_req("after-abort/big", "big", e["big"])]}]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Exports of every prompt (kv_full), the tampered copies, and the vLLM engine over them. Returns (results, out,
    engine log)."""
    base = tmp_path_factory.mktemp("vllm_failures")
    go, exports_dir = base / "exports-ready", base / "kv"
    exports = {name: exports_dir / name for name in LENGTHS if name != "a"}
    tampered = {rid: base / "tampered" / rid.replace("/", "-") / name for rid, name, _ in FAULTS + RACES}
    spec = {"model": CKPT, "hybrid": True, "prefix_caching": True, "block_size": B, "max_model_len": N_BIG + 64,
            "kv_cache_bytes": 1 << 28, "extra_config": {"async_min_bytes": 4 << 20, "nixl_staging_mib": STAGING_MIB},
            "phases": _phases(exports, tampered, go)}

    def make_exports():
        eng = PrefillEngine.from_checkpoint(CKPT, dtype="float32", progress=False)
        names = list(exports)
        eng.prefill([np.asarray(_prompt(n)) for n in names], str(exports_dir), ids=names, kv_full=True)
        for rid, name, _ in FAULTS + RACES:  # the directory name is the manifest's request_id: copies keep it
            shutil.copytree(kv.resolve(str(exports[name])), tampered[rid])

    data, text = run_drivers(base, {"engine": spec}, make_exports, go)["engine"]
    return data["results"], data, text


def _same_as_plain(results, rid, name, loaded):
    got, ref = results[rid], results[f"plain/{name}"]
    assert got["tokens"] == ref["tokens"][:len(got["tokens"])] and got["tokens"], (rid, got["tokens"], ref["tokens"])
    err = float(np.max(np.abs(np.asarray(got["logprobs"]) - np.asarray(ref["logprobs"][:len(got["logprobs"])]))))
    assert err <= LOGPROB_TOL, (rid, err)
    params = got["kv_transfer_params"]
    assert params[plan.LOADED_KEY] == loaded, (rid, params)
    assert params[plan.STATUS_KEY] == ("loaded" if loaded else params[plan.STATUS_KEY]), (rid, params)
    return params


def test_async_load_decodes_like_plain_vllm_while_others_keep_decoding(run):
    """The BIG export loads in the background (load_async): its request decodes the plain run's tokens with n−1 tokens
    loaded; request A keeps decoding meanwhile (its tokens equal its plain run's): several decode steps between BIG's
    arrival and its first token (an in-step load leaves room for about 2). Gap lengths are printed, not asserted:
    they are wall-clock times of a shared machine (the inter-token latency belongs to benchmarks/)."""
    results, _, log = run
    _same_as_plain(results, "async/big", "big", N_BIG - 1)
    assert results["async/big"]["num_cached_tokens"] == N_BIG - 1
    assert results["a"]["tokens"] == results["plain/a"]["tokens"]
    assert re.search(r"request \S+: export \S+/big \(found by kv_transfer_params\S*\) validated, 8000 tokens, "
                     r"background load", log)
    load_ms = float(re.findall(r"injected tokens \[0, 7999\) \(7999\) from \S+ in ([0-9.]+) ms \(background;", log)[0])
    big, a = results["async/big"], results["a"]
    t0, t1 = big["added"], big["token_times"][0]
    during = [t for t in a["token_times"] if t0 <= t <= t1]
    gaps = np.diff([t for t in a["token_times"] if t0 - 1 <= t <= t1])
    before = np.diff([t for t in a["token_times"] if t < t0])
    print(f"background load of {N_BIG} tokens: {load_ms:.0f} ms; A decoded {len(during)} tokens meanwhile, max gap "
          f"{gaps.max() * 1e3:.0f} ms (median before {np.median(before) * 1e3:.0f} ms)")
    assert len(during) >= 3, (len(during), load_ms)


@pytest.mark.parametrize("name", ["short", "2B", "2B1"])
def test_block_edges(run, name):
    """Prompts of 2·B and 2·B+1 tokens and one shorter than a block: n−1 tokens loaded, the plain run's tokens."""
    results, _, _ = run
    _same_as_plain(results, f"edge/{name}", name, LENGTHS[name] - 1)
    assert results[f"edge/{name}"]["num_cached_tokens"] == LENGTHS[name] - 1


def test_same_prompt_twice_at_once(run):
    """Two requests of one prompt in one batch: both decode the plain tokens; neither reports tokens it did not get
    (vLLM's count of computed tokens agrees with the connector's)."""
    results, _, _ = run
    for rid in ("dup/1", "dup/2"):
        params = _same_as_plain(results, rid, "dup", results[rid]["kv_transfer_params"][plan.LOADED_KEY])
        assert params[plan.LOADED_KEY] in (0, LENGTHS["dup"] - 1), params
        if params[plan.LOADED_KEY] == 0:  # vLLM's own prefix cache held it (the other request computed it)
            assert params[plan.STATUS_KEY] == plan.CACHE_HELD, params
    assert results["dup/1"]["kv_transfer_params"][plan.LOADED_KEY] == LENGTHS["dup"] - 1


def test_first_token_stops_the_request(run):
    """max_tokens=1 and the first token a stop token (as EOS would be): that one token, stopped, n−1 loaded."""
    results, _, _ = run
    got = results["eos"]
    assert got["tokens"] == results["plain/eos"]["tokens"][:1] and got["finish_reason"] == "stop", got
    assert got["kv_transfer_params"] == {plan.LOADED_KEY: LENGTHS["eos"] - 1, plan.STATUS_KEY: "loaded",
                                         handoff.TRANSPORT_KEY: handoff.FILE}


def test_failed_load_fails_the_request_under_fail(run):
    """Policy `fail`: an export truncated (inline load) or corrupted (one byte, background load) after validation
    ends that request with an error and no token; so does a NIXL pull that starts after the entry's lease expired
    (no file to fall back to) or whose bytes fail their XXH3 digest; the worker logs the reason; the healthy request
    in the batch loads."""
    results, _, log = run
    reasons = {rid: REASONS[action] for rid, _, action in FAULTS}
    reasons.update({"fail/nixl-lease": LEASE_GONE, "fail/nixl-flip": r"XXH3-128 digest mismatch"})
    for rid, why in reasons.items():
        if rid.startswith("fail/"):
            got = results[rid]
            assert got["finish_reason"] == "error" and got["tokens"] == [], (rid, got)
            assert re.search(rf"request {rid}-\w+: loading \S+ failed \(.*{why}", log), rid
    _same_as_plain(results, "fail/healthy", "2B", LENGTHS["2B"] - 1)


@pytest.mark.parametrize("rid,name,action", RACES)
def test_export_removed_after_validation_still_loads(run, rid, name, action):
    """The /v1/kv/release race (policy fail): the export's file, or the whole export, removed right after the
    scheduler validated it (found by its path here; by token hash in tests/test_pd_vllm.py) — the load reads the
    validated bytes the connector holds open: n−1 loaded, the plain tokens, never an error."""
    results, _, _ = run
    params = _same_as_plain(results, rid, name, LENGTHS[name] - 1)
    assert params[handoff.TRANSPORT_KEY] == handoff.FILE


def test_nixl_pull_loads_like_a_file(run):
    """KV pulled over NIXL from the pool (background, XXH3 per layer): n−1 loaded, the plain tokens, transport nixl
    (also for a record whose manifest lists no files, as the P/D endpoint publishes one before its export is written);
    a pull after the lease expired falls back to the file export when the record has one (status loaded, transport
    says why); a composed record (each layer's rows split over two pools, off the block boundaries, as a 2-process
    prefill answers) loads the same, with prefix caching on; every entry a request pulled, or tried to pull (the
    corrupted one too), is freed once that request finished, in both pools. The staging buffer is the one sized at
    start-up (`nixl_staging_mib`): no pull grew it."""
    results, data, log = run
    assert data["staging_bytes"] == STAGING_MIB << 20, data["staging_bytes"]
    assert re.search(rf"NIXL staging buffer of {STAGING_MIB} MiB ready", log)
    for rid, name in (("nixl/big", "big"), ("nixl/2B1", "2B1"), ("nixl/pre-export", "mid"),
                      ("nixl/composed-big", "big"), ("nixl/composed-2B1", "2B1")):
        params = _same_as_plain(results, rid, name, LENGTHS[name] - 1)
        assert params[handoff.TRANSPORT_KEY] == handoff.NIXL, params
    params = _same_as_plain(results, "nixl/fallback", "mid", LENGTHS["mid"] - 1)
    assert re.fullmatch(rf"file \(the NIXL pull failed: {LEASE_GONE}\)", params[handoff.TRANSPORT_KEY]), params
    load_ms = float(re.findall(r"injected tokens \[0, 7999\) \(7999\) from nixl:\S+ in ([0-9.]+) ms \(background;",
                               log)[0])
    print(f"NIXL background load of {N_BIG} tokens (~40 MB): {load_ms:.0f} ms")
    assert data["pool"]["entries"] == 0 and data["pool"]["used_bytes"] == 0, data["pool"]
    assert data["pool2"]["entries"] == 0 and data["pool2"]["used_bytes"] == 0, data["pool2"]


def test_failed_load_is_recomputed_under_recompute(run):
    """Policy `recompute`: corrupted or truncated after validation, or a NIXL pull after the lease expired → vLLM
    prefills the request (the plain tokens), the status says the load failed and why, 0 tokens loaded; the healthy
    request loads."""
    results, _, _ = run
    for rid, name, why in [(r, n, REASONS[a]) for r, n, a in FAULTS] + [("recompute/nixl-lease", "2B", LEASE_GONE)]:
        if rid.startswith("recompute/"):
            params = _same_as_plain(results, rid, name, 0)
            assert re.fullmatch(rf"recomputed: the KV load failed: .*{why}.*", params[plan.STATUS_KEY]), params
            assert handoff.TRANSPORT_KEY not in params
    _same_as_plain(results, "recompute/healthy", "2B", LENGTHS["2B"] - 1)


def test_abort_while_loading_frees_its_blocks(run):
    """A request aborted while its export loads in the background: its rows are not used (the load thread stops at
    its next layer), its blocks come back (free blocks idle after the run == before it), the same export then loads
    whole for another request, and once no load is in flight the GIL switch interval is Python's default again."""
    results, data, log = run
    assert results["abort/big"]["finish_reason"] == "aborted"
    assert re.search(r"request abort/big-\w+ finished while its KV was loading; its rows are not used", log)
    _same_as_plain(results, "after-abort/big", "big", N_BIG - 1)
    assert data["free_blocks"]["end"] == data["free_blocks"]["start"], data["free_blocks"]
    assert data["switch_interval_s"] == 0.005  # Python's default again once no load is in flight
