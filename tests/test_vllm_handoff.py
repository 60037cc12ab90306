"""What the vLLM connector does before it reports tokens, without vLLM (`slope_jax.kv.vllm_handoff`): a pinned file
export stays readable, whole, when the prefill removes it after validation (the `/v1/kv/release` race), a removed one
is refused (vLLM prefills); a NIXL hand-off record is validated from its manifest like a file export (prompt, model,
weights, dtype, layout) and refused naming the field."""

from __future__ import annotations

import base64
import copy
import os

import ml_dtypes
import numpy as np
import pytest
from support import CONFIG_A

from slope_jax.kv import format as kvfmt
from slope_jax.kv import nixl_transport as nt
from slope_jax.kv import vllm_handoff as handoff
from slope_jax.kv import vllm_plan as plan

N = 40
WEIGHTS = "ab" * 16
KW = dict(cfg=CONFIG_A, cache_dtype="float32", weights=WEIGHTS)


def _export(kv_dir, rid: str, n: int = N) -> str:
    """A bf16 export of CONFIG_A (last_window) recording WEIGHTS."""
    rng = np.random.default_rng(7)
    staging = kvfmt.staging_dir(str(kv_dir), rid, kvfmt.new_run_nonce(), 0)
    segs = []
    for layer in range(CONFIG_A.num_hidden_layers):
        start, end = kvfmt.kept_range(n, CONFIG_A.layer_types[layer], CONFIG_A.sliding_window, False)
        k, v = (rng.standard_normal((end - start, CONFIG_A.num_key_value_heads, CONFIG_A.head_dim), np.float32)
                .astype(ml_dtypes.bfloat16) for _ in range(2))
        segs.append((layer, start, end, k, v))
    name, records = kvfmt.write_shard_file(staging, 0, segs)
    kvfmt.write_manifest(staging, request_id=rid, token_ids=np.arange(n), cfg=CONFIG_A, dtype="bfloat16", full=False,
                         segments=records, files=[name], first_token=17, weights_digest=WEIGHTS)
    return kvfmt.publish(str(kv_dir), rid, staging, overwrite=False)


def _record(path: str) -> dict:
    """kv_transfer_params as `KVPool.publish_export` would return them (no pool: digests and address are dummies)."""
    kv = kvfmt.load(path)
    layers, dtype = nt._layer_layout(kv)
    for lay in layers:
        lay["xxh3_128"] = "00" * 16
    end = layers[-1]["offset"] + layers[-1]["nbytes"]
    m = nt.handoff_manifest(kvfmt.read_manifest(path))
    return {nt.PARAMS_KEY: {"protocol": nt.PROTOCOL, "request_id": m["request_id"], "entry": "e#1", "agent": "pool",
                            "agent_metadata": base64.b64encode(b"md").decode(), "address": 4096, "nbytes": end,
                            "dtype": dtype, "digest": "xxh3_128", "layers": layers, "lease_s": 60.0,
                            "manifest": m}}


def test_pinned_export_survives_its_removal(tmp_path):
    path = _export(tmp_path / "kv", "r1")
    params = {plan.PATH_KEY: path}
    export, how, pin = handoff.choose_pinned(params, np.arange(N), None, verify_checksums=False, **KW)
    assert how == f"kv_transfer_params.{plan.PATH_KEY}" and export.path == pin.dir
    want = {name: open(os.path.join(pin.source, name), "rb").read() for name in os.listdir(pin.source)}
    kvfmt.remove_tree(pin.source)  # what /v1/kv/release does, right after validation
    os.remove(path)
    assert not os.path.exists(pin.source)
    for name, data in want.items():  # the worker reads through the pin: the validated bytes, whole
        with open(os.path.join(export.path, name), "rb") as f:
            assert f.read() == data, name
    got = kvfmt.load(export.path)
    assert sorted(got) == list(range(CONFIG_A.num_hidden_layers))
    pin.close()
    assert not os.path.exists(pin.dir)
    pin.close()  # idempotent
    # removed before it was pinned: refused (vLLM prefills the request itself), never an error later
    with pytest.raises(plan.ExportRefused, match="cannot open the export"):
        handoff.choose_pinned(params, np.arange(N), None, verify_checksums=False, **KW)


def test_pinned_lookup_by_token_hash_skips_a_removed_export(tmp_path):
    kv_dir = tmp_path / "kv"
    _export(kv_dir, "a")
    index = plan.ExportIndex(str(kv_dir))
    index.refresh()
    export, how, pin = handoff.choose_pinned(None, np.arange(N), index, verify_checksums=False, **KW)
    assert "kv_dir index" in how and kvfmt.read_manifest(export.path)["request_id"] == "a"
    pin.close()
    kvfmt.remove_tree(kvfmt.resolve(str(kv_dir / "a")))
    os.remove(kv_dir / "a")
    export, how, pin = handoff.choose_pinned(None, np.arange(N), index, verify_checksums=False, **KW)
    assert export is None and pin is None and "no export of this prompt" in how


