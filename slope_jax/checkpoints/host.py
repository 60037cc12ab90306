"""Host staging buffers for parameter loading: one block per distinct shard, shared by its replicas.

Both loaders (HF safetensors and the orbax store) build each parameter as a global `jax.Array` from host blocks: one
block per distinct shard index among this process's devices (devices that hold the same shard — the ring/Ulysses
replicas of a pipeline stage — share one read), filled once, then placed with `jax.make_array_from_callback`.

Blocks start on a 64-byte boundary. On the CPU backend PJRT adopts such a host buffer instead of copying it
(measured with jax 0.10: a buffer at an address ≡ 16 mod 64 is copied, one at ≡ 0 is adopted), so the replicas of a
shard share one buffer rather than one copy each; on GPU/TPU the block is the staging buffer of one host→device copy
per device. Blocks handed to JAX must not be written afterwards.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

ALIGN = 64  # bytes; XLA's CPU runtime minimum alignment for adopting a host buffer


def aligned_zeros(shape, dtype) -> np.ndarray:
    """A zero-filled C-contiguous array of `shape`/`dtype` whose data starts on an `ALIGN`-byte boundary (pages are
    zeroed lazily by the allocator: untouched padding costs no time)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.zeros(n + ALIGN, np.uint8)
    off = (-raw.ctypes.data) % ALIGN
    return raw[off:off + n].view(dtype).reshape(shape)


def as_aligned(a: np.ndarray) -> np.ndarray:
    """`a` itself if it is C-contiguous and aligned, else an aligned copy."""
    if a.flags.c_contiguous and a.ctypes.data % ALIGN == 0:
        return a
    out = aligned_zeros(a.shape, a.dtype)
    out[...] = a
    return out


def index_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Hashable `(start, stop)` per axis of a device's shard index (None bounds resolved against `shape`)."""
    return tuple(s.indices(d)[:2] for s, d in zip(index, shape))


def local_shards(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> dict[tuple, tuple[slice, ...]]:
    """The distinct shard indices among this process's devices, keyed by `index_key` (replicas collapse)."""
    out = {}
    for index in sharding.addressable_devices_indices_map(tuple(shape)).values():
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        out.setdefault(index_key(index, shape), index)
    return out


def place(shape: tuple[int, ...], sharding: jax.sharding.Sharding,
          blocks: dict[tuple, np.ndarray] | Callable[[tuple[slice, ...]], np.ndarray]) -> jax.Array:
    """The global array of `shape` under `sharding` from host blocks: `blocks[index_key]` (a dict from
    `local_shards`' keys) or `blocks(index)` called once per distinct shard. Each block is made aligned (copied only
    if it is not) and given to every device holding that shard."""
    shape = tuple(shape)
    cache: dict = {}

    def cb(index):
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        key = index_key(index, shape)
        if key not in cache:
            cache[key] = as_aligned(blocks[key] if isinstance(blocks, dict) else blocks(index))
        return cache[key]

    return jax.make_array_from_callback(shape, sharding, cb)


def allgather_bytes(blob: bytes) -> list[bytes]:
    """Every process's `blob`, in process order (an all-gather of lengths, then of the zero-padded bytes through
    `multihost_utils.process_allgather`). Every process must call it. One process: `[blob]`."""
    if jax.process_count() == 1:
        return [blob]
    from jax.experimental import multihost_utils

    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([len(blob)], np.int32))).reshape(-1)
    buf = np.zeros(max(1, int(sizes.max())), np.uint8)
    buf[:len(blob)] = np.frombuffer(blob, np.uint8)
    every = np.asarray(multihost_utils.process_allgather(buf)).reshape(len(sizes), -1)
    return [bytes(every[i, :int(n)]) for i, n in enumerate(sizes)]


def disagreements(reads) -> list[str]:
    """Compare this process's `digest.ReadDigests` with every other process's (all-gathered: every process must call
    it, after loading, before the first step): the stored slices read with different contents by different
    processes, one line each (`digest.compare_reads`); empty when they agree or in a one-process run."""
    import json

    from slope_jax.checkpoints import digest

    if jax.process_count() == 1:
        return []
    every = allgather_bytes(json.dumps(reads.digests, sort_keys=True).encode())
    return digest.compare_reads({pid: json.loads(b) for pid, b in enumerate(every)})


def refusal(problems: list[str], path: str) -> str:
    """The start-up error for `disagreements`: names each tensor (at most 5) and the processes."""
    more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
    return (f"processes read different weights from {path} (every process must load a byte-identical copy of the "
            "checkpoint; compare or re-copy the files): " + " | ".join(problems[:5]) + more)
