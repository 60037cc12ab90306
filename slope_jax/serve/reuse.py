"""Prefix reuse in the engine: find each prompt's longest cached prefix, agree on it across processes, and lay its KV
out for a suffix step (`PrefillEngine.prefill`; the JAX-free parts are `slope_jax.kv.prefix` and `kv.store`).

Lookup order for one prompt (at most n − 1 tokens, whole blocks): the host tier (this process's RAM), then the
`kv_dir` exports (`KVStore.lookup`: manifests only; the entry's files are read and verified when it is used). An
entry that fails verification is skipped with one log line naming the reason, dropped from the index, and the prompt
computed cold. Under several processes, process 0 decides every prompt's hit (its index is the one consulted); every
process then reads that export from the shared `kv_dir` and the hit stands only if every process read it.

Layout of the cached rows for a step (`prefix_arrays`): `S` rows per request (the capacity, `prefix_capacity`), split
evenly over the R·U devices of a stage in contiguous natural-order runs (device d holds positions [d·q, (d+1)·q),
q = ⌈p / (R·U)⌉), so every device folds the same number of cached keys into the visiting queries
(`context_parallel.prefix_attention`); unused rows carry INVALID_POS and cost no attention work (their tiles are
skipped). Capacities are coarse (four per octave) so that a growing conversation compiles a new program rarely.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import jax
import numpy as np
import xxhash

from slope_jax.checkpoints import digest as digest_lib
from slope_jax.checkpoints import host as host_lib
from slope_jax.kv import prefix as prefix_lib
from slope_jax.kv.store import KVStore, ReuseRefused
from slope_jax.model import attention as attn_lib
from slope_jax.serve.compute import Broadcast

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Hit:
    """One prompt's reuse decision: its block hashes (for its own export's record) and the cached prefix (or None)."""

    hashes: list[str]
    prefix: prefix_lib.PrefixKV | None = None
    identity: str | None = None  # the cache identity the hashes are rooted in (`kv.prefix.identity`)
    release: object = None  # called when the step no longer needs the prefix (unpins a host-tier entry)

    @property
    def cached(self) -> int:
        return 0 if self.prefix is None else self.prefix.num_tokens


def checkpoint_weights_digest(path: str) -> str | None:
    """The checkpoint files' weights digest, or None where there are no weight files to read (a converted
    directory: the engine then digests its parameters)."""
    try:
        return digest_lib.weights_digest(path)
    except FileNotFoundError:
        return None


def params_digest(params) -> str:
    """XXH3-128 (hex) of every parameter's bytes as placed (leaf paths, shapes, dtypes and data). Under several
    processes each hashes the shards it holds and the per-process digests are all-gathered and combined, so every
    process gets the same value."""
    h = xxhash.xxh3_128()
    multi = jax.process_count() > 1
    for path, a in jax.tree_util.tree_flatten_with_path(params)[0]:
        h.update(f"{jax.tree_util.keystr(path)}:{a.shape}:{a.dtype}".encode())
        shards = (sorted(a.addressable_shards, key=lambda s: str(s.index)) if multi and hasattr(a, "addressable_shards")
                  else [None])
        for sh in shards:
            data = np.asarray(a if sh is None else sh.data)
            h.update(np.ascontiguousarray(data).view(np.uint8).tobytes())
    if not multi:
        return h.hexdigest()
    from jax.experimental import multihost_utils

    every = np.asarray(multihost_utils.process_allgather(np.frombuffer(h.digest(), np.uint8)))
    return xxhash.xxh3_128(every.tobytes()).hexdigest()


def prefix_capacity(p: int, multiple: int = 1) -> int:
    """Rows compiled for a p-token cached prefix: p rounded up to a quarter octave (p ≤ S < 1.25·p for p ≥ 4), then
    to a multiple of `multiple` (the R·U devices of a stage). 0 for p = 0."""
    if p <= 0:
        return 0
    step = max(1, (1 << (int(p).bit_length() - 1)) // 4)
    s = -(-int(p) // step) * step
    return -(-s // multiple) * multiple


def suffix_bucket(s: int, multiple: int = 1) -> int:
    """Padded length of the s new tokens of a prefix hit: a quarter octave (at least 16 rows), then a multiple of the
    layout's token multiple (`ParallelConfig.token_multiple`)."""
    return prefix_capacity(max(int(s), 16), multiple)


def find(engine, tokens: list[np.ndarray], salts: list[str | None], kv_dir: str | None) -> list[Hit]:
    """Every prompt's Hit (module docstring). `salts`: each prompt's `cache_salt` (None: none)."""
    block = engine.reuse.block_size
    idents = [engine.prefix_identity(s) for s in salts]
    hits = [Hit(prefix_lib.block_hashes(x, i, block), identity=i) for x, i in zip(tokens, idents)]
    store = engine.kv_store(kv_dir) if kv_dir is not None else None
    if jax.process_count() == 1:
        try:
            for x, hit in zip(tokens, hits):
                _lookup_local(engine, x, hit, store)
        except BaseException:  # the caller releases only hits it received: unpin the host entries taken so far
            for hit in hits:
                if hit.release is not None:
                    hit.release()
            raise
        return hits
    return _agree(engine, tokens, hits, store)


