"""KV hand-off over NIXL (`slope_jax.kv.nixl_transport`): a prefill-side pool in one process, readers in others.

The pool runs in a child process (`_SERVER`, driven over JSON lines); this process (and, in one test, vLLM's venv)
pulls. Checked: the pulled KV is bit-identical to `format.load` of the same export (layers, kinds, positions, dtype,
manifest); a tampered byte is caught by the layer's digest; an entry a reader is pulling is never evicted, is freed
once released, and the pool stays within its bytes; the lease frees unread entries, but not while held; a pull of
a freed, unknown or unreachable entry raises a KVTransferError naming the request and the cause.
"""

from __future__ import annotations

import base64
import inspect
import json
import os
import re
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # loopback only (inherited by the pool process)
pytest.importorskip("nixl._api", reason="nixl is not installed: pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1")

import ml_dtypes  # noqa: E402

from slope_jax import kv as kvfmt  # noqa: E402
from slope_jax.kv import nixl_transport as nt  # noqa: E402
from support import CONFIG_A, REPO  # noqa: E402

KH, HD = 4, 12  # synthetic entries: CONFIG_A's KV heads and head_dim


def _synthetic(seed: int, layers: int, tokens: int, kh: int, hd: int):
    """Deterministic bf16 KV for `layers` layers (the pool process and the test build the same arrays)."""
    import ml_dtypes
    import numpy as np

    from slope_jax.kv.format import LayerKV

    rng = np.random.default_rng(seed)
    return {layer: LayerKV(rng.standard_normal((tokens, kh, hd), np.float32).astype(ml_dtypes.bfloat16),
                           rng.standard_normal((tokens, kh, hd), np.float32).astype(ml_dtypes.bfloat16),
                           np.arange(tokens, dtype=np.int32), "full_attention" if layer % 2 else "sliding_attention")
            for layer in range(layers)}


_SERVER = inspect.getsource(_synthetic) + r'''
import json, sys
from slope_jax.kv import nixl_transport as nt

pools = {}
for line in sys.stdin:
    cmd = json.loads(line)
    op = cmd.pop("op")
    try:
        if op == "pool":
            pools[len(pools)] = nt.KVPool(**cmd)
            out = {"pool": len(pools) - 1}
        else:
            pool = pools[cmd.pop("pool")]
            if op == "publish":
                out = pool.publish(cmd["rid"], _synthetic(cmd["seed"], cmd["layers"], cmd["tokens"], cmd["kh"],
                                                          cmd["hd"]), {"request_id": cmd["rid"]})
            elif op == "publish_export":
                out = pool.publish_export(cmd["path"])
            elif op == "publish_half":  # this process's pieces of an export: each layer's first or second half
                from slope_jax.kv import format as kvfmt
                kv, pieces = kvfmt.load(cmd["path"]), []
                for layer, lkv in kv.items():
                    a, b = int(lkv.positions[0]), int(lkv.positions[-1]) + 1
                    lo, hi = (a, (a + b) // 2) if cmd["half"] == 0 else ((a + b) // 2, b)
                    pieces.append((layer, lo, hi, lkv.k[lo - a: hi - a], lkv.v[lo - a: hi - a]))
                out = pool.publish_pieces(cmd["rid"], pieces, {layer: lkv.kind for layer, lkv in kv.items()})
            elif op == "tamper":
                pool._arena[cmd["address"] - pool._base] ^= 0xFF
                out = {}
            elif op == "stats":
                out = pool.stats()
            elif op == "gone":
                out = {"reason": pool.gone_reason(cmd["entry"])}
            elif op == "discard":
                out = {"freed": pool.discard(cmd["entry"])}
            elif op == "close":
                pool.close()
                out = {}
    except Exception as e:
        out = {"error": f"{type(e).__name__}: {e}"}
    sys.stdout.write("@@" + json.dumps(out) + "\n")
    sys.stdout.flush()
'''


