"""Prefix reuse (issue 30): a prompt served from a cached prefix gives the cold prompt's first token, logits and KV
(float32, every layout family), its export is whole, and a cache entry is never used for other weights, another
cache_salt, a tampered, truncated or stale export; retention never removes an export in use.

Blocks of 8 tokens against config A's window of 10: cached prefixes end before, inside and after the first window,
and hits range from one block to n−1 tokens.
"""

import json
import logging
import os
import threading
import time

import numpy as np
import pytest
from support import CONFIG_A, TILES, random_prompt

from slope_jax import kv
from slope_jax.kv import prefix as prefix_lib
from slope_jax.kv.store import KVStore
from slope_jax.parallel.config import ParallelConfig
from slope_jax.serve.engine import PrefillEngine

BLOCK = 8
TOL = 2e-5  # float32 logits / K / V of a hit vs the cold prompt (measured max 1.0e-6 on every layout)
BASE = random_prompt(CONFIG_A, 96, seed=5)


def _engine(checkpoints, parallel=ParallelConfig(), **reuse):
    devices = None
    if parallel.num_devices > 1:
        import jax

        devices = jax.devices()[:parallel.num_devices]
    return PrefillEngine.from_checkpoint(checkpoints["A"]["mxfp4"], parallel, dtype="float32", progress=False,
                                         devices=devices, reuse=prefix_lib.ReuseOptions(block_size=BLOCK, **reuse),
                                         **TILES)


def _prompt(n: int, tail_seed: int = 0) -> np.ndarray:
    """The first min(n, 40) tokens of BASE (what the warm-up cached), then other tokens."""
    head = BASE[:min(n, 40)]
    return np.concatenate([head, random_prompt(CONFIG_A, n - head.size, seed=900 + tail_seed)]).astype(np.int32)


def _check(cold, hot, prompt, want_cached, tmp_path=None):
    want = cold.prefill([prompt], return_kv=True, prefix_reuse=False)[0]
    got = hot.prefill([prompt], return_kv=True)[0]
    assert got.cached_tokens == want_cached
    assert got.first_token == want.first_token
    assert np.abs(got.logits - want.logits).max() < TOL
    assert sorted(got.kv) == sorted(want.kv)
    for layer in want.kv:
        np.testing.assert_array_equal(got.kv[layer].positions, want.kv[layer].positions)
        assert np.abs(got.kv[layer].k - want.kv[layer].k).max() < TOL
        assert np.abs(got.kv[layer].v - want.kv[layer].v).max() < TOL


# (n, cached): one block + 1 new token; n−1 cached; a hit shorter than n−1; a split inside the first window
# (8 < W = 10); 30 new tokens (more than a window) after 40 cached
SWEEP = [(9, 8), (17, 16), (24, 16), (12, 8), (41, 40), (70, 40)]


def test_timed_runs_measure_each_length_and_cache_nothing(checkpoints):
    """`compute.timed_runs` (the launcher's warm-up of its --precompile buckets) returns one measured time per
    length and leaves no prefix-cache entry behind: its dummy prompts must not serve, or be counted as, real hits."""
    eng = _engine(checkpoints)
    from slope_jax.serve.compute import Broadcast, timed_runs

    runs = timed_runs(eng, [24, 40], Broadcast(False))
    assert [(n, m) for n, m, _ in runs] == [(24, 1), (40, 1)] and all(ms > 0 for *_, ms in runs)
    assert eng.bucket(39) == eng.bucket(40) != eng.bucket(24)
    one = Broadcast(False)
    assert [n for n, *_ in timed_runs(eng, [40, 39, 40, 24], one)] == [24, 39]  # one length per bucket, shortest first
    assert [n for n, *_ in timed_runs(eng, [40, 24], one, budget_ms=1e-3)] == [24]  # no step starts past the budget
    ids = (np.arange(40) % CONFIG_A.vocab_size).astype(np.int32)  # the warm-up's own prompt
    assert eng.prefill([ids], return_kv=False)[0].cached_tokens == 0
    assert eng.prefill([ids], return_kv=False)[0].cached_tokens == 32  # while a real prompt is cached (blocks of 8)


def test_hit_equals_cold_on_one_device(checkpoints, reference_engines):
    hot = _engine(checkpoints)
    hot.prefill([BASE[:40]])  # cached: 5 blocks
    for n, cached in SWEEP:
        _check(reference_engines["A"], hot, _prompt(n, n), cached)


def test_consecutive_hits_of_one_shape_reuse_the_host_buffers_exactly(checkpoints, reference_engines):
    """Two hits of the same step shape in a row (40 cached rows each, from two different cached prompts): the second
    lays its rows out in the buffers the first used (`serve.reuse.PrefixBuffers`) and still equals its cold prompt."""
    hot = _engine(checkpoints)
    other = random_prompt(CONFIG_A, 40, seed=77).astype(np.int32)
    hot.prefill([BASE[:40], other])
    _check(reference_engines["A"], hot, _prompt(70, 70), 40)
    kept = hot._prefix_buffers._kv
    assert kept is not None
    tail = random_prompt(CONFIG_A, 30, seed=78).astype(np.int32)
    _check(reference_engines["A"], hot, np.concatenate([other, tail]), 40)
    assert hot._prefix_buffers._kv is kept  # the same arrays, refilled


