"""Start-up fingerprint: every process of a run must compile the same step and feed it the same weights.

A fingerprint is a flat dict of everything that shapes the compiled step or its inputs: package versions, the
layout, dtype, tiles, export flags and the checkpoint (its config and a sampled content hash of its weight files).
The processes exchange fingerprints at start-up (`slope_jax.serve.distributed.preflight`) and `compare` names every
field on which they differ, so a run with, say, `--dtype` given to one process only fails at once with that name
instead of hanging in the first collective or computing with mixed programs. No JAX needed.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os

_SAMPLES = 16  # blocks hashed per weight file, evenly spaced (plus the safetensors header)
_BLOCK = 1 << 16


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


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


def checkpoint_fingerprint(path: str) -> dict[str, str]:
    """{"checkpoint.config": sha256 of config.json (and original/config.json), "checkpoint.weights": digest over the
    weight files (names, sizes, sampled contents) and index files}. Cheap: a few MiB read per file."""
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


def make(step_options: dict, checkpoint: str) -> dict:
    """The fingerprint of one process: package versions + `step_options` (flag name → value: every flag that changes
    the compiled step or what it reads) + the checkpoint's fingerprint."""
    fp = {"slope_jax": _version("slope_jax"), "jax": _version("jax"), "jaxlib": _version("jaxlib")}
    fp.update({k: step_options[k] for k in sorted(step_options)})
    fp.update(checkpoint_fingerprint(checkpoint) if os.path.isdir(checkpoint) else {"checkpoint.config": "missing"})
    json.dumps(fp)  # must travel as JSON
    return fp


def compare(fingerprints: dict[int, dict]) -> list[str]:
    """Fields on which processes differ, one readable line each (empty when all agree), e.g.
    "dtype: process 0 has 'bfloat16'; process 1 has 'float32'". A field missing on a process counts as a value."""
    fields = sorted(set().union(*(fp.keys() for fp in fingerprints.values()))) if fingerprints else []
    problems = []
    for field in fields:
        groups: dict[str, list[int]] = {}
        for pid in sorted(fingerprints):
            value = fingerprints[pid].get(field, "<missing>")
            groups.setdefault(json.dumps(value, sort_keys=True), []).append(pid)
        if len(groups) > 1:
            parts = []
            for value, pids in groups.items():
                who = f"process {pids[0]} has" if len(pids) == 1 else f"processes {', '.join(map(str, pids))} have"
                parts.append(f"{who} {json.loads(value)!r}")
            problems.append(f"{field}: " + "; ".join(parts))
    return problems