class PoolProcess:
    """The prefill side: a child process holding KVPools, driven one JSON command at a time."""

    def __init__(self, log_path):
        self.log = open(log_path, "w")
        path = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))  # e.g. another NIXL release's
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=path))

    def __call__(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            assert line, f"the pool process died (log: {self.log.name})"
            if line.startswith("@@"):
                return json.loads(line[2:])

    def pool(self, **kw) -> int:
        return self("pool", **kw)["pool"]

    def publish(self, pool: int, rid: str, tokens: int, layers: int = 4, seed: int = 0) -> dict:
        return self("publish", pool=pool, rid=rid, seed=seed, layers=layers, tokens=tokens, kh=KH, hd=HD)

    def wait_stats(self, pool: int, pred, timeout: float = 5.0) -> dict:
        """Poll the pool's stats until `pred(stats)` (the pool handles releases on its own thread)."""
        deadline = time.monotonic() + timeout
        while True:
            st = self("stats", pool=pool)
            if pred(st) or time.monotonic() > deadline:
                return st
            time.sleep(0.02)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = PoolProcess(tmp_path_factory.mktemp("nixl") / "pool.log")
    yield s
    s.close()


@pytest.fixture(scope="module")
def reader():
    r = nt.KVReader(timeout_s=20)
    yield r
    r.close()


def _export(tmp_path, rid: str, n: int) -> str:
    """A real bf16 export of CONFIG_A (default sliding policy: sliding layers keep the last W rows)."""
    rng = np.random.default_rng(5)
    staging = kvfmt.staging_dir(str(tmp_path), rid, kvfmt.new_run_nonce(), 0)
    segs = []
    for layer in range(CONFIG_A.num_hidden_layers):
        start, end = kvfmt.kept_range(n, CONFIG_A.layer_types[layer], CONFIG_A.sliding_window, False)
        k, v = (rng.standard_normal((end - start, KH, HD), np.float32).astype(ml_dtypes.bfloat16) for _ in range(2))
        mid = (start + end) // 2
        segs += [(layer, start, mid, k[: mid - start], v[: mid - start]), (layer, mid, end, k[mid - start:],
                                                                          v[mid - start:])]
    name, records = kvfmt.write_shard_file(staging, 0, segs)
    kvfmt.write_manifest(staging, request_id=rid, token_ids=np.arange(n), cfg=CONFIG_A, dtype="bfloat16", full=False,
                         segments=records, files=[name], first_token=17)
    return kvfmt.publish(str(tmp_path), rid, staging, overwrite=False)


def _assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for layer, w in want.items():
        g = got[layer]
        assert g.kind == w.kind and g.k.dtype == w.k.dtype == ml_dtypes.bfloat16
        assert g.k.shape == w.k.shape and g.v.shape == w.v.shape, layer
        assert g.k.tobytes() == w.k.tobytes() and g.v.tobytes() == w.v.tobytes(), layer
        assert g.positions.dtype == np.int32 and np.array_equal(g.positions, w.positions), layer


def test_pull_equals_the_export_then_the_entry_is_freed(server, reader, tmp_path):
    path = _export(tmp_path, "doc-1", 23)
    want = kvfmt.load(path)
    lo, hi = kvfmt.kept_range(23, CONFIG_A.layer_types[0], CONFIG_A.sliding_window, False)  # format's rule
    assert want[0].k.shape == (hi - lo, KH, HD) and want[1].k.shape == (23, KH, HD)
    pool = server.pool(capacity_bytes=1 << 20)
    params = server("publish_export", pool=pool, path=path)
    assert params[nt.PARAMS_KEY]["manifest"] == kvfmt.read_manifest(path)
    json.dumps(params)  # kv_transfer_params travel as JSON
    seen = []
    got = reader.pull(params, on_layer=lambda layer, lkv: seen.append((layer, lkv.k.shape[0])))
    _assert_same(got, want)
    assert seen == [(layer, want[layer].k.shape[0]) for layer in range(CONFIG_A.num_hidden_layers)]
    # released as received: the pool frees it, and a second pull is told why
    st = server.wait_stats(pool, lambda s: s["entries"] == 0)
    assert st["entries"] == 0 and st["used_bytes"] == 0
    with pytest.raises(nt.KVTransferError, match=r"request 'doc-1'.*gone.*released: the decode side has it"):
        reader.pull(params)


def test_composed_record_pulls_each_piece_from_its_own_pool(server, reader, tmp_path):
    """A multi-process prefill's record (`compose`): each process's pieces stay in its own pool (two processes
    here, each half of every layer's rows, as ring 2 holds them) and the reader pulls them from both. Whole layers
    equal the export's bitwise; `on_layer` gets every piece under its layer id with its positions; `done` frees
    both entries; a tampered byte in one part fails the pull and leaves no hold in either pool; a record whose
    pieces leave a gap in a layer is refused before any READ."""
    path = _export(tmp_path, "doc-2", 41)
    want = kvfmt.load(path)
    manifest = nt.handoff_manifest(kvfmt.read_manifest(path))
    other = PoolProcess(tmp_path / "pool2.log")
    try:
        pools = [(server, server.pool(capacity_bytes=1 << 20)), (other, other.pool(capacity_bytes=1 << 20))]

        def parts(rid):
            return [proc("publish_half", pool=p, path=path, half=i, rid=rid) for i, (proc, p) in enumerate(pools)]

        params = nt.compose("doc-2", parts("doc-2#a"), manifest)
        json.dumps(params)
        _assert_same(reader.pull(params, release=False), want)  # joined: a copy of the two halves
        seen = []
        assert reader.pull(params, release=False, on_layer=lambda layer, lkv: seen.append(
            (layer, int(lkv.positions[0]), int(lkv.positions[-1]) + 1, lkv.k.tobytes()))) == {}
        for layer, w in want.items():
            got = sorted(x for x in seen if x[0] == layer)
            assert len(got) == 2 and got[0][2] == got[1][1], got  # two pieces that meet
            assert got[0][3] + got[1][3] == w.k.tobytes() and (got[0][1], got[1][2]) == (w.positions[0],
                                                                                         w.positions[-1] + 1)
        reader.done(params)
        for proc, p in pools:
            assert proc.wait_stats(p, lambda s: s["entries"] == 0)["entries"] == 0

        params = nt.compose("doc-3", parts("doc-3#a"), manifest)
        rec = params[nt.PARAMS_KEY]["parts"][1]
        lay = rec["layers"][1]
        assert other("tamper", pool=pools[1][1], address=rec["address"] + lay["offset"] + 5) == {}
        with pytest.raises(nt.KVTransferError, match=r"request 'doc-3'.*layer 1: XXH3-128 digest mismatch"):
            reader.pull(params)
        for proc, p in pools:
            st = proc.wait_stats(p, lambda s: s["held"] == 0)
            assert st["held"] == 0 and st["entries"] == 1, st

        gap = json.loads(json.dumps(params))
        for field in (gap[nt.PARAMS_KEY]["parts"][1]["manifest"]["pieces"], gap[nt.PARAMS_KEY]["parts"][1]["layers"]):
            del field[0]  # the second half of layer 0 is missing
        with pytest.raises(nt.KVTransferError, match=r"request 'doc-3'.*slope_jax_nixl.parts: layer 0: pieces "
                                                     r"\[\(\d+, \d+\)\] do not tile its rows \[\d+, \d+\)"):
            nt.check_record(gap)
        late = json.loads(json.dumps(params))
        late[nt.PARAMS_KEY]["parts"][1]["manifest"]["pieces"][0][1] += 1  # a piece one row shorter than its region
        with pytest.raises(nt.KVTransferError, match=r"slope_jax_nixl.parts\[1\].manifest.pieces: .*differ"):
            nt.check_record(late)
    finally:
        other.close()


def test_reused_buffer_and_many_pulls(server, reader):
    """`out=`: one registered buffer reused; each pull returns views of the bytes just read."""
    pool = server.pool(capacity_bytes=1 << 20)
    out = np.zeros(1 << 18, np.uint8)
    for seed in (1, 2, 3):
        params = server.publish(pool, f"r{seed}", tokens=50 + seed, seed=seed)
        got = reader.pull(params, out=out)
        _assert_same(got, _synthetic(seed, 4, 50 + seed, KH, HD))
        assert np.shares_memory(got[0].k, out)


def test_tampered_byte_is_caught_by_the_layer_digest(server, reader):
    pool = server.pool(capacity_bytes=1 << 20)
    params = server.publish(pool, "tamper", tokens=40)
    rec = params[nt.PARAMS_KEY]
    lay = rec["layers"][2]
    v_byte = rec["address"] + lay["offset"] + lay["nbytes"] // 2 + 3  # inside layer 2's V
    assert server("tamper", pool=pool, address=v_byte) == {}
    with pytest.raises(nt.KVTransferError, match=r"request 'tamper'.*layer 2: XXH3-128 digest mismatch"):
        reader.pull(params)
    # a failed pull drops its hold but does not report the KV received: the entry stays (for a retry or its lease)
    st = server.wait_stats(pool, lambda s: s["held"] == 0)
    assert st["entries"] == 1 and st["held"] == 0


def test_held_entry_is_never_evicted_and_the_pool_stays_bounded(server, reader):
    size = 120  # tokens: ~46 KB per entry (4 layers x 2 x 120 x 4 x 12 x 2 bytes + positions)
    probe = server.pool(capacity_bytes=1 << 20)
    entry_bytes = server.publish(probe, "probe", tokens=size)[nt.PARAMS_KEY]["nbytes"]
    cap = 2 * entry_bytes + 100  # room for two entries
    pool = server.pool(capacity_bytes=cap, lease_s=60)
    a = server.publish(pool, "A", tokens=size, seed=1)
    b = server.publish(pool, "B", tokens=size, seed=2)
    during = {}

    def while_pulling(layer, lkv):
        if layer == 0:  # A is held now: publishing C must evict B (A is older, but held)
            during["c"] = server.publish(pool, "C", tokens=size, seed=3)
            during["stats"] = server("stats", pool=pool)
            during["b_gone"] = server("gone", pool=pool, entry=b[nt.PARAMS_KEY]["entry"])["reason"]
            during["d"] = server.publish(pool, "D", tokens=2 * size, seed=4)  # cannot fit beside held A

    got = reader.pull(a, on_layer=while_pulling)
    _assert_same(got, _synthetic(1, 4, size, KH, HD))
    assert nt.PARAMS_KEY in during["c"]
    assert sorted(p["request_id"] for p in during["stats"]["per_entry"].values()) == ["A", "C"]
    assert during["stats"]["held"] == 1 and during["stats"]["used_bytes"] <= cap
    assert during["b_gone"] == "evicted (least recently used) to make room"
    assert "KVPoolFull" in during["d"]["error"] and "held by readers" in during["d"]["error"]
    st = server.wait_stats(pool, lambda s: s["entries"] == 1)  # A released -> freed; C stays
    assert [p["request_id"] for p in st["per_entry"].values()] == ["C"]
    with pytest.raises(nt.KVTransferError, match=r"request 'B'.*evicted"):
        reader.pull(b)
    _assert_same(reader.pull(during["c"]), _synthetic(3, 4, size, KH, HD))


def test_lease_frees_unread_entries_but_not_held_ones(server, reader):
    pool = server.pool(capacity_bytes=1 << 20, lease_s=0.3)
    stale = server.publish(pool, "stale", tokens=30)
    time.sleep(0.8)
    with pytest.raises(nt.KVTransferError, match=r"request 'stale'.*its lease expired before a reader released it"):
        reader.pull(stale)
    slow = server.publish(pool, "slow", tokens=30, seed=9)
    got = reader.pull(slow, on_layer=lambda layer, lkv: time.sleep(0.4) if layer == 0 else None)  # > the lease
    _assert_same(got, _synthetic(9, 4, 30, KH, HD))
    # the hold kept it past its lease: the reader's release was the first thing to free it
    assert server.wait_stats(pool, lambda s: s["entries"] == 0)["entries"] == 0
    assert server("gone", pool=pool, entry=slow[nt.PARAMS_KEY]["entry"])["reason"] == "released: the decode side has it"


def test_done_from_a_reader_that_never_pulled_frees_the_entry_without_further_calls(server):
    """`done` from a reader that never talked to the pool (process 0 dropping a peer's offer, a decode side whose
    request ended before its pull) frees the entry at once. The reader's agent has no progress thread: its release
    went out only on its next NIXL call, so the entry stayed until its lease (60 s here) when none came."""
    pool = server.pool(capacity_bytes=1 << 20, lease_s=60)
    a, b = server.publish(pool, "never-pulled-a", tokens=20), server.publish(pool, "never-pulled-b", tokens=20)
    fresh = nt.KVReader(timeout_s=20)
    try:
        assert fresh.done(a) is True  # the pool answered
        st = server.wait_stats(pool, lambda s: s["entries"] == 1, timeout=1.0)  # no reader call meanwhile
        assert st["entries"] == 1, st
        gone = server("gone", pool=pool, entry=a[nt.PARAMS_KEY]["entry"])["reason"]
        assert gone == "released: the decode side has it"
        assert fresh.done(b) is True and server("stats", pool=pool)["entries"] == 0  # answered: already freed
        # a reader whose metadata the pool cannot load (another NIXL release) gets no answer, but its release counts
        refused = nt.KVReader(timeout_s=20, ack_timeout_s=0.3)
        try:
            refused._metadata = base64.b64encode(b"nixlSerDes|not a real agent").decode()
            d = server.publish(pool, "refused-md", tokens=20)
            assert refused.done(d) is False
            assert server.wait_stats(pool, lambda s: s["entries"] == 0, timeout=2.0)["entries"] == 0
        finally:
            refused.close()
        # a pool that does not answer: done returns False after ack_timeout_s, it never raises or hangs
        quiet = nt.KVReader(timeout_s=20, ack_timeout_s=0.2)
        try:
            c = server.publish(pool, "unanswered", tokens=20)
            server("close", pool=pool)
            t0 = time.monotonic()
            assert quiet.done(c) is False and time.monotonic() - t0 < 2.0
        finally:
            quiet.close()
    finally:
        fresh.close()


def test_pull_of_a_freed_or_unknown_entry_fails_cleanly(server, reader):
    pool = server.pool(capacity_bytes=1 << 20)
    params = server.publish(pool, "gone-1", tokens=20)
    assert server("discard", pool=pool, entry=params[nt.PARAMS_KEY]["entry"]) == {"freed": True}
    with pytest.raises(nt.KVTransferError, match=r"request 'gone-1'.*discarded by the prefill side"):
        reader.pull(params)
    unknown = json.loads(json.dumps(params))
    unknown[nt.PARAMS_KEY]["entry"] = "never#99"
    with pytest.raises(nt.KVTransferError, match=r"request 'gone-1'.*unknown entry"):
        reader.pull(unknown)


def test_pull_from_a_dead_prefill_process_fails_cleanly(tmp_path):
    reader = nt.KVReader(timeout_s=3)
    dead = PoolProcess(tmp_path / "dead.log")
    pool = dead.pool(capacity_bytes=1 << 20)
    _assert_same(reader.pull(dead.publish(pool, "alive", tokens=20)), _synthetic(0, 4, 20, KH, HD))
    params = dead.publish(pool, "orphan", tokens=20)
    dead.proc.kill()
    dead.proc.wait(timeout=30)
    dead.log.close()
    t0 = time.monotonic()
    with pytest.raises(nt.KVTransferError, match=r"request 'orphan'.*pool agent 'slope-kvpool-.*'") as err:
        reader.pull(params)
    # UCX reports the disconnect at once, or the hold times out
    assert time.monotonic() - t0 < 10, err.value
    assert err.value.unreachable, err.value
    assert "REMOTE_DISCONNECT" in str(err.value) or "did not answer" in str(err.value), err.value


@pytest.mark.parametrize("field,value,match", [
    ("protocol", 99, "protocol: 99"),
    ("dtype", "int8", "dtype: 'int8'"),
    ("agent_metadata", "not base64!", "agent_metadata: not base64"),
    ("layers", [{"layer": 0}], r"layers\[0\]: malformed"),
])
def test_malformed_params_name_the_field(field, value, match):
    rec = {"protocol": nt.PROTOCOL, "request_id": "bad", "entry": "bad#1", "agent": "x", "agent_metadata": "",
           "address": 4096, "nbytes": 4096, "dtype": "bfloat16", "layers": []}
    rec[field] = value
    with pytest.raises(nt.KVTransferError, match=rf"request 'bad'.*{match}"):
        nt._spec({nt.PARAMS_KEY: rec})
    rec = dict(rec, layers=[{"layer": 0, "kind": "full_attention", "offset": 0, "tokens": 100, "kv_heads": KH,
                             "head_dim": HD, "nbytes": 2 * 100 * KH * HD * 2 + 400, "xxh3_128": "00" * 16}],
               protocol=nt.PROTOCOL, dtype="bfloat16", agent_metadata="")
    with pytest.raises(nt.KVTransferError, match=r"layers\[0\]: region \[0, 19600\) .* does not fit"):
        nt._spec({nt.PARAMS_KEY: rec})


_VLLM_READER = r"""
import importlib.abc, json, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("jax", "jaxlib", "torch"):
            raise ImportError(f"blocked for this test: {name}")
sys.meta_path.insert(0, Block())
import xxhash
from slope_jax.kv import nixl_transport as nt
kv = nt.pull(json.loads(sys.stdin.read()))
print(json.dumps({str(l): xxhash.xxh3_64_hexdigest(x.k.tobytes() + x.v.tobytes() + x.positions.tobytes()) + x.kind
                  for l, x in kv.items()}))
"""


def test_reader_in_vllm_venv_without_jax_or_torch(server, tmp_path):
    """The connector's side: vLLM's venv (no JAX; torch blocked) pulls the same bytes."""
    python = os.path.join(REPO, ".venv-vllm", "bin", "python")
    if not os.path.exists(python):
        pytest.skip("no .venv-vllm (launch/vllm_venv.sh builds it)")
    path = _export(tmp_path, "cross", 31)
    pool = server.pool(capacity_bytes=1 << 20)
    params = server("publish_export", pool=pool, path=path)
    out = subprocess.run([python, "-c", _VLLM_READER], input=json.dumps(params), capture_output=True, text=True,
                         timeout=120, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    if "No module named 'nixl'" in out.stderr:
        pytest.skip("nixl is not installed in .venv-vllm")
    assert out.returncode == 0, out.stderr[-3000:]
    import xxhash

    want = {str(layer): xxhash.xxh3_64_hexdigest(x.k.tobytes() + x.v.tobytes() + x.positions.tobytes()) + x.kind
            for layer, x in kvfmt.load(path).items()}
    assert json.loads(out.stdout.strip().splitlines()[-1]) == want


def test_publish_from_the_host_tier_equals_publishing_the_export(checkpoints, tmp_path):
    """The endpoint fills the pool from the engine's host tier (`kv.prefix.export_rows`) rather than re-reading the
    export just written: for a cold prompt and a prefix hit (last_window exports: sliding layers hold their kept
    range only) every layer's rows, positions and kind equal the export's, so both publications carry the same
    XXH3 digests; a prompt the tier does not hold exactly (a shorter one, or one evicted) gives None, and the
    endpoint's publish then re-reads the export."""
    from support import TILES, random_prompt

    from slope_jax.kv import prefix as prefix_lib
    from slope_jax.parallel.config import ParallelConfig
    from slope_jax.serve import http
    from slope_jax.serve.engine import PrefillEngine

    eng = PrefillEngine.from_checkpoint(checkpoints["A"]["mxfp4"], ParallelConfig(), dtype="float32", progress=False,
                                        reuse=prefix_lib.ReuseOptions(block_size=8), **TILES)
    base = random_prompt(CONFIG_A, 45, seed=3)
    prompts = {"cold": base, "hit": np.concatenate([base, random_prompt(CONFIG_A, 14, seed=4)]).astype(np.int32)}
    kv_dir = str(tmp_path / "kv")
    with nt.KVPool(1 << 24, lease_s=60) as pool:
        for rid, prompt in prompts.items():
            res = eng.prefill([prompt], ids=[rid], kv_dir=kv_dir)[0]
            assert res.cached_tokens == (40 if rid == "hit" else 0)
            manifest = kvfmt.read_manifest(kvfmt.resolve(res.kv_path))
            rows = prefix_lib.export_rows(eng.host_tier, manifest)
            want = kvfmt.load(res.kv_path, verify=True)
            assert rows is not None and sorted(rows) == sorted(want)
            for i, lkv in want.items():
                assert rows[i].kind == lkv.kind
                np.testing.assert_array_equal(rows[i].positions, lkv.positions)
                np.testing.assert_array_equal(rows[i].k, lkv.k)  # bitwise: the same float32 rows
                np.testing.assert_array_equal(rows[i].v, lkv.v)
            a = pool.publish(rid, rows, nt.handoff_manifest(manifest))[nt.PARAMS_KEY]["layers"]
            b = pool.publish_export(res.kv_path)[nt.PARAMS_KEY]["layers"]
            assert [x["xxh3_128"] for x in a] == [x["xxh3_128"] for x in b]
            assert [(x["tokens"], x["kind"]) for x in a] == [(x["tokens"], x["kind"]) for x in b]
        # the endpoint's publish (`HttpIntake.publish`, on a stand-in carrying what it reads)
        intake = types.SimpleNamespace(kv_pool=pool, host_tier=eng.host_tier, _lock=threading.Lock(), _entries={})
        assert http.HttpIntake.publish(intake, "hit", os.path.join(kv_dir, "hit"))["publish_from"] == "host tier"
        # the tier's newest entry for the first 5 blocks is the longer prompt's: the shorter one is not held exactly
        cold = kvfmt.read_manifest(kvfmt.resolve(os.path.join(kv_dir, "cold")))
        assert prefix_lib.export_rows(eng.host_tier, cold) is None
        assert http.HttpIntake.publish(intake, "cold", os.path.join(kv_dir, "cold"))["publish_from"] == "export"
        eng.host_tier.max_bytes = 0
        eng.host_tier.unpin("nothing")  # evicts down to the budget
        hit = kvfmt.read_manifest(kvfmt.resolve(os.path.join(kv_dir, "hit")))
        assert len(eng.host_tier) == 0 and prefix_lib.export_rows(eng.host_tier, hit) is None


# two processes under -m slow (68 s of a cold suite): the default suite covers them with tests/test_pd_vllm.py (a
# 2-process endpoint answering vLLM over NIXL) and tests/test_peer_rows.py (the offered rows bitwise the export)
@pytest.mark.parametrize("processes,axis", [(1, "ring"), pytest.param(2, "ring", marks=pytest.mark.slow),
                                            pytest.param(2, "pipeline", marks=pytest.mark.slow)])
def test_endpoint_answers_over_nixl_before_its_export_is_written(reader, tmp_path, processes, axis):
    """The P/D endpoint (one launcher process, or two: ring 2, each holding half the sequence, or pipeline 2, each
    holding half the layers) answers a request that hands its KV over NIXL as soon as its first token is on the host
    (`HttpIntake.deliver_early`; under two processes the other process offers its rows over NIXL, as the broadcast
    batch marks the request `early`, and the record names both processes' pools): `export_pending` in the answer,
    the record published from the step's KV in memory; what the decode side pulls is bitwise the export written
    after, whose final record then lands in the results file; so too for a prefix hit
    (its cached rows joined to the computed ones). A prompt shorter than a reuse block is answered so too, and
    released before its export is written, that export is removed once written. A request over files waits for its
    export (on disk when answered); /v1/kv/release frees the pool entries."""
    import urllib.request

    from support import SHIPPED, free_port, launcher_env

    port, base, coord = free_port(), tmp_path, free_port()
    procs = []
    for i in reversed(range(processes)):
        multi = [f"--num_processes={processes}", f"--process_id={i}", f"--coordinator_address=127.0.0.1:{coord}",
                 f"--{axis}={processes}"] if processes > 1 else []
        cmd = [sys.executable, "-m", "slope_jax.launch", "--cpu_devices=1", f"--checkpoint={SHIPPED}", *multi,
               "--dtype=float32", "--q_tile=32", "--kv_tile=32", "--moe_tile=32", f"--http_port={port}",
               f"--kv_dir={base / 'kv'}", f"--results={base / 'results.jsonl'}", "--prefix_block=16",
               "--kv_pool_gib=0.0625", "--batch_wait_ms=0"]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=launcher_env(), stdout=open(base / f"log{i}", "w"),
                                      stderr=subprocess.STDOUT))
    url = f"http://127.0.0.1:{port}"

    def post(path, body):
        req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())

    def pulled_equals_export(params):
        got = reader.pull(params)
        path = params["slope_jax_kv_path"]
        deadline = time.time() + 60
        while not os.path.exists(os.path.join(path, "manifest.json")):  # the export follows the answer
            assert time.time() < deadline, "the export was never written"
            time.sleep(0.05)
        want = kvfmt.load(path, verify=True)
        assert sorted(got) == sorted(want)
        for layer, w in want.items():
            assert got[layer].kind == w.kind and got[layer].k.dtype == w.k.dtype == np.float32
            assert got[layer].k.tobytes() == w.k.tobytes() and got[layer].v.tobytes() == w.v.tobytes(), layer
            assert np.array_equal(got[layer].positions, w.positions)
        return path

    try:
        deadline = time.time() + 300
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5):
                    break
            except OSError:
                assert time.time() < deadline and all(p.poll() is None for p in procs), (
                    (base / "log0").read_text()[-3000:])
                time.sleep(0.5)
        rng = np.random.default_rng(11)
        prompt = rng.integers(0, 1000, 70).tolist()  # 4 blocks of 16 and 6 tokens; crosses the window (32)
        body = post("/v1/completions", {"prompt": prompt, "request_id": "early",
                                        "kv_transfer_params": {"do_remote_decode": True}})
        params = body["kv_transfer_params"]
        assert body["export_pending"] is True and body["publish_from"] == "memory", body
        # two processes: each one's rows stay in its own pool, the record names both (`nixl_transport.compose`)
        assert len(params[nt.PARAMS_KEY].get("parts", [None])) == processes, params[nt.PARAMS_KEY].keys()
        path = pulled_equals_export(params)
        assert params[nt.PARAMS_KEY]["manifest"]["first_token"] == body["choices"][0]["token_ids"][0]
        # a prefix hit of it (its first 64 tokens from the export just written), answered early too
        hit = post("/v1/completions", {"prompt": prompt + rng.integers(0, 1000, 9).tolist(), "request_id": "hit",
                                       "kv_transfer_params": {"do_remote_decode": True}})
        assert hit["export_pending"] is True and hit["usage"]["prompt_tokens_details"]["cached_tokens"] == 64, hit
        pulled_equals_export(hit["kv_transfer_params"])
        post("/v1/kv/release", {"request_id": "hit"})
        # over files: answered once the export is on disk
        other = rng.integers(0, 1000, 45).tolist()
        files = post("/v1/completions", {"prompt": other, "request_id": "files", "kv_transfer_params": {
            "do_remote_decode": True, "slope_jax_transport": "files"}})
        assert "export_pending" not in files and nt.PARAMS_KEY not in files["kv_transfer_params"]
        assert os.path.exists(os.path.join(files["kv_transfer_params"]["slope_jax_kv_path"], "manifest.json"))
        released = post("/v1/kv/release", {"request_id": "early"})
        assert released["removed"] is False and "prefix reuse" in released["reason"], released
        # shorter than a block (no reuse blocks): released at once, its export goes once written
        short = post("/v1/completions", {"prompt": prompt[:13], "request_id": "short",
                                         "kv_transfer_params": {"do_remote_decode": True}})
        assert short["export_pending"] is True, short
        released = post("/v1/kv/release", {"request_id": "short"})
        assert released["removed"] is True or "reclaimed once written" in released["reason"], released
        deadline = time.time() + 60
        while os.path.lexists(short["kv_transfer_params"]["slope_jax_kv_path"]):
            assert time.time() < deadline, "the released export was not reclaimed once written"
            time.sleep(0.05)
        with urllib.request.urlopen(url + "/v1/kv/pool", timeout=30) as r:
            pool = json.loads(r.read())
        assert pool["entries"] == 0 and pool["used_bytes"] == 0, pool
        records = {r["id"]: r for r in map(json.loads, (base / "results.jsonl").read_text().splitlines())}
        assert records["early"]["kv_path"] == path and records["early"]["export_ms"] > 0
        assert "export_pending" not in records["early"] and records["hit"]["cached_tokens"] == 64
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)


