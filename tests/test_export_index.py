"""The vLLM connector's kv_dir lookup (`slope_jax.kv.vllm_plan.ExportIndex`) costs O(1) per request however many
exports the directory holds (issue 31 item 6: with 10,000 exports, re-reading every manifest on each miss stalled
vLLM's scheduler 3.5 s per request). 2,000 published exports (a real one, and manifest-only copies of it naming
other token hashes): after the first listing, a miss reads no manifest and takes well under 50 ms; a new
publication, a re-export of an id and a removal are each seen at the next lookup by reading one manifest (or none)."""

import json
import os
import shutil
import time

import numpy as np
from support import REPO

from slope_jax.kv import format as kvfmt
from slope_jax.kv import vllm_plan as plan
from slope_jax.model.config import ModelConfig

CFG = ModelConfig.from_json(os.path.join(REPO, "checkpoints", "tiny-gpt-oss-hd64", "config.json"))
NONCE = "0123456789abcdef"
N_EXPORTS = 2000


def _real_export(kv_dir: str, rid: str, tokens: np.ndarray) -> str:
    """A complete export of random KV for `tokens` (every layer kept in full), published like the engine does."""
    staging = kvfmt.staging_dir(kv_dir, rid, NONCE, 0)
    rng = np.random.default_rng(0)
    n, k, h = len(tokens), CFG.num_key_value_heads, CFG.head_dim
    segments = [(layer, 0, n, rng.normal(size=(n, k, h)).astype(np.float32),
                 rng.normal(size=(n, k, h)).astype(np.float32)) for layer in range(CFG.num_hidden_layers)]
    name, records = kvfmt.write_shard_file(staging, 0, segments, token_ids=tokens)
    kvfmt.write_manifest(staging, request_id=rid, token_ids=tokens, cfg=CFG, dtype="float32", full=True,
                         segments=records, files=[name], run_nonce=NONCE)
    return kvfmt.publish(kv_dir, rid, staging, overwrite=False)


def _fake_export(kv_dir: str, rid: str, manifest: dict, token_hash: str, counter: int, overwrite=False) -> str:
    """A manifest-only export (the index reads manifests only) naming `token_hash`, published atomically."""
    staging = kvfmt.staging_dir(kv_dir, rid, NONCE, counter)
    os.mkdir(staging)
    with open(os.path.join(staging, kvfmt.MANIFEST), "w") as f:
        json.dump({**manifest, "request_id": rid, "token_ids_sha256": token_hash}, f)
    return kvfmt.publish(kv_dir, rid, staging, overwrite=overwrite)


def _age(kv_dir: str) -> None:
    """Date the directory back past the index's racy window, as a directory not written to for a while is."""
    old = time.time() - 10
    os.utime(kv_dir, (old, old))


def _timed(index, token_hash):
    t = time.perf_counter()
    paths = index.lookup_all(token_hash)
    return paths, (time.perf_counter() - t) * 1e3


def test_lookup_is_o1_with_2000_exports(tmp_path):
    kv_dir = str(tmp_path / "kv")
    os.mkdir(kv_dir)
    tokens = np.arange(5, 45, dtype=np.int32)
    real = _real_export(kv_dir, "real", tokens)
    manifest = kvfmt.read_manifest(real)
    t = time.perf_counter()
    for i in range(N_EXPORTS - 1):  # plain directories (as format-2 exports are): 10x faster to write than publish
        os.mkdir(os.path.join(kv_dir, f"fake-{i:05d}"))
        with open(os.path.join(kv_dir, f"fake-{i:05d}", kvfmt.MANIFEST), "w") as f:
            json.dump({**manifest, "request_id": f"fake-{i:05d}", "token_ids_sha256": f"{i:064x}"}, f)
    print(f"wrote {N_EXPORTS - 1} exports in {time.perf_counter() - t:.2f} s")
    _age(kv_dir)
    index = plan.ExportIndex(kv_dir)
    missing = "f" * 64
    paths, first_ms = _timed(index, missing)
    assert paths == [] and index.reads == N_EXPORTS  # the first listing reads each manifest once
    miss_ms = []
    for _ in range(20):
        paths, ms = _timed(index, missing)
        assert paths == []
        miss_ms.append(ms)
    print(f"first listing {first_ms:.1f} ms, then a miss: max {max(miss_ms):.3f} ms over 20")
    assert index.reads == N_EXPORTS  # no manifest read again
    assert max(miss_ms) < 50  # an O(1) check of the directory's mtime (measured ~0.01 ms; the first listing ~300)
    assert index.lookup_all(kvfmt.token_hash(tokens)) == [real]
    assert index.lookup_all(f"{17:064x}") == [os.path.join(kv_dir, "fake-00017")]
    # a new publication: found at the next lookup, by reading its manifest only
    new = _fake_export(kv_dir, "late", manifest, "a" * 64, 10**6)
    paths, ms = _timed(index, "a" * 64)
    assert paths == [new] and index.reads == N_EXPORTS + 1
    print(f"a new export found in {ms:.1f} ms")
    assert ms < 50
    # a re-export of an id replaces it: its old hash is gone, its new one found; a second export of the
    # same prompt under another id is listed beside the first (sorted by id)
    _fake_export(kv_dir, "fake-00003", manifest, "b" * 64, 10**6 + 1, overwrite=True)
    twin = _fake_export(kv_dir, "a-twin", manifest, f"{17:064x}", 10**6 + 2)
    assert index.lookup_all("b" * 64) == [os.path.join(kv_dir, "fake-00003")]
    assert index.lookup_all(f"{3:064x}") == []
    assert index.lookup_all(f"{17:064x}") == [twin, os.path.join(kv_dir, "fake-00017")]
    assert index.reads == N_EXPORTS + 3
    # a removed export is never returned, even before the next listing; exclusion skips a refused candidate
    os.remove(twin)
    assert index.lookup_all(f"{17:064x}") == [os.path.join(kv_dir, "fake-00017")]
    assert index.lookup_all(f"{17:064x}", exclude=frozenset({os.path.join(kv_dir, "fake-00017")})) == []
    # a broken entry is skipped; a directory that does not exist yet is an empty index
    os.mkdir(os.path.join(kv_dir, "broken"))
    assert index.lookup_all("c" * 64) == []
    assert plan.ExportIndex(str(tmp_path / "absent")).lookup_all("c" * 64) == []
    shutil.rmtree(kv_dir)
    assert index.lookup_all(kvfmt.token_hash(tokens)) == []
