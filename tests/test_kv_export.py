"""KV export format, reader validation, reference decode continuation, and request validation."""

import json
import os

import numpy as np
import pytest
from conftest import CONFIG_A, TILES, random_prompt

from slope_jax import kv
from slope_jax.kv import decode
from slope_jax.parallel.config import ParallelConfig
from slope_jax.serve import requests as req_lib
from slope_jax.serve.engine import PrefillEngine
from slope_jax.serve.requests import RequestError

DECODE_TOL = 1e-4  # measured max |Δlogit| 1.3e-6 (float32)


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
    return prompts, ids, base, single, multi


def test_export_layout_and_manifest(exported):
    prompts, ids, base, single, _ = exported
    w = CONFIG_A.sliding_window
    for p, rid, res in zip(prompts, ids, single):
        path = base / "single" / rid
        assert res.kv_path == str(path)
        m = kv.read_manifest(str(path))
        assert m["num_tokens"] == len(p) and m["token_ids_sha256"] == kv.token_hash(p)
        assert m["axes"]["k"] == ["token", "kv_head", "head_dim"] and m["rope_applied"] is True
        assert m["model"]["fingerprint"] == CONFIG_A.fingerprint() and m["first_token"] == res.first_token
        loaded = kv.load(str(path))
        assert sorted(loaded) == list(range(CONFIG_A.num_hidden_layers))
        for layer, lk in loaded.items():
            start = max(0, len(p) - w) if CONFIG_A.is_sliding(layer) else 0  # sliding layers keep the last W
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
            assert np.abs(ka[layer].k - kb[layer].k).max() < 1e-5
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
    shutil.copytree(base / "pp_cp" / rid, dst)
    with open(dst / "manifest.json") as f:
        return dst, json.load(f)


def _write(dst, manifest):
    with open(dst / "manifest.json", "w") as f:
        json.dump(manifest, f)


def test_reader_rejects_length_mismatch(exported, tmp_path):
    dst, m = _export_copy(exported, tmp_path)
    seg = m["layers"][1]["segments"][0]
    seg["end"] += 1  # the manifest now claims one more token than the tensor holds
    _write(dst, m)
    with pytest.raises(kv.KVFormatError, match=r"layer 1 k tensor .* has shape \[\d+, 4, 12\], the manifest declares"):
        kv.load(str(dst))


def test_reader_rejects_missing_layer(exported, tmp_path):
    dst, m = _export_copy(exported, tmp_path)
    m["layers"] = [rec for rec in m["layers"] if rec["layer"] != 2]
    _write(dst, m)
    with pytest.raises(kv.KVFormatError, match=r"layer\(s\) \[2\] missing from the manifest"):
        kv.load(str(dst))


def test_reader_rejects_undeclared_layout(exported, tmp_path):
    dst, m = _export_copy(exported, tmp_path)
    del m["axes"]
    _write(dst, m)
    with pytest.raises(kv.KVFormatError, match="undeclared or unknown layout"):
        kv.load(str(dst))
    m["axes"] = {"k": ["kv_head", "token", "head_dim"], "v": ["kv_head", "token", "head_dim"], "positions": ["token"]}
    _write(dst, m)
    with pytest.raises(kv.KVFormatError, match="undeclared or unknown layout"):
        kv.load(str(dst))


def test_reader_rejects_gaps_and_missing_files(exported, tmp_path):
    dst, m = _export_copy(exported, tmp_path)
    m["layers"][3]["segments"] = m["layers"][3]["segments"][1:]
    _write(dst, m)
    with pytest.raises(kv.KVFormatError, match="layer 3 tokens .* are not covered"):
        kv.load(str(dst))
    dst2, m2 = _export_copy(exported, tmp_path / "b")
    os.remove(dst2 / m2["files"][-1])
    with pytest.raises(kv.KVFormatError, match="which does not exist"):
        kv.load(str(dst2))
    os.remove(dst2 / "manifest.json")
    with pytest.raises(kv.KVFormatError, match="no manifest.json"):
        kv.load(str(dst2))


def test_export_files_are_atomic(reference_engines, tmp_path, monkeypatch):
    """A failure while writing leaves no manifest and no partial file under its final name."""
    from safetensors import numpy as st_numpy

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(st_numpy, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        reference_engines["A"].prefill([random_prompt(CONFIG_A, 12, seed=2)], str(tmp_path), ids=["r"])
    assert os.listdir(tmp_path / "r") == []


# ------------------------------------------------------------------------------------------------ requests
@pytest.mark.parametrize("line,match", [
    ("{not json", "line 7: not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"tokens": [1]}', "missing field 'id'"),
    ('{"id": "../x", "tokens": [1]}', "may only use letters"),
    ('{"id": ".hidden", "tokens": [1]}', "must not start with '.'"),
    ('{"id": "a", "tokens": []}', "the prompt is empty"),
    ('{"id": "a", "tokens": [1, 448]}', r"token id 448 at index 1 is outside the vocabulary \[0, 448\)"),
    ('{"id": "a", "tokens": [1, true]}', "'tokens' must be a list of integers"),
    ('{"id": "a", "tokens": [1], "text": "x"}', "exactly one of 'tokens' or 'text'"),
    ('{"id": "a", "text": "hello"}', "needs a tokenizer"),
    ('{"id": "a", "tokens": [1], "ttft_slo_ms": -5}', "'ttft_slo_ms' must be a positive number"),
    ('{"id": "a", "tokens": [1], "temperature": 0}', r"unknown field\(s\) \['temperature'\]"),
    ('{"id": "a", "tokens": [1, 2, 3, 4, 5, 6]}', r"6 tokens exceeds the limit of 5 \(--max_tokens\)"),
])
def test_bad_request_lines(line, match):
    with pytest.raises(RequestError, match=match):
        req_lib.parse(line, 7, vocab_size=CONFIG_A.vocab_size, max_tokens=5)


def test_duplicate_ids_and_text_requests():
    from conftest import SHIPPED
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(SHIPPED, "tokenizer.json"))
    seen = set()
    r = req_lib.parse('{"id": "t", "text": "It was the best of times"}', 1, vocab_size=1024, max_tokens=100,
                      tokenizer=tok, seen_ids=seen)
    assert r.tokens.tolist() == tok.encode("It was the best of times").ids and r.ttft_slo_ms is None
    with pytest.raises(RequestError, match="duplicate id 't'"):
        req_lib.parse('{"id": "t", "tokens": [1]}', 2, vocab_size=1024, max_tokens=100, seen_ids=seen)