def test_prefill_from_several_threads_equals_each_prompt_alone(checkpoints, reference_engines):
    """Four threads call one engine's `prefill` at once, three times each, with hits of one step shape (40 cached
    rows each, from four cached prompts; then 64, from their own first calls): every call equals its cold prompt.
    Unserialised, two threads laid their rows out in the one kept buffer pair at once and one read the other's
    (logits off by ~1.3, no error)."""
    hot = _engine(checkpoints)
    heads = [BASE[:40]] + [random_prompt(CONFIG_A, 40, seed=80 + i).astype(np.int32) for i in range(3)]
    hot.prefill(heads)
    prompts = [np.concatenate([h, random_prompt(CONFIG_A, 30, seed=90 + i)]).astype(np.int32)
               for i, h in enumerate(heads)]
    cold = [r.logits for r in reference_engines["A"].prefill(prompts, prefix_reuse=False)]
    start, got, errors = threading.Barrier(len(prompts)), {}, []

    def serve(i):
        try:
            start.wait()
            for rep in range(3):
                r = hot.prefill([prompts[i]])[0]
                got[i, rep] = (r.cached_tokens, float(np.abs(r.logits - cold[i]).max()))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(got) == 3 * len(prompts)
    # the first call of each prompt hits its 40-token head; later ones hit 64 tokens of its own first call's KV
    assert all(cached == (40 if rep == 0 else 64) and err < TOL for (_, rep), (cached, err) in got.items()), got


def test_prefix_buffers_are_reused_and_every_row_not_written_is_zeroed():
    """A kept buffer still holds the last step's rows: prefix_arrays zeroes exactly what it does not write (capacity
    padding, a sliding layer's rows before its window, padding stack entries), so no stale row or NaN remains."""
    from types import SimpleNamespace

    from slope_jax.serve.reuse import PrefixBuffers, prefix_arrays

    kh, hd, cap = 2, 3, 12
    eng = SimpleNamespace(cfg=SimpleNamespace(num_key_value_heads=kh, head_dim=hd), mesh=None, parallel=None,
                          plan=SimpleNamespace(flat=[0, 1, -1]), dtype=np.dtype(np.float32))
    rng = np.random.default_rng(0)

    def hit(p, start):
        k = {i: rng.standard_normal((p - start.get(i, 0), kh, hd)).astype(np.float32) for i in (0, 1)}
        v = {i: rng.standard_normal((p - start.get(i, 0), kh, hd)).astype(np.float32) for i in (0, 1)}
        return SimpleNamespace(cached=p, prefix=prefix_lib.PrefixKV(p, k, v, source="host", start=start))

    bufs = PrefixBuffers(keep_bytes=1 << 20)
    _, k1, v1, _ = prefix_arrays(eng, [hit(12, {})], cap, bufs)
    k1[:] = np.nan  # poison the kept pair
    v1[:] = np.nan
    h = hit(8, {1: 5})
    _, k2, v2, pos = prefix_arrays(eng, [h], cap, bufs)
    assert np.shares_memory(k2, k1)  # the kept pair, not a new one
    for got, held in ((k2, h.prefix.k), (v2, h.prefix.v)):
        np.testing.assert_array_equal(got[0, 0, :8], held[0])
        np.testing.assert_array_equal(got[0, 1, 5:8], held[1])
        assert not got[0, 0, 8:].any() and not got[0, 1, :5].any() and not got[0, 1, 8:].any()
        assert not got[0, 2].any()  # the padding stack entry
    np.testing.assert_array_equal(pos[0], np.r_[np.arange(8), np.full(4, pos[0, -1])])
    big = PrefixBuffers(keep_bytes=16)  # too small to keep: a new zeroed pair every time
    k3, _, fresh = big.get((4, 5), np.float32)
    assert fresh and not k3.any() and big._kv is None and big.get((4, 5), np.float32)[0] is not k3


@pytest.mark.parametrize("parallel", [
    ParallelConfig(ring=2, ulysses=4),  # Ulysses x zigzag ring
    ParallelConfig(pipeline=2, ring=2, ulysses=2),  # pipeline stages
    ParallelConfig(pipeline=2, ring=2, seq_chunks=2),  # sequence-pipelined chunks
    ParallelConfig(ring=3, ulysses=2, expert=6),  # expert parallelism over the CP devices
], ids=["cp-1x2x4", "pp-2x2x2", "chunks-2x2x1-c2", "ep-1x3x2"])
def test_hit_equals_cold_on_every_layout_family(checkpoints, reference_engines, parallel):
    hot = _engine(checkpoints, parallel)
    hot.prefill([BASE[:40]])
    for n, cached in ((41, 40), (70, 40)):
        _check(reference_engines["A"], hot, _prompt(n, n), cached)


@pytest.mark.parametrize("parallel", [ParallelConfig(), ParallelConfig(ring=2, ulysses=4)], ids=["1dev", "cp-1x2x4"])
def test_bf16_hit_is_as_close_to_float32_as_the_bf16_cold_prompt(checkpoints, reference_engines, parallel):
    """bfloat16, the launcher's default dtype (the float32 parity tests above never run its bit-packed bf16 KV stacks,
    `model.stack.bits`, nor the sliding layers' slice of them): a hit, split inside and after the first window, gives
    the bf16 cold prompt's first token, its logits are as close to the float32 cold reference as the bf16 cold
    prompt's, and the cached rows it reused are bitwise the rows its entry was computed with."""
    import jax

    devices = jax.devices()[:parallel.num_devices] if parallel.num_devices > 1 else None
    make = dict(dtype="bfloat16", progress=False, devices=devices, **TILES)
    hot = PrefillEngine.from_checkpoint(checkpoints["A"]["mxfp4"], parallel,
                                        reuse=prefix_lib.ReuseOptions(block_size=BLOCK), **make)
    cold = PrefillEngine.from_checkpoint(checkpoints["A"]["mxfp4"], parallel, **make)
    entry = hot.prefill([BASE[:40]], return_kv=True)[0].kv  # cached: 5 blocks
    for n, cached in ((12, 8), (70, 40)):
        prompt = _prompt(n, n)
        ref = reference_engines["A"].prefill([prompt], prefix_reuse=False)[0]
        want = cold.prefill([prompt], prefix_reuse=False)[0]
        got = hot.prefill([prompt], return_kv=True)[0]
        assert got.cached_tokens == cached and got.first_token == want.first_token
        cold_err = np.abs(np.asarray(want.logits, np.float32) - ref.logits).max()
        hit_err = np.abs(np.asarray(got.logits, np.float32) - ref.logits).max()
        # bf16 rounding in other step shapes only: measured hit 0.025-0.060 vs cold 0.023-0.065 (max abs logits)
        assert hit_err <= 2 * cold_err + 0.02, (hit_err, cold_err)
        for layer, rows in entry.items():
            same = np.isin(got.kv[layer].positions, rows.positions[rows.positions < cached])
            reused = np.isin(rows.positions, got.kv[layer].positions[same])
            assert same.sum() == reused.sum() > 0
            for name in ("k", "v"):
                np.testing.assert_array_equal(np.asarray(getattr(got.kv[layer], name))[same],
                                              np.asarray(getattr(rows, name))[reused])


