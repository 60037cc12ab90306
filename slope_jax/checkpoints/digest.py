"""Digests of checkpoints (no JAX): what processes compare to know they hold the same weights.

Two kinds, for two decisions:
- `ReadDigests` — **full content, as read**: every byte a loader reads for a parameter (`checkpoints.hf.load_params`
  from safetensors, `checkpoints.orbax_store.restore` from TensorStore into host blocks) is hashed once, as it
  arrives (xxHash XXH3-64: measured 7.2 GB/s vs 1.0 GB/s for zlib.crc32 on this VM), keyed by the stored tensor and
  the slice of it read. After loading, before the first step, the processes all-gather these digests and refuse to
  start if two of them read different bytes for the same stored slice (`compare_reads`, `checkpoints.host.agree`).
  No extra read, no sampling: this is the weight agreement every correctness decision rests on.
- `checkpoint_digest` — **before loading**, for the start-up fingerprint (`serve.fingerprint`): the config and the
  tensor directory (file names, sizes, safetensors headers: names, dtypes, shapes, offsets) of an HF / `original/`
  checkpoint, or a converted directory's marker. It catches a wrong checkpoint before JAX starts; it says nothing
  about the weight bytes. `file_digest` (a sampled content hash: ~2 MiB read per file) only names the source of a
  converted directory in its marker (`orbax_store._source_id`); no agreement is decided on it.
A directory converted by `python -m slope_jax.convert` is identified by its marker (`slope_jax_orbax.json`: format,
config, dtype, declared parameters and the source checkpoint's sampled id), not by its orbax data files, whose layout
depends on the order the shards were written in.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import time

import xxhash

from slope_jax.model.config import CONVERTED_MARKER

ORBAX_MARKER = CONVERTED_MARKER  # written last by checkpoints.orbax_store.save
_SAMPLES = 16  # blocks hashed per weight file, evenly spaced (plus the safetensors header)
_BLOCK = 1 << 16


class ContentChangedError(ValueError):
    """One process read different bytes for one stored slice at two times: the checkpoint changed while loading."""


class ReadDigests:
    """XXH3-64 digests of the bytes one process read for its parameters: stored slice label → 16 hex digits.

    Labels name what was read, in the stored tensor's own terms (e.g. `model.layers.3.mlp.router.weight` for a whole
    tensor, `model.embed_tokens.weight[0:512]` for rows, `layers/wq/3[0:64, 0:96]` for a slice of a converted
    directory's array), so processes that read the same stored bytes have the same label whatever their devices.
    `nbytes` / `seconds` account the hashing (for the load-time cost in logs and benchmarks). Thread-safe.
    """

    def __init__(self):
        self.digests: dict[str, str] = {}
        self.nbytes = 0
        self.seconds = 0.0
        self._lock = threading.Lock()

    def add(self, label: str, data) -> None:
        """Hash `data` (a numpy array or any C-contiguous buffer, as read) under `label`. Raises ContentChangedError
        if this process already read different bytes under the same label (the file changed while loading)."""
        t0 = time.perf_counter()
        if hasattr(data, "dtype"):  # numpy (also ml_dtypes bfloat16, which the buffer protocol cannot export)
            import numpy as np

            data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        d = xxhash.xxh3_64_hexdigest(data)
        n = memoryview(data).nbytes
        with self._lock:
            self.nbytes += n
            self.seconds += time.perf_counter() - t0
            old = self.digests.setdefault(label, d)
        if old != d:
            raise ContentChangedError(f"{label}: read twice with different contents ({old} then {d}): the checkpoint "
                             "changed while it was being loaded")


def slice_label(name: str, index=None, shape=None) -> str:
    """`name` plus the slice read: `name[a:b, c:d]` (bounds resolved against `shape`; `index` a slice or tuple of
    slices; trailing whole axes dropped), or `name` for a whole tensor."""
    if index is None:
        return name
    index = index if isinstance(index, tuple) else (index,)
    parts = []
    for i, s in enumerate(index):
        if isinstance(s, slice):
            lo, hi, _ = s.indices(shape[i]) if shape is not None else (s.start or 0, s.stop, 1)
            parts.append(f"{lo}:{hi}")
        else:
            parts.append(str(int(s)))
    while parts and shape is not None and parts[-1] == f"0:{shape[len(parts) - 1]}":
        parts.pop()
    return f"{name}[{', '.join(parts)}]" if parts else name


def compare_reads(per_process: dict[int, dict[str, str]]) -> list[str]:
    """The stored slices that two or more processes read with different contents, one readable line each (empty
    when all shared reads agree), e.g. "tensor model.layers.1.mlp.router.weight: process 0 read 1f…; process 1 read
    9c…". Slices read by one process only have nothing to be compared with."""
    labels: dict[str, dict[str, list[int]]] = {}
    for pid in sorted(per_process):
        for label, d in per_process[pid].items():
            labels.setdefault(label, {}).setdefault(d, []).append(pid)
    problems = []
    for label in sorted(labels):
        groups = labels[label]
        if len(groups) > 1:
            parts = [(f"process {p[0]} read" if len(p) == 1 else f"processes {', '.join(map(str, p))} read") + f" {d}"
                     for d, p in groups.items()]
            problems.append(f"tensor {label}: " + "; ".join(parts))
    return problems


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
    """{"checkpoint.config": 16 hex chars, "checkpoint.tensors": 16 hex chars} of a checkpoint directory, reading
    no weight data.

    HF / `original/`: sha256 of config.json (and original/config.json), and of the weight files' names, sizes and
    safetensors headers (tensor names, dtypes, shapes, offsets) and the index files. A converted (orbax) directory:
    sha256 of its marker's config, and of its fingerprint + dtype (declared parameters, source id). Equal digests
    for copies of the same files, whatever their path; the weight bytes themselves are compared after loading
    (`ReadDigests`). Raises OSError / ValueError for an unreadable marker.
    """
    marker = os.path.join(path, ORBAX_MARKER)
    if os.path.isfile(marker):
        with open(marker) as f:
            meta = json.load(f)
        cfg = json.dumps(meta.get("config"), sort_keys=True).encode()
        weights = json.dumps([meta.get("fingerprint"), meta.get("dtype")]).encode()
        return {"checkpoint.config": hashlib.sha256(cfg).hexdigest()[:16],
                "checkpoint.tensors": hashlib.sha256(weights).hexdigest()[:16]}
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
            elif name.endswith(".safetensors.index.json"):
                with open(full, "rb") as f:
                    weights.update(f"{sub}/{name}:".encode() + f.read())
            elif name.endswith(".safetensors"):
                weights.update(f"{sub}/{name}:{os.path.getsize(full)}:".encode() + _safetensors_header(full))
    return {"checkpoint.config": cfg.hexdigest()[:16], "checkpoint.tensors": weights.hexdigest()[:16]}


def _safetensors_header(path: str) -> bytes:
    """The length-prefixed JSON header of a safetensors file (what every loader reads first), or b"" if it is not
    one (the loader reports that with the file's name)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return b""
        (n,) = struct.unpack("<Q", head)
        return head + f.read(min(n, 1 << 27))



def weights_digest(path: str) -> str:
    """The weights' identity a prefix cache and a KV export record: `slope_jax.kv.prefix.weights_digest` (kept in the
    JAX-free `kv` package, so the vLLM connector computes the same value)."""
    from slope_jax.kv.prefix import weights_digest as digest

    return digest(path)
