"""KV export format, reader validation, reference decode continuation, and request validation."""

import json
import os

import numpy as np
import pytest
from support import CONFIG_A, TILES, random_prompt

from slope_jax import kv
from slope_jax.kv import decode
from slope_jax.kv import format as kvfmt
from slope_jax.parallel.config import ParallelConfig
from slope_jax.serve import requests as req_lib
from slope_jax.serve.engine import PrefillEngine
from slope_jax.serve.requests import RequestError

DECODE_TOL = 1e-5  # measured max |Δlogit| 1.6e-6 (float32, both exports, all lengths)


@pytest.fixture(scope="module")
def exported(checkpoints, reference_engines, tmp_path_factory):
    """Prompts of lengths 1, W−1, W, W+1, 3W+2 exported by the single-device engine and by a (2, 2, 2) layout."""
    w = CONFIG_A.sliding_window
    prompts = [random_prompt(CONFIG_A, n, seed=300 + n) for n in (1, w - 1, w, w + 1, 3 * w + 2)]
    ids = [f"len-{len(p)}" for p in prompts]
    base = tmp_path_factory.mktemp("kv")
    single = reference_engines["A"].prefill(prompts, str(base / "single"), ids=ids, return_kv=True)
    par = PrefillEngine.from_checkpoint(checkpoints["A"]["mxfp4"], ParallelConfig(pipeline=2, ring=2, ulysses=2),
                                        dtype="float32", progress=False, **TILES)
    multi = par.prefill(prompts, str(base / "pp_cp"), ids=ids)
    par.prefill(prompts, str(base / "pp_cp_last_window"), ids=ids, prefix_reuse=False)  # for the tamper tests
    return prompts, ids, base, single, multi


def test_export_layout_and_manifest(exported):
    prompts, ids, base, single, _ = exported
    for p, rid, res in zip(prompts, ids, single):
        path = base / "single" / rid
        assert res.kv_path == str(path)
        m = kv.read_manifest(str(path))
        assert m["num_tokens"] == len(p) and m["token_ids_sha256"] == kv.token_hash(p)
        assert m["axes"]["k"] == ["token", "kv_head", "head_dim"] and m["rope_applied"] is True
        assert m["model"]["fingerprint"] == CONFIG_A.fingerprint() and m["first_token"] == res.first_token
        # prefix reuse is on by default, so sliding layers keep every token (a later prompt may reuse this export
        # from any block boundary); the last_window policy is the default with prefix_reuse=False (test below)
        assert m["sliding_policy"] == "full" and m["prefix"]["block_size"] == 128
        assert len(m["prefix"]["hashes"]) == len(p) // 128
        loaded = kv.load(str(path))
        assert sorted(loaded) == list(range(CONFIG_A.num_hidden_layers))
        for layer, lk in loaded.items():
            start = 0
            np.testing.assert_array_equal(lk.positions, np.arange(start, len(p)))
            np.testing.assert_array_equal(lk.k, res.kv[layer].k[start:])
            np.testing.assert_array_equal(lk.v, res.kv[layer].v[start:])
            assert lk.kind == CONFIG_A.layer_types[layer]


def test_parallel_export_matches_single_device(exported):
    prompts, ids, base, single, multi = exported
    for rid, a, b in zip(ids, single, multi):
        ka, kb = kv.load(str(base / "single" / rid)), kv.load(str(base / "pp_cp" / rid))
        assert a.first_token == b.first_token
        for layer in ka:
            np.testing.assert_array_equal(ka[layer].positions, kb[layer].positions)
            assert np.abs(ka[layer].k - kb[layer].k).max() < 1e-5  # measured max 1.9e-6
            assert np.abs(ka[layer].v - kb[layer].v).max() < 1e-5


def test_decode_continuation_equals_full_forward(exported, reference_engines, checkpoints):
    """Exported KV + first token → next-token logits == a full forward over prompt + first token."""
    prompts, ids, base, single, _ = exported
    eng = reference_engines["A"]
    for p, rid, res in zip(prompts, ids, single):
        for path in (base / "single" / rid, base / "pp_cp" / rid):
            cache = kv.load(str(path))
            logits = decode.decode_step(CONFIG_A, eng.params, cache, res.first_token, len(p))
            full = eng.prefill([np.concatenate([p, [res.first_token]])])[0].logits
            assert np.abs(logits - full).max() < DECODE_TOL, (rid, str(path))


