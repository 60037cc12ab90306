"""KV hand-off over NIXL (UCX) from host memory: no shared filesystem between prefill and decode.

The prefill side keeps each finished request's KV — per layer K, V `[T, K, H]` and int32 positions `[T]`, the tensors
an export writes (`slope_jax.kv.format`) — in one registered host-memory arena (`KVPool`) and hands the decode side
`kv_transfer_params` (`{PARAMS_KEY: {...}}`, plain JSON): the pool's NIXL agent name and serialized metadata (base64),
the entry's address and per-layer offsets, shapes, dtype, the manifest and an XXH3-128 digest per layer. The decode
side (`KVReader.pull`, or the module-level `pull`) pulls the bytes with one-sided NIXL READs into its own registered
buffer, checks each layer's digest as its READ completes and returns what `slope_jax.kv.format.load` returns:
global layer id → `LayerKV(k, v, positions, kind)`.

Lifetime (the pool never frees KV a reader is pulling; a reader never accepts KV that was freed):
- the pool is bounded in bytes (`capacity_bytes`); a publish that does not fit evicts least recently used entries
  that no reader holds, and raises `KVPoolFull` if the held ones leave no room;
- every entry has a lease (`lease_s`): unheld past it, it is freed;
- read handshake, over NIXL notifications (`sjkv1:` + JSON): the reader asks `hold` (entry, token, seconds; its own
  agent metadata the first time it talks to that pool), the pool answers `held` (the seconds granted, at most
  `max_hold_s`) or `gone` (why: released, lease expired, evicted, discarded, unknown); while a hold is live the entry
  is never freed. The reader posts its READs with the question and uses nothing before the answer `held` (safe:
  entry keys are never reused and a freed entry never returns, so an entry live at the answer was live since its
  publication). After the READs it sends `release` (`done`: the decode side has the KV, free it once no other hold
  is live; a failed pull drops only its hold) and waits, briefly, for the pool's `released`: the reader's agent has
  no progress thread, so a notification it sends goes out only while it calls NIXL, and a release left queued kept
  the entry until its hold or lease lapsed. A hold that outlives its seconds (a reader that died) lapses; every
  layer's digest is checked, so even a reader whose hold lapsed mid-pull never accepts reused memory.

Each layer is one contiguous region [K | V | positions] (64-byte aligned) with its own READ, so a connector can write
layer i into its cache while later layers are in flight (`on_layer`).

Several processes (a multi-process prefill: each holds its shards of every step): each publishes its own pieces —
rows [a, b) of a layer — in its own pool (`KVPool.publish_pieces`), and `compose` names every pool in one record;
a reader pulls the parts in parallel, each with its own hold, and gets each piece under its layer id (`on_layer`)
or whole layers (`join`). Each byte then crosses the network once, from the process that computed it.

Imports numpy, xxhash and ml_dtypes at module level (no JAX, no torch: vLLM's venv imports it); `nixl` on first use.
UCX picks its transports itself (shared memory / CMA between processes of one host, RDMA or TCP between hosts);
`UCX_NET_DEVICES=lo` keeps it on loopback (what the tests and `benchmarks/handoff.py` set).
"""

from __future__ import annotations

import base64
import collections
import concurrent.futures
import dataclasses
import functools
import importlib.metadata
import json
import os
import queue
import secrets
import threading
import time
from typing import Callable, Mapping, Sequence

import numpy as np
import xxhash

from slope_jax.kv.format import DTYPES, LayerKV

PARAMS_KEY = "slope_jax_nixl"  # kv_transfer_params[PARAMS_KEY]: what a reader needs (see `KVPool.publish`)
PROTOCOL = 1  # one pool's record
MAX_UNCLAIMED_REPLIES = 256  # pools' answers a reader keeps for a waiter that has not asked yet (late ones dropped)
COMPOSED_PROTOCOL = 2  # `compose`'s: a reader that knows only 1 refuses it by its protocol, not a missing field
_MSG = b"sjkv1:"  # notification prefix: the lease protocol's messages, JSON after it
_ALIGN = 64  # layer regions start on cache lines
_ENTRY_ALIGN = 4096  # entries start on pages
_GONE_KEEP = 4096  # freed entries remembered for a clear "gone" reason


class KVTransferError(RuntimeError):
    """A pull failed; the message names the request and the cause. Attributes: `request_id`, `cause`, `unreachable`
    (the pool's agent could not be reached or a READ failed, as opposed to a refused, gone or corrupt entry)."""

    def __init__(self, request_id: str, cause: str, *, unreachable: bool = False):
        self.request_id, self.cause, self.unreachable = request_id, cause, unreachable
        super().__init__(f"KV pull of request {request_id!r} failed: {cause}")


class KVPoolFull(RuntimeError):
    """A publish does not fit the pool even after evicting every entry no reader holds."""


def _nixl():
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent, nixl_agent_config


@functools.cache
def nixl_release() -> str:
    """The NIXL build this process runs, as `<distribution> <version>` (e.g. `nixl-cu12 1.5.1`: the package that holds
    the agent, which the `nixl` meta package only selects), or `unknown`. Agents of different releases may not read
    each other's metadata (measured over UCX: 1.3.2 and 1.5.1 cannot; 1.4.1, 1.5.1 and 1.5.2 can)."""
    top = _nixl()[0].__module__.split(".")[0]  # nixl_cu12: its distribution's name, normalized (1 ms, no scan)
    for dist in (top, "nixl"):
        try:
            return f"{dist.replace('_', '-')} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def _release_hint(theirs: object, side: str) -> str:
    """A clause naming both NIXL releases when `theirs` (the peer's `nixl_release()`) differs from ours, else ''."""
    mine = nixl_release()
    if not isinstance(theirs, str) or theirs == mine:
        return ""
    return (f"; the {side} runs NIXL {theirs} and this process {mine}: agents of different releases may not read "
            f"each other's metadata, install one release on both sides (launch/vllm_venv.sh pins nixl==1.5.1)")


def _new_agent(name: str):
    agent_cls, config_cls = _nixl()
    return agent_cls(name, config_cls(enable_prog_thread=False, backends=["UCX"]))


def _descs(rows: list[tuple[int, int]]) -> np.ndarray:
    """NIXL's Nx3 descriptor array (address, bytes, device id 0) for host memory."""
    return np.array([(a, n, 0) for a, n in rows], dtype=np.uint64).reshape(-1, 3)


def _message(**fields) -> bytes:
    return _MSG + json.dumps(fields, separators=(",", ":")).encode()


def _parse(raw: bytes) -> dict | None:
    if not raw.startswith(_MSG):
        return None
    try:
        msg = json.loads(raw[len(_MSG):])
    except ValueError:
        return None
    return msg if isinstance(msg, dict) else None


def _log(text: str) -> None:
    import logging

    logging.getLogger(__name__).warning(text)