def test_join_tiles_each_layer_from_pieces_in_any_order():
    """`nixl_transport.join` (a composed record's pull; process 0 joining every process's pieces of a request):
    layers come out whole and in token order whatever order the pieces arrive in (zigzag ring pieces interleave), a
    layer of one piece is that piece unchanged, the joined rows land in the given buffer (views), and a missing or
    overlapping piece is a ValueError naming the layer and its rows."""
    rng = np.random.default_rng(5)
    k, v = (rng.standard_normal((23, 3, 5)).astype(np.float32) for _ in range(2))
    manifest = {"layers": [{"layer": 0, "kind": "sliding_attention", "token_range": [7, 23]},
                           {"layer": 1, "kind": "full_attention", "token_range": [0, 23]}]}
    pieces = [(1, 12, 18, k[12:18], v[12:18]), (0, 7, 23, k[7:], v[7:]), (1, 18, 23, k[18:], v[18:]),
              (1, 0, 5, k[:5], v[:5]), (1, 5, 12, k[5:12], v[5:12])]
    buf = np.zeros(1 << 12, np.uint8)
    for out in (None, buf):
        got = nt.join(manifest, pieces[::-1] if out is None else pieces, out=out)
        assert sorted(got) == [0, 1] and got[0].kind == "sliding_attention" and got[1].kind == "full_attention"
        assert got[0].k is pieces[1][3]  # one piece: itself
        np.testing.assert_array_equal(got[0].positions, np.arange(7, 23))
        np.testing.assert_array_equal(got[1].k, k)  # exact: copies of the same float32 rows
        np.testing.assert_array_equal(got[1].v, v)
        np.testing.assert_array_equal(got[1].positions, np.arange(23))
    assert np.shares_memory(got[1].k, buf) and np.shares_memory(got[1].v, buf)
    for bad in (pieces[:-1], pieces + [(1, 4, 6, k[4:6], v[4:6])], [p for p in pieces if p[0] == 1]):
        with pytest.raises(ValueError, match=r"layer \d: pieces .* do not tile its rows \[\d+, 23\)"):
            nt.join(manifest, bad)


