"""KV export of a sharded prefill step (`slope_jax.kv.format` on disk), one or many processes.

`KVExporter.export_batch` takes a step's K/V (global jax arrays `[M, stack, T, K, H]` in the layout's token order)
and, per request: every process writes the pieces its devices hold into one fresh staging directory (named from the
run nonce and an export counter advanced identically on every process), all meet at a barrier, process 0 writes the
manifest and publishes (`format.publish`, atomic), and every process learns which exports were published.
A directory that takes no writes (read-only, full, over quota, no permission: `store.unwritable`) fails only the
exports it refuses: each is reported as its request's `export_error` (nothing of it is left in `kv_dir`), and the
caller decides whether that fails the request (`KVStore.exports_required`).
numpy at import; JAX (multihost_utils) only when a multi-process run calls it, so `slope_jax.kv` stays JAX-free.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Sequence

import numpy as np

from slope_jax.kv import format as kvfmt
from slope_jax.kv.store import unwritable

log = logging.getLogger(__name__)

# each process's outcome of one export (its own piece; process 0 also the publication), all-gathered or broadcast
OK, NOT_WRITABLE, FAILED = 0, 1, 2


class ExportFailed(RuntimeError):
    """Process 0 could not publish some exports of a step (multi-process runs: raised on every process); the
    message names the request ids and process 0's errors."""