@pytest.mark.parametrize("parallel", [ParallelConfig(), ParallelConfig(ring=2, ulysses=4)], ids=["1dev", "cp-1x2x4"])
def test_on_computed_precedes_the_export_and_carries_its_manifest_and_rows(checkpoints, tmp_path, parallel):
    """`prefill(on_computed=...)` (what the P/D endpoint answers from before the export is written): called after
    each step with the first tokens, before the export exists; each `PendingExport`'s manifest equals the written
    one but for the files and their checksums, and its rows are bitwise the rows the export then holds, for a cold
    prompt and prefix hits (default kv_full with reuse on, and a last_window export), with reuse on and off."""
    eng = _engine(checkpoints, parallel)
    d = str(tmp_path / "kv")
    seen = []

    def on_computed(ids, results, exports):
        for rid, res, x in zip(ids, results, exports):
            assert not os.path.lexists(os.path.join(d, rid)) and res.kv_path is None
            seen.append((rid, res.first_token, x.manifest, x.rows()))

    jobs = [(["doc"], [BASE[:40]], None), (["turn", "other"], [_prompt(57, 1), _prompt(23, 2)], None),
            (["window"], [_prompt(61, 3)], False)]
    for ids, prompts, full in jobs:
        out = eng.prefill(prompts, d, ids=ids, kv_full=full, on_computed=on_computed)
        assert all((r.cached_tokens > 0) == (rid != "doc") for rid, r in zip(ids, out))
    eng.prefill([_prompt(45, 4)], d, ids=["no-reuse"], prefix_reuse=False, on_computed=on_computed)
    assert sorted(x[0] for x in seen) == ["doc", "no-reuse", "other", "turn", "window"]  # one call per step
    for rid, first, early, rows in seen:
        written = kv.read_manifest(os.path.join(d, rid))
        assert early["first_token"] == first == written["first_token"]
        assert early["files"] == [] and early["checksums"] == {} and written["files"]
        assert {k: v for k, v in early.items() if k not in ("files", "checksums")} == \
            {k: v for k, v in written.items() if k not in ("files", "checksums")}
        want = kv.load(os.path.join(d, rid), verify=True)
        assert rows is not None and sorted(rows) == sorted(want)
        for i, lkv in want.items():  # bitwise: the same float32 rows the export holds
            np.testing.assert_array_equal(rows[i].positions, lkv.positions)
            np.testing.assert_array_equal(rows[i].k, lkv.k)
            np.testing.assert_array_equal(rows[i].v, lkv.v)
    assert kv.read_manifest(os.path.join(d, "window"))["sliding_policy"] == "last_window"


def test_export_of_a_hit_is_whole_and_reuse_survives_a_restart(checkpoints, reference_engines, tmp_path):
    d = str(tmp_path / "kv")
    first = _engine(checkpoints, host_bytes=0)
    first.prefill([BASE[:40]], d, ids=["doc"])
    restarted = _engine(checkpoints, host_bytes=0)  # a new engine: the index comes from the manifests on disk
    prompt = _prompt(57, 1)
    res = restarted.prefill([prompt], d, ids=["turn"])[0]
    assert res.cached_tokens == 40
    cold = reference_engines["A"].prefill([prompt], str(tmp_path / "cold"), ids=["turn"], prefix_reuse=False,
                                          kv_full=True)[0]
    a, b = kv.load(res.kv_path), kv.load(cold.kv_path)
    for layer in b:
        np.testing.assert_array_equal(a[layer].positions, np.arange(len(prompt)))
        assert np.abs(a[layer].k - b[layer].k).max() < TOL and np.abs(a[layer].v - b[layer].v).max() < TOL
    m = kv.read_manifest(res.kv_path)
    assert m["model"]["weights_digest"] == restarted.weights_digest
    assert len(m["prefix"]["hashes"]) == len(prompt) // BLOCK
    # a decode engine cannot tell it from the cold export: the next token's logits from either cache match a full
    # forward over the prompt and its first token (the reference decode step, kv.decode)
    from slope_jax.kv import decode

    full = reference_engines["A"].prefill([np.concatenate([prompt, [res.first_token]])], prefix_reuse=False)[0]
    for path in (res.kv_path, cold.kv_path):
        logits = decode.decode_step(CONFIG_A, reference_engines["A"].params, kv.load(path), res.first_token,
                                    len(prompt))
        assert np.abs(logits - full.logits).max() < 1e-5  # as tests/test_kv_export.py (measured 1.6e-6 there)


