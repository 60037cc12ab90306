"""KV cache export for a decode engine (prefill/decode disaggregation), and its reader.

An export is one directory per request:

    <kv_dir>/<request_id>/kv-p<process>.safetensors   one per process: the K/V pieces that process computed
    <kv_dir>/<request_id>/manifest.json                written last, atomically: the export is valid iff it exists

Format `slope_jax.kv` version 1 (readable without JAX: safetensors + JSON):
- every tensor's axis order is **declared** in the manifest (`axes`: token, kv_head, head_dim); a reader must not
  infer a layout from shapes (two layouts can share a shape);
- K is post-RoPE (`rope_applied: true`), V as projected; tokens in natural order; each segment carries its int32
  global positions;
- layers are keyed by **global** layer id with their kind; full layers hold tokens [0, n); sliding layers hold the
  last W tokens [max(0, n−W), n) unless the export was asked for the full KV (`sliding_policy: "full"`), W tokens
  being all a decoder needs (spec §2.3);
- `num_tokens`, the SHA-256 of the token ids (int32 little-endian) and the model fingerprint identify what the KV
  belongs to.
Files are written to a temporary name and renamed; the manifest comes after every process's file is in place, so
a crash never leaves a valid-looking partial export.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Iterable

import numpy as np

from slope_jax.atomic import atomic_json, atomic_write

FORMAT = "slope_jax.kv"
VERSION = 1
AXES = ["token", "kv_head", "head_dim"]
MANIFEST = "manifest.json"


@dataclasses.dataclass
class LayerKV:
    """One layer's KV cache for one prompt: post-RoPE `k`, `v` `[T, K, H]` (activation dtype) in natural token order,
    `positions` int32 `[T]` (0…T−1), `kind` "sliding_attention" or "full_attention"."""

    k: np.ndarray
    v: np.ndarray
    positions: np.ndarray
    kind: str


class KVFormatError(ValueError):
    """An export on disk is inconsistent or of an unknown layout; the message names the field and what was found."""


def token_hash(ids: np.ndarray) -> str:
    return hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()


def kept_range(num_tokens: int, kind: str, window: int, full: bool) -> tuple[int, int]:
    """Token range [start, end) an export keeps for a layer."""
    if kind == "sliding_attention" and not full:
        return max(0, num_tokens - window), num_tokens
    return 0, num_tokens


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


def write_shard_file(directory: str, process: int, segments: Iterable[tuple[int, int, int, np.ndarray, np.ndarray]]
                     ) -> tuple[str, list[dict]]:
    """Write one process's pieces: `segments` of (layer, start, end, k [end−start, K, H], v). Returns (file name,
    segment records for the manifest)."""
    from safetensors.numpy import save_file

    name = f"kv-p{process}.safetensors"
    tensors, records = {}, []
    for layer, start, end, k, v in segments:
        rec = {"layer": int(layer), "start": int(start), "end": int(end), "file": name,
               "k": segment_name(layer, "k", start, end), "v": segment_name(layer, "v", start, end),
               "positions": segment_name(layer, "positions", start, end)}
        tensors[rec["k"]] = np.ascontiguousarray(k)
        tensors[rec["v"]] = np.ascontiguousarray(v)
        tensors[rec["positions"]] = np.arange(start, end, dtype=np.int32)
        records.append(rec)
    os.makedirs(directory, exist_ok=True)
    atomic_write(os.path.join(directory, name), lambda tmp: save_file(tensors, tmp, metadata={"format": FORMAT}))
    return name, records


def write_manifest(directory: str, *, request_id: str, token_ids: np.ndarray, cfg, dtype: str, full: bool,
                   segments: list[dict], files: list[str], first_token: int | None = None) -> str:
    """Write `manifest.json` (atomically, last). `segments`: records from every process's `write_shard_file`."""
    by_layer: dict[int, list[dict]] = {}
    for s in segments:
        by_layer.setdefault(s["layer"], []).append(s)
    layers = []
    for layer in range(cfg.num_hidden_layers):
        segs = sorted(by_layer.get(layer, []), key=lambda s: s["start"])
        kind = cfg.layer_types[layer]
        layers.append({"layer": layer, "kind": kind,
                       "token_range": list(kept_range(len(token_ids), kind, cfg.sliding_window, full)),
                       "segments": [{k: s[k] for k in ("file", "start", "end", "k", "v", "positions")} for s in segs]})
    manifest = {
        "format": FORMAT, "version": VERSION, "request_id": request_id,
        "num_tokens": int(len(token_ids)), "token_ids_sha256": token_hash(token_ids),
        "first_token": first_token,
        "model": {"fingerprint": cfg.fingerprint(), "num_hidden_layers": cfg.num_hidden_layers,
                  "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
                  "sliding_window": cfg.sliding_window},
        "dtype": dtype, "axes": {"k": AXES, "v": AXES, "positions": ["token"]},
        "rope_applied": True, "token_order": "natural",
        "sliding_policy": "full" if full else "last_window",
        "files": sorted(set(files)), "layers": layers,
    }
    path = os.path.join(directory, MANIFEST)
    atomic_json(path, manifest)
    return path