def usable_hashes(engine, tokens: np.ndarray, salt: str | None) -> list[str]:
    """The chained block hashes of `tokens` a hit may cover (whole blocks, at most n − 1 tokens; `kv.prefix`) under
    the engine's prefix identity and `salt`; [] with reuse off. Two prompts share a cached prefix of as many tokens
    as their lists' common leading hashes times the block size."""
    if not engine.reuse.enabled:
        return []
    block = engine.reuse.block_size
    return _limit(prefix_lib.block_hashes(tokens, engine.prefix_identity(salt), block), tokens.size, block)


def peek(engine, tokens: np.ndarray, salt: str | None, kv_dir: str | None, usable: Sequence[str] | None = None
         ) -> int:
    """Tokens of `tokens` a prefill would most likely take from the prefix cache now (host tier or `kv_dir` index;
    nothing is read or verified): what admission predicts a request's TTFT from. 0 with reuse off. `usable`: the
    prompt's `usable_hashes`, when already computed."""
    if not engine.reuse.enabled:
        return 0
    block = engine.reuse.block_size
    usable = usable_hashes(engine, tokens, salt) if usable is None else usable
    if not usable:
        return 0
    best = engine.host_tier.lookup(usable, touch=False)[1] if engine.host_tier is not None else 0
    if kv_dir is not None:  # not marked used: a request admission rejects uses nothing
        best = max(best, engine.kv_store(kv_dir).lookup(usable, block, touch=False)[1])
    return best * block