def _digest(buf) -> str:
    return xxhash.xxh3_128_hexdigest(buf)


def _aligned(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def handoff_manifest(manifest: dict) -> dict:
    """The manifest a hand-off record carries: the export's, less `prefix.hashes` (one hash per prefix-reuse block,
    ~6,000 at 100K tokens: only the prefill's own cache reads them)."""
    out = dict(manifest)
    if isinstance(out.get("prefix"), dict):
        out["prefix"] = {k: v for k, v in out["prefix"].items() if k != "hashes"}
    return out


def is_composed(rec: Mapping) -> bool:
    """Whether a hand-off record (the `PARAMS_KEY` part) is a `compose`d one (by its protocol, the only field a
    reader trusts before validating it)."""
    return rec.get("protocol") == COMPOSED_PROTOCOL


def parts_of(rec: Mapping) -> list:
    """The one-pool records a hand-off record is made of: a `compose`d record's parts, else the record itself."""
    return list(rec["parts"]) if is_composed(rec) else [rec]


def params_of(kv_transfer_params: Mapping | None) -> dict | None:
    """The NIXL hand-off record of a request's kv_transfer_params (`kv_transfer_params[PARAMS_KEY]`), or None."""
    if not kv_transfer_params:
        return None
    rec = kv_transfer_params.get(PARAMS_KEY)
    return rec if isinstance(rec, dict) else None


def compose(request_id: str, parts: list[dict], manifest: dict) -> dict:
    """One hand-off record over several pools: the request's `kv_transfer_params` (`{PARAMS_KEY: rec}`) whose
    `rec["parts"]` are the records of `KVPool.publish_pieces` (each process of a multi-process prefill publishes
    its own pieces in its own pool), so a reader pulls every piece straight from the process that computed it: each
    byte crosses the network once, and the pools are read in parallel. `rec` also holds `request_id`, `protocol`,
    `nbytes` (the staging a reader needs: the parts page-aligned one after another), `dtype`, `nixl` and `manifest`
    (the export's, whose `layers[].token_range` the pieces must tile). Raises ValueError for parts of different
    dtypes or without pieces."""
    parts = [params_of(p) or p for p in parts]
    dtypes = {p.get("dtype") for p in parts}
    if not parts or len(dtypes) != 1 or any(not isinstance((p.get("manifest") or {}).get("pieces"), list)
                                            for p in parts):
        raise ValueError(f"request {request_id!r}: compose needs publish_pieces records of one dtype, got "
                         f"{len(parts)} with dtypes {sorted(map(str, dtypes))}")
    nbytes = sum(_aligned(int(p["nbytes"]), _ENTRY_ALIGN) for p in parts)
    return {PARAMS_KEY: {"protocol": COMPOSED_PROTOCOL, "request_id": request_id, "parts": parts, "nbytes": nbytes,
                         "dtype": dtypes.pop(), "nixl": nixl_release(), "manifest": manifest}}


def join(manifest: dict, pieces: list, out: np.ndarray | None = None) -> dict[int, LayerKV]:
    """Whole layers from pieces (`(layer, a, b, k, v)`, any order, every process's): global layer id → LayerKV over
    the manifest's `token_range` of that layer (its `kind`), in token order; a layer of one piece is that piece, the
    others are joined in `out` (a uint8 buffer large enough: views into it) or fresh arrays. Raises ValueError when
    the pieces do not tile a layer's range exactly (a piece missing or overlapping, `_check_tiling`)."""
    _check_tiling(manifest, [(int(p[0]), int(p[1]), int(p[2])) for p in pieces])
    by_layer: dict[int, list] = {}
    for p in pieces:
        by_layer.setdefault(int(p[0]), []).append(p)
    result, at = {}, 0
    for rec in manifest["layers"]:
        layer, (a, b) = int(rec["layer"]), (int(x) for x in rec["token_range"])
        have = sorted(by_layer[layer], key=lambda p: p[1])
        kv = []
        for i in (3, 4):
            parts = [p[i] for p in have]
            if len(parts) == 1:
                kv.append(parts[0])
                continue
            shape, dtype = (b - a, *parts[0].shape[1:]), parts[0].dtype
            dst = None
            if out is not None:
                n = int(np.prod(shape)) * dtype.itemsize
                dst = out[at:at + n].view(dtype).reshape(shape)
                at = -(-(at + n) // 64) * 64
            kv.append(np.concatenate(parts, out=dst))
        result[layer] = LayerKV(kv[0], kv[1], np.arange(a, b, dtype=np.int32), rec["kind"])
    return result


# ---------------------------------------------------------------------------------------------------------------
# Prefill side
@dataclasses.dataclass
class _Entry:
    key: str
    request_id: str
    offset: int  # in the arena
    nbytes: int
    lease: float  # seconds after `last_use` an unheld entry is freed
    last_use: float  # monotonic: publication, or the last hold or release
    holds: dict = dataclasses.field(default_factory=dict)  # token -> monotonic end of the hold
    done: bool = False  # a reader reported it has the KV: free once no hold is live


def _layer_layout(kv: Mapping[int, object]) -> tuple[list[dict], str]:
    """Per-layer region records (offsets relative to the entry) and the common dtype name. Raises ValueError."""
    layers, off, dtype = [], 0, None
    for layer in sorted(kv):
        lkv = kv[layer]
        k, v, pos = np.asarray(lkv.k), np.asarray(lkv.v), np.asarray(lkv.positions)
        if k.ndim != 3 or k.shape != v.shape or k.dtype != v.dtype or pos.shape != (k.shape[0],):
            raise ValueError(f"layer {layer}: k {k.shape} {k.dtype}, v {v.shape} {v.dtype}, positions {pos.shape}: "
                             "expected k and v [T, K, H] of one dtype and positions [T]")
        if dtype is None:
            dtype = k.dtype.name
        if k.dtype.name != dtype or dtype not in DTYPES:
            raise ValueError(f"layer {layer}: dtype {k.dtype.name}, expected one of {DTYPES}, the same in every layer")
        kb = k.nbytes
        layers.append({"layer": int(layer), "kind": str(lkv.kind), "offset": off, "tokens": int(k.shape[0]),
                       "kv_heads": int(k.shape[1]), "head_dim": int(k.shape[2]), "nbytes": 2 * kb + 4 * k.shape[0]})
        off = _aligned(off + layers[-1]["nbytes"], _ALIGN)
    return layers, dtype or "float32"


class KVPool:
    """The prefill side's registered host-memory pool of finished requests' KV, served to readers over NIXL.

    Args:
      capacity_bytes: the arena's size; every entry lives in it (one NIXL registration, so the agent metadata a reader
        loads never changes).
      lease_s: an entry no reader holds is freed this many seconds after its publication or its last hold or
        release (a release that reports the KV received frees it at once).
      max_hold_s: the longest hold granted to one reader's request.
      name: the NIXL agent name (default: unique per pool).
      prefault: touch the arena's pages now, so publishing does not pay first-touch page faults.
      poll_s: the notification thread's sleep when idle (a reader's READs do not wait for it: see `KVReader`).
    The pool serves holds and releases on a daemon thread; `close()` stops it and deregisters the arena.
    """

    def __init__(self, capacity_bytes: int, *, lease_s: float = 60.0, max_hold_s: float = 120.0,
                 name: str | None = None, prefault: bool = True, poll_s: float = 0.001):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes={capacity_bytes}: expected > 0")
        self.capacity_bytes, self.lease_s, self.max_hold_s = int(capacity_bytes), lease_s, max_hold_s
        self.poll_s = poll_s
        self.name = name or f"slope-kvpool-{os.getpid()}-{secrets.token_hex(4)}"
        self._agent = _new_agent(self.name)
        self._nixl = nixl_release()  # named in every record
        self._arena = np.empty(self.capacity_bytes, np.uint8)
        if prefault:
            self._arena.fill(0)  # np.zeros would map pages lazily: touch them now, not during a publish
        self._base = self._arena.ctypes.data
        self._reg = self._agent.register_memory(_descs([(self._base, self.capacity_bytes)]), "DRAM")
        self._metadata = base64.b64encode(self._agent.get_agent_metadata()).decode()
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._free = [(0, self.capacity_bytes)]  # sorted (offset, size) extents
        self._gone: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._peers: set[str] = set()
        self._refused: set[str] = set()  # readers whose metadata failed to load (logged once each)
        self._count = 0
        self._filler_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"{self.name}-notifs", daemon=True)
        self._thread.start()

    # -- publishing ---------------------------------------------------------------------------------------------
    def publish(self, request_id: str, kv: Mapping[int, object], manifest: dict | None = None, *,
                lease_s: float | None = None) -> dict:
        """Copy one request's KV into the pool and return the request's `kv_transfer_params` (`{PARAMS_KEY: rec}`).

        `kv`: global layer id → an object with `k`, `v` `[T, K, H]` (one dtype: float32, bfloat16 or float16),
        `positions` int32 `[T]` and `kind` (`LayerKV`, `PrefillResult.kv`, what `format.load` returns); `manifest`:
        the export's manifest dict (JSON), handed to the reader unchanged. `rec` holds `agent`, `agent_metadata`
        (base64), `entry`, `address`, `nbytes`, `dtype`, `layers` (per layer: `layer`, `kind`, `offset` in the entry,
        `tokens`, `kv_heads`, `head_dim`, `nbytes`, `xxh3_128`), `lease_s`, `nixl` (`nixl_release()`), `manifest`.
        Raises ValueError for inconsistent tensors, KVPoolFull if it does not fit beside the held entries.
        """
        layers, dtype = _layer_layout(kv)
        total = _aligned(max(1, layers[-1]["offset"] + layers[-1]["nbytes"] if layers else 1), _ENTRY_ALIGN)
        with self._lock:
            offset = self._allocate(total, request_id)  # reserved: not in _entries until its bytes are in place
            self._count += 1
            key = f"{request_id}#{self._count}"
        try:  # layers in parallel: the copies and digests release the GIL (one layer per thread at a time)
            digests = self._fillers().map(lambda rec: self._fill(offset + rec["offset"], kv[rec["layer"]]), layers)
            for rec, digest in zip(layers, digests):
                rec["xxh3_128"] = digest
        except BaseException:
            with self._lock:
                self._release_extent(offset, total)
            raise
        lease = self.lease_s if lease_s is None else float(lease_s)
        now = time.monotonic()
        with self._lock:
            self._entries[key] = _Entry(key, request_id, offset, total, lease, now)
        return {PARAMS_KEY: {"protocol": PROTOCOL, "request_id": request_id, "entry": key, "agent": self.name,
                             "agent_metadata": self._metadata, "address": self._base + offset, "nbytes": total,
                             "dtype": dtype, "digest": "xxh3_128", "layers": layers, "lease_s": lease,
                             "nixl": self._nixl, "manifest": manifest}}

    def publish_export(self, path: str, cfg=None, *, verify: bool = True, lease_s: float | None = None) -> dict:
        """Publish a file export (`<kv_dir>/<request_id>`, read by `format.load`, its file digests checked with
        `verify`) with its manifest (`handoff_manifest`: less the prefix-reuse block hashes, which no reader uses)."""
        from slope_jax.kv import format as kvfmt

        target = kvfmt.resolve(path)  # one version: the manifest and the tensors of the same export
        manifest = kvfmt.read_manifest(target)
        kv = kvfmt.load(target, cfg, verify=verify)
        return self.publish(manifest["request_id"], kv, handoff_manifest(manifest), lease_s=lease_s)

    def publish_pieces(self, request_id: str, pieces: list, kinds: Sequence[str] | Mapping[int, str], *,
                       lease_s: float | None = None) -> dict:
        """Publish one process's pieces of a request's KV (a multi-process prefill holds each layer's rows spread
        over its processes): `pieces` are `(layer, a, b, K [b − a, K, H], V)`, the rows [a, b) of global layer
        `layer` (`kinds[layer]`: its kind, e.g. the config's `layer_types`). Returns `publish`'s kv_transfer_params
        whose record's `layers[i]` is piece i and whose manifest is `{"pieces": [[layer, a, b], ...]}`: a part of a
        `compose`d record. Raises what `publish` raises."""
        kv = {i: LayerKV(k, v, np.arange(a, b, dtype=np.int32), kinds[layer])
              for i, (layer, a, b, k, v) in enumerate(pieces)}
        return self.publish(request_id, kv, {"pieces": [[int(x) for x in p[:3]] for p in pieces]}, lease_s=lease_s)

    def _fillers(self) -> concurrent.futures.ThreadPoolExecutor:
        """The threads that copy and digest a publication's layers (created on first use, one per core up to 4)."""
        with self._lock:
            if self._filler_pool is None:
                self._filler_pool = concurrent.futures.ThreadPoolExecutor(
                    min(4, os.cpu_count() or 1), thread_name_prefix=f"{self.name}-fill")
            return self._filler_pool

    def _fill(self, at: int, lkv) -> str:
        """Write one layer's [K | V | positions] at arena offset `at`; the region's digest."""
        k, v = np.ascontiguousarray(lkv.k), np.ascontiguousarray(lkv.v)
        pos = np.ascontiguousarray(lkv.positions, dtype="<i4")
        kb = k.nbytes
        region = self._arena[at: at + 2 * kb + pos.nbytes]
        region[:kb] = k.reshape(-1).view(np.uint8)
        region[kb: 2 * kb] = v.reshape(-1).view(np.uint8)
        region[2 * kb:] = pos.view(np.uint8)
        return _digest(region)

    # -- the arena ------------------------------------------------------------------------------------------------
    def _allocate(self, size: int, request_id: str) -> int:
        """First fit; evicts least recently used unheld entries until `size` fits. Called with the lock held."""
        now = time.monotonic()
        held = sum(e.nbytes for e in self._entries.values() if self._live_holds(e, now))
        if size > self.capacity_bytes - held:  # refused before evicting anything
            raise KVPoolFull(f"request {request_id!r}: its KV needs {size} bytes; the pool has {self.capacity_bytes} "
                             f"bytes, {held} of them held by readers")
        while True:
            for i, (off, n) in enumerate(self._free):
                if n >= size:
                    self._free[i: i + 1] = [(off + size, n - size)] if n > size else []
                    return off
            idle = [e for e in self._entries.values() if not self._live_holds(e, now)]
            if not idle:  # fragmentation: the held entries split the free space
                raise KVPoolFull(f"request {request_id!r}: no free extent of {size} bytes between the entries "
                                 "readers hold")
            self._drop(min(idle, key=lambda e: e.last_use), "evicted (least recently used) to make room")

    def _release_extent(self, offset: int, size: int) -> None:
        free = sorted(self._free + [(offset, size)])
        merged = [free[0]]
        for off, n in free[1:]:
            last_off, last_n = merged[-1]
            if last_off + last_n == off:
                merged[-1] = (last_off, last_n + n)
            else:
                merged.append((off, n))
        self._free = merged

    def _drop(self, e: _Entry, reason: str) -> None:
        del self._entries[e.key]
        self._release_extent(e.offset, e.nbytes)
        self._gone[e.key] = reason
        while len(self._gone) > _GONE_KEEP:
            self._gone.popitem(last=False)

    @staticmethod
    def _live_holds(e: _Entry, now: float) -> bool:
        for token in [t for t, end in e.holds.items() if end <= now]:
            del e.holds[token]  # a hold that outlived its seconds (its reader died or is stuck) lapses
        return bool(e.holds)

    def discard(self, entry: str) -> bool:
        """Free an entry now (e.g. its request was aborted) unless a reader holds it; True if it was freed."""
        with self._lock:
            e = self._entries.get(entry)
            if e is None or self._live_holds(e, time.monotonic()):
                return False
            self._drop(e, "discarded by the prefill side")
            return True

    def stats(self) -> dict:
        """{capacity_bytes, used_bytes, entries, held: entries with a live hold, per_entry: {entry: {request_id,
        nbytes, holds, done, lease_left_s}}}."""
        now = time.monotonic()
        with self._lock:
            for e in self._entries.values():
                self._live_holds(e, now)  # lapsed holds are not counted
            per = {e.key: {"request_id": e.request_id, "nbytes": e.nbytes, "holds": len(e.holds), "done": e.done,
                           "lease_left_s": e.last_use + e.lease - now} for e in self._entries.values()}
            used = sum(e.nbytes for e in self._entries.values())
            return {"capacity_bytes": self.capacity_bytes, "used_bytes": used, "entries": len(per),
                    "held": sum(1 for p in per.values() if p["holds"]), "per_entry": per}

    def gone_reason(self, entry: str) -> str | None:
        """Why a freed entry was freed (recent ones), None if it is live or unknown."""
        with self._lock:
            return self._gone.get(entry)

    # -- the lease protocol -------------------------------------------------------------------------------------
    def _serve(self) -> None:
        """The notification thread: the only user of the pool's agent after start-up."""
        next_expiry = 0.0
        while not self._stop.is_set():
            notifs = self._agent.get_new_notifs()
            for sender, msgs in notifs.items():
                for raw in msgs:
                    msg = _parse(raw)
                    if msg is not None:
                        try:
                            self._handle(sender, msg)
                        except Exception as e:  # noqa: BLE001 - one peer's failure (e.g. gone) must not stop the pool
                            _log(f"{self.name}: message {msg.get('op')!r} from {sender!r} failed: {e!r}")
            if time.monotonic() >= next_expiry:
                self._expire()
                next_expiry = time.monotonic() + 0.01
            if not notifs:
                time.sleep(self.poll_s)

    def _handle(self, sender: str, msg: dict) -> None:
        if msg.get("md") and sender not in self._peers:
            try:
                self._agent.add_remote_agent(base64.b64decode(msg["md"]))
                self._peers.add(sender)
            except Exception as e:  # noqa: BLE001 - a bad peer must not stop the pool; it gets no answer and times out
                if sender not in self._refused:
                    self._refused.add(sender)
                    _log(f"{self.name}: cannot load the NIXL metadata of reader {sender!r} ({type(e).__name__}: {e}); "
                         f"it gets no answer{_release_hint(msg.get('nixl'), 'reader')}")
                if msg.get("op") != "release":  # a release still counts: it needs no answer to free the entry
                    return
        op, key, token = msg.get("op"), str(msg.get("entry")), str(msg.get("token"))
        now = time.monotonic()
        with self._lock:
            e = self._entries.get(key)
            if op == "hold":
                if e is None:
                    reply = _message(op="gone", token=token, reason=self._gone.get(
                        key, "unknown entry (never published by this pool, or the pool restarted)"))
                else:
                    grant = max(0.0, min(float(msg.get("hold_s", 0)), self.max_hold_s))
                    e.holds[token] = now + grant
                    e.last_use = now
                    reply = _message(op="held", token=token, hold_s=grant)
            elif op == "release":
                if e is not None:
                    e.holds.pop(token, None)
                    e.last_use = now
                    e.done = e.done or bool(msg.get("done"))
                    if e.done and not self._live_holds(e, now):
                        self._drop(e, "released: the decode side has it")
                if not msg.get("ack"):  # a reader that does not wait for the answer
                    return
                reply = _message(op="released", token=str(msg["ack"]))
            else:
                return
        if sender in self._peers:
            self._agent.send_notif(sender, reply)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for e in list(self._entries.values()):
                if not self._live_holds(e, now) and (e.done or now >= e.last_use + e.lease):
                    self._drop(e, "released: the decode side has it" if e.done else
                               "its lease expired before a reader released it")

    def close(self) -> None:
        """Stop serving, deregister the arena. Readers pulling now fail (their digests or READs)."""
        self._stop.set()
        self._thread.join(timeout=10)
        if self._filler_pool is not None:
            self._filler_pool.shutdown(wait=True)
        try:
            self._agent.deregister_memory(self._reg)
        except Exception:  # noqa: BLE001 - closing twice, or an agent already torn down
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------------------------------------------
# Decode side
@dataclasses.dataclass
class _Pull:
    """A validated hand-off record."""

    request_id: str
    entry: str
    agent: str
    metadata: bytes
    address: int
    nbytes: int
    dtype: np.dtype
    layers: list
    nixl: str | None = None  # the pool's NIXL release (`nixl_release()`), named in errors when it differs from ours


@dataclasses.dataclass
class _Parts:
    """A validated `compose`d record: `parts[i]` is pulled into the staging at `offsets[i]`; `pieces[i][j]` is the
    (layer, a, b) of its `layers[j]`."""

    request_id: str
    parts: list
    pieces: list
    offsets: list
    nbytes: int
    manifest: dict


def _spec(params: Mapping, where: str = PARAMS_KEY) -> _Pull | _Parts:
    """Validate a hand-off record (`kv_transfer_params` or its `PARAMS_KEY` part; a `compose`d one's parts each as
    a record of their own, `where` naming it). Raises KVTransferError naming the field."""
    rec = params_of(params) or params
    rid = str(rec.get("request_id", "?"))

    def bad(field, why):
        raise KVTransferError(rid, f"kv_transfer_params.{where}.{field}: {why}")

    if is_composed(rec):
        return _parts_spec(rec, rid, bad)
    if rec.get("protocol") != PROTOCOL:
        bad("protocol", f"{rec.get('protocol')!r}, this reader speaks {PROTOCOL} and {COMPOSED_PROTOCOL}")
    for field, typ in (("entry", str), ("agent", str), ("agent_metadata", str), ("address", int), ("nbytes", int),
                       ("dtype", str), ("layers", list)):
        if not isinstance(rec.get(field), typ):
            bad(field, f"missing or not a {typ.__name__}")
    if rec["dtype"] not in DTYPES:
        bad("dtype", f"{rec['dtype']!r}, expected one of {DTYPES}")
    dtype = np.dtype(rec["dtype"])
    end = 0
    for i, lay in enumerate(rec["layers"]):
        try:
            t, kh, hd, off, n = (int(lay[x]) for x in ("tokens", "kv_heads", "head_dim", "offset", "nbytes"))
            int(lay["layer"]), str(lay["kind"]), bytes.fromhex(lay["xxh3_128"])
        except (KeyError, TypeError, ValueError) as e:
            bad(f"layers[{i}]", f"malformed ({e!r})")
        if n != 2 * t * kh * hd * dtype.itemsize + 4 * t or off < end or off + n > rec["nbytes"] or min(t, kh, hd) < 0:
            bad(f"layers[{i}]", f"region [{off}, {off + n}) for {t}x{kh}x{hd} {dtype.name} does not fit the entry's "
                f"{rec['nbytes']} bytes after the previous layer (ends at {end})")
        end = off + n
    try:
        md = base64.b64decode(rec["agent_metadata"], validate=True)
    except ValueError as e:
        bad("agent_metadata", f"not base64 ({e})")
    release = rec.get("nixl") if isinstance(rec.get("nixl"), str) else None
    return _Pull(rid, rec["entry"], rec["agent"], md, rec["address"], rec["nbytes"], dtype, rec["layers"], release)


def _parts_spec(rec: Mapping, rid: str, bad) -> _Parts:
    """`_spec` of a `compose`d record: each part a record, its pieces one per layer region with the region's token
    count, the parts page-aligned within `nbytes`, every layer of the manifest tiled exactly by the pieces."""
    parts, manifest = rec.get("parts"), rec.get("manifest")
    if not isinstance(parts, list) or not parts or not all(isinstance(p, dict) for p in parts):
        bad("parts", "expected a non-empty list of records")
    if not isinstance(manifest, dict) or not isinstance(manifest.get("layers"), list):
        bad("manifest", "missing, or without layers")
    specs, pieces, offsets, at = [], [], [], 0
    for i, part in enumerate(parts):
        if is_composed(part):
            bad(f"parts[{i}]", "a composed record cannot be a part")
        spec = _spec({**part, "request_id": rid}, f"{PARAMS_KEY}.parts[{i}]")
        got = (part.get("manifest") or {}).get("pieces")
        try:
            got = [(int(p[0]), int(p[1]), int(p[2])) for p in got]
        except (TypeError, ValueError, IndexError) as e:
            bad(f"parts[{i}].manifest.pieces", f"malformed ({e!r})")
        if len(got) != len(spec.layers) or any(b - a != int(lay["tokens"]) or a < 0
                                               for (_, a, b), lay in zip(got, spec.layers)):
            bad(f"parts[{i}].manifest.pieces", f"{len(got)} pieces for {len(spec.layers)} regions, or a piece's rows "
                "differ from its region's tokens")
        specs.append(spec)
        pieces.append(got)
        offsets.append(at)
        at += _aligned(spec.nbytes, _ENTRY_ALIGN)
    if {s.dtype.name for s in specs} != {rec.get("dtype")}:  # the record's dtype is what readers check and cast from
        bad("dtype", f"{rec.get('dtype')!r}, its parts hold {sorted({s.dtype.name for s in specs})}: expected one, "
            "the same")
    if not isinstance(rec.get("nbytes"), int) or rec["nbytes"] < at:
        bad("nbytes", f"{rec.get('nbytes')!r}: the parts need {at}")
    try:
        _check_tiling(manifest, [p for got in pieces for p in got])
    except (KeyError, TypeError, ValueError) as e:
        bad("parts", str(e))
    return _Parts(rid, specs, pieces, offsets, at, manifest)


def _check_tiling(manifest: dict, pieces: list) -> None:
    """ValueError unless the (layer, a, b) pieces tile every layer's `token_range` of the manifest exactly."""
    by_layer: dict[int, list] = {}
    for layer, a, b in pieces:
        by_layer.setdefault(layer, []).append((a, b))
    want = {int(rec["layer"]): tuple(int(x) for x in rec["token_range"]) for rec in manifest["layers"]}
    for layer in sorted(set(want) | set(by_layer)):
        spans = sorted(by_layer.get(layer, []))
        if layer not in want or not spans or spans[0][0] != want[layer][0] or spans[-1][1] != want[layer][1] or \
                any(hi != lo for (_, hi), (lo, _) in zip(spans, spans[1:])):
            rows = "[{}, {})".format(*want[layer]) if layer in want else "(not in the manifest)"
            raise ValueError(f"layer {layer}: pieces {spans} do not tile its rows {rows}")


def check_record(params: Mapping) -> None:
    """Raise KVTransferError naming the field unless `params` (kv_transfer_params or its `PARAMS_KEY` record) is a
    well-formed hand-off record this reader can pull."""
    _spec(params)


class KVReader:
    """The decode side: pulls pool entries over NIXL READ (one NIXL agent per reader; thread-safe).

    Args:
      name: the NIXL agent name (default: unique).
      hold_s: the hold asked for each pull (the pool may grant less); a pull must finish within it.
      timeout_s: the longest wait for the pool's answer and for the READs.
      ack_timeout_s: the longest wait for the pool's answer to a release (`done`, the end of a pull); past it the
        entry is left to its hold's or lease's end.
    """

    def __init__(self, name: str | None = None, *, hold_s: float = 60.0, timeout_s: float = 60.0,
                 ack_timeout_s: float = 2.0):
        self.name = name or f"slope-kvreader-{os.getpid()}-{secrets.token_hex(4)}"
        self.hold_s, self.timeout_s, self.ack_timeout_s = hold_s, timeout_s, ack_timeout_s
        self._agent = _new_agent(self.name)
        self._nixl = nixl_release()  # named in each first hold
        self._metadata = base64.b64encode(self._agent.get_agent_metadata()).decode()
        self._lock = threading.RLock()  # every agent call (NIXL agents are not thread-safe by default)
        self._pools: dict[str, bytes] = {}  # pool agent name -> the metadata loaded for it
        self._introduced: set[str] = set()
        self._replies: dict[str, dict] = {}
        self._regs: dict[tuple[int, int], object] = {}  # caller buffers registered once (`out=`)

    def pull(self, params: Mapping, *, out: np.ndarray | None = None, release: bool = True,
             on_layer: Callable[[int, LayerKV], None] | None = None) -> dict[int, LayerKV]:
        """Pull a request's KV: global layer id → `LayerKV(k, v, positions, kind)`, as `format.load` returns.

        Args:
          params: the request's `kv_transfer_params` (or its `PARAMS_KEY` record), from `KVPool.publish`, or from
            `compose` (several pools, pulled in parallel: `on_layer` then gets each piece — a layer's rows
            [a, b), `positions` saying which — and the pull returns {}; without `on_layer` whole layers, joined).
          out: a uint8 buffer of at least the record's `nbytes` to read into (registered with NIXL on first use and
            kept registered: reuse it to avoid registration and first-touch page faults); the returned arrays are
            views into it. Default: a fresh buffer per pull.
          release: tell the pool the KV was received (it frees the entry once no other reader holds it); False
            only drops this pull's hold.
          on_layer: called with (layer, LayerKV) as each layer's bytes arrive and pass their digest (in order, once
            the pool has granted the hold). A pull that fails later may have delivered some layers: discard them.
        Raises KVTransferError (naming the request and the cause): a malformed record, the entry gone (released,
        lease expired, evicted, unknown), no answer from the pool, a failed READ, a digest mismatch.
        """
        spec = _spec(params)
        buf, temp = self._staging(spec, out)
        try:
            if isinstance(spec, _Parts):
                return self._pull_parts(spec, buf, release, on_layer)
            return self._pull_one(spec, buf, release, on_layer)
        finally:
            if temp is not None:
                with self._lock:
                    self._agent.deregister_memory(temp)

    def _pull_one(self, spec: _Pull, buf: np.ndarray, release: bool, on_layer) -> dict[int, LayerKV]:
        """Pull one pool's entry into `buf` (registered): hold, READs checked layer by layer, release."""
        self._connect(spec)
        token = secrets.token_hex(8)
        ok = False
        try:
            self._ask_hold(spec, token)
            kv = self._read_layers(spec, buf, on_layer, token)
            ok = True
            return kv
        except KVTransferError as e:
            if e.unreachable:  # the pool's process is gone (or its transport failed): drop its endpoint
                self._forget(spec.agent)
            raise
        finally:
            if ok or spec.agent in self._pools:
                self._release(spec, token, bool(ok and release))

    def _pull_parts(self, spec: _Parts, buf: np.ndarray, release: bool, on_layer) -> dict[int, LayerKV]:
        """Pull a `compose`d record's parts, each from its own pool on a thread of its own (NIXL and the digests
        only), in parallel; `on_layer` gets each verified piece under its global layer id on the calling thread, in
        arrival order (so a caller's per-thread settings, e.g. torch's thread count, hold for it). Waits for every
        part before it returns or raises (`on_layer`'s error first, then the first part's): no piece arrives after.
        `release` tells every pool once all parts arrived. Returns whole layers (`join`: a copy of layers of several
        pieces) when `on_layer` is None, else {} (the pieces went to it)."""
        n = len(spec.parts)
        got, errors, arrived = [None] * n, [None] * n, queue.SimpleQueue()

        def one(i: int) -> None:
            pieces = spec.pieces[i]
            hand = None if on_layer is None else (lambda j, lkv: arrived.put((pieces[j][0], lkv)))
            try:
                got[i] = self._pull_one(spec.parts[i], buf[spec.offsets[i]: spec.offsets[i] + spec.parts[i].nbytes],
                                        False, hand)
            except BaseException as e:  # noqa: BLE001 - raised by the caller once every part has ended
                errors[i] = e
            finally:
                arrived.put(None)

        threads = [threading.Thread(target=one, args=(i,), name=f"{self.name}-part{i}", daemon=True)
                   for i in range(n)]
        for t in threads:
            t.start()
        ended, failed = 0, None
        while ended < n:
            item = arrived.get()
            if item is None:
                ended += 1
            elif failed is None:
                try:
                    on_layer(*item)
                except BaseException as e:  # noqa: BLE001 - raised once every part has ended
                    failed = e
        for t in threads:
            t.join()
        for e in [failed] + errors:
            if e is not None:
                raise e
        if release:  # only once every part arrived: a failed pull leaves every entry for a retry or its lease
            for part in spec.parts:
                self._release(part, secrets.token_hex(8), True)
        if on_layer is not None:
            return {}
        return join(spec.manifest, [(layer, a, b, got[i][j].k, got[i][j].v)
                                    for i, pieces in enumerate(spec.pieces) for j, (layer, a, b) in enumerate(pieces)])

    def done(self, params: Mapping) -> bool:
        """Tell the pool the decode side is done with this record's entry (after one or more `pull(...,
        release=False)`): it is freed once no reader holds it (a composed record: every part's pool). Waits for each
        pool's answer (up to `ack_timeout_s` each); returns whether every pool answered. Best effort, like `pull`'s
        release; a malformed record, or a pool whose metadata cannot be loaded (after telling the others), raises
        KVTransferError."""
        spec = _spec(params)
        failed, answered = None, True
        for part in spec.parts if isinstance(spec, _Parts) else [spec]:
            try:
                self._connect(part)
            except KVTransferError as e:  # that pool's lease frees its entry; the others are still told
                failed = failed or e
                continue
            answered = self._release(part, secrets.token_hex(8), True) and answered
        if failed is not None:
            raise failed
        return answered

    def drop_buffer(self, out: np.ndarray) -> None:
        """Deregister a buffer registered by `pull(out=...)` (before freeing or replacing it)."""
        with self._lock:
            reg = self._regs.pop((out.ctypes.data, out.nbytes), None)
            if reg is not None:
                self._agent.deregister_memory(reg)

    def _forget(self, agent: str) -> None:
        """Drop a pool agent whose process is gone. The worker is progressed first, so that operations still queued
        to it (the hold notification) fail and leave UCX's queues: destroying an agent with them queued aborts."""
        with self._lock:
            for _ in range(50):
                self._agent.get_new_notifs()
                time.sleep(0.001)
            try:
                self._agent.remove_remote_agent(agent)
            except Exception as e:  # noqa: BLE001 - already disconnected
                _log(f"{self.name}: removing pool agent {agent!r}: {e!r}")
            self._pools.pop(agent, None)
            self._introduced.discard(agent)

    def _connect(self, spec: _Pull) -> None:
        with self._lock:
            if self._pools.get(spec.agent) == spec.metadata:
                return
            try:
                if spec.agent in self._pools:  # the same name with new metadata: a restarted pool
                    self._agent.remove_remote_agent(spec.agent)
                    self._introduced.discard(spec.agent)
                name = self._agent.add_remote_agent(spec.metadata)
            except Exception as e:  # noqa: BLE001 - NIXL raises its own error types
                raise KVTransferError(spec.request_id, f"cannot load the metadata of pool agent {spec.agent!r}: "
                                      f"{type(e).__name__}: {e}{_release_hint(spec.nixl, 'pool')}") from e
            name = name.decode() if isinstance(name, bytes) else name
            if name != spec.agent:
                raise KVTransferError(spec.request_id, f"the metadata names agent {name!r}, the record {spec.agent!r}")
            self._pools[spec.agent] = spec.metadata

    def _release(self, spec: _Pull, token: str, done: bool) -> bool:
        """Tell the pool this pull's hold ends (`done`: the KV arrived) and wait up to `ack_timeout_s` for its
        answer, progressing the agent meanwhile: without progress the notification stays queued in UCX (no progress
        thread) until this reader's next NIXL call. Returns whether the pool answered. Best effort: an unsent or
        unanswered release lets the hold lapse after its seconds (the lease frees the entry), never loses KV."""
        ack = secrets.token_hex(8)
        try:
            with self._lock:
                intro = {} if spec.agent in self._introduced else {"md": self._metadata, "nixl": self._nixl}
                self._agent.send_notif(spec.agent, _message(op="release", entry=spec.entry, token=token, done=done,
                                                            ack=ack, **intro))  # the pool answers only readers it knows
                self._introduced.add(spec.agent)
        except Exception as e:  # noqa: BLE001 - the pool is gone; nothing to release
            _log(f"request {spec.request_id!r}: release of entry {spec.entry!r} not sent: {e!r}")
            return False
        try:
            answered = self._await_reply(ack, self.ack_timeout_s) is not None
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error types (the pool went away)
            _log(f"request {spec.request_id!r}: release of entry {spec.entry!r}: {e!r}")
            return False
        if not answered:
            _log(f"request {spec.request_id!r}: pool agent {spec.agent!r} did not answer the release of entry "
                 f"{spec.entry!r} within {self.ack_timeout_s:g} s (its hold or lease frees it)")
        return answered

    def _ask_hold(self, spec: _Pull, token: str) -> None:
        """Ask the pool to hold the entry (its answer: `_await_hold`). Raises KVTransferError if it is unreachable."""
        with self._lock:
            md = None if spec.agent in self._introduced else self._metadata
            try:
                intro = {"md": md, "nixl": self._nixl} if md else {}
                self._agent.send_notif(spec.agent, _message(op="hold", entry=spec.entry, token=token,
                                                            hold_s=self.hold_s, **intro))
            except Exception as e:  # noqa: BLE001 - NIXL raises its own error types
                raise KVTransferError(spec.request_id, f"cannot reach pool agent {spec.agent!r}: "
                                      f"{type(e).__name__}: {e}", unreachable=True) from e
            self._introduced.add(spec.agent)

    def _poll_reply(self, token: str, blocking: bool) -> dict | None:
        """Progress the agent once (sending what it has queued) and take the pools' answers; the one for `token`, or
        None (also when not `blocking` and another thread holds the agent). Raises what NIXL raises."""
        if not self._lock.acquire(blocking=blocking):
            return None
        try:
            for msgs in self._agent.get_new_notifs().values():
                for raw in msgs:
                    msg = _parse(raw)
                    if msg is not None and "token" in msg:
                        self._replies[str(msg["token"])] = msg
                        if len(self._replies) > MAX_UNCLAIMED_REPLIES:  # answers nobody waits for any more
                            self._replies.pop(next(iter(self._replies)))
            return self._replies.pop(token, None)
        finally:
            self._lock.release()

    def _await_reply(self, token: str, timeout_s: float, wait: bool = True) -> dict | None:
        """The pools' answer for `token`, progressing the agent until it comes or `timeout_s` passes (then None);
        with `wait` False one try that does not wait for the agent either. Raises what NIXL raises."""
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self._poll_reply(token, wait)
            if reply is not None or not wait or time.monotonic() > deadline:
                return reply
            time.sleep(0.0002)

    def _hold_answer(self, spec: _Pull, token: str, wait: bool) -> float | None:
        """The pool's answer to `_ask_hold`: the seconds granted, or None if it has not come (only when not `wait`:
        then the agent is not waited for either). Raises KVTransferError if the entry is gone or the pool does not
        answer within the timeout."""
        try:
            reply = self._await_reply(token, self.timeout_s, wait)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error types (a peer disconnected)
            raise KVTransferError(spec.request_id, f"waiting for pool agent {spec.agent!r} to answer the "
                                  f"hold: {type(e).__name__}: {e}", unreachable=True) from e
        if reply is None:
            if not wait:
                return None
            raise KVTransferError(spec.request_id, f"pool agent {spec.agent!r} did not answer the hold of entry "
                                  f"{spec.entry!r} within {self.timeout_s:g} s (is the prefill side running?)"
                                  f"{_release_hint(spec.nixl, 'pool')}", unreachable=True)
        if reply.get("op") != "held":
            raise KVTransferError(spec.request_id, f"entry {spec.entry!r} is gone from pool {spec.agent!r}: "
                                  f"{reply.get('reason', reply)}")
        return float(reply.get("hold_s", 0.0))

    def _staging(self, spec: _Pull | _Parts, out: np.ndarray | None):
        """(buffer, registration to drop after the pull or None)."""
        if out is None:
            buf = np.empty(max(1, spec.nbytes), np.uint8)
            with self._lock:
                return buf, self._agent.register_memory(_descs([(buf.ctypes.data, buf.nbytes)]), "DRAM")
        if out.dtype != np.uint8 or out.ndim != 1 or not out.flags.c_contiguous or out.nbytes < spec.nbytes:
            raise KVTransferError(spec.request_id, f"out: a contiguous uint8 buffer of >= {spec.nbytes} bytes is "
                                  f"needed, got {out.dtype} {out.shape}")
        key = (out.ctypes.data, out.nbytes)
        with self._lock:
            if key not in self._regs:
                self._regs[key] = self._agent.register_memory(_descs([key]), "DRAM")
        return out, None

    def _read_layers(self, spec: _Pull, buf: np.ndarray, on_layer, token: str) -> dict[int, LayerKV]:
        """One READ per layer, posted in order by a helper thread (over shared memory / CMA a READ copies while it
        is posted), while this thread takes the layers as they complete and checks each digest: hashing layer i
        overlaps reading layer i+1.

        The READs start before the pool's answer to the hold; no layer is handed out (`on_layer`, the result) before
        the answer says `held`. That is safe because an entry's key is never reused and a freed entry never comes
        back, so an entry live when the pool granted the hold was live since its publication, before any of these
        READs; from then on the hold keeps it. An answer `gone` fails the pull whatever the bytes."""
        t0 = time.monotonic()
        posted: list = [None] * len(spec.layers)
        failed: list = []
        cond, stop = threading.Condition(), threading.Event()
        poster = threading.Thread(target=self._post_all, args=(spec, buf, posted, failed, cond, stop), daemon=True)
        poster.start()
        granted, out, pending = None, {}, []
        try:
            for i, lay in enumerate(spec.layers):
                self._await_read(spec, i, posted, failed, cond, t0)
                region = buf[lay["offset"]: lay["offset"] + lay["nbytes"]]
                if _digest(region) != lay["xxh3_128"]:
                    granted = self._hold_answer(spec, token, True) if granted is None else granted  # gone: say so
                    late = f"; the hold of {granted:g} s had lapsed" if time.monotonic() - t0 > granted else ""
                    raise KVTransferError(spec.request_id, f"layer {lay['layer']}: XXH3-128 digest mismatch (the bytes "
                                          f"read from pool {spec.agent!r} differ from the published ones{late})")
                out[lay["layer"]] = _layer_views(region, lay, spec.dtype)
                pending.append(lay["layer"])
                granted = self._hold_answer(spec, token, False) if granted is None else granted
                if granted is not None:
                    _deliver(pending, out, on_layer)
            if granted is None:
                granted = self._hold_answer(spec, token, True)
            _deliver(pending, out, on_layer)
            return out
        finally:
            stop.set()
            poster.join()
            self._finish([p[0] for p in posted if p is not None])

    def _await_read(self, spec: _Pull, i: int, posted: list, failed: list, cond, t0: float) -> None:
        """Until layer i's READ is posted and complete. Raises KVTransferError."""
        lay = spec.layers[i]
        with cond:
            if not cond.wait_for(lambda: posted[i] is not None or failed, timeout=self.timeout_s):
                raise KVTransferError(spec.request_id, f"the READ of layer {lay['layer']} was not posted within "
                                      f"{self.timeout_s:g} s", unreachable=True)
        if posted[i] is None:
            raise KVTransferError(spec.request_id, f"posting the READ of layer {lay['layer']} from pool agent "
                                  f"{spec.agent!r} failed: {failed[0]}", unreachable=True)
        if posted[i][1] != "DONE":  # done while posted (shared memory / CMA): no state call, no lock
            self._wait(spec, posted[i][0], lay, t0)

    def _post_all(self, spec: _Pull, buf: np.ndarray, posted: list, failed: list, cond, stop) -> None:
        for i, lay in enumerate(spec.layers):
            if stop.is_set():
                return
            try:
                with self._lock:
                    local = self._agent.get_xfer_descs(_descs([(buf.ctypes.data + lay["offset"], lay["nbytes"])]),
                                                       "DRAM")
                    remote = self._agent.get_xfer_descs(_descs([(spec.address + lay["offset"], lay["nbytes"])]),
                                                        "DRAM")
                    h = self._agent.initialize_xfer("READ", local, remote, spec.agent)
                    state = self._agent.transfer(h)
                    if state == "ERR":
                        h.release()
                        raise RuntimeError("NIXL returned ERR")
            except Exception as e:  # noqa: BLE001 - handed to the reading thread, which raises it with the request
                with cond:
                    failed.append(f"{type(e).__name__}: {e}")
                    cond.notify_all()
                return
            with cond:
                posted[i] = (h, state)
                cond.notify_all()

    def _state(self, h) -> tuple[str, str]:
        """A transfer's state (`PROC`, `DONE` or `ERR`) and, for an error NIXL raised instead of returning `ERR` (its
        peer disconnected mid-READ: `nixlRemoteDisconnectError`), its name and text."""
        with self._lock:
            try:
                return self._agent.check_xfer_state(h), ""
            except Exception as e:  # noqa: BLE001 - NIXL raises its own error types
                return "ERR", f"{type(e).__name__}: {e}"

    def _wait(self, spec: _Pull, h, lay: dict, t0: float) -> None:
        while True:
            state, why = self._state(h)
            if state == "DONE":
                return
            if state == "ERR":
                raise KVTransferError(spec.request_id, f"the NIXL READ of layer {lay['layer']} failed ("
                                      f"{why or 'pool agent gone or the memory deregistered'}; pool agent "
                                      f"{spec.agent!r}{_release_hint(spec.nixl, 'pool')})", unreachable=True)
            if time.monotonic() - t0 > self.timeout_s:
                raise KVTransferError(spec.request_id, f"the READ of layer {lay['layer']} did not finish within "
                                      f"{self.timeout_s:g} s", unreachable=True)
            time.sleep(0.0001)

    def _finish(self, handles: list) -> None:
        """Release transfer handles; one still in flight (an error path) is waited for first."""
        for h in handles:
            deadline = time.monotonic() + self.timeout_s
            with self._lock:
                while self._state(h)[0] == "PROC" and time.monotonic() < deadline:
                    time.sleep(0.0001)
                try:
                    h.release()
                except Exception:  # noqa: BLE001 - a handle NIXL could not abort is kept in its leak list
                    pass

    def close(self) -> None:
        """Deregister the caller buffers registered through `out=`."""
        with self._lock:
            for reg in self._regs.values():
                self._agent.deregister_memory(reg)
            self._regs.clear()


def _deliver(pending: list, out: dict, on_layer) -> None:
    """Hand the verified layers in `pending` to `on_layer` (in order) and clear it."""
    if on_layer is not None:
        for layer in pending:
            on_layer(layer, out[layer])
    pending.clear()


def _layer_views(region: np.ndarray, lay: dict, dtype: np.dtype) -> LayerKV:
    t, kh, hd = lay["tokens"], lay["kv_heads"], lay["head_dim"]
    kb = t * kh * hd * dtype.itemsize
    return LayerKV(region[:kb].view(dtype).reshape(t, kh, hd), region[kb: 2 * kb].view(dtype).reshape(t, kh, hd),
                   region[2 * kb: 2 * kb + 4 * t].view("<i4"), lay["kind"])


_default: KVReader | None = None
_default_lock = threading.Lock()


def pull(params: Mapping, **kwargs) -> dict[int, LayerKV]:
    """`KVReader.pull` on this process's default reader (created on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = KVReader()
    return _default.pull(params, **kwargs)
