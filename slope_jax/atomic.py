"""Atomic file writes: write to a temporary file in the target's directory, fsync, then `os.replace` — a reader sees
the old file, the new file, or none, never a torn one. The one helper every writer in slope_jax uses (KV export,
checkpoint writer). Needs only the standard library and numpy/safetensors when those formats are written."""

from __future__ import annotations

import errno
import json
import os
import tempfile
from typing import Callable


def unwritable_ancestor(path: str) -> str | None:
    """None if `path` (a file or directory to create, with any missing parents) can be created: its nearest existing
    ancestor is a writable directory. Else that ancestor, for the caller's error message — checked before long work,
    so a bad output path fails in a second, not after it."""
    base = os.path.abspath(path)
    while not os.path.exists(base) and os.path.dirname(base) != base:
        base = os.path.dirname(base)
    return None if os.path.isdir(base) and os.access(base, os.W_OK) else base


def atomic_write(path: str, write: Callable[[str], None], *, mode: int = 0o644) -> None:
    """Call `write(tmp_path)` to produce the file, then rename it to `path` atomically.

    The temporary file sits in `path`'s directory (same filesystem, so the rename is atomic) with a `.tmp-` prefix;
    it is removed if `write` raises, and the exception propagates. A `path` that is a symbolic link: the file it
    names is replaced and the link stays. A `path` that exists and is no regular file — a FIFO, a character device
    (`/dev/stdout` → a pipe or terminal), a socket — is written through, as `open` would: renaming over it would
    replace the device or pipe itself. A directory: IsADirectoryError.
    """
    if os.path.islink(path):
        path = os.path.realpath(path)
    if os.path.exists(path) and not os.path.isfile(path):
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, "a directory, not a file", path)
        write(path)
        return
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".tmp-")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def atomic_json(path: str, obj, *, indent: int = 1) -> None:
    """Write `obj` as strict JSON (NaN/Infinity are refused with ValueError) atomically to `path`."""

    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=indent, allow_nan=False)
            f.write("\n")

    atomic_write(path, write)


def atomic_safetensors(path: str, tensors: dict, metadata: dict | None = None) -> None:
    """Write numpy `tensors` as one safetensors file atomically to `path`."""
    import numpy as np
    from safetensors.numpy import save_file

    atomic_write(path, lambda tmp: save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, tmp,
                                             metadata=metadata))