def test_nixl_record_is_validated_like_a_file_export(tmp_path):
    path = _export(tmp_path / "kv", "r2")
    params = {**_record(path), plan.FIRST_TOKEN_KEY: 17}
    assert len(params[nt.PARAMS_KEY]["manifest"]["layers"]) == CONFIG_A.num_hidden_layers
    export = handoff.validate_record(params, np.arange(N), **KW)
    file_export = plan.validate(path, np.arange(N), params=None, **KW)
    assert isinstance(export, handoff.NixlExport) and export.record is params[nt.PARAMS_KEY]
    assert (export.num_tokens, export.dtype, export.sliding_from) == (N, "bfloat16", file_export.sliding_from)
    assert export.path == "nixl:pool/e#1"

    def refused(change, prompt=np.arange(N), match="", **kw):
        p = copy.deepcopy(params)
        change(p[nt.PARAMS_KEY])
        with pytest.raises(plan.ExportRefused, match=match):
            handoff.validate_record(p, prompt, **{**KW, **kw})

    refused(lambda r: None, np.arange(N) + 1, "token_ids_sha256")
    refused(lambda r: None, np.arange(N - 1), "num_tokens")
    refused(lambda r: r["manifest"]["model"].update(weights_digest="cd" * 16), match="model.weights_digest")
    refused(lambda r: None, match="cache_salt", cache_salt="tenant-b")
    refused(lambda r: r.update(dtype="float16"), match="dtype")
    refused(lambda r: None, match="only exact", cache_dtype="float16")
    refused(lambda r: r["layers"][1].update(kind="sliding_attention" if r["layers"][1]["kind"] ==
                                            "full_attention" else "full_attention"), match="layer 1")
    refused(lambda r: r.pop("manifest"), match="manifest")
    refused(lambda r: r.update(protocol=99), match="protocol")
    refused(lambda r: r["layers"][0].update(nbytes=5), match=r"layers\[0\]")
    with pytest.raises(plan.ExportRefused, match="first_token"):
        handoff.validate_record({**params, plan.FIRST_TOKEN_KEY: 18}, np.arange(N), **KW)


def _composed(path: str) -> dict:
    """kv_transfer_params as a 2-process prefill answers (`nixl_transport.compose`): each layer's rows split in two,
    the first half in one pool's part, the second in another's (dummy digests and addresses, as `_record`)."""
    kv = kvfmt.load(path)
    parts = []
    for half in (0, 1):
        pieces = {}
        for layer, lkv in kv.items():
            a, b = int(lkv.positions[0]), int(lkv.positions[-1]) + 1
            lo, hi = (a, (a + b) // 2) if half == 0 else ((a + b) // 2, b)
            pieces[len(pieces)] = (layer, lo, hi, kvfmt.LayerKV(lkv.k[lo - a: hi - a], lkv.v[lo - a: hi - a],
                                                                np.arange(lo, hi, dtype=np.int32), lkv.kind))
        layers, dtype = nt._layer_layout({i: p[3] for i, p in pieces.items()})
        for lay in layers:
            lay["xxh3_128"] = "00" * 16
        parts.append({"protocol": nt.PROTOCOL, "request_id": f"key-{half}", "entry": f"e#{half}",
                      "agent": f"pool{half}", "agent_metadata": base64.b64encode(b"md").decode(), "address": 4096,
                      "nbytes": layers[-1]["offset"] + layers[-1]["nbytes"], "dtype": dtype, "digest": "xxh3_128",
                      "layers": layers, "lease_s": 60.0,
                      "manifest": {"pieces": [list(p[:3]) for p in pieces.values()]}})
    return nt.compose("r3", parts, nt.handoff_manifest(kvfmt.read_manifest(path)))


def test_composed_nixl_record_is_validated_like_one_pools(tmp_path):
    """A multi-process prefill's record (one part per process's pool, each layer in pieces) passes the same checks
    as one pool's, per piece, and its pieces must tile every layer's rows (checked before any READ)."""
    path = _export(tmp_path / "kv", "r3")
    params = {**_composed(path), plan.FIRST_TOKEN_KEY: 17}
    export = handoff.validate_record(params, np.arange(N), **KW)
    single = handoff.validate_record({**_record(path), plan.FIRST_TOKEN_KEY: 17}, np.arange(N), **KW)
    assert (export.num_tokens, export.dtype, export.sliding_from) == (single.num_tokens, single.dtype,
                                                                      single.sliding_from)
    assert export.path == "nixl:pool0/e#0 (+1 pool)" and export.record is params[nt.PARAMS_KEY]

    def refused(change, match):
        p = copy.deepcopy(params)
        change(p[nt.PARAMS_KEY])
        with pytest.raises(plan.ExportRefused, match=match):
            handoff.validate_record(p, np.arange(N), **KW)

    flip = {"full_attention": "sliding_attention", "sliding_attention": "full_attention"}
    refused(lambda r: r["parts"][1]["layers"][1].update(kind=flip[r["parts"][1]["layers"][1]["kind"]]), "layer 1")
    heads = CONFIG_A.num_key_value_heads * CONFIG_A.head_dim  # the same bytes per row as one head of all of them
    refused(lambda r: [lay.update(kv_heads=1, head_dim=heads) for lay in r["parts"][1]["layers"]],
            rf"layers\[0\]: 1 KV heads of {heads} in the record")
    refused(lambda r: (r["parts"][1]["layers"].pop(0), r["parts"][1]["manifest"]["pieces"].pop(0)),
            r"layer 0: pieces .* do not tile")
    refused(lambda r: r["parts"][0].update(protocol=nt.COMPOSED_PROTOCOL), r"parts\[0\]: a composed record cannot "
            "be a part")
    refused(lambda r: r.update(protocol=nt.PROTOCOL), r"slope_jax_nixl.entry: missing")  # parts of a single record
    refused(lambda r: r.update(nbytes=10), "nbytes")
    refused(lambda r: r.update(dtype="float32"), r"slope_jax_nixl.dtype: 'float32', its parts hold \['bfloat16'\]")
    refused(lambda r: r["manifest"]["model"].update(weights_digest="cd" * 16), "model.weights_digest")
