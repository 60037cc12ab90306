"""Prefix reuse, the parts without JAX: content-addressed KV blocks, the cache identity, the host-memory tier.

- **Blocks.** A prompt is cut into blocks of `block_size` tokens; block i's hash is SHA-256 of (block i−1's hash,
  block i's token ids as int32 little-endian), block 0 chained to the **identity** (as vLLM's automatic prefix caching
  chains its block hashes, with the cache salt in the first block). Equal hash at block i ⇔ the same identity and the
  same first (i+1)·block_size tokens. Only whole blocks are hashed; a hit reuses at most n − 1 tokens (the last
  token's hidden state is what the first token needs, so at least one token is always computed).
- **Identity.** Everything that changes the KV of a token sequence: the model config's fingerprint, a digest of the
  weight bytes (`PrefillEngine.weights_digest`), the K/V dtype, the KV layout (KV heads, head_dim, sliding window,
  layer kinds) and the request's `cache_salt` (vLLM's name: one tenant's prefix never serves another's; the salt
  itself is never written anywhere, only inside this hash).
- **Host tier.** `HostTier` keeps the KV of recent prompts in host RAM (natural token order, every layer whole),
  least-recently-used first out under a byte budget; an entry in use (`pin`) is never evicted.

Block size (default `DEFAULT_BLOCK`, 128 tokens): a hit reuses whole blocks, so up to B − 1 tokens of a shared
prefix are recomputed; B = 128 is gpt-oss's sliding window, so that waste is never more than one window of work, and
it keeps the index small (1,024 hashes for a 128K-token prompt). Length buckets (`parallel.layout.bucket_length`)
apply to the *suffix*, so B need not divide a bucket.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
import time
from collections import OrderedDict

import numpy as np

DEFAULT_BLOCK = 128
HASH_HEX = 32  # hex digits kept of each SHA-256 block hash (128 bits)


@dataclasses.dataclass(frozen=True)
class ReuseOptions:
    """Prefix-reuse options that travel together (engine, launcher, HTTP endpoint).

    enabled: look up and reuse cached prefixes (default True); exports are then written with every sliding-layer
      token (`sliding_policy: "full"`), which reuse at an arbitrary block boundary needs.
    block_size: tokens per hashed block (≥ 1; see the module docstring for the default).
    host_bytes: byte budget of the host-memory tier (0 turns it off; default 2 GiB).
    """

    enabled: bool = True
    block_size: int = DEFAULT_BLOCK
    host_bytes: int = 2 << 30

    def __post_init__(self):
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size < 1:
            raise ValueError(f"prefix block_size={self.block_size!r}: must be an integer >= 1")
        if not isinstance(self.host_bytes, int) or self.host_bytes < 0:
            raise ValueError(f"prefix host_bytes={self.host_bytes!r}: must be an integer >= 0")


def identity(*, fingerprint: str, weights: str, dtype: str, kv_heads: int, head_dim: int, window: int,
             layer_types, cache_salt: str | None = None) -> str:
    """The cache identity (hex) of KV computed under these conditions (module docstring). `cache_salt`: None or a
    string; two different salts (or a salt and none) never share a prefix."""
    desc = {"fingerprint": fingerprint, "weights": weights, "dtype": dtype, "kv_heads": int(kv_heads),
            "head_dim": int(head_dim), "window": int(window), "layer_types": list(layer_types),
            "salt": None if cache_salt is None else hashlib.sha256(cache_salt.encode()).hexdigest()}
    return hashlib.sha256(repr(sorted(desc.items())).encode()).hexdigest()[:HASH_HEX]


def block_hashes(tokens, ident: str, block_size: int) -> list[str]:
    """Chained hashes of the whole blocks of `tokens` (int ids): `[n // block_size]` hex strings."""
    ids = np.asarray(tokens, dtype="<i4")
    out, parent = [], bytes.fromhex(ident)
    for i in range(ids.size // block_size):
        h = hashlib.sha256(parent + ids[i * block_size:(i + 1) * block_size].tobytes()).digest()
        out.append(h.hex()[:HASH_HEX])
        parent = h[:HASH_HEX // 2]
    return out


def reusable_tokens(num_blocks_hit: int, n: int, block_size: int) -> int:
    """Tokens a hit of `num_blocks_hit` leading blocks reuses for an n-token prompt: whole blocks, at most n − 1."""
    return min(num_blocks_hit, (n - 1) // block_size) * block_size


class Rows:
    """One layer's K (or V) rows `[n, K, H]` held as consecutive segments (NumPy arrays, never written after they are
    made), so that host-tier entries share rows by reference: a hit's entry is its prefix's segments plus the rows it
    computed, where a copy of a 16K-token prefix cost ~80 ms per turn (peer config) and every turn of a conversation
    held the whole conversation again.

    Segments may be views of one another's arrays; `owners()` names the arrays that own their memory (what
    `HostTier` counts, once however many entries share them).
    """

    def __init__(self, segments):
        """`segments`: arrays `[m_i, K, H]` of one dtype, at least one (empty ones are dropped)."""
        segments = tuple(segments)
        if not segments:
            raise ValueError("Rows needs at least one segment (an empty one for no rows)")
        self._empty = segments[0][:0]
        self.segments = tuple(a for a in segments if a.shape[0])
        self.dtype = self._empty.dtype
        self.shape = (sum(a.shape[0] for a in self.segments), *self._empty.shape[1:])

    def __len__(self) -> int:
        return self.shape[0]

    def owners(self) -> list[np.ndarray]:
        """The arrays owning the segments' memory (a segment itself, or the array it is a view of)."""
        out = []
        for s in self.segments:
            while s.base is not None and isinstance(s.base, np.ndarray):
                s = s.base
            out.append(s)
        return out

    def _pieces(self, lo: int, hi: int):
        """(segment, first row, last row) of the rows [lo, hi), in order. Raises IndexError outside [0, n]."""
        if not 0 <= lo <= hi <= len(self):
            raise IndexError(f"rows [{lo}, {hi}) outside [0, {len(self)})")
        at = 0
        for s in self.segments:
            a, b = max(lo, at), min(hi, at + s.shape[0])
            if a < b:
                yield s, a - at, b - at
            at += s.shape[0]

    def slice(self, lo: int, hi: int) -> Rows:
        """Rows [lo, hi) as views of the segments (no copy)."""
        return Rows([s[a:b] for s, a, b in self._pieces(lo, hi)] or [self._empty])

    def extend(self, rows: np.ndarray) -> Rows:
        """These rows followed by `rows [m, K, H]` (referenced, not copied)."""
        return Rows((*self.segments, rows))

    def array(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Rows [lo, hi) as one array: a view when they lie in one segment, else a copy."""
        hi = len(self) if hi is None else hi
        parts = [s[a:b] for s, a, b in self._pieces(lo, hi)]
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else self._empty

    def copy_into(self, dst: np.ndarray, lo: int, hi: int) -> None:
        """`dst[:hi − lo] = rows [lo, hi)`, segment by segment (no intermediate array)."""
        at = 0
        for s, a, b in self._pieces(lo, hi):
            dst[at:at + b - a] = s[a:b]
            at += b - a


def as_rows(a) -> Rows:
    """`a` as `Rows` (an array becomes one segment)."""
    return a if isinstance(a, Rows) else Rows((a,))


@dataclasses.dataclass
class PrefixKV:
    """The KV of a prompt's first `num_tokens` tokens, ready for a suffix step: per global layer id, K and V
    `[num_tokens, K, H]` (`Rows` from the host tier or arrays from an export; natural order, post-RoPE, the engine's
    dtype; a sliding layer may hold only its rows from `start`), and where it came from (`source`: "host" or an
    export path)."""

    num_tokens: int
    k: dict
    v: dict
    source: str
    start: dict[int, int] = dataclasses.field(default_factory=dict)  # first row held per layer (default 0)

    def rows(self, layer: int, lo: int, hi: int):
        """K, V arrays of positions [lo, hi) of `layer` (lo must be ≥ the layer's first held row; a copy only where
        host-tier rows span segments)."""
        s = self.start.get(layer, 0)
        return tuple(as_rows(a[layer]).array(lo - s, hi - s) for a in (self.k, self.v))

    def copy_rows(self, layer: int, lo: int, hi: int, k_dst: np.ndarray, v_dst: np.ndarray) -> None:
        """Write K, V of positions [lo, hi) of `layer` into `k_dst[:hi − lo]`, `v_dst[:hi − lo]`."""
        s = self.start.get(layer, 0)
        as_rows(self.k[layer]).copy_into(k_dst, lo - s, hi - s)
        as_rows(self.v[layer]).copy_into(v_dst, lo - s, hi - s)

    def shared_rows(self, layer: int, lo: int, hi: int) -> tuple[Rows, Rows]:
        """K, V of positions [lo, hi) of `layer` to keep in a host-tier entry: views of host-tier rows (shared), a
        copy of an export's rows (its arrays may be file-backed, or hold rows the entry does not need)."""
        s = self.start.get(layer, 0)
        out = []
        for a in (self.k[layer], self.v[layer]):
            out.append(a.slice(lo - s, hi - s) if isinstance(a, Rows) else Rows((a[lo - s:hi - s].copy(),)))
        return out[0], out[1]


@dataclasses.dataclass
class HostEntry:
    """One prompt's KV in host memory: token ids, its block hashes, per-layer K/V `Rows` `[n, K, H]` (natural order;
    arrays are taken as one segment), sharing segments with the entries it was computed from."""

    key: str
    tokens: np.ndarray
    hashes: list[str]
    k: dict[int, Rows]
    v: dict[int, Rows]

    def __post_init__(self):
        self.k = {i: as_rows(a) for i, a in self.k.items()}
        self.v = {i: as_rows(a) for i, a in self.v.items()}

    def owners(self) -> dict[int, np.ndarray]:
        """The arrays owning its rows' memory, by `id`."""
        return {id(o): o for rows in (*self.k.values(), *self.v.values()) for o in rows.owners()}


class RefCounts:
    """Thread-safe use counts by key: `add` / `remove` (a key at 0 is dropped); `held(key)` says whether one is in
    use. The host tier pins entries with it, `kv.store.KVStore` the exports a load is reading."""

    def __init__(self):
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, key: str) -> None:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1

    def remove(self, key: str) -> None:
        with self._lock:
            left = self._counts.get(key, 0) - 1
            if left > 0:
                self._counts[key] = left
            else:
                self._counts.pop(key, None)

    def held(self, key: str) -> bool:
        with self._lock:
            return self._counts.get(key, 0) > 0