def test_a_peer_of_another_nixl_release_is_named_and_a_disconnect_mid_read_fails_cleanly(server, monkeypatch):
    """Measured: a 1.3.2 reader cannot load a 1.5.1 pool's metadata (NIXL_ERR_BACKEND), and a 1.5.1 reader's READ
    from a 1.3.2 pool ends in `nixlRemoteDisconnectError` raised by `check_xfer_state`. Both must come out as a
    KVTransferError that names the two releases, and the reader must stay usable."""
    reader = nt.KVReader(timeout_s=5)
    pool = server.pool(capacity_bytes=1 << 20)
    params = server.publish(pool, "vers-1", tokens=30)
    assert params[nt.PARAMS_KEY]["nixl"] == nt.nixl_release() != "unknown"  # one venv: the same release
    other = json.loads(json.dumps(params))
    other[nt.PARAMS_KEY].update(nixl="nixl-cu12 0.0.1", agent="slope-kvpool-other",
                                agent_metadata=base64.b64encode(b"nixlSerDes|not a real agent").decode())
    with pytest.raises(nt.KVTransferError, match=r"request 'vers-1'.*cannot load the metadata.*pool runs NIXL "
                       r"nixl-cu12 0\.0\.1 and this process nixl-cu12 \d"):
        reader.pull(other)

    class nixlRemoteDisconnectError(RuntimeError):  # noqa: N801 - NIXL's own class name, as the message shows it
        pass

    def disconnected(h):
        raise nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")

    real_transfer = reader._agent.transfer
    monkeypatch.setattr(reader._agent, "transfer", lambda h: (real_transfer(h), "PROC")[1])  # still in flight
    monkeypatch.setattr(reader._agent, "check_xfer_state", disconnected)
    with pytest.raises(nt.KVTransferError, match=r"request 'vers-1'.*READ of layer 0 failed \("
                       r"nixlRemoteDisconnectError: NIXL_ERR_REMOTE_DISCONNECT") as err:
        reader.pull(params)
    assert err.value.unreachable
    monkeypatch.undo()
    _assert_same(reader.pull(server.publish(pool, "vers-2", tokens=31, seed=4)), _synthetic(4, 4, 31, KH, HD))
    reader.close()
    # the other direction: the pool cannot load a reader's metadata; it logs that once, naming both releases
    monkeypatch.setattr(nt, "nixl_release", lambda: "nixl-cu12 0.0.2")  # what the reader names in its first hold
    stranger = nt.KVReader(timeout_s=2)
    monkeypatch.setattr(stranger, "_metadata", base64.b64encode(b"nixlSerDes|not a real agent").decode())
    with pytest.raises(nt.KVTransferError, match=r"request 'vers-3'.*did not answer the hold"):
        stranger.pull(server.publish(pool, "vers-3", tokens=32))
    log = open(server.log.name).read()
    assert re.search(rf"cannot load the NIXL metadata of reader '{stranger.name}'.*reader runs NIXL nixl-cu12 0\.0\.2"
                     r" and this process nixl-cu12 \d", log), log[-2000:]
    monkeypatch.undo()
    stranger.close()