# ---------------------------------------------------------------------------------------------------------------
# Reading
def read_manifest(path: str) -> dict:
    """The manifest of an export directory, with its format, version and declared layout checked."""
    mpath = os.path.join(path, MANIFEST)
    if not os.path.exists(mpath):
        raise KVFormatError(f"{path}: no {MANIFEST} (an unfinished or failed export is never valid)")
    try:
        with open(mpath) as f:
            m = json.load(f)
    except json.JSONDecodeError as e:
        raise KVFormatError(f"{mpath}: not valid JSON ({e})") from e
    if m.get("format") != FORMAT or m.get("version") != VERSION:
        raise KVFormatError(f"{mpath}: format {m.get('format')!r} version {m.get('version')!r}, expected "
                            f"{FORMAT!r} version {VERSION}")
    axes = m.get("axes")
    if axes != {"k": AXES, "v": AXES, "positions": ["token"]}:
        raise KVFormatError(f"{mpath}: undeclared or unknown layout axes={axes!r}; this reader knows "
                            f"k, v = {AXES} and positions = ['token'] only")
    if m.get("rope_applied") is not True or m.get("token_order") != "natural":
        raise KVFormatError(f"{mpath}: rope_applied={m.get('rope_applied')!r}, token_order={m.get('token_order')!r}; "
                            "expected post-RoPE K in natural token order")
    return m


def load(path: str) -> dict:
    """Read an export: global layer id → `LayerKV(k, v, positions, kind)` (the structure of `PrefillResult.kv`).

    Raises KVFormatError for a missing manifest or file, an unknown layout, a missing layer, a tensor whose length
    disagrees with its declared token range, or token ranges that do not tile the layer's kept range.
    """
    from safetensors import safe_open

    m = read_manifest(path)
    n_layers = m["model"]["num_hidden_layers"]
    kh, hd = m["model"]["num_key_value_heads"], m["model"]["head_dim"]
    handles = {}
    for fname in m["files"]:
        fpath = os.path.join(path, fname)
        if not os.path.exists(fpath):
            raise KVFormatError(f"{path}: manifest lists {fname}, which does not exist")
        handles[fname] = safe_open(fpath, framework="numpy")
    layers = {rec["layer"]: rec for rec in m["layers"]}
    missing = [i for i in range(n_layers) if i not in layers]
    if missing:
        raise KVFormatError(f"{path}: layer(s) {missing} missing from the manifest (num_hidden_layers={n_layers})")
    out = {}
    for layer in range(n_layers):
        rec = layers[layer]
        start, end = rec["token_range"]
        ks, vs, ps = [], [], []
        cursor = start
        for seg in sorted(rec["segments"], key=lambda s: s["start"]):
            if seg["start"] != cursor:
                raise KVFormatError(f"{path}: layer {layer} tokens [{cursor}, {seg['start']}) are not covered "
                                    f"(declared range [{start}, {end}))")
            h = handles.get(seg["file"])
            if h is None:
                raise KVFormatError(f"{path}: layer {layer} segment refers to {seg['file']}, not in 'files'")
            try:
                k, v, pos = (h.get_tensor(seg[x]) for x in ("k", "v", "positions"))
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error type for a missing key
                raise KVFormatError(f"{path}: layer {layer}: tensor missing from {seg['file']}: {e}") from e
            want = seg["end"] - seg["start"]
            for name, t in (("k", k), ("v", v)):
                if t.shape != (want, kh, hd):
                    raise KVFormatError(f"{path}: layer {layer} {name} tensor {seg[name]!r} has shape "
                                        f"{list(t.shape)}, the manifest declares [{want}, {kh}, {hd}] "
                                        f"(tokens [{seg['start']}, {seg['end']}) x kv_head x head_dim)")
            if not np.array_equal(pos, np.arange(seg["start"], seg["end"])):
                raise KVFormatError(f"{path}: layer {layer} positions of {seg['positions']!r} are not "
                                    f"[{seg['start']}, {seg['end']})")
            ks.append(k), vs.append(v), ps.append(pos)
            cursor = seg["end"]
        if cursor != end:
            raise KVFormatError(f"{path}: layer {layer} covers tokens up to {cursor}, the manifest declares "
                                f"[{start}, {end}) (num_tokens={m['num_tokens']})")
        out[layer] = LayerKV(np.concatenate(ks) if ks else np.zeros((0, kh, hd)),
                             np.concatenate(vs) if vs else np.zeros((0, kh, hd)),
                             np.concatenate(ps) if ps else np.zeros((0,), np.int32), rec["kind"])
    return out