class KVExporter:
    """Exports the requests of prefill steps to `kv_dir/<id>/`.

    Args:
      cfg: the model config (`layer_types`, `sliding_window`; the manifest records it).
      stack_layers: the layer held by each entry of the K/V stack axis, -1 for an empty slot
        (`parallel.stages.StagePlan.flat`).
      dtype: the K/V dtype's name ("bfloat16", "float32"), as the manifest records it.
      run_nonce: this run's nonce, the same on every process (staging names, manifest).
    """

    def __init__(self, cfg, stack_layers: Sequence[int], dtype: str, run_nonce: str, weights_digest: str | None = None):
        self.cfg, self.stack_layers, self.dtype, self.run_nonce = cfg, list(stack_layers), dtype, run_nonce
        self.weights_digest = weights_digest  # recorded as the manifest's model.weights_digest
        self.count = 0  # exports begun, advanced identically on every process

    def export_batch(self, kv_dir: str, ids: list[str], batch: list[np.ndarray], k, v, positions: np.ndarray,
                     full: bool, results: list, overwrite: bool, *, offsets: Sequence[int] | None = None,
                     prefixes: Sequence | None = None, reuse: Sequence[dict | None] | None = None,
                     started: float | None = None) -> dict[str, str]:
        """Export every request of a step. `batch[j]`: request j's token ids; `positions[i]`: the position of layout
        row i within the step; `results[j]` gets `kv_path` and `export_ms` (first token on the host → this request's
        export published; `started`: the `time.perf_counter()` the first tokens reached the host, default now).
        Each device shard of K/V is copied to the host once for the whole batch.
        Prefix hits: the step computed request j's tokens from `offsets[j]` on (its rows hold positions
        `positions + offsets[j]`); `prefixes[j]` (`kv.prefix.PrefixKV`) holds its first `offsets[j]` tokens, which
        process 0 writes into its own file, so the export is whole: a decode engine cannot tell it from a cold one.
        `reuse[j]`: the prefix record for the manifest (`{"block_size", "hashes"}`) or None.
        Returns {request id: reason} of the exports `kv_dir` refused to take (`store.unwritable`: read-only, full,
        over quota, no permission; the same ids on every process): their results get `kv_path` None and
        `export_error` naming the path and the error, and nothing of them stays in `kv_dir`.
        Raises ExportFailed naming the requests whose export failed otherwise (multi-process: on every process); a
        single process raises process 0's error itself."""
        import jax

        e0 = time.perf_counter() if started is None else started
        me, multi = jax.process_index(), jax.process_count() > 1
        host = self.host_shards(k, v)
        status, reasons = [], {}
        for j, (rid, res) in enumerate(zip(ids, results)):
            req = self._request(j, batch, positions, full, offsets, prefixes, reuse)
            staging, code, err = self._write_own_pieces(kv_dir, rid, host, j, req, full, me, multi)
            if me == 0 and code == OK:
                try:
                    self._publish(kv_dir, rid, staging, k, j, req, full, res.first_token, overwrite)
                except Exception as e:  # noqa: BLE001 - reported to every process below, then raised
                    if not multi and not unwritable(e):
                        raise
                    code, err = (NOT_WRITABLE if unwritable(e) else FAILED), e
            if me == 0 and code == NOT_WRITABLE and _discard(kv_dir, rid, staging):
                code = OK  # the failure came after the atomic publication: the export is whole and in place
            if err is not None and code != OK:
                reasons[rid] = f"{type(err).__name__}: {err}" if isinstance(err, BaseException) else err
            status.append(code)
            res.export_ms = 1e3 * (time.perf_counter() - e0)
        if multi:
            status = _agree_published(ids, status, reasons)
        return self._report(kv_dir, ids, results, status, reasons)

    @staticmethod
    def _report(kv_dir: str, ids: list[str], results: list, status: list[int], reasons: dict) -> dict[str, str]:
        """Each result's `kv_path` (published) or `export_error` (refused by the directory); the refused ids."""
        refused = {}
        for rid, res, code in zip(ids, results, status):
            path = os.path.join(kv_dir, rid)
            if code == OK:
                res.kv_path = path
                continue
            refused[rid] = reasons.get(rid, "process 0 could not write it (see its log)")
            res.kv_path = None
            res.export_error = f"KV export {path!r} not written: {kv_dir!r} takes no writes ({refused[rid]})"
        return refused

    def _write_own_pieces(self, kv_dir, rid, host, j, req: _Req, full, me, multi) -> tuple[str, int, object]:
        """This process's pieces of request j into a fresh staging directory, then every process learns whether
        every piece was written (multi-process: an all-gather, also the barrier before process 0 publishes).
        Returns (staging path, OK / NOT_WRITABLE / FAILED over all processes, the error: this process's OSError, a
        peer's as text, or None)."""
        staging = kvfmt.staging_dir(kv_dir, rid, self.run_nonce, self.count)
        self.count += 1
        n = int(req.tokens.size)
        err = None
        try:
            sf = req.sliding_from
            local = [seg for index, hk, hv in host for seg in self.segments(index, hk, hv, j, n, sf, req.positions)]
            if me == 0:
                local += list(self.prefix_segments(req.prefix, n, sf))
            if local or me == 0:
                kvfmt.write_shard_file(staging, me, local, token_ids=req.tokens if me == 0 else None)
        except OSError as e:
            if not multi and not unwritable(e):
                raise
            err = e
        code = OK if err is None else NOT_WRITABLE if unwritable(err) else FAILED
        if not multi:
            return staging, code, err
        from jax.experimental import multihost_utils

        if err is not None:
            log.info("kv export %s: process %d could not write its piece: %s", staging, me, err)
        codes = np.asarray(multihost_utils.process_allgather(np.asarray([code], np.int32))).reshape(-1)
        if err is None and codes.max() != OK:
            bad = int(np.argmax(codes))
            err = f"process {bad} could not write its piece (see its log)"
        return staging, int(codes.max()), err

    def manifest(self, j: int, rid: str, batch: list[np.ndarray], k, positions: np.ndarray, full: bool,
                 first_token: int, *, offsets: Sequence[int] | None = None, prefixes: Sequence | None = None,
                 reuse: Sequence[dict | None] | None = None) -> dict:
        """The manifest request j's export will carry (`format.build_manifest`: no files or checksums yet), known
        before any file is written; arguments as `export_batch`'s. No I/O and no communication (the records come
        from the global sharding): any process may ask."""
        req = self._request(j, batch, positions, full, offsets, prefixes, reuse)
        return kvfmt.build_manifest(request_id=rid, token_ids=req.tokens, cfg=self.cfg, dtype=self.dtype,
                                    full=req.full, segments=self._records(k, j, req), first_token=int(first_token),
                                    run_nonce=self.run_nonce, weights_digest=self.weights_digest, prefix=req.reuse,
                                    sliding_from=None if req.full else req.sliding_from)

    @staticmethod
    def host_shards(k, v) -> list:
        """This process's shards of a step's K/V on the host: `(index into [M, stack, T, K, H], k, v)` each."""
        return [(sk.index, np.asarray(sk.data), np.asarray(sv.data))
                for sk, sv in zip(k.addressable_shards, v.addressable_shards)]

    def own_pieces(self, j: int, batch: list[np.ndarray], host: list, positions: np.ndarray, full: bool, *,
                   offsets: Sequence[int] | None = None, prefixes: Sequence | None = None) -> list:
        """The pieces of request j's export that this process writes — `(layer, start, end, k, v)` in natural token
        order from its shards (`host_shards`), and on process 0 a prefix hit's reused rows — without writing them
        (`serve.peer_rows`); arguments as `export_batch`'s."""
        import jax

        req = self._request(j, batch, positions, full, offsets, prefixes, None)
        n, sf = int(req.tokens.size), req.sliding_from
        out = [seg for index, hk, hv in host for seg in self.segments(index, hk, hv, j, n, sf, req.positions)]
        if jax.process_index() == 0:
            out += list(self.prefix_segments(req.prefix, n, sf))
        return out

    def _request(self, j, batch, positions, full, offsets, prefixes, reuse) -> _Req:
        """Request j of a step as its export sees it (positions shifted past a reused prefix, `sliding_from`)."""
        req = _Req(batch[j], positions + (0 if offsets is None else int(offsets[j])),
                   None if prefixes is None else prefixes[j], None if reuse is None else reuse[j])
        req.sliding_from = self.sliding_from(int(req.tokens.size), full, req.prefix)
        req.full = full and req.sliding_from == 0
        return req

    def _records(self, k, j: int, req: _Req) -> list[dict]:
        """Segment records of request j's export: every process's pieces and process 0's prefix rows."""
        n, sf = int(req.tokens.size), req.sliding_from
        records = self.segment_records(k, j, n, sf, req.positions)
        return records + [_record(0, layer, a, b) for layer, a, b, _, _ in
                          self.prefix_segments(req.prefix, n, sf, shapes_only=True)]

    def _publish(self, kv_dir, rid, staging, k, j, req: _Req, full, first_token, overwrite) -> None:
        """Process 0: the manifest of every process's pieces, then the atomic publish."""
        records = self._records(k, j, req)
        files = sorted({r["file"] for r in records} | {kvfmt.shard_file_name(0)})
        kvfmt.write_manifest(staging, request_id=rid, token_ids=req.tokens, cfg=self.cfg, dtype=self.dtype,
                             full=req.full, segments=records, files=files, first_token=first_token,
                             run_nonce=self.run_nonce, weights_digest=self.weights_digest, prefix=req.reuse,
                             sliding_from=None if req.full else req.sliding_from)
        kvfmt.publish(kv_dir, rid, staging, overwrite=overwrite)

    def sliding_from(self, n: int, full: bool, prefix) -> int:
        """The first position sliding layers keep in an export of `n` tokens: 0 with `full`, else `kvfmt.kept_range`'s
        (the last W tokens and the rows back to every vLLM block boundary at or before n−W), in both cases raised to
        the first row a prefix hit's reused KV holds in a sliding layer (`prefix.start`, when it was read from a
        `last_window` export): rows that were never kept cannot be exported, so such a hit's export is written as
        `last_window` even when `full` was asked for; vLLM then refuses it with prefix caching on (with that reason)
        and prefills the prompt itself, and the prefix index serves only the blocks it can (`kv.store`)."""
        sf = 0 if full else kvfmt.kept_range(n, kvfmt.SLIDING, self.cfg.sliding_window, False)[0]
        if prefix is not None and sf < prefix.num_tokens:
            held = [prefix.start.get(i, 0) for i, kind in enumerate(self.cfg.layer_types) if kind == kvfmt.SLIDING]
            sf = max([sf] + held)
        return sf

    def _kept(self, layer: int, n: int, sliding_from: int) -> tuple[int, int]:
        return (sliding_from if self.cfg.layer_types[layer] == kvfmt.SLIDING else 0), n

    def prefix_segments(self, prefix, n: int, sliding_from: int, shapes_only: bool = False):
        """(layer, start, end, k, v) of a prefix hit's reused tokens [0, p) that the export keeps (process 0;
        sliding layers from `sliding_from`)."""
        if prefix is None:
            return
        for layer in range(self.cfg.num_hidden_layers):
            start, end = self._kept(layer, n, sliding_from)
            a, b = start, min(end, prefix.num_tokens)
            if b > a:
                k, v = (None, None) if shapes_only else prefix.rows(layer, a, b)
                yield layer, a, b, k, v

    def segments(self, index, rows_k, rows_v, j: int, n: int, sliding_from: int, positions: np.ndarray):
        """K/V pieces of request j in one shard (`index` into the global `[M, stack, T, K, H]`, data `rows_k/v`):
        (layer, start, end, k, v) in natural token order, limited to the tokens an export keeps (sliding layers from
        `sliding_from`). `positions`: the natural position of each layout row of the step (pads at
        positions ≥ n)."""
        stack_lo = index[1].indices(len(self.stack_layers))[0]
        tok_lo = index[2].indices(len(positions))[0]
        pos_local = positions[tok_lo:tok_lo + rows_k.shape[2]]
        for e in range(rows_k.shape[1]):
            layer = self.stack_layers[stack_lo + e]
            if layer < 0:
                continue
            start, end = self._kept(layer, n, sliding_from)
            sel = np.nonzero((pos_local >= start) & (pos_local < end))[0]
            sel = sel[np.argsort(pos_local[sel], kind="stable")]
            for row0, a, b in kvfmt.runs(pos_local[sel]):
                rows = sel[row0:row0 + (b - a)]
                if rows.size and np.all(np.diff(rows) == 1):  # consecutive rows (every layout's runs): a view
                    rows = slice(int(rows[0]), int(rows[-1]) + 1)
                yield layer, a, b, rows_k[j, e, rows], rows_v[j, e, rows]

    def segment_records(self, k, j: int, n: int, sliding_from: int, positions: np.ndarray) -> list[dict]:
        """Manifest records of every process's pieces, derived from the global sharding (no communication)."""
        records, seen = [], set()
        for device, index in k.sharding.devices_indices_map(k.shape).items():
            key = tuple(s.indices(d) for s, d in zip(index, k.shape))
            if key in seen:
                continue
            seen.add(key)
            shape = [len(range(*sl)) for sl in key]
            empty = np.zeros((shape[0], shape[1], shape[2], 0, 0), np.float32)  # shapes only: names, not data
            for layer, a, b, _, _ in self.segments(index, empty, empty, j, n, sliding_from, positions):
                records.append(_record(device.process_index, layer, a, b))
        return records


