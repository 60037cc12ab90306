"""Content digests of checkpoint directories (no JAX, no numpy): what two processes, or a converted directory and its
source, compare to know they hold the same weights.

HF / `original/` checkpoints: a sampled content hash of the weight files (`file_digest`: ~2 MiB read per file
whatever its size). A directory converted by `python -m slope_jax.convert` is identified by its marker
(`slope_jax_orbax.json`: format, config, dtype, declared parameters and the source checkpoint's content digest),
not by its orbax data files, whose layout depends on the order the shards were written in.
"""

from __future__ import annotations

import hashlib
import json
import os

ORBAX_MARKER = "slope_jax_orbax.json"  # written last by checkpoints.orbax_store.save
_SAMPLES = 16  # blocks hashed per weight file, evenly spaced (plus the safetensors header)
_BLOCK = 1 << 16


def file_digest(path: str) -> str:
    """SHA-256 of a file's size, its first 1 MiB (a safetensors header: names, dtypes, shapes, offsets) and 16 blocks
    of 64 KiB spread evenly over the rest: reads ~2 MiB per file whatever its size, and two checkpoints of equal
    shapes but other weights (e.g. other random seeds or fine-tunes) differ in every block."""
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if size > 1 << 20:
            for i in range(_SAMPLES):
                f.seek((1 << 20) + (size - (1 << 20) - _BLOCK) * i // max(1, _SAMPLES - 1))
                h.update(f.read(_BLOCK))
    return h.hexdigest()


def checkpoint_digest(path: str) -> dict[str, str]:
    """{"checkpoint.config": 16 hex chars, "checkpoint.weights": 16 hex chars} of a checkpoint directory.

    HF / `original/`: sha256 of config.json (and original/config.json), and a digest over the weight files (names,
    sizes, sampled contents) and index files. A converted (orbax) directory: sha256 of its marker's config, and of its
    fingerprint + dtype (the fingerprint covers the source's content digest). Equal digests for copies of the same
    files, whatever their path. Raises OSError / ValueError for an unreadable marker.
    """
    marker = os.path.join(path, ORBAX_MARKER)
    if os.path.isfile(marker):
        with open(marker) as f:
            meta = json.load(f)
        cfg = json.dumps(meta.get("config"), sort_keys=True).encode()
        weights = json.dumps([meta.get("fingerprint"), meta.get("dtype")]).encode()
        return {"checkpoint.config": hashlib.sha256(cfg).hexdigest()[:16],
                "checkpoint.weights": hashlib.sha256(weights).hexdigest()[:16]}
    cfg, weights = hashlib.sha256(), hashlib.sha256()
    for sub in ("", "original"):
        d = os.path.join(path, sub)
        if not os.path.isdir(d):
            continue
        for name in sorted(os.listdir(d)):
            full = os.path.join(d, name)
            if name == "config.json":
                with open(full, "rb") as f:
                    cfg.update(sub.encode() + b"/" + f.read())
            elif name.endswith(".safetensors") or name.endswith(".safetensors.index.json"):
                weights.update(f"{sub}/{name}:{file_digest(full)}".encode())
    return {"checkpoint.config": cfg.hexdigest()[:16], "checkpoint.weights": weights.hexdigest()[:16]}
