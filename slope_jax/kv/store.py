"""The owner of a KV directory's policy (no JAX): whether an export may be written, prefix reuse, retention.

Every entry point (the engine, the launcher's intake, the HTTP endpoint) asks one `KVStore` per `--kv_dir`:
- **exists / overwrite** (`check_new`): an existing export of an id is an error unless the store may overwrite it.
- **reuse** (`lookup`, `load_prefix`, `record`): an in-memory index, block hash → every export holding that block
  (`kv.prefix.BlockIndex`), rebuilt from the manifests at start-up (`scan`, so reuse survives restarts) and kept
  current as exports are published (`record`) and as other writers publish into the same directory (`refresh`: only
  names not seen before are read). Only manifests are read for the index; an entry's tensors are read when it serves
  a hit, with every file's digest checked and its token ids compared with the request's, so a tampered, truncated
  or stale entry is skipped (`ReuseRefused` names why; `discard` takes it out of the index) and the prefix is taken
  from another export holding it, or the request computed cold.
- **retention** (`max_bytes`, `max_age_s`): when the store is opened (`PrefillEngine.use_store` / `kv_store`) and
  after each publication, exports are removed least recently used first while the directory holds more than
  `max_bytes` of export files, and exports not used for `max_age_s`; an export this process holds (`hold`) or one
  published less than `min_age_s` ago (60 s: a decode engine handed it has that long to read it) is never removed.
  Last use is the version directory's mtime (`lookup` touches it), so the order survives restarts. Removing an id
  collects its superseded versions; once per grace period retention sweeps versions no pointer names, and `scan`
  sweeps killed runs' staging debris (`kv.format.collect`). The same policy bounds P/D exports that a decode engine
  has consumed.
- **a directory that takes no writes** (read-only, full, over quota, no permission: `unwritable`): reuse from the
  exports already there goes on (reads are all it needs), new prefixes are not stored, an export it refuses fails
  alone (`exports_required`: the request errors, or only its `export_error` says so) and leaves nothing behind, and
  retention keeps what it cannot remove; `note_unwritable` logs one warning per store naming the directory and the
  error. The host tier (RAM) is unaffected.
Two writers sharing a directory never corrupt each other: exports are published atomically (`kv.format.publish`),
the index lives in each process's memory, and a reader that finds an entry gone computes cold.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time

import numpy as np

from slope_jax.kv import format as kvfmt
from slope_jax.kv import prefix as prefix_lib

log = logging.getLogger(__name__)


# errors that say the directory takes no (more) writes, as opposed to a fault of one export
UNWRITABLE = frozenset({errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM,
                        errno.ENOTDIR})


# a directory modification time younger than this is "racy" (as git calls an index entry of the same second): two
# publications within one tick of the file system's coarse clock leave the same mtime, so `refresh` lists again
RACY_MTIME_NS = 2_000_000_000


# retention's default minimum age of an export (`KVStore.min_age_s`): the NIXL pool's default lease
# (`serve.http`, $SLOPE_JAX_KV_LEASE_S), the time a decode engine is given to read what it was handed
MIN_AGE_S = 60.0

SKIPS_LOGGED = 20  # entries of one store whose reason for not being reused is logged at WARNING (`KVStore._skip`)


class ReuseRefused(ValueError):
    """A cached entry cannot serve a prefix hit; the message names the entry and the reason."""


def unwritable(err: BaseException | None) -> bool:
    """True if `err` (or an error it was raised from: `raise ... from`) is an OSError saying the directory takes no
    writes: read-only file system, no space left, disk quota exceeded, a file-size limit (`ulimit -f`), permission
    denied, a path component that is not a directory, or a directory whose parent cannot be created
    (`kv.format.UncreatableDirectoryError`)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, kvfmt.UncreatableDirectoryError) or (isinstance(err, OSError) and err.errno in UNWRITABLE):
            return True
        seen.add(id(err))
        err = err.__cause__
    return False


def _reuse_record(manifest: dict) -> tuple[int, list[str]] | None:
    """The manifest's `prefix` record as (block size, block hashes), or None when it is absent or malformed (a block
    size that is not a positive integer, hashes that are not a list of strings): such an export is no reuse candidate,
    and one bad manifest never stops the directory's other exports from serving."""
    pre = manifest.get("prefix")
    if not isinstance(pre, dict):
        return None
    block, hashes = pre.get("block_size"), pre.get("hashes")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        return None
    if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
        return None
    return block, hashes