class _Req:
    """One request of an export: token ids, the natural position of each step row, the reused prefix (or None) and
    its manifest prefix record (or None)."""

    def __init__(self, tokens, positions, prefix, reuse):
        self.tokens, self.positions, self.prefix, self.reuse = tokens, positions, prefix, reuse
        self.sliding_from = 0  # the first position sliding layers keep (`KVExporter.sliding_from`)
        self.full = False  # written with sliding_policy "full" (asked for, and every sliding row is at hand)


def _record(process: int, layer: int, a: int, b: int) -> dict:
    return {"layer": layer, "start": a, "end": b, "file": kvfmt.shard_file_name(process),
            "k": kvfmt.segment_name(layer, "k", a, b), "v": kvfmt.segment_name(layer, "v", a, b),
            "positions": kvfmt.segment_name(layer, "positions", a, b)}


def _discard(kv_dir: str, rid: str, staging: str) -> bool:
    """Remove what a refused export left in `kv_dir` (process 0, after every process wrote or failed): its staging
    directory, its version directory and pointer-in-placement. True if the pointer already names its version (the
    error came after the atomic publication: the export is whole, and stays)."""
    tag = os.path.basename(os.path.normpath(staging))[len(".tmp-"):]  # "<nonce>-<counter>.<id>" (format.staging_dir)
    try:
        if os.readlink(os.path.join(kv_dir, rid)) == f".v-{tag}":
            return True
    except OSError:
        pass
    for name in (f".tmp-{tag}", f".v-{tag}"):
        shutil.rmtree(os.path.join(kv_dir, name), ignore_errors=True)
    try:
        os.remove(os.path.join(kv_dir, f".lnk-{tag}"))
    except OSError:
        pass
    return False


def _agree_published(ids: list[str], status: list[int], reasons: dict[str, str]) -> list[int]:
    """Every process learns process 0's outcome of each export (and waits for its publication): the status list
    (OK / NOT_WRITABLE per id); ExportFailed on every process if any export failed otherwise."""
    from jax.experimental import multihost_utils

    agreed = [int(c) for c in multihost_utils.broadcast_one_to_all(np.asarray(status, np.int32))]
    bad = [rid for rid, code in zip(ids, agreed) if code == FAILED]
    if bad:
        raise ExportFailed(f"KV export of request(s) {bad} failed on process 0"
                           + (f": {'; '.join(reasons[r] for r in bad if r in reasons)}"
                              if any(r in reasons for r in bad) else "; see its log"))
    return agreed