class BlockIndex:
    """Block hash → the keys of every entry holding that block, the latest added first. Several entries hold the
    same blocks (a conversation's turns, a document under many questions): when one leaves (evicted, removed,
    refused), the others still serve those blocks. Not locked: the host tier and `kv.store.KVStore` call it under
    their own locks."""

    def __init__(self):
        self._by_hash: dict[str, dict[str, None]] = {}  # insertion-ordered: the last key is the latest added

    def add(self, key: str, hashes: list[str]) -> None:
        for h in hashes:
            holders = self._by_hash.setdefault(h, {})
            holders.pop(key, None)
            holders[key] = None

    def remove(self, key: str, hashes: list[str]) -> None:
        for h in hashes:
            holders = self._by_hash.get(h)
            if holders is not None:
                holders.pop(key, None)
                if not holders:
                    del self._by_hash[h]

    def holders(self, block_hash: str):
        """The keys of the entries holding `block_hash`, the latest added first (an iterator: O(1) to the first)."""
        return reversed(self._by_hash.get(block_hash, {}))

    def clear(self) -> None:
        self._by_hash.clear()


class HostTier:
    """Host-memory prefix tier: LRU over entries under a byte budget; pinned entries are never evicted.

    Thread-safe. `lookup(hashes)` → (entry, blocks matched) for the entry sharing the most leading blocks. `nbytes`
    counts the memory the entries hold: an array shared by several entries (a conversation's earlier turns, a
    document under many questions: `Rows`) once, and until the last entry holding it leaves.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[str, HostEntry] = OrderedDict()
        self._index = BlockIndex()
        self._owners: dict[int, list] = {}  # id(array) -> [array, entries holding it]
        self._pins = RefCounts()
        self._lock = threading.Lock()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, entry: HostEntry) -> bool:
        """Insert (or refresh) an entry, evicting least-recently-used unpinned ones to fit; False if it cannot fit."""
        owners = entry.owners()
        with self._lock:
            if sum(o.nbytes for i, o in owners.items() if i not in self._owners) > self.max_bytes:
                return False
            if entry.key in self._entries:
                self._drop(entry.key)
            self._entries[entry.key] = entry
            for i, o in owners.items():
                held = self._owners.setdefault(i, [o, 0])
                if held[1] == 0:
                    self.nbytes += o.nbytes
                held[1] += 1
            self._index.add(entry.key, entry.hashes)
            self._evict()
            return entry.key in self._entries

    def _drop(self, key: str) -> None:
        e = self._entries.pop(key)
        for i in e.owners():
            held = self._owners[i]
            held[1] -= 1
            if held[1] == 0:
                self.nbytes -= held[0].nbytes
                del self._owners[i]
        self._index.remove(key, e.hashes)

    def _evict(self) -> None:
        for key in list(self._entries):
            if self.nbytes <= self.max_bytes:
                return
            if not self._pins.held(key):
                self._drop(key)

    def lookup(self, hashes: list[str], touch: bool = True) -> tuple[HostEntry | None, int]:
        """The entry sharing the longest run of leading block hashes (and how many), marked recently used unless
        `touch` is False (admission's look ahead: a request it rejects uses nothing)."""
        with self._lock:
            for i in range(len(hashes), 0, -1):
                key = next(self._index.holders(hashes[i - 1]), None)
                if key is not None:
                    if touch:
                        self._entries.move_to_end(key)
                    return self._entries[key], i
        return None, 0

    def pin(self, key: str) -> None:
        """Mark an entry in use: never evicted until `unpin`."""
        self._pins.add(key)

    def unpin(self, key: str) -> None:
        self._pins.remove(key)
        with self._lock:
            self._evict()


def export_rows(tier: HostTier, manifest: dict) -> dict | None:
    """The rows an export holds, taken from the host tier's entry of the same prompt instead of its files: global
    layer id → `kv.format.LayerKV` (K, V `[b − a, K, H]` for the manifest's `token_range` [a, b) of the layer,
    int32 positions, kind), views into the entry (copies where its rows span segments). None when the tier holds no
    entry of exactly this prompt (no block hashes in the manifest: reuse off or a prompt shorter than a block;
    evicted; only a longer prompt's) or its arrays disagree with the manifest (dtype, length, a layer missing).

    The entry is matched by the manifest's identity-rooted block hashes (`block_hashes`: the weights, dtype, KV
    layout and cache_salt are in them) and its token ids' hash. Its arrays are never written after `HostTier.add`,
    so an eviction meanwhile leaves the views valid."""
    from slope_jax.kv.format import LayerKV, token_hash

    hashes = (manifest.get("prefix") or {}).get("hashes") or []
    if not hashes:
        return None
    entry, matched = tier.lookup(list(hashes))
    if entry is None or matched < len(hashes) or token_hash(entry.tokens) != manifest.get("token_ids_sha256"):
        return None
    n, out = int(manifest["num_tokens"]), {}
    for rec in manifest["layers"]:
        i, (a, b) = int(rec["layer"]), (int(x) for x in rec["token_range"])
        k, v = entry.k.get(i), entry.v.get(i)
        if k is None or v is None or b != n or k.shape[0] != n or k.dtype.name != manifest.get("dtype"):
            return None
        out[i] = LayerKV(k.array(a, b), v.array(a, b), np.arange(a, b, dtype=np.int32), rec["kind"])
    return out


_WEIGHTS_CACHE: dict[tuple, str] = {}
RACY_NS = 2_000_000_000  # a file changed this recently may change again within the same clock tick: not cached


def weights_digest(path: str) -> str:
    """XXH3-128 (32 hex digits) of every byte of an HF / `original/` checkpoint's weight files (`*.safetensors`,
    headers included, in sorted relative-path order, each prefixed by its name and size): the identity of the weights
    that a prefix cache and a KV export record, so that KV computed with other weights of the same config is never
    reused or loaded. Computed once per process for unchanged files (keyed by names, sizes, inodes, modification and
    change times; files changed in the last 2 s are hashed again: a rewrite within one tick of the file system's
    clock keeps its times); ~7 GB/s of hashing here. Raises FileNotFoundError when the directory holds no weight
    file (a converted directory: use the loaded parameters' digest instead)."""
    files = []
    for sub in ("", "original"):
        d = os.path.join(path, sub)
        if os.path.isdir(d):
            files += [os.path.join(sub, n) for n in sorted(os.listdir(d)) if n.endswith(".safetensors")]
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weight files to digest")
    t0 = time.time_ns()  # before the stats: a change just after them is within RACY_NS of t0, however long hashing
    st = {f: os.stat(os.path.join(path, f)) for f in files}
    key = (os.path.realpath(path), tuple((f, s.st_size, s.st_ino, s.st_mtime_ns, s.st_ctime_ns) for f, s in st.items()))
    if key in _WEIGHTS_CACHE:
        return _WEIGHTS_CACHE[key]
    import xxhash

    h = xxhash.xxh3_128()
    for rel in files:
        h.update(f"{rel}:{st[rel].st_size}:".encode())
        with open(os.path.join(path, rel), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
    if all(t0 - s.st_ctime_ns > RACY_NS for s in st.values()):
        _WEIGHTS_CACHE[key] = h.hexdigest()
    return h.hexdigest()