def _first_servable_block(manifest: dict, block: int, num_blocks: int) -> int:
    """Index of the first whole block whose end p this export can serve as a cached prefix: a p-token prefix needs
    every full layer's rows from 0 and every sliding layer's from max(0, p − W + 1). A `"full"` export serves every
    block (0); a `"last_window"` one keeps sliding rows from `sliding_from` only, so its earlier blocks are not
    indexed (a prompt sharing only those is computed cold instead of being matched to an entry that must refuse it,
    and the entry keeps serving the longer prefixes it holds)."""
    if block < 1:
        return num_blocks
    starts = {kvfmt.SLIDING: 0, kvfmt.FULL: 0}
    for rec in manifest["layers"]:
        starts[rec["kind"]] = max(starts.get(rec["kind"], 0), int(rec["token_range"][0]))
    if starts[kvfmt.FULL] > 0:
        return num_blocks
    lo = starts[kvfmt.SLIDING]
    return 0 if lo == 0 else min(num_blocks, -(-(lo + int(manifest["model"]["sliding_window"]) - 1) // block) - 1)


class KVStore:
    """Policy of one KV directory.

    Args:
      kv_dir: the export directory (`<kv_dir>/<request_id>/`, `slope_jax.kv.format`).
      overwrite: an existing export of a request id may be replaced (atomically); default False: it is an error.
      max_bytes: retention budget of export files in bytes (None: unbounded).
      max_age_s: exports unused for longer than this are removed (None: no age limit).
      min_age_s: retention never removes an export published less than this long ago (default `MIN_AGE_S`, 60 s,
        the NIXL pool's default lease): a decode engine given its path has that long to read it, and a record that
        names it is true when written. The directory may exceed `max_bytes` by the exports of the last `min_age_s`.
      exports_required: where the directory takes no writes (`unwritable`), a request whose export it refuses fails
        (`RequestError`; default True, the launcher's: a decode engine reads every export); False (the Python API's
        `PrefillEngine.kv_store`): the request's result comes back with `kv_path` None and `export_error` saying why.
    """

    def __init__(self, kv_dir: str, *, overwrite: bool = False, max_bytes: int | None = None,
                 max_age_s: float | None = None, exports_required: bool = True, min_age_s: float | None = None):
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"kv_dir max_bytes={max_bytes}: must be >= 0")
        if max_age_s is not None and max_age_s <= 0:
            raise ValueError(f"kv_dir max_age_s={max_age_s}: must be > 0")
        self.kv_dir = kv_dir
        self.overwrite = overwrite
        self.exports_required = exports_required
        self.write_error: str | None = None  # why the directory first refused a write (None: it never did)
        self.max_bytes, self.max_age_s = max_bytes, max_age_s
        self.min_age_s = MIN_AGE_S if min_age_s is None else float(min_age_s)
        self._lock = threading.RLock()
        self._seen: dict[str, str] = {}  # request id -> version dir indexed (or "" for an unusable one)
        self._listed: dict[str, int] = {}  # request id -> inode of its directory entry at the last listing
        self._versions: set[str] = set()  # version directory names at the last listing
        self._swept = 0.0  # time.time() of retention's last sweep of superseded versions (`retain`)
        self._entries: dict[str, dict] = {}  # request id -> {"hashes", "block", "bytes", "used", "version", ...}
        self._blocks = prefix_lib.BlockIndex()  # block hash -> the entries holding it
        self._held = prefix_lib.RefCounts()
        self._dir_mtime = None
        self._warned: set[str] = set()  # conditions already warned about (one warning line each per store)
        self.removed: list[str] = []  # ids removed by retention (for logs and tests)
        self.skipped: dict[str, str] = {}  # ids whose entry is no reuse candidate -> why (`_skip`)

    # -------------------------------------------------------------------------------------------------- exists
    def check_new(self, request_id: str) -> None:
        """Raise `ExportExistsError` (naming the path and the way out) if `request_id` already has an export here and
        this store may not overwrite it."""
        kvfmt.check_target(self.kv_dir, request_id, self.overwrite)

    def exists(self, request_id: str) -> bool:
        return os.path.lexists(os.path.join(self.kv_dir, request_id))

    # -------------------------------------------------------------------------------------------------- index
    def scan(self) -> int:
        """(Re)build the index from every export's manifest; returns the number of reusable entries."""
        with self._lock:
            self._seen.clear(), self._entries.clear(), self._blocks.clear(), self._listed.clear()
            self._dir_mtime, self._versions = None, set()
            self._collect()  # debris of runs that were killed, versions no pointer names (past their grace periods)
            self.refresh()
            return len(self._entries)

    def refresh(self) -> None:
        """Index exports published since the last look: nothing to do while the directory's mtime is unchanged (every
        publication, replacement or removal renames or unlinks an entry in it); else one `scandir`, and only the ids
        whose directory entry is new or was replaced (another inode, or a new version directory of the id) are read
        again (~35 ms for 10,000 exports here, against ~70 ms reading every pointer)."""
        try:
            mtime = os.stat(self.kv_dir).st_mtime_ns
        except OSError:
            return
        with self._lock:
            if mtime == self._dir_mtime:
                return
            # a modification time this recent may be shared by a publication still to come (the file system stamps
            # from a coarse clock tick): not trusted, so the next lookup lists the directory again
            self._dir_mtime = mtime if time.time_ns() - mtime > RACY_MTIME_NS else None
            try:
                listed = {e.name: e.inode() for e in os.scandir(self.kv_dir)}
            except OSError as e:
                self._warn("list", f"cannot list it ({e}); no prefix reuse from it until it can be read "
                                   "(requests are computed cold)")
                return
            versions = {name for name in listed if name.startswith(".v-")}
            renewed = {kvfmt.export_id(v) for v in versions - self._versions}  # re-exported, whatever the inode
            self._versions = versions
            names = {name: inode for name, inode in listed.items() if not name.startswith(".")}
            for gone in (set(self._seen) | set(self._listed)) - set(names):
                self._forget(gone)
                self._listed.pop(gone, None)
            for rid, inode in names.items():
                if self._listed.get(rid) != inode or rid in renewed:
                    self._listed[rid] = inode
                    self._index(rid)

    def _index(self, rid: str) -> None:
        path = os.path.join(self.kv_dir, rid)
        try:
            version = kvfmt.pointer_version(self.kv_dir, rid) if os.path.islink(path) else rid
        except kvfmt.KVFormatError as e:  # a foreign link: never read as an export, never followed by retention
            if self._seen.get(rid) != "":
                self._forget(rid)
                self._seen[rid] = ""
                self._skip(rid, str(e))
            return
        except OSError:
            return
        if self._seen.get(rid) == version:
            return
        self._forget(rid)
        self._seen[rid] = version
        try:
            m = kvfmt.read_manifest(path)
        except (kvfmt.KVFormatError, OSError) as e:  # not a reuse candidate (the decode side reports it too)
            if os.path.lexists(path):  # else removed while it was read: another writer's retention, no fault
                self._skip(rid, str(e) if isinstance(e, kvfmt.KVFormatError) else f"{path}: {e}")
            return
        record = _reuse_record(m)
        if record is None:
            return
        try:  # last use: the version directory's mtime (`lookup` touches it), so LRU survives restarts
            used = os.lstat(os.path.join(self.kv_dir, version)).st_mtime
            published = os.stat(os.path.join(self.kv_dir, version, kvfmt.MANIFEST)).st_mtime
        except OSError:
            used = published = time.time()
        block, hashes = record
        try:
            entry = {"hashes": hashes[_first_servable_block(m, block, len(hashes)):], "block": block,
                     "bytes": sum(int(c["bytes"]) for c in m["checksums"].values()), "used": used,
                     "published": published, "version": version}
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            self._skip(rid, f"{path}: manifest fields reuse reads are malformed ({type(e).__name__}: {e})")
            return  # a manifest the format check let through but reuse cannot read: not a candidate
        self._entries[rid] = entry
        self._blocks.add(rid, entry["hashes"])
        self.skipped.pop(rid, None)

    def _skip(self, rid: str, reason: str) -> None:
        """Log why entry `rid` is no reuse candidate: one line per entry (and version), the first `SKIPS_LOGGED` of a
        store at WARNING, the rest at DEBUG after one line saying so."""
        with self._lock:
            self.skipped[rid] = reason
            n = len(self.skipped)
        if n <= SKIPS_LOGGED:
            log.warning("kv_dir %s: entry %r is not used for prefix reuse: %s", self.kv_dir, rid, reason)
        else:
            if n == SKIPS_LOGGED + 1:
                log.warning("kv_dir %s: more entries are not used for prefix reuse; further reasons are logged at "
                            "DEBUG level", self.kv_dir)
            log.debug("kv_dir %s: entry %r is not used for prefix reuse: %s", self.kv_dir, rid, reason)

    def _forget(self, rid: str) -> None:
        self._seen.pop(rid, None)
        e = self._entries.pop(rid, None)
        if e:
            self._blocks.remove(rid, e["hashes"])

    def record(self, request_id: str) -> None:
        """Index an export this process just published, then apply retention."""
        with self._lock:
            self._seen.pop(request_id, None)
            self._index(request_id)
        self.retain()

    def lookup(self, hashes: list[str], block_size: int, touch: bool = True) -> tuple[str | None, int]:
        """(request id, leading blocks matched) of the export sharing the most leading blocks of `hashes`, marked used
        (retention's LRU, on disk too) unless `touch` is False (admission's look ahead)."""
        self.refresh()
        with self._lock:
            for i in range(len(hashes), 0, -1):
                rid = next((r for r in self._blocks.holders(hashes[i - 1]) if self._entries[r]["block"] == block_size),
                           None)
                if rid is not None:
                    if touch:
                        self._used(rid)
                    return rid, i
        return None, 0

    def _used(self, rid: str) -> None:
        """Mark an entry used now, also on disk (its version directory's mtime: what `_index` reads after a restart;
        a directory that refuses it only loses that)."""
        e = self._entries[rid]
        e["used"] = time.time()
        try:
            os.utime(os.path.join(self.kv_dir, e["version"]), (e["used"], e["used"]))
        except OSError:
            pass

    def discard(self, request_id: str) -> None:
        """Drop an entry from the index (it failed to serve a hit); the files stay for the decode side."""
        with self._lock:
            e = self._entries.get(request_id)
            if e:
                self._blocks.remove(request_id, e["hashes"])
                e["hashes"] = []

    # -------------------------------------------------------------------------------------------------- loading
    def load_prefix(self, request_id: str, tokens: np.ndarray, num_tokens: int, *, cfg, dtype: str,
                    weights: str) -> prefix_lib.PrefixKV:
        """The KV of the first `num_tokens` of `tokens` from export `request_id`, verified: manifest vs the model
        (`cfg` fingerprint, layer kinds, KV heads, head_dim, window), dtype, weights digest, every file's size and
        digest, and the export's own token ids vs the request's. Raises ReuseRefused naming the reason."""
        path = os.path.join(self.kv_dir, request_id)
        self.hold(request_id)
        try:
            m = kvfmt.read_manifest(path, cfg)
            if m["dtype"] != dtype:
                raise ReuseRefused(f"{path}: dtype {m['dtype']} (this engine computes {dtype})")
            if m["model"].get("weights_digest") != weights:
                raise ReuseRefused(f"{path}: model.weights_digest {m['model'].get('weights_digest')!r} is not this "
                                   f"engine's weights ({weights})")
            kv, ids = kvfmt.load_with_tokens(path, cfg)
        except kvfmt.KVFormatError as e:
            raise ReuseRefused(str(e)) from e
        except OSError as e:
            raise ReuseRefused(f"{path}: {e}") from e
        except Exception as e:  # noqa: BLE001 - bytes that pass the digest but no parser reads (a manifest whose
            # digests were rewritten to match other bytes): the entry cannot serve, the request must not fail
            raise ReuseRefused(f"{path}: unreadable ({type(e).__name__}: {str(e)[:200]})") from e
        finally:
            self.release(request_id)
        if ids is None or ids.size < num_tokens or not np.array_equal(ids[:num_tokens], tokens[:num_tokens]):
            raise ReuseRefused(f"{path}: its token ids differ from the request's first {num_tokens} tokens")
        start = {}
        for layer, lk in kv.items():
            lo = int(lk.positions[0]) if lk.positions.size else num_tokens
            need = max(0, num_tokens - cfg.sliding_window + 1) if lk.kind == kvfmt.SLIDING else 0
            if lo > need:
                raise ReuseRefused(f"{path}: layer {layer} holds tokens from {lo}, a {num_tokens}-token prefix needs "
                                   f"them from {need} (sliding_policy {m['sliding_policy']!r})")
            start[layer] = lo
        return prefix_lib.PrefixKV(num_tokens, {i: lk.k for i, lk in kv.items()}, {i: lk.v for i, lk in kv.items()},
                                   source=path, start=start)

    def hold(self, request_id: str) -> None:
        """Mark an export in use by this process: retention never removes it until `release`."""
        self._held.add(request_id)

    def release(self, request_id: str) -> None:
        self._held.remove(request_id)

    # -------------------------------------------------------------------------------------------------- retention
    def retain(self, now: float | None = None) -> list[str]:
        """Apply `max_age_s` and `max_bytes` (least recently used first; held exports are kept). Returns the ids
        removed."""
        if self.max_bytes is None and self.max_age_s is None:
            return []
        now = time.time() if now is None else now
        if now - self._swept > kvfmt.GC_GRACE_S:  # versions no pointer names (their id removed, by anyone) and dead
            self._swept = now  # staging, once per grace period: one listing of the directory
            self._collect()
        self.refresh()
        removed = []
        with self._lock:
            order = sorted(self._entries, key=lambda r: self._entries[r]["used"])
            total = sum(e["bytes"] for e in self._entries.values())
            for rid in order:
                e = self._entries[rid]
                old = self.max_age_s is not None and now - e["used"] > self.max_age_s
                over = self.max_bytes is not None and total > self.max_bytes
                if not (old or over) or self._held.held(rid) or now - e["published"] < self.min_age_s:
                    continue
                if self._remove(rid, e["version"]):
                    total -= e["bytes"]
                    removed.append(rid)
        if removed:
            log.info("kv_dir retention: removed %d export(s) of %s (least recently used first): %s", len(removed),
                     self.kv_dir, ", ".join(removed[:8]) + (" …" if len(removed) > 8 else ""))
        self.removed.extend(removed)
        return removed

    def _remove(self, rid: str, version: str) -> bool:
        """Remove export `rid` if its pointer still names `version` (another writer may have replaced it)."""
        path = os.path.join(self.kv_dir, rid)
        try:
            if os.path.islink(path):
                if kvfmt.pointer_version(self.kv_dir, rid) != version:
                    return False
                os.remove(path)  # the pointer first: a directory that refuses it keeps the export whole
                kvfmt.remove_tree(os.path.join(self.kv_dir, version))
            else:  # a version-2 export (a plain directory): set aside whole first, for the same reason
                aside = os.path.join(self.kv_dir, f".old-{kvfmt.new_run_nonce()}-0.{rid}")
                os.rename(path, aside)
                kvfmt.remove_tree(aside)
        except FileNotFoundError:
            pass
        except kvfmt.KVFormatError:  # replaced by a foreign link meanwhile: nothing through it is removed
            return False
        except OSError as e:
            if unwritable(e):
                self.note_unwritable(f"{type(e).__name__}: {e}")
            else:
                self._warn("remove", f"retention cannot remove {path!r} ({e}); the export stays")
            return False
        self._forget(rid)
        self._collect(rid)  # its superseded versions past their grace period
        return True

    def _collect(self, rid: str | None = None) -> None:
        """`kv.format.collect` of one id (None: every id), never failing: what a directory refuses to remove stays."""
        try:
            kvfmt.collect(self.kv_dir, rid)
        except OSError as e:
            log.debug("kv_dir %s: garbage collection stopped (%s)", self.kv_dir, e)

    def note_unwritable(self, reason: str) -> None:
        """Record that the directory refused a write (`unwritable`; `reason` names the error) and say once per store
        what it means: reuse from the exports already there goes on, new prefixes are not stored."""
        with self._lock:
            if self.write_error is None:
                self.write_error = reason
        self._warn("write", f"takes no writes ({reason}): prefix reuse continues from the exports already there "
                            "without storing new prefixes; " + (
                                "requests whose KV export it refuses fail" if self.exports_required else
                                "requests run without their KV export (PrefillResult.export_error says why)"))

    def _warn(self, condition: str, message: str) -> None:
        """One warning line per condition per store."""
        with self._lock:
            if condition in self._warned:
                return
            self._warned.add(condition)
        log.warning("kv_dir %s: %s", self.kv_dir, message)
