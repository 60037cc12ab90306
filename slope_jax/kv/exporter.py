"""KV export of a sharded prefill step (`slope_jax.kv.format` on disk), one or many processes.

`KVExporter.export_batch` takes a step's K/V (global jax arrays `[M, stack, T, K, H]` in the layout's token order)
and, per request: every process writes the pieces its devices hold into one fresh staging directory (named from the
run nonce and an export counter advanced identically on every process), all meet at a barrier, process 0 writes the
manifest and publishes (`format.publish`, atomic), and every process learns which exports were published.
numpy at import; JAX (multihost_utils) only when a multi-process run calls it, so `slope_jax.kv` stays JAX-free.
"""

from __future__ import annotations

import os
import time
from typing import Sequence

import numpy as np

from slope_jax.kv import format as kvfmt


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

    def __init__(self, cfg, stack_layers: Sequence[int], dtype: str, run_nonce: str):
        self.cfg, self.stack_layers, self.dtype, self.run_nonce = cfg, list(stack_layers), dtype, run_nonce
        self.count = 0  # exports begun, advanced identically on every process

    def export_batch(self, kv_dir: str, ids: list[str], batch: list[np.ndarray], k, v, positions: np.ndarray,
                     full: bool, results: list, overwrite: bool) -> None:
        """Export every request of a step. `batch[j]`: request j's token ids; `positions[i]`: the natural position
        of layout row i; `results[j]` gets `kv_path` and `export_ms` (first token on the host → this request's
        export published). Each device shard of K/V is copied to the host once for the whole batch.
        Raises ExportFailed naming the requests whose export process 0 could not publish (multi-process: on every
        process); a single process raises process 0's error itself."""
        import jax

        e0 = time.perf_counter()
        me, multi = jax.process_index(), jax.process_count() > 1
        host = [(sk.index, np.asarray(sk.data), np.asarray(sv.data))
                for sk, sv in zip(k.addressable_shards, v.addressable_shards)]
        failed: dict[str, str] = {}
        for j, (rid, res) in enumerate(zip(ids, results)):
            n = int(batch[j].size)
            staging = self._write_own_pieces(kv_dir, rid, host, j, n, full, positions, me, multi)
            if me == 0:
                try:
                    self._publish(kv_dir, rid, staging, k, j, batch[j], full, positions, res.first_token, overwrite)
                except Exception as e:  # noqa: BLE001 - reported to every process below, then raised
                    if not multi:
                        raise
                    failed[rid] = f"{type(e).__name__}: {e}"
            res.kv_path = os.path.join(kv_dir, rid)
            res.export_ms = 1e3 * (time.perf_counter() - e0)
        if multi:
            _agree_published(ids, failed)

    def _write_own_pieces(self, kv_dir, rid, host, j, n, full, positions, me, multi) -> str:
        """This process's pieces of request j into a fresh staging directory, then the barrier; its path."""
        staging = kvfmt.staging_dir(kv_dir, rid, self.run_nonce, self.count)
        self.count += 1
        local = [seg for index, hk, hv in host for seg in self.segments(index, hk, hv, j, n, full, positions)]
        if local:
            kvfmt.write_shard_file(staging, me, local)
        if multi:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"slope_jax kv export {os.path.basename(staging)}")
        return staging

    def _publish(self, kv_dir, rid, staging, k, j, tokens, full, positions, first_token, overwrite) -> None:
        """Process 0: the manifest of every process's pieces, then the atomic publish."""
        records = self.segment_records(k, j, int(tokens.size), full, positions)
        kvfmt.write_manifest(staging, request_id=rid, token_ids=tokens, cfg=self.cfg, dtype=self.dtype, full=full,
                             segments=records, files=[r["file"] for r in records], first_token=first_token,
                             run_nonce=self.run_nonce)
        kvfmt.publish(kv_dir, rid, staging, overwrite=overwrite)

    def segments(self, index, rows_k, rows_v, j: int, n: int, full: bool, positions: np.ndarray):
        """K/V pieces of request j in one shard (`index` into the global `[M, stack, T, K, H]`, data `rows_k/v`):
        (layer, start, end, k, v) in natural token order, limited to the tokens an export keeps."""
        stack_lo = index[1].indices(len(self.stack_layers))[0]
        tok_lo = index[2].indices(len(positions))[0]
        pos_local = positions[tok_lo:tok_lo + rows_k.shape[2]]
        for e in range(rows_k.shape[1]):
            layer = self.stack_layers[stack_lo + e]
            if layer < 0:
                continue
            start, end = kvfmt.kept_range(n, self.cfg.layer_types[layer], self.cfg.sliding_window, full)
            sel = np.nonzero((pos_local >= start) & (pos_local < end))[0]
            sel = sel[np.argsort(pos_local[sel], kind="stable")]
            for row0, a, b in kvfmt.runs(pos_local[sel]):
                rows = sel[row0:row0 + (b - a)]
                yield layer, a, b, rows_k[j, e, rows], rows_v[j, e, rows]

    def segment_records(self, k, j: int, n: int, full: bool, positions: np.ndarray) -> list[dict]:
        """Manifest records of every process's pieces, derived from the global sharding (no communication)."""
        records, seen = [], set()
        for device, index in k.sharding.devices_indices_map(k.shape).items():
            key = tuple(s.indices(d) for s, d in zip(index, k.shape))
            if key in seen:
                continue
            seen.add(key)
            shape = [len(range(*sl)) for sl in key]
            empty = np.zeros((shape[0], shape[1], shape[2], 0, 0), np.float32)  # shapes only: names, not data
            fname = f"kv-p{device.process_index}.safetensors"
            for layer, a, b, _, _ in self.segments(index, empty, empty, j, n, full, positions):
                records.append({"layer": layer, "start": a, "end": b, "file": fname,
                                "k": kvfmt.segment_name(layer, "k", a, b), "v": kvfmt.segment_name(layer, "v", a, b),
                                "positions": kvfmt.segment_name(layer, "positions", a, b)})
        return records


def _agree_published(ids: list[str], failed: dict[str, str]) -> None:
    """Every process learns which exports process 0 published (and waits for them); ExportFailed if any was not."""
    from jax.experimental import multihost_utils

    ok = multihost_utils.broadcast_one_to_all(np.asarray([rid not in failed for rid in ids]))
    if not np.all(ok):
        bad = [rid for rid, good in zip(ids, ok) if not good]
        raise ExportFailed(f"KV export of request(s) {bad} failed on process 0"
                           + (f": {'; '.join(failed.values())}" if failed else "; see its log"))