def test_a_last_window_export_is_indexed_for_the_hits_it_can_serve(checkpoints, reference_engines, tmp_path, caplog):
    """A `last_window` export (`kv_full=False`) keeps sliding-layer rows from `sliding_from` only, so it serves a
    prefix of p tokens only when p − W + 1 ≥ sliding_from. A prompt sharing a shorter prefix is computed cold without
    a skipped-entry warning (the entry was matched, refused and dropped from the index), and the entry still serves
    the longer prefixes it holds."""
    d = str(tmp_path / "kv")
    eng = _engine(checkpoints, host_bytes=0)
    doc = random_prompt(CONFIG_A, 300, seed=41)
    eng.prefill([doc], d, ids=["doc"], kv_full=False)
    assert kv.read_manifest(os.path.join(d, "doc"))["sliding_from"] == 300 - 10 - 127  # W = 10, vLLM blocks ≤ 128
    short = np.concatenate([doc[:80], random_prompt(CONFIG_A, 20, seed=42)]).astype(np.int32)  # 80 − 9 < 163
    with caplog.at_level(logging.WARNING):
        assert eng.prefill([short], d, ids=["short"])[0].cached_tokens == 0
    assert "skipped" not in caplog.text
    longer = np.concatenate([doc[:280], random_prompt(CONFIG_A, 9, seed=43)]).astype(np.int32)
    got = eng.prefill([longer], d, ids=["long"])[0]
    assert got.cached_tokens == 280  # 35 blocks; the first servable one ends at 176 (176 − 9 ≥ 163)
    want = reference_engines["A"].prefill([longer], prefix_reuse=False)[0]
    assert got.first_token == want.first_token and np.abs(got.logits - want.logits).max() < TOL
    # its export was asked for whole (reuse on), but sliding rows before 163 were never kept: it says so, and a
    # decode step from it equals a full forward over the prompt and its first token (as the restart test above)
    from slope_jax.kv import decode

    m = kv.read_manifest(got.kv_path)
    assert (m["sliding_policy"], m["sliding_from"]) == ("last_window", 163)
    full = reference_engines["A"].prefill([np.concatenate([longer, [got.first_token]])], prefix_reuse=False)[0]
    logits = decode.decode_step(CONFIG_A, reference_engines["A"].params, kv.load(got.kv_path), got.first_token,
                                len(longer))
    assert np.abs(logits - full.logits).max() < 1e-5


def test_other_weights_and_other_salts_never_share(checkpoints, tmp_path):
    import jax

    d = str(tmp_path / "kv")
    a = _engine(checkpoints)
    a.prefill([BASE[:40]], d, ids=["doc"], cache_salt="tenant-1")
    assert a.prefill([_prompt(50)], cache_salt="tenant-2")[0].cached_tokens == 0
    assert a.prefill([_prompt(50)])[0].cached_tokens == 0  # no salt is another tenant too
    assert a.prefill([_prompt(50)], cache_salt="tenant-1")[0].cached_tokens == 40
    # same config, other weight bytes: the identity differs, so neither tier nor kv_dir serves it
    perturbed = jax.tree.map(lambda x: x, a.params)
    perturbed["final_norm"] = perturbed["final_norm"] * 1.001
    b = PrefillEngine(CONFIG_A, perturbed, dtype="float32", reuse=prefix_lib.ReuseOptions(block_size=BLOCK), **TILES)
    assert b.weights_digest != a.weights_digest
    assert b.prefill([_prompt(50)], d, ids=["x"], cache_salt="tenant-1")[0].cached_tokens == 0
    # even an entry whose hashes match is refused by its manifest's weights digest
    with pytest.raises(Exception, match="weights_digest"):
        b.kv_store(d).load_prefix("doc", _prompt(50), 40, cfg=CONFIG_A, dtype="float32", weights=b.weights_digest)


def _flip_last_byte(path):
    m = kv.read_manifest(path)
    f = os.path.join(os.path.realpath(path), m["files"][0])
    data = bytearray(open(f, "rb").read())
    data[-1] ^= 1
    open(f, "wb").write(bytes(data))