def _limit(hashes: list[str], n: int, block: int) -> list[str]:
    return hashes[:prefix_lib.reusable_tokens(len(hashes), n, block) // block]


# exports a single-process lookup reads before it gives up on the kv_dir (each refused one leaves the index, so the
# next lookup finds another entry holding the blocks, or a shorter prefix): a few, since each read checks every file
LOAD_ATTEMPTS = 3


def _lookup_local(engine, x: np.ndarray, hit: Hit, store: KVStore | None) -> None:
    """Single process: the host tier, then the store (an export that cannot serve is skipped for the next one that
    holds the prefix, up to LOAD_ATTEMPTS); the longer hit wins."""
    block = engine.reuse.block_size
    usable = _limit(hit.hashes, x.size, block)
    host_blocks = 0
    tier = engine.host_tier
    if tier is not None and usable:
        entry, host_blocks = tier.lookup(usable)
        p = host_blocks * block
        if entry is not None and np.array_equal(entry.tokens[:p], x[:p]):
            tier.pin(entry.key)
            hit.prefix = prefix_lib.PrefixKV(p, entry.k, entry.v, source="host")
            hit.release = lambda key=entry.key: tier.unpin(key)
        else:
            host_blocks = 0
    for _ in range(LOAD_ATTEMPTS if store is not None and usable else 0):
        rid, blocks = store.lookup(usable, block)
        if rid is None or blocks <= host_blocks:
            return
        loaded = _load(engine, store, rid, x, blocks * block)  # refused: out of the index, the next holder is tried
        if loaded is not None:
            if hit.release is not None:
                hit.release()
            hit.prefix, hit.release = loaded, None
            return


def _load(engine, store: KVStore, rid: str, x: np.ndarray, p: int) -> prefix_lib.PrefixKV | None:
    """Read and verify export `rid`'s first p tokens; None (one warning naming the reason) if it cannot serve."""
    try:
        return store.load_prefix(rid, x, p, cfg=engine.cfg, dtype=engine.dtype.name, weights=engine.weights_digest)
    except ReuseRefused as e:
        log.warning("prefix reuse: cached entry %r skipped (not used again): %s", rid, e)
        store.discard(rid)
        return None


def _agree(engine, tokens, hits: list[Hit], store: KVStore | None) -> list[Hit]:
    """Several processes: process 0 looks up, all read its choices from the shared kv_dir, all-or-nothing per hit."""
    from jax.experimental import multihost_utils

    block = engine.reuse.block_size
    choice = []
    if jax.process_index() == 0 and store is not None:
        for x, hit in zip(tokens, hits):
            usable = _limit(hit.hashes, x.size, block)
            rid, blocks = store.lookup(usable, block) if usable else (None, 0)
            choice.append([rid, blocks * block])
    choice = Broadcast(True)(choice) or [[None, 0]] * len(hits)  # process 0's choices on every process
    loaded = [None if rid is None else _load(engine, store, rid, x, p)
              for (rid, p), x in zip(choice, tokens)]
    ok = np.asarray([c[0] is None or lp is not None for c, lp in zip(choice, loaded)], np.int32)
    every = np.asarray(multihost_utils.process_allgather(ok)).reshape(jax.process_count(), -1).min(axis=0)
    for hit, lp, good in zip(hits, loaded, every):
        hit.prefix = lp if good else None
    return hits


# prefix K/V buffers of at most this many bytes (k and v together) are kept between hits (`PrefixBuffers`)
KEEP_PREFIX_BUFFER_BYTES = 1 << 30


class PrefixBuffers:
    """The host k, v buffers of the last suffix step's cached rows, kept for the next step of the same shape.

    A conversation's turns hit with the same (M, E, S, K, H) shape (capacities are coarse), and fresh buffers of that
    size cost first-touch page faults on every hit: prefix_arrays of a 16K-token hit (2 × 32 MiB, peer config, one CPU
    device) took 12–28 ms on touched pages and 110–185 ms when they were fresh; only the rows a step does not write
    are zeroed again (the whole pair took 11 ms). Buffers above
    KEEP_PREFIX_BUFFER_BYTES are not kept (host RAM, for large models and long prompts). The step reads them before
    the next step is laid out: the engine runs its steps one after another (not thread-safe; the engine's lock
    serialises its callers, `serve.engine._one_at_a_time`).

    The buffers start on a 64-byte boundary (`checkpoints.host.aligned_zeros`, as the loaders' weight blocks): JAX's
    CPU client then uses them in place as the step's input (a device array aliasing the host buffer) where an
    unaligned buffer is copied first — 45–53 ms of a 16K-token hit's step (2 × 32 MiB, peer config, one CPU device).
    """

    def __init__(self, keep_bytes: int = KEEP_PREFIX_BUFFER_BYTES):
        self.keep_bytes = keep_bytes
        self._kv: tuple[np.ndarray, np.ndarray] | None = None

    def get(self, shape: tuple[int, ...], dtype) -> tuple[np.ndarray, np.ndarray, bool]:
        """k, v of `shape` and `dtype` and whether they are fresh (all zeros): the kept pair when it matches (its
        content is the last step's: the caller writes every row), else a new zeroed pair (kept if small enough)."""
        if self._kv is not None and self._kv[0].shape == shape and self._kv[0].dtype == np.dtype(dtype):
            return (*self._kv, False)
        self._kv = None  # the old pair is freed before the new one is made
        kv = (host_lib.aligned_zeros(shape, dtype), host_lib.aligned_zeros(shape, dtype))
        if 2 * kv[0].nbytes <= self.keep_bytes:
            self._kv = kv
        return (*kv, True)


def step_kv_dtype(dtype) -> np.dtype:
    """The dtype a suffix step takes its cached K/V in: bfloat16 as its uint16 bits (`model.stack.bits`: inside the
    step's loops a bf16 slice would re-write the whole cache as float32, and a bitcast on the device is a copy), any
    other dtype as itself."""
    return np.dtype(np.uint16) if np.dtype(dtype) == np.dtype(jax.numpy.bfloat16) else np.dtype(dtype)


def prefix_arrays(engine, hits: list[Hit], capacity: int, buffers: PrefixBuffers | None = None):
    """Host arrays of a suffix step's cached prefixes: (offsets int32 `[M]`, k, v `[M, E, S, K, H]` (E stack entries
    of `engine.plan.flat`; the engine's dtype, viewed as `step_kv_dtype`), positions int32 `[M, S]`), rows laid out
    as the module docstring says (single device: one group, natural order). `buffers`: where k, v come from (and are
    kept for the next step); None: new arrays."""
    cfg, flat = engine.cfg, engine.plan.flat
    group = 1 if engine.mesh is None else engine.parallel.ring * engine.parallel.ulysses
    m, e = len(hits), len(flat)
    shape = (m, e, capacity, cfg.num_key_value_heads, cfg.head_dim)
    k, v, fresh = (buffers if buffers is not None else PrefixBuffers(keep_bytes=0)).get(shape, engine.dtype)
    pos = np.full((m, capacity), attn_lib.INVALID_POS, np.int32)
    offsets = np.zeros((m,), np.int32)
    per = capacity // group
    for j, hit in enumerate(hits):
        p = hit.cached
        offsets[j] = p
        q = -(-p // group)
        for d in range(group):
            lo, hi = d * q, min(p, (d + 1) * q)
            if hi > lo:
                pos[j, d * per:d * per + hi - lo] = np.arange(lo, hi, dtype=np.int32)
            for entry, layer in enumerate(flat):
                # rows a layer does not hold (sliding, before its window), capacity padding and padding stack
                # entries are zero (no position: never attended; zero so that 0 · value stays 0)
                a = max(lo, hit.prefix.start.get(layer, 0)) if layer >= 0 else hi
                w0, w1 = (d * per + a - lo, d * per + hi - lo) if a < hi else (d * per, d * per)
                if a < hi:
                    hit.prefix.copy_rows(layer, a, hi, k[j, entry, w0:w1], v[j, entry, w0:w1])
                if not fresh:  # a kept buffer holds the last step's rows: zero only what is not written now
                    for x in (k, v):
                        x[j, entry, d * per:w0] = 0
                        x[j, entry, w1:(d + 1) * per] = 0
    bits = step_kv_dtype(engine.dtype)
    return offsets, k.view(bits), v.view(bits), pos
