"""Start-up fingerprint: every process of a run must compile the same step and feed it the same weights.

A fingerprint is a flat dict of everything that shapes the compiled step or its inputs: package versions, the
layout, dtype, every `StepOptions` field (tiles, attention / MoE implementations), export flags and the checkpoint
(its config and its tensor directory: file names, sizes and safetensors headers, or a converted directory's marker;
no weight bytes). The processes exchange fingerprints at
start-up (`slope_jax.serve.distributed.preflight`) and `compare` names every field on which they differ, so a run
with, say, `--dtype` given to one process only fails at once with that name instead of hanging in the first
collective or computing with mixed programs. No JAX needed. The weight bytes are compared in full after loading,
before the first step (`checkpoints.digest.ReadDigests`: every byte hashed as it is read, then all-gathered).
"""

from __future__ import annotations

import importlib.metadata
import json
import os

from slope_jax.checkpoints import digest



def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def checkpoint_fingerprint(path: str) -> dict[str, str]:
    """The checkpoint's part of a fingerprint (`checkpoints.digest.checkpoint_digest`: config and tensor directory of
    an HF/original checkpoint, or the marker of a converted directory)."""
    return digest.checkpoint_digest(path)


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