def test_without_prefix_reuse_sliding_layers_keep_the_last_window(reference_engines, tmp_path):
    """`last_window` (the default with prefix reuse off): sliding layers keep the last W tokens and the rows back to
    the block boundary at or before n−W for every block size ≤ VLLM_BLOCK_MAX (128): [max(0, n−W−127), n)."""
    w, cover = CONFIG_A.sliding_window, kvfmt.VLLM_BLOCK_MAX
    prompts = [random_prompt(CONFIG_A, n, seed=2) for n in (3 * w + 2, 200)]
    out = reference_engines["A"].prefill(prompts, str(tmp_path), ids=["x", "y"], prefix_reuse=False, return_kv=True)
    for p, res in zip(prompts, out):
        n = len(p)
        m = kv.read_manifest(res.kv_path)
        # not indexed for reuse (no block hashes), but the identity the decode side checks cache_salt and weights
        assert m["sliding_policy"] == "last_window" and m["prefix"]["hashes"] == []
        assert len(m["prefix"]["identity"]) == 32
        sf = max(0, n - w - (cover - 1))
        assert m["sliding_from"] == sf == (0 if n == 3 * w + 2 else 200 - w - 127)
        # every block size's boundary at or before n−W is kept: vLLM with prefix caching on fills that block whole
        assert all((n - w) // b * b >= sf for b in range(1, cover + 1))
        for layer, lk in kv.load(res.kv_path).items():
            start = sf if CONFIG_A.is_sliding(layer) else 0
            np.testing.assert_array_equal(lk.positions, np.arange(start, n))
            np.testing.assert_array_equal(lk.k, res.kv[layer].k[start:])


def test_last_window_export_of_a_prefix_hit(reference_engines, tmp_path):
    """A prefix hit exported with kv_full=False: its sliding layers' rows [n−W−127, p) come from the reused prefix
    (host tier) and equal a cold prefill's; the exporter raises `sliding_from` to the first row a reused prefix
    holds when that prefix came from a `last_window` export that kept fewer rows (also for an export asked whole)."""
    from slope_jax.kv.exporter import KVExporter
    from slope_jax.kv.prefix import PrefixKV

    eng, w = reference_engines["A"], CONFIG_A.sliding_window
    base = random_prompt(CONFIG_A, 300, seed=41)
    prompt = np.concatenate([base[:256], random_prompt(CONFIG_A, 50, seed=42)])
    eng.prefill([base], str(tmp_path / "first"), ids=["base"])
    res = eng.prefill([prompt], str(tmp_path / "hit"), ids=["hit"], kv_full=False)[0]
    assert res.cached_tokens == 256
    cold = eng.prefill([prompt], prefix_reuse=False, return_kv=True)[0]
    sf = len(prompt) - w - (kvfmt.VLLM_BLOCK_MAX - 1)
    assert kv.read_manifest(res.kv_path)["sliding_from"] == sf
    for layer, lk in kv.load(res.kv_path).items():
        start = sf if CONFIG_A.is_sliding(layer) else 0
        np.testing.assert_array_equal(lk.positions, np.arange(start, len(prompt)))
        assert np.abs(lk.k - cold.kv[layer].k[start:]).max() < 1e-5
    exporter = KVExporter(CONFIG_A, [], "float32", kv.new_run_nonce())
    sliding = [i for i in range(CONFIG_A.num_hidden_layers) if CONFIG_A.is_sliding(i)]
    held = PrefixKV(256, {}, {}, source="x", start={i: 240 for i in sliding})
    assert exporter.sliding_from(306, False, held) == 240
    # asked for whole (kv_full): the rows before 240 were never kept, so the export keeps sliding rows from 240 (and
    # is written as last_window); a prefix that held every row leaves a whole export whole
    assert exporter.sliding_from(306, True, held) == 240 and exporter.sliding_from(600, True, held) == 240
    assert exporter.sliding_from(306, True, PrefixKV(256, {}, {}, source="host")) == 0
    assert exporter.sliding_from(306, False, PrefixKV(256, {}, {}, source="host")) == sf
    assert exporter.sliding_from(600, False, held) == 600 - w - 127  # the reused rows lie before what is kept


def test_full_kv_export(reference_engines, tmp_path):
    p = random_prompt(CONFIG_A, 3 * CONFIG_A.sliding_window, seed=1)
    res = reference_engines["A"].prefill([p], str(tmp_path), ids=["x"], kv_full=True, return_kv=True)[0]
    loaded = kv.load(res.kv_path)
    assert kv.read_manifest(res.kv_path)["sliding_policy"] == "full"
    for layer in loaded:
        np.testing.assert_array_equal(loaded[layer].k, res.kv[layer].k)


def _export_copy(exported, tmp_path, rid="len-32"):
    import shutil

    _, _, base, _, _ = exported
    dst = tmp_path / rid
    shutil.copytree(base / "pp_cp_last_window" / rid, dst)  # last_window: token ranges depend on the window
    with open(dst / "manifest.json") as f:
        return dst, json.load(f)


def _write(dst, manifest):
    with open(dst / "manifest.json", "w") as f:
        json.dump(manifest, f)


def _swap_layer_types(m):
    m["model"]["layer_types"][:2] = m["model"]["layer_types"][1::-1]


def _flip_kind(m):
    m["layers"][1]["kind"] = "sliding_attention"


def _extra_file(m):
    m["files"].append("kv-p9.safetensors")
    m["checksums"]["kv-p9.safetensors"] = dict(m["checksums"]["kv-p0.safetensors"])


def _other_positions(m):
    segs = m["layers"][1]["segments"]
    segs[0]["positions"] = segs[1]["positions"]


def _flip_byte(dst, m):
    path = dst / m["files"][0]
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


# (tamper, regex the KVFormatError must match: it names the field). Manifest edits take the dict; file edits
# (marked by two arguments) take the export directory too.
TAMPERS = {
    "format": (lambda m: m.update(format="other.kv"), "format 'other.kv'"),
    "version": (lambda m: m.update(version=1), "version 1"),
    "axes": (lambda m: m["axes"].update(k=["kv_head", "token", "head_dim"]), "axes: undeclared or unknown layout"),
    "axes_missing": (lambda m: m.pop("axes"), "axes: undeclared or unknown layout"),
    "rope_applied": (lambda m: m.update(rope_applied=False), "rope_applied=False"),
    "request_id": (lambda m: m.update(request_id="len-33"), "request_id: 'len-33' does not name"),
    "num_tokens": (lambda m: m.update(num_tokens=33), r"token_range: .* num_tokens=33"),
    "num_tokens_type": (lambda m: m.update(num_tokens="32"), "num_tokens: '32' is not a positive integer"),
    "token_ids_sha256": (lambda m: m.update(token_ids_sha256="ABC"), "token_ids_sha256: 'ABC'"),
    "run_nonce": (lambda m: m.pop("run_nonce"), "run_nonce: None"),
    "first_token": (lambda m: m.update(first_token=-1), "first_token: -1"),
    "dtype": (lambda m: m.update(dtype="bfloat16"), "dtype: layer 0 k tensor .* is float32, the manifest declares"),
    "dtype_unknown": (lambda m: m.update(dtype="int8"), "dtype: 'int8'"),
    "sliding_policy": (lambda m: m.update(sliding_policy="full"), r"sliding_from: 0: .*'last_window' only"),
    "sliding_policy_alone": (lambda m: (m.update(sliding_policy="full"), m.pop("sliding_from"), m["layers"][0].update(
        token_range=[22, 32])), r"layers\[0\]\.token_range: .*sliding_policy='full'"),
    "sliding_from": (lambda m: m.update(sliding_from=23), r"sliding_from: 23: .*max\(0, n−W\) = 22"),
    "sliding_from_type": (lambda m: m.update(sliding_from="0"), r"sliding_from: '0': expected"),
    "sliding_from_range": (lambda m: m.update(sliding_from=5),
                           r"token_range: \[0, 32\], .*sliding_from=5 keeps \[5, 32\]"),
    # (the window decides no token range of this 32-token export: sliding layers keep all of it; the model check
    # catches it)
    "model.sliding_window": (lambda m: m["model"].update(sliding_window=11), r"model\.sliding_window: the export says "
                             "11, the model has 10"),
    "model.layer_types": (_swap_layer_types, r"layers\[0\]\.kind: 'sliding_attention', but model.layer_types"),
    "model.num_hidden_layers": (lambda m: m["model"].update(num_hidden_layers=5), "model.num_hidden_layers: 5"),
    "model.num_key_value_heads": (lambda m: m["model"].update(num_key_value_heads=2),
                                  r"declares \[\d+, 2, 12\] .*model.num_key_value_heads"),
    "model.head_dim": (lambda m: m["model"].update(head_dim=16), r"declares \[\d+, 4, 16\] .*model.head_dim"),
    "model.fingerprint": (lambda m: m["model"].update(fingerprint="0" * 16), "model.fingerprint: the export says"),
    "layers.kind": (_flip_kind, r"layers\[1\]\.kind: 'sliding_attention', but model.layer_types\[1\]"),
    "layers.missing": (lambda m: m.update(layers=[r for r in m["layers"] if r["layer"] != 2]),
                       r"layers: layer\(s\) \[2\] missing"),
    "layers.token_range": (lambda m: m["layers"][0].update(token_range=[22, 32]), r"layers\[0\]\.token_range"),
    "segments.gap": (lambda m: m["layers"][3].update(segments=m["layers"][3]["segments"][1:]),
                     r"layers\[3\]\.segments: layer 3 tokens \[0, …\) are not covered"),
    # a segment's tensors are named by its layer and range (`segment_name`): an edited range or a tensor of another
    # segment is caught by the name before any tensor is read
    "segments.end": (lambda m: m["layers"][1]["segments"][-1].update(end=33),
                     r"layers\[1\]\.segments: segment \[\d+, 33\) names tensor 'layer\.1\.k\.\d+-32' for k"),
    "segments.positions": (_other_positions, r"layers\[1\]\.segments: segment \[\d+, \d+\) names tensor "
                                             r"'layer\.1\.positions\.[\d-]+' for positions"),
    "files": (_extra_file, r"files: lists \['kv-p9.safetensors'\], which no segment uses"),
    "checksums.xxh3_128": (lambda m: m["checksums"]["kv-p0.safetensors"].update(xxh3_128="0" * 32),
                           r"checksums.kv-p0.safetensors.xxh3_128: the file's XXH3-128 differs"),
    "checksums.digest": (lambda m: m["checksums"]["kv-p0.safetensors"].pop("xxh3_128"),
                         r"checksums.kv-p0.safetensors: .* has no file digest \(xxh3_128 or sha256\)"),
    "checksums.bytes": (lambda m: m["checksums"]["kv-p0.safetensors"].update(bytes=5),
                        r"checksums.kv-p0.safetensors.bytes: the file has \d+ bytes, the manifest records 5"),
    "file_content": (_flip_byte, r"checksums.kv-p0.safetensors.xxh3_128: the file's XXH3-128 differs"),
}


@pytest.mark.parametrize("field", sorted(TAMPERS))
def test_reader_rejects_tampered_manifest(field, exported, tmp_path):
    """Every manifest field the reader relies on, edited alone in a copy of a (2, 2, 2) export, is a KVFormatError
    naming it."""
    dst, m = _export_copy(exported, tmp_path)
    kv.load(str(dst), CONFIG_A)  # the untouched copy loads
    tamper, match = TAMPERS[field]
    if tamper.__code__.co_argcount == 2:
        tamper(dst, m)
    else:
        tamper(m)
        _write(dst, m)
    with pytest.raises(kv.KVFormatError, match=match):  # self-consistency alone; the model only for its fingerprint
        kv.load(str(dst), CONFIG_A if field in ("model.fingerprint", "model.sliding_window") else None)


def test_older_exports_with_sha256_checksums_still_verify(exported, tmp_path):
    """Exports written before the file digest became XXH3-128 carry `sha256` per file: they load and verify the same
    (the data equal the XXH3 copy's), and a flipped byte is caught by the SHA-256."""
    import hashlib

    dst, m = _export_copy(exported, tmp_path)
    want = kv.load(str(dst), CONFIG_A)
    for name, entry in m["checksums"].items():
        entry.pop("xxh3_128")
        entry["sha256"] = hashlib.sha256((dst / name).read_bytes()).hexdigest()
    _write(dst, m)
    got = kv.load(str(dst), CONFIG_A, verify=True)
    assert sorted(got) == sorted(want)
    for layer in want:
        np.testing.assert_array_equal(got[layer].k, want[layer].k)
        np.testing.assert_array_equal(got[layer].v, want[layer].v)
    _flip_byte(dst, m)
    with pytest.raises(kv.KVFormatError, match=r"checksums.kv-p0.safetensors.sha256: the file's SHA-256 differs"):
        kv.load(str(dst), CONFIG_A)


def test_a_pointer_removed_while_it_is_resolved_reads_as_no_export(exported, monkeypatch):
    """Retention or an overwrite can remove `<kv_dir>/<id>` between realpath's lstat and its readlink: the reader
    gets KVFormatError (no such export, a miss), never a bare FileNotFoundError (seen under concurrent eviction)."""
    def gone(path, *a, **k):
        raise FileNotFoundError(2, "No such file or directory", path)

    monkeypatch.setattr(os.path, "realpath", gone)
    with pytest.raises(kv.KVFormatError, match="no such export"):
        kv.load(str(exported))


def test_reader_rejects_missing_files(exported, tmp_path):
    dst, m = _export_copy(exported, tmp_path)
    os.remove(dst / m["files"][-1])
    with pytest.raises(kv.KVFormatError, match="which does not exist"):
        kv.load(str(dst))
    os.remove(dst / "manifest.json")
    with pytest.raises(kv.KVFormatError, match="no manifest.json"):
        kv.load(str(dst))


def test_export_files_are_atomic(reference_engines, tmp_path, monkeypatch):
    """A failure while writing leaves no export under the request's name."""
    from safetensors import numpy as st_numpy

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(st_numpy, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        reference_engines["A"].prefill([random_prompt(CONFIG_A, 12, seed=2)], str(tmp_path), ids=["r"])
    assert not (tmp_path / "r").exists()
    assert all(name.startswith(".tmp-") for name in os.listdir(tmp_path))


class _Crash(BaseException):
    """Stands for a kill: BaseException, so no `except Exception` on the way out runs."""


def _export_state(path, expected):
    """'old', 'new' or 'none' — and a complete, unmixed export when not 'none'."""
    try:
        loaded = kv.load(str(path), CONFIG_A)
    except kv.KVFormatError as e:
        assert "no manifest.json" in str(e), e
        return "none"
    m = kv.read_manifest(str(path))
    for name, (prompt, res) in expected.items():
        if m["token_ids_sha256"] == kv.token_hash(prompt):
            assert sorted(loaded) == list(range(CONFIG_A.num_hidden_layers))
            for layer, lk in loaded.items():  # every tensor from that export: never a mix
                start = lk.positions[0]
                np.testing.assert_array_equal(lk.k, res.kv[layer].k[start:])
                np.testing.assert_array_equal(lk.v, res.kv[layer].v[start:])
            return name
    raise AssertionError(f"export of unknown tokens {m['token_ids_sha256']}")


@pytest.mark.parametrize("point,after", [("shard_written", "old"), ("manifest_written", "old"),
                                         ("version_ready", "old"), ("pointer_replaced", "new")])
def test_crash_during_overwrite_leaves_old_new_or_none(point, after, reference_engines, tmp_path, monkeypatch):
    """Re-export an existing id (overwrite=True) and crash at each commit point: the export under the id is the
    complete old one or the complete new one (format 3: a pointer replaced by rename(2)); the next export of that id
    removes the leftovers."""
    from slope_jax.kv import format as kvfmt

    eng = reference_engines["A"]
    old_p, new_p = random_prompt(CONFIG_A, 23, seed=11), random_prompt(CONFIG_A, 17, seed=12)
    old = eng.prefill([old_p], str(tmp_path), ids=["x"], return_kv=True)[0]
    new = eng.prefill([new_p], str(tmp_path / "ref"), ids=["x"], return_kv=True)[0]

    def crash(where):
        if where == point:
            raise _Crash(where)

    monkeypatch.setattr(kvfmt, "_crash_point", crash)
    with pytest.raises(_Crash):
        eng.prefill([new_p], str(tmp_path), ids=["x"], overwrite=True)
    monkeypatch.setattr(kvfmt, "_crash_point", None)
    assert _export_state(tmp_path / "x", {"old": (old_p, old), "new": (new_p, new)}) == after
    assert len(os.listdir(tmp_path)) > 3  # the crash left debris (or a superseded version) beside ref, x, x's version
    monkeypatch.setattr(kvfmt, "GC_GRACE_S", 0.0)  # superseded versions are kept for readers this long
    eng.prefill([new_p], str(tmp_path), ids=["x"], overwrite=True)
    assert _export_state(tmp_path / "x", {"new": (new_p, new)}) == "new"
    version = os.readlink(tmp_path / "x")
    assert sorted(os.listdir(tmp_path)) == sorted(["ref", "x", version])  # leftovers cleaned up


def test_existing_export_is_refused_or_replaced_whole(reference_engines, tmp_path):
    """Without overwrite an existing id is a RequestError and the old export is untouched; with overwrite the new
    export holds exactly its own files (a kv-p1 of an older 2-process run does not survive into it)."""
    import shutil

    eng = reference_engines["A"]
    a, b = random_prompt(CONFIG_A, 15, seed=21), random_prompt(CONFIG_A, 26, seed=22)
    eng.prefill([a], str(tmp_path), ids=["y"])
    shutil.copy(tmp_path / "y" / "kv-p0.safetensors", tmp_path / "y" / "kv-p1.safetensors")  # older run's file
    with pytest.raises(RequestError, match=r"prompt 0: KV export '.*/y' already exists: pass overwrite=True"):
        eng.prefill([b], str(tmp_path), ids=["y"])
    assert kv.read_manifest(str(tmp_path / "y"))["token_ids_sha256"] == kv.token_hash(a)
    eng.prefill([b], str(tmp_path), ids=["y"], overwrite=True)
    m = kv.read_manifest(str(tmp_path / "y"))
    assert m["token_ids_sha256"] == kv.token_hash(b) and m["files"] == ["kv-p0.safetensors"]
    assert sorted(os.listdir(tmp_path / "y")) == ["kv-p0.safetensors", "manifest.json"]
    assert os.path.islink(tmp_path / "y") and os.readlink(tmp_path / "y").startswith(".v-")  # format 3: a pointer
    kv.load(str(tmp_path / "y"), CONFIG_A)


_NO_JAX_READER = r"""
import sys
sys.modules["jax"] = None  # any `import jax` now raises ImportError
import numpy as np
from slope_jax import kv
want = np.load(sys.argv[2])
cache = kv.load(sys.argv[1])
import ml_dtypes
for layer, lk in cache.items():
    assert lk.k.dtype == ml_dtypes.bfloat16 and lk.positions.dtype == np.int32, (lk.k.dtype, lk.positions.dtype)
    np.testing.assert_array_equal(lk.k.astype(np.float32), want[f"k{layer}"])
    np.testing.assert_array_equal(lk.v.astype(np.float32), want[f"v{layer}"])
import torch
cache = kv.load(sys.argv[1], framework="pt")
for layer, lk in cache.items():
    assert lk.k.dtype == torch.bfloat16, lk.k.dtype
    np.testing.assert_array_equal(lk.k.float().numpy(), want[f"k{layer}"])
    np.testing.assert_array_equal(lk.v.float().numpy(), want[f"v{layer}"])
assert "jax" not in [m.split(".")[0] for m, mod in sys.modules.items() if mod is not None]
print("read", len(cache), "layers without jax")
"""


def test_bf16_export_reads_without_jax(tmp_path):
    """A bf16 export (written with the format's own writer) loads in a process where importing jax fails: through
    numpy (ml_dtypes.bfloat16) and through torch (torch.bfloat16), bit-exact."""
    import subprocess
    import sys

    import ml_dtypes

    n, w = 23, CONFIG_A.sliding_window
    rng = np.random.default_rng(0)
    kvs = {layer: [rng.standard_normal((n, CONFIG_A.num_key_value_heads, CONFIG_A.head_dim)).astype(
        ml_dtypes.bfloat16) for _ in range(2)] for layer in range(CONFIG_A.num_hidden_layers)}
    staging = kv.staging_dir(str(tmp_path), "bf", kv.new_run_nonce(), 0)
    segs, want = [], {}
    for layer, (k, v) in kvs.items():
        start, end = kv.kept_range(n, CONFIG_A.layer_types[layer], w, False)
        for a, b in ((start, (start + end) // 2), ((start + end) // 2, end)):  # two segments per layer
            segs.append((layer, a, b, k[a:b], v[a:b]))
        want[f"k{layer}"], want[f"v{layer}"] = k[start:].astype(np.float32), v[start:].astype(np.float32)
    name, records = kv.write_shard_file(staging, 0, segs)
    kv.write_manifest(staging, request_id="bf", token_ids=np.arange(n), cfg=CONFIG_A, dtype="bfloat16", full=False,
                      segments=records, files=[name])
    path = kv.publish(str(tmp_path), "bf", staging, overwrite=False)
    np.savez(tmp_path / "want.npz", **want)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo)
    out = subprocess.run([sys.executable, "-c", _NO_JAX_READER, path, str(tmp_path / "want.npz")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"read {CONFIG_A.num_hidden_layers} layers without jax" in out.stdout


# ------------------------------------------------------------------------------------------------ requests
@pytest.mark.parametrize("line,match", [
    ("{not json", "line 7: not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"tokens": [1]}', "missing field 'id'"),
    ('{"id": "../x", "tokens": [1]}', "may only use letters"),
    ('{"id": ".hidden", "tokens": [1]}', "must not start with '.'"),
    ('{"id": "a", "tokens": []}', "the prompt is empty"),
    ('{"id": "a", "tokens": [1, 448]}', r"token id 448 at index 1 is outside the vocabulary \[0, 448\)"),
    ('{"id": "a", "tokens": [1, true]}', r"'tokens'\[1\] is True \(bool\); token ids must be integers"),
    ('{"id": "a", "tokens": [1], "text": "x"}', "exactly one of 'tokens' or 'text'"),
    ('{"id": "a", "text": "hello"}', "needs a tokenizer"),
    ('{"id": "a", "tokens": [1], "ttft_slo_ms": -5}', "'ttft_slo_ms' must be a finite number > 0, got -5"),
    ('{"id": "a", "tokens": [1], "temperature": 0}', r"unknown field\(s\) \['temperature'\]"),
    ('{"id": "a", "tokens": [1, 2, 3, 4, 5, 6]}', r"6 tokens exceeds the limit of 5 \(--max_tokens\)"),
])
def test_bad_request_lines(line, match):
    with pytest.raises(RequestError, match=match):
        req_lib.parse(line, 7, vocab_size=CONFIG_A.vocab_size, max_tokens=5)


def test_duplicate_ids_and_text_requests():
    from support import SHIPPED
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(SHIPPED, "tokenizer.json"))
    seen = set()
    r = req_lib.parse('{"id": "t", "text": "It was the best of times"}', 1, vocab_size=1024, max_tokens=100,
                      tokenizer=tok, seen_ids=seen)
    assert r.tokens.tolist() == tok.encode("It was the best of times").ids and r.ttft_slo_ms is None
    with pytest.raises(RequestError, match="duplicate id 't'"):
        req_lib.parse('{"id": "t", "tokens": [1]}', 2, vocab_size=1024, max_tokens=100, seen_ids=seen)


# ------------------------------------------------------------------------------------------------ concurrency
_RACE_WRITER = r"""
import sys, time
import numpy as np
from slope_jax import kv
kv_dir, seed, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = kv.model_config(sys.argv[4])
nonce, raw = kv.new_run_nonce(), 0
for i in range(rounds):
    n = 3 + (7 * seed + i) % 29  # every export its own length and values: a mixed read cannot go unnoticed
    tokens = np.full(n, 100 * seed + i, np.int32)
    segs = []
    for layer in range(cfg.num_hidden_layers):
        a, b = kv.kept_range(n, cfg.layer_types[layer], cfg.sliding_window, False)
        k = np.full((b - a, cfg.num_key_value_heads, cfg.head_dim), 100 * seed + i, np.float32)
        segs.append((layer, a, b, k, -k))
    staging = kv.staging_dir(kv_dir, "same", nonce, i)
    try:
        name, records = kv.write_shard_file(staging, 0, segs)
        kv.write_manifest(staging, request_id="same", token_ids=tokens, cfg=cfg, dtype="float32", full=False,
                          segments=records, files=[name], run_nonce=nonce)
        kv.publish(kv_dir, "same", staging, overwrite=True)
    except Exception as e:
        raw += 1
        print("RAW", type(e).__name__, e, flush=True)
print("WRITER_DONE raw", raw, flush=True)
"""

_RACE_READER = r"""
import os, sys, time
import numpy as np
from slope_jax import kv
kv_dir, stop = sys.argv[1], sys.argv[2]
path = os.path.join(kv_dir, "same")
loads = partial = raw = 0
while not os.path.exists(stop):
    if not os.path.lexists(path):
        continue  # before the first publication: no export, nothing to read
    try:
        cache = kv.load(path)
        m = kv.read_manifest(path)
    except kv.KVFormatError as e:
        partial += 1
        print("PARTIAL", e, flush=True)
        continue
    except Exception as e:
        raw += 1
        print("RAW", type(e).__name__, e, flush=True)
        continue
    values = {float(lk.k.flat[0]) for lk in cache.values() if lk.k.size}
    values |= {-float(lk.v.flat[0]) for lk in cache.values() if lk.v.size}
    if len(values) != 1 or any(not np.all(lk.k == lk.k.flat[0]) for lk in cache.values() if lk.k.size):
        partial += 1  # tensors of two exports in one read
        print("MIXED", values, flush=True)
    loads += 1
print("READER_DONE loads", loads, "partial", partial, "raw", raw, flush=True)
"""


def test_concurrent_overwrites_publish_whole_exports(tmp_path):
    """Two writer processes each overwrite one id 40 times while a reader process loads it in a loop: no writer
    gets a raw error, the reader never sees a partial or mixed export, and the final export is valid."""
    import re
    import subprocess
    import sys

    from support import REPO, SHIPPED

    env = dict(os.environ, PYTHONPATH=REPO)
    kv_dir, stop = str(tmp_path / "kv"), str(tmp_path / "stop")
    os.makedirs(kv_dir)
    reader = subprocess.Popen([sys.executable, "-c", _RACE_READER, kv_dir, stop], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    writers = [subprocess.Popen([sys.executable, "-c", _RACE_WRITER, kv_dir, str(seed), "40", SHIPPED], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for seed in (1, 2)]
    outs = [w.communicate(timeout=300)[0] for w in writers]
    open(stop, "w").close()
    read_out = reader.communicate(timeout=120)[0]
    for w, out in zip(writers, outs):
        assert w.returncode == 0 and "WRITER_DONE raw 0" in out, out[-3000:]
    m = re.search(r"READER_DONE loads (\d+) partial (\d+) raw (\d+)", read_out)
    assert reader.returncode == 0 and m, read_out[-3000:]
    loads, partial, raw = map(int, m.groups())
    assert partial == 0 and raw == 0 and loads > 0, read_out[-3000:]
    cfg = kv.model_config(SHIPPED)
    final = kv.load(os.path.join(kv_dir, "same"), cfg)
    assert sorted(final) == list(range(cfg.num_hidden_layers))
    assert kv.read_manifest(os.path.join(kv_dir, "same"))["request_id"] == "same"
    # what remains: the pointer, its version, superseded versions within their grace period; no staging debris
    left = [n for n in os.listdir(kv_dir) if n != "same"]
    assert all(n.startswith(".v-") for n in left), left


def _stage(kv_dir, rid, nonce, counter, value):
    """A complete staged export of CONFIG_A (n = 13 tokens, every K = value, V = −value) via the format's writer."""
    n = 13
    segs = []
    for layer in range(CONFIG_A.num_hidden_layers):
        a, b = kv.kept_range(n, CONFIG_A.layer_types[layer], CONFIG_A.sliding_window, False)
        k = np.full((b - a, CONFIG_A.num_key_value_heads, CONFIG_A.head_dim), value, np.float32)
        segs.append((layer, a, b, k, -k))
    staging = kv.staging_dir(str(kv_dir), rid, nonce, counter)
    name, records = kv.write_shard_file(staging, 0, segs)
    kv.write_manifest(staging, request_id=rid, token_ids=np.full(n, value, np.int32), cfg=CONFIG_A, dtype="float32",
                      full=False, segments=records, files=[name], run_nonce=nonce)
    return staging


def test_publish_without_overwrite_loser_and_version_2_exports(tmp_path):
    """Without overwrite the second publisher of an id gets ExportExistsError (KVExistsError) and leaves nothing
    behind; a version-2 export (a plain directory) is read, and replaced by a pointer on overwrite."""
    import shutil

    n1, n2 = kv.new_run_nonce(), kv.new_run_nonce()
    path = kv.publish(str(tmp_path), "a", _stage(tmp_path, "a", n1, 0, 1.0), overwrite=False)
    with pytest.raises(kv.KVExistsError, match="already exists"):
        kv.publish(str(tmp_path), "a", _stage(tmp_path, "a", n2, 0, 2.0), overwrite=False)
    assert sorted(os.listdir(tmp_path)) == sorted(["a", os.readlink(path)])  # the loser's version is gone
    assert float(kv.load(path, CONFIG_A)[0].k.flat[0]) == 1.0
    # a version-2 export: the id is the directory itself
    shutil.copytree(kv.resolve(path), tmp_path / "old")
    m = json.load(open(tmp_path / "old" / "manifest.json"))
    m.update(request_id="old", version=2)
    json.dump(m, open(tmp_path / "old" / "manifest.json", "w"))
    assert float(kv.load(str(tmp_path / "old"), CONFIG_A)[1].k.flat[0]) == 1.0
    kv.publish(str(tmp_path), "old", _stage(tmp_path, "old", n2, 1, 3.0), overwrite=True)
    assert os.path.islink(tmp_path / "old") and float(kv.load(str(tmp_path / "old"))[1].k.flat[0]) == 3.0


def test_retention_removes_superseded_versions_its_removals_leave_without_a_pointer(reference_engines, tmp_path,
                                                                                    monkeypatch):
    """An id exported, overwritten, then removed by retention: its superseded version had no pointer left and was only
    ever collected by a later export of the same id — never, so the directory outgrew its byte budget. Retention now
    collects an id's versions when it removes the id, and sweeps versions no pointer names once per grace period."""
    from slope_jax.kv import format as kvfmt
    from slope_jax.kv.store import KVStore

    eng, d = reference_engines["A"], str(tmp_path)
    eng.prefill([random_prompt(CONFIG_A, 20, seed=31)], d, ids=["a"])
    eng.prefill([random_prompt(CONFIG_A, 21, seed=32)], d, ids=["a"], overwrite=True)
    eng.prefill([random_prompt(CONFIG_A, 22, seed=33)], d, ids=["b"])
    os.remove(os.path.join(d, "b"))  # b's pointer removed by hand: its version is an orphan too
    monkeypatch.setattr(kvfmt, "GC_GRACE_S", 0.0)
    store = KVStore(d, max_bytes=0, min_age_s=0)  # over budget: every export not in use goes
    store.scan()
    assert store.retain() == ["a"]
    assert os.listdir(d) == []  # a's two versions and b's orphaned version
