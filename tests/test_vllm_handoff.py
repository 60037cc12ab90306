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