def _truncate(path):
    m = kv.read_manifest(path)
    f = os.path.join(os.path.realpath(path), m["files"][0])
    os.truncate(f, os.path.getsize(f) // 2)


def _edit_manifest(**fields):
    def edit(path):
        mpath = os.path.join(os.path.realpath(path), "manifest.json")
        m = json.load(open(mpath))
        for key, value in fields.items():
            target = m
            *parents, leaf = key.split(".")
            for p in parents:
                target = target[p]
            target[leaf] = value
        json.dump(m, open(mpath, "w"))
    return edit


def _garbage_with_matching_digest(path):
    """Other bytes of the same size, and the manifest's digest rewritten to match: only a parser can tell."""
    import xxhash

    vdir = os.path.realpath(path)
    m = kv.read_manifest(path)
    name = m["files"][0]
    data = np.random.default_rng(0).integers(0, 256, os.path.getsize(os.path.join(vdir, name)), np.uint8).tobytes()
    open(os.path.join(vdir, name), "wb").write(data)
    m["checksums"][name]["xxh3_128"] = xxhash.xxh3_128_hexdigest(data)
    json.dump(m, open(os.path.join(vdir, "manifest.json"), "w"))


def _remap_manifest(how):
    """Edit the manifest's mapping of layers to tensors (every file's bytes and digest stay valid): `how` "kv" swaps
    the k and v tensor names of layer 1's segments, "layers" swaps the `layer` ids of layers 1 and 3 (same kind)."""
    def edit(path):
        mpath = os.path.join(os.path.realpath(path), "manifest.json")
        m = json.load(open(mpath))
        recs = {r["layer"]: r for r in m["layers"]}
        if how == "kv":
            for seg in recs[1]["segments"]:
                seg["k"], seg["v"] = seg["v"], seg["k"]
        else:
            recs[1]["layer"], recs[3]["layer"] = 3, 1
        json.dump(m, open(mpath, "w"))
    return edit


@pytest.mark.parametrize("damage, reason", [
    (_flip_last_byte, "XXH3-128"),  # tampered bytes
    (_truncate, "bytes"),  # truncated file
    (_edit_manifest(**{"model.fingerprint": "0" * 16}), "fingerprint"),  # another model's export
    (_edit_manifest(dtype="bfloat16"), "dtype"),  # computed in another dtype
    (_edit_manifest(**{"model.sliding_window": 11}), "sliding_window"),  # another window
    (_edit_manifest(**{"model.num_key_value_heads": 2}), "num_key_value_heads"),  # another KV layout
    (_garbage_with_matching_digest, "unreadable"),  # digests rewritten to match bytes no parser reads
    (_remap_manifest("kv"), "names tensor"),  # k and v swapped: verified bytes, wrong KV (probe: logits off 1.46)
    (_remap_manifest("layers"), "names tensor"),  # two layers' records swapped
], ids=["tampered", "truncated", "fingerprint", "dtype", "window", "kv_heads", "garbage", "kv_swapped",
        "layers_swapped"])
def test_a_bad_entry_is_skipped_with_its_reason_and_the_prompt_computed_cold(checkpoints, reference_engines,
                                                                             tmp_path, caplog, damage, reason):
    d = str(tmp_path / "kv")
    _engine(checkpoints, host_bytes=0).prefill([BASE[:40]], d, ids=["doc"])
    damage(os.path.join(d, "doc"))
    fresh = _engine(checkpoints, host_bytes=0)
    prompt = _prompt(50)
    with caplog.at_level(logging.WARNING, logger="slope_jax.serve.reuse"):
        res = fresh.prefill([prompt], return_kv=True, kv_dir=d, ids=["q"])[0]
    assert res.cached_tokens == 0
    lines = [r.getMessage() for r in caplog.records if "prefix reuse" in r.getMessage()]
    assert len(lines) == 1 and reason in lines[0] and "'doc'" in lines[0], lines
    want = reference_engines["A"].prefill([prompt], prefix_reuse=False)[0]
    assert res.first_token == want.first_token and np.abs(res.logits - want.logits).max() < TOL
    # skipped once: the entry left the index, the next prompt neither warns nor hits
    caplog.clear()
    assert fresh.prefill([_prompt(60)], kv_dir=d, ids=["q2"])[0].cached_tokens in (0, 48)  # q's own export may serve
    assert not [r for r in caplog.records if "prefix reuse" in r.getMessage()]


def test_entries_sharing_blocks_serve_them_when_one_is_skipped_or_removed(checkpoints, reference_engines, tmp_path,
                                                                          caplog):
    """`doc` (40 tokens) and the later `turn` (doc + 16 tokens) hold the same 5 blocks; the index pointed them at the
    latest only, so skipping or removing `turn` hid `doc`'s valid blocks and the prompt was computed cold."""
    d = str(tmp_path / "kv")
    writer = _engine(checkpoints, host_bytes=0)
    writer.prefill([BASE[:40]], d, ids=["doc"])
    writer.prefill([_prompt(56, 1)], d, ids=["turn"])
    _truncate(os.path.join(d, "turn"))
    fresh = _engine(checkpoints, host_bytes=0)
    prompt = _prompt(50)
    with caplog.at_level(logging.WARNING, logger="slope_jax.serve.reuse"):
        res = fresh.prefill([prompt], kv_dir=d, ids=["q"])[0]
    lines = [r.getMessage() for r in caplog.records if "prefix reuse" in r.getMessage()]
    assert len(lines) == 1 and "'turn'" in lines[0], lines  # refused, then the next holder served
    assert res.cached_tokens == 40
    want = reference_engines["A"].prefill([prompt], prefix_reuse=False)[0]
    assert res.first_token == want.first_token and np.abs(res.logits - want.logits).max() < TOL
    # `q` (just written) is now the latest holder; removed by another process, `doc` serves the blocks again
    os.remove(os.path.join(d, "q"))
    assert fresh.prefill([_prompt(60, 2)], kv_dir=d, ids=["q2"])[0].cached_tokens == 40


def test_host_tier_entries_sharing_blocks_serve_them_after_one_is_evicted():
    """One document under two questions: evicting the entry added last leaves the document's blocks to the other."""
    def entry(key, hashes, nbytes=1000):
        k, v = ({0: np.zeros((nbytes // 8,), np.float32)} for _ in range(2))
        return prefix_lib.HostEntry(key, np.arange(4), hashes, k, v)

    tier = prefix_lib.HostTier(max_bytes=2500)
    assert tier.add(entry("q1", ["d0", "d1", "q1"])) and tier.add(entry("q2", ["d0", "d1", "q2"]))
    assert tier.lookup(["d0", "d1", "q1"])[1] == 3  # q1 used last: q2 is the least recently used
    assert tier.add(entry("other", ["o0"]))  # over budget: q2 leaves
    got, blocks = tier.lookup(["d0", "d1", "q3"])
    assert got is not None and got.key == "q1" and blocks == 2


def test_a_malformed_reuse_record_is_no_candidate_and_stops_no_other_export(checkpoints, tmp_path):
    """One manifest whose `prefix.block_size` is not an integer made every prefill on the directory raise (`int()` in
    the index); it is now just not a candidate."""
    d = str(tmp_path / "kv")
    writer = _engine(checkpoints, host_bytes=0)
    writer.prefill([BASE[:40], random_prompt(CONFIG_A, 40, seed=71).astype(np.int32)], d, ids=["doc", "bad"])
    _edit_manifest(**{"prefix.block_size": "8x"})(os.path.join(d, "bad"))
    assert _engine(checkpoints, host_bytes=0).prefill([_prompt(50)], d, ids=["q"])[0].cached_tokens == 40


def test_kv_results_are_read_only_so_the_prefix_cache_cannot_be_changed(checkpoints, reference_engines):
    """`return_kv` hands out the host tier's arrays (no copy): an edit of a result's K must not change later hits."""
    hot = _engine(checkpoints)
    res = hot.prefill([BASE[:40]], return_kv=True)[0]
    with pytest.raises(ValueError, match="read-only"):
        res.kv[0].k[:] = 0
    _check(reference_engines["A"], hot, _prompt(50), 40)


def test_a_lookup_that_raises_unpins_the_host_entries_it_took(checkpoints, monkeypatch):
    from slope_jax.serve import reuse as reuse_lib

    hot = _engine(checkpoints)
    hot.prefill([BASE[:40]])
    real, calls = reuse_lib._lookup_local, []

    def second_fails(engine, x, hit, store):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("lookup failed")
        real(engine, x, hit, store)

    monkeypatch.setattr(reuse_lib, "_lookup_local", second_fails)
    with pytest.raises(RuntimeError, match="lookup failed"):
        hot.prefill([_prompt(50), _prompt(60, 1)])
    assert not hot.host_tier._pins._counts  # the first prompt's pin was released


def test_host_tier_is_lru_within_its_budget_and_never_evicts_an_entry_in_use():
    def entry(key, nbytes):
        k, v = ({0: np.zeros((nbytes // 8,), np.float32)} for _ in range(2))
        return prefix_lib.HostEntry(key, np.arange(4), [f"{key}-h"], k, v)

    tier = prefix_lib.HostTier(max_bytes=2500)
    assert tier.add(entry("a", 1000)) and tier.add(entry("b", 1000))
    tier.lookup(["a-h"])  # a is now the most recently used
    tier.pin("b")
    assert tier.add(entry("c", 1000))  # over budget: b is pinned, so a goes though it was used last
    assert tier.lookup(["a-h"])[0] is None and tier.lookup(["b-h"])[1] == 1 and tier.nbytes <= 2500
    tier.unpin("b")
    assert not tier.add(entry("huge", 4000))  # larger than the whole budget: not cached


def test_admission_look_ahead_marks_nothing_used():
    """`serve.reuse.peek` (admission's prediction of a request's hit) reads the index without marking the entry used:
    a request that admission then rejects must not keep an entry in the host tier (nor on disk) over one that served."""
    import types

    from slope_jax.serve import reuse

    block, ident = 4, "0" * 32
    tier = prefix_lib.HostTier(max_bytes=2500)
    prompts = {key: np.arange(8, dtype=np.int32) + 100 * i for i, key in enumerate("abc")}
    for key, toks in prompts.items():
        k, v = ({0: np.zeros((1000 // 8,), np.float32)} for _ in range(2))
        prompts[key] = (toks, prefix_lib.HostEntry(key, toks, prefix_lib.block_hashes(toks, ident, block), k, v))
    engine = types.SimpleNamespace(reuse=prefix_lib.ReuseOptions(block_size=block), host_tier=tier,
                                   prefix_identity=lambda salt: ident)
    assert tier.add(prompts["a"][1]) and tier.add(prompts["b"][1])
    assert reuse.peek(engine, np.concatenate([prompts["a"][0], [7]]), None, None) == 8  # a's 2 blocks would serve
    assert tier.add(prompts["c"][1])  # over budget: a, the least recently used, leaves (peek used nothing)
    assert tier.lookup(prompts["a"][1].hashes)[0] is None and tier.lookup(prompts["b"][1].hashes)[1] == 2


def test_host_tier_entries_share_rows_and_count_them_once():
    """A turn's entry references its prefix's rows (`kv.prefix.Rows`): the tier counts shared arrays once, frees
    them when their last entry leaves, and every entry still reads its own rows."""
    rng = np.random.default_rng(3)
    doc = rng.standard_normal((40, 2, 3)).astype(np.float32)  # 960 bytes per K or V
    base = prefix_lib.HostEntry("doc", np.arange(40), ["h0"], {0: doc}, {0: doc + 1})
    parent = prefix_lib.PrefixKV(40, base.k, base.v, source="host")
    turns = []
    for i, extra in enumerate((5, 7)):
        new = rng.standard_normal((extra, 2, 3)).astype(np.float32)
        pk, pv = parent.shared_rows(0, 0, 32)  # a hit of 32 rows: views, then the computed rows
        turns.append(prefix_lib.HostEntry(f"t{i}", np.arange(32 + extra), ["h0", f"t{i}"], {0: pk.extend(new)},
                                          {0: pv.extend(new + 1)}))
        np.testing.assert_array_equal(turns[-1].k[0].array(), np.concatenate([doc[:32], new]))
        buf = np.zeros((32 + extra - 30, 2, 3), np.float32)
        prefix_lib.PrefixKV(32 + extra, turns[-1].k, turns[-1].v, source="host").copy_rows(0, 30, 32 + extra, buf,
                                                                                            buf.copy())
        np.testing.assert_array_equal(buf, np.concatenate([doc[30:32], new]))
    own = 2 * 4 * 6 * (5 + 7)  # the turns' computed rows, K and V
    tier = prefix_lib.HostTier(max_bytes=2 * doc.nbytes + own + 100)
    for e in (base, *turns):
        assert tier.add(e)
    assert tier.nbytes == 2 * doc.nbytes + own  # the document once, not three times

    def entry(key, floats):
        return prefix_lib.HostEntry(key, np.arange(1), [f"{key}-h"], {0: np.zeros((floats,), np.float32)},
                                    {0: np.zeros((floats,), np.float32)})

    # over budget by 100: "doc" goes first (least recently used) and frees nothing the turns still hold, then t0
    assert tier.add(entry("x", 25))
    assert [tier.lookup([h])[0] is not None for h in ("h0", "t0", "t1")] == [True, False, True]
    assert tier.lookup(["h0"])[0].key == "t1" and tier.nbytes == 2 * doc.nbytes + 2 * 4 * 6 * 7 + 200
    # x, then t1 (the last holder of the document's arrays) leave: their memory is freed
    assert tier.add(entry("y", doc.size)) and len(tier) == 1 and tier.nbytes == 2 * doc.nbytes
    np.testing.assert_array_equal(turns[1].v[0].array(0, 32), doc[:32] + 1)  # views stay valid after eviction


def test_retention_keeps_new_exports_for_their_readers_and_remembers_use_across_restarts(checkpoints, tmp_path):
    """A budget smaller than one export removed it right after publication: its record and P/D answer named a path
    that was gone before any decode engine could read it. Exports younger than `min_age_s` now stay; last-use times
    live on disk (a restarted store evicted a hot prefix as if unused); a start-up scan removes a killed run's
    staging debris, which nothing else ever did."""
    d = str(tmp_path / "kv")
    eng = _engine(checkpoints, host_bytes=0)
    eng.prefill([BASE[:40], random_prompt(CONFIG_A, 40, seed=51).astype(np.int32)], d, ids=["hot", "cold"])
    store = KVStore(d, max_bytes=1, min_age_s=3600)
    assert store.scan() == 2 and store.retain() == []  # both younger than an hour: kept though over budget
    assert store.lookup(prefix_lib.block_hashes(BASE[:40], eng.prefix_identity(), BLOCK), BLOCK)[0] == "hot"
    for rid in ("hot", "cold"):  # both published two hours ago; "hot" was just used, "cold" an hour ago
        os.utime(os.path.join(d, os.readlink(os.path.join(d, rid)), "manifest.json"), (time.time() - 7200,) * 2)
    os.utime(os.path.join(d, os.readlink(os.path.join(d, "cold"))), (time.time() - 3600,) * 2)
    debris = os.path.join(d, ".tmp-0123456789abcdef-0.killed")
    os.makedirs(debris)
    os.utime(debris, (time.time() - 7200,) * 2)
    hot_bytes = sum(c["bytes"] for c in kv.read_manifest(os.path.join(d, "hot"))["checksums"].values())
    restarted = KVStore(d, max_bytes=hot_bytes, min_age_s=3600)  # room for one: the least recently used goes
    assert restarted.scan() == 2 and not os.path.exists(debris)
    assert restarted.retain() == ["cold"]
    assert sorted(os.listdir(d)) == sorted(["hot", os.readlink(os.path.join(d, "hot"))])


def test_retention_removes_least_recently_used_exports_but_not_one_in_use(checkpoints, tmp_path):
    d = str(tmp_path / "kv")
    eng = _engine(checkpoints, host_bytes=0)
    for i in range(4):
        eng.prefill([random_prompt(CONFIG_A, 30, seed=40 + i)], d, ids=[f"r{i}"])
    sizes = {r: sum(c["bytes"] for c in kv.read_manifest(os.path.join(d, r))["checksums"].values())
             for r in ("r0", "r1", "r2", "r3")}
    store = KVStore(d, max_bytes=sizes["r0"] + sizes["r2"] + sizes["r3"], min_age_s=0)  # room for three of four
    assert store.scan() == 4
    store.hold("r0")  # in use: kept even though it is the least recently used
    removed = store.retain()
    assert removed == ["r1"] and os.path.exists(os.path.join(d, "r0"))
    # concurrent readers while the store evicts: every read sees a whole export or none
    store.release("r0")
    errors = []

    outcomes = {"whole": 0, "gone": 0}

    def read():
        for _ in range(20):
            for r in ("r0", "r2", "r3"):
                try:
                    layers = kv.load(os.path.join(d, r))
                except kv.KVFormatError:
                    outcomes["gone"] += 1  # removed meanwhile: a miss, never a half-read export
                    continue
                except Exception as e:  # noqa: BLE001 - anything else is a fault
                    errors.append(e)
                    continue
                if sorted(layers) != list(range(CONFIG_A.num_hidden_layers)) or any(
                        lk.positions.size != 30 for lk in layers.values()):
                    errors.append(AssertionError(f"{r}: a partial export was read"))
                outcomes["whole"] += 1

    t = threading.Thread(target=read)
    t.start()
    store.max_bytes = 0
    store.retain()
    t.join()
    assert not errors and not [x for x in os.listdir(d) if not x.startswith(".")]
    assert outcomes["whole"] + outcomes["gone"] == 60  # every read ended whole or as a miss


def test_two_engines_sharing_a_kv_dir_see_each_others_exports(checkpoints, tmp_path):
    d = str(tmp_path / "kv")
    a, b = _engine(checkpoints, host_bytes=0), _engine(checkpoints, host_bytes=0)
    a.kv_store(d), b.kv_store(d)  # both indexes built before either exports
    a.prefill([BASE[:40]], d, ids=["from-a"])
    res = b.prefill([_prompt(45)], d, ids=["from-b"])[0]
    assert res.cached_tokens == 40  # b found a's export by refreshing its index
    for rid in ("from-a", "from-b"):
        kv.load(os.path.join(d, rid))  # both whole and verified
    # two publications in one tick of the file system's clock leave the directory's mtime unchanged: b, which listed
    # the directory at that mtime, must still see the second one
    tick = time.time_ns()
    os.utime(d, ns=(tick, tick))
    b.kv_store(d).refresh()
    other = random_prompt(CONFIG_A, 40, seed=61).astype(np.int32)
    a.prefill([other], d, ids=["same-tick"])
    os.utime(d, ns=(tick, tick))
    tail = random_prompt(CONFIG_A, 5, seed=62).astype(np.int32)
    assert b.prefill([np.concatenate([other, tail])], d, ids=["after"])[0].cached_tokens == 40


# Two processes x 4 CPU devices (ring 2 x Ulysses 4), as launch/local.sh runs them: process 0 picks the hit from the
# shared kv_dir, both read it, the suffix step runs over both processes, and the export is whole.
TWO_PROCESS_WORKER = r"""
import json, os, sys
import numpy as np
import jax
num, pid, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.distributed.initialize(f"127.0.0.1:{port}", num, pid, initialization_timeout=300)
from slope_jax.kv.prefix import ReuseOptions
from slope_jax.parallel.config import ParallelConfig
from slope_jax.serve.engine import PrefillEngine
spec = json.load(open(os.path.join(out, "spec.json")))
eng = PrefillEngine.from_checkpoint(spec["checkpoint"], ParallelConfig(ring=2, ulysses=4), dtype="float32",
                                    progress=False, reuse=ReuseOptions(block_size=16), q_tile=32, kv_tile=32,
                                    prefix_q_tile=16, prefix_kv_tile=24, moe_tile=32)
kv_dir = os.path.join(out, "kv")
eng.prefill([np.asarray(spec["doc"], np.int32)], kv_dir, ids=["doc"])
res = eng.prefill([np.asarray(spec["prompt"], np.int32)], kv_dir, ids=["turn"])[0]
if pid == 0:
    np.save(os.path.join(out, "logits.npy"), res.logits)
    json.dump({"cached_tokens": res.cached_tokens, "first_token": res.first_token},
              open(os.path.join(out, "result.json"), "w"))
"""


def test_hit_equals_cold_over_two_processes(tmp_path):
    import subprocess
    import sys

    from support import REPO, SHIPPED, free_port

    from slope_jax import xla_env

    doc = random_prompt(CONFIG_A, 70, seed=11).tolist()  # the shipped checkpoint's vocabulary is larger than A's
    prompt = doc[:64] + random_prompt(CONFIG_A, 37, seed=12).tolist()
    (tmp_path / "spec.json").write_text(json.dumps({"checkpoint": SHIPPED, "doc": doc, "prompt": prompt}))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(XLA_FLAGS=xla_env.xla_flags("", cpu_devices=4), JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    port = free_port()
    procs = [(i, subprocess.Popen([sys.executable, "-c", TWO_PROCESS_WORKER, "2", str(i), str(port), str(tmp_path)],
                                  cwd=REPO, env=env, stdout=open(tmp_path / f"p{i}.log", "w"),
                                  stderr=subprocess.STDOUT)) for i in (1, 0)]
    for i, p in procs:
        p.wait(timeout=900)
        assert p.returncode == 0, (tmp_path / f"p{i}.log").read_text()[-3000:]
    got = json.loads((tmp_path / "result.json").read_text())
    assert got["cached_tokens"] == 64
    one = PrefillEngine.from_checkpoint(SHIPPED, dtype="float32", progress=False, q_tile=32, kv_tile=32,
                                        moe_tile=32, reuse=prefix_lib.ReuseOptions(block_size=16))
    cold = one.prefill([prompt], prefix_reuse=False, return_kv=True)[0]
    assert got["first_token"] == cold.first_token
    assert np.abs(np.load(tmp_path / "logits.npy") - cold.logits).max() < TOL
    export = kv.load(str(tmp_path / "kv" / "turn"))
    for layer, lk in export.items():
        np.testing.assert_array_equal(lk.positions, np.arange(len(prompt)))
        assert np.abs(lk.k - cold.kv[layer].k).max() < TOL and np.abs(lk.v - cold.kv[layer].v).max() < TOL
    # a restart with another process count and layout (one process, one device) reuses what the two wrote
    longer = np.asarray(prompt + random_prompt(CONFIG_A, 23, seed=13).tolist(), np.int32)
    hit = one.prefill([longer], str(tmp_path / "kv"), ids=["restarted"])[0]
    assert hit.cached_tokens == 96  # the 101-token turn's six whole blocks of 16
    want = one.prefill([longer], prefix_reuse=False)[0]
    assert hit.first_token == want.first_token and np.abs(hit.logits - want.logits).max() < TOL


def test_launcher_reuses_prefixes_per_salt_and_reports_cached_tokens(tmp_path):
    """The launcher (one process, 1 CPU device) with requests served one batch at a time: a later turn reuses the
    first one's prefix (the record and the summary say how many tokens), a request with another cache_salt does not,
    and --noprefix_reuse turns it off."""
    import subprocess
    import sys

    from support import REPO, launcher_env

    doc = random_prompt(CONFIG_A, 70, seed=21).tolist()
    turn = doc[:64] + random_prompt(CONFIG_A, 20, seed=22).tolist()
    lines = [{"id": "doc", "tokens": doc}, {"id": "turn", "tokens": turn},
             {"id": "other-tenant", "tokens": turn, "cache_salt": "tenant-2"}]
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text("".join(json.dumps(x) + "\n" for x in lines))

    def run(tag, *extra):
        res = tmp_path / f"{tag}.jsonl"
        r = subprocess.run([sys.executable, "-m", "slope_jax.launch", "--cpu_devices=1", "--dtype=float32",
                            "--batch_size=1", "--prefix_block=16", f"--requests={reqs}", f"--results={res}",
                            f"--kv_dir={tmp_path / tag}", *extra], cwd=REPO, env=launcher_env(),
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return {x["id"]: x for x in map(json.loads, res.read_text().splitlines())}, r.stderr

    recs, err = run("on")
    assert [recs[i]["cached_tokens"] for i in ("doc", "turn", "other-tenant")] == [0, 64, 0]
    assert "238 prompt tokens (64 from the prefix cache)" in err, err[-2000:]
    off, _ = run("off", "--noprefix_reuse")
    assert [off[i]["cached_tokens"] for i in ("doc", "turn", "other-tenant")] == [0, 0, 0]
    assert recs["turn"]["first_token"] == off["turn"]["first_token"]
    assert kv.read_manifest(str(tmp_path / "off" / "doc"))["sliding_policy"] == "last_window"
    assert kv.read_manifest(str(tmp_path / "on" / "doc"))["sliding_policy"] == "full"


@pytest.mark.parametrize("parallel", [ParallelConfig(), ParallelConfig(ring=2, ulysses=2)], ids=["1dev", "cp-1x2x2"])
def test_a_window_of_one_reads_no_cached_key(tmp_path, parallel):
    """sliding_window=1 (a query sees only itself): a sliding layer reads none of the cached rows (W − 1 = 0), which
    made the prefix attention divide by a zero key tile (ZeroDivisionError for every hit of such a config). Hits
    inside, at and past a block edge equal the cold prompt."""
    import dataclasses

    from slope_jax.checkpoints import writer as checkpoint_writer

    cfg = dataclasses.replace(CONFIG_A, sliding_window=1)
    path = str(tmp_path / "w1")
    checkpoint_writer.write_hf(path, cfg, checkpoint_writer.random_params(cfg, seed=11), experts="mxfp4")
    devices = None
    if parallel.num_devices > 1:
        import jax

        devices = jax.devices()[:parallel.num_devices]
    hot, cold = (PrefillEngine.from_checkpoint(path, parallel, dtype="float32", progress=False, devices=devices,
                                               reuse=prefix_lib.ReuseOptions(block_size=BLOCK), **TILES)
                 for _ in range(2))
    hot.prefill([BASE[:40]])
    for n, cached in [(9, 8), (41, 40), (70, 40)]:
        _check(cold, hot, _prompt(n, n), cached)
