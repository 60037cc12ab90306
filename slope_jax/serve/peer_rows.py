"""A computed request's KV rows made reachable from process 0 over NIXL, under several processes, before its
export is written: what the P/D endpoint's early answer publishes (`serve.http.HttpIntake.deliver_early`).

Each process holds only its shards of a step's K/V. Every other process copies its pieces of the request
(`kv.exporter.KVExporter.own_pieces`: (layer, start, end, K `[b − a, K, H]`, V) in natural token order, the pieces
its export file will hold) into its own registered host-memory pool (`kv.nixl_transport.KVPool.publish_pieces`: one
entry, one region per piece) and posts the entry's record under a key of JAX's coordination service. Process 0 then
either
- hands the records on (`records`): the endpoint publishes its own pieces in its pool and answers with one record
  naming every pool (`nixl_transport.compose`), which the decode side pulls from each process in parallel — each
  byte crosses the network once, from the process that computed it to the decode side; or
- pulls the pieces itself (`collect`: one `KVReader.pull` per peer, one NIXL READ per piece; the pull's release frees
  the peer's entry) and joins them with its own into whole layers (`joined`): `PendingExport.rows()` of the Python
  API's `rows_for`.
Either way no step is all-gathered to every process (`PrefillEngine._gather_kv`: over Gloo on CPU, ~0.3 GB/s on the
2-core test machine).

A peer that cannot offer its pieces (its pool full, NIXL gone) posts the error instead: process 0's `records` /
`collect` raise RuntimeError naming the process, and the request is answered after its export. An offer process 0
does not take (the client left) is dropped by `discard` / `drop`.

Imports JAX (the coordination service) and `kv.nixl_transport` (numpy, xxhash); `nixl` when a pool or reader starts.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
from absl import logging

from slope_jax.kv import nixl_transport as nt
from slope_jax.kv.format import LayerKV

KEY_PREFIX = "slope_jax/peer_rows/"
STATS_PREFIX = "slope_jax/peer_pool_stats/"  # + process id: that process's pool occupancy (`PeerRows.peer_pools`)
STATS_PERIOD_S = 1.0


def _client():
    """JAX's coordination-service client (the one `jax.distributed.initialize` made)."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("peer rows need jax.distributed (several processes)")
    return client


class PeerRows:
    """The processes' side of collecting a request's pieces on process 0 (module doc). Process 0 holds a NIXL
    reader, every other process a pool of `pool_bytes`; `timeout_s` bounds process 0's wait for a peer's record and
    its pull. Raises what `KVPool` / `KVReader` raise when NIXL cannot start (the launcher then gathers instead)."""

    def __init__(self, pool_bytes: int, *, timeout_s: float = 60.0, lease_s: float = 60.0):
        import jax

        self.me, self.count = jax.process_index(), jax.process_count()
        self.timeout_s = float(timeout_s)
        self.pool = nt.KVPool(pool_bytes, lease_s=lease_s, prefault=True) if self.me != 0 else None
        self.reader = nt.KVReader(hold_s=timeout_s, timeout_s=timeout_s) if self.me == 0 else None
        # process 0's buffers, reused (registered once; their pages touched once, not per request): one per offering
        # peer to pull into, one the layers are joined in (`join`)
        self._staging: dict[int, np.ndarray] = {}
        self._joined: np.ndarray | None = None
        self._stop = threading.Event()
        self._poster = None
        if self.pool is not None:  # its occupancy, for process 0's GET /v1/kv/pool
            self._poster = threading.Thread(target=self._post_stats, name="peer-pool-stats", daemon=True)
            self._poster.start()

    def _post_stats(self) -> None:
        """A peer's thread: post its pool's occupancy (`KVPool.stats` less per-entry detail, the pool's name and the
        posting time) under `STATS_PREFIX`<process> every `STATS_PERIOD_S`, until `close`."""
        key, failed = f"{STATS_PREFIX}{self.me}", False
        while not self._stop.is_set():
            try:
                stats = self.pool.stats()
                stats.pop("per_entry")
                _client().key_value_set(key, json.dumps({"pool": self.pool.name, **stats, "posted": time.time()}),
                                        allow_overwrite=True)
            except Exception as e:  # noqa: BLE001 - a diagnostic: logged once, retried
                if not failed:
                    logging.warning("process %d: pool occupancy not posted: %s: %s", self.me, type(e).__name__, e)
                failed = True
            self._stop.wait(STATS_PERIOD_S)

    def peer_pools(self) -> dict[int, dict]:
        """Process 0: every other process's pool as it last posted it (`_post_stats`: capacity_bytes, used_bytes,
        entries, held, pool name) with `age_s`, the seconds since (~`STATS_PERIOD_S` when live), keyed by process.
        {} when none posted yet or the coordination service cannot be read. Never raises."""
        try:
            items = _client().key_value_dir_get(STATS_PREFIX)
        except Exception:  # noqa: BLE001 - a diagnostic
            return {}
        out, now = {}, time.time()
        for name, raw in items:
            try:
                stats = json.loads(raw)
                stats["age_s"] = round(now - stats.pop("posted"), 3)
                out[int(name.rsplit("/", 1)[1])] = stats
            except (ValueError, KeyError, TypeError):
                continue
        return dict(sorted(out.items()))

    def offer(self, key: str, pieces: list, kinds: list[str]) -> None:
        """A peer: publish its pieces of one request (`(layer, a, b, k, v)`; `kinds[layer]`: the layer's kind) under
        `key` (the same on every process) and post the record, or the error that prevented it. Never raises."""
        try:
            if pieces:
                rec = self.pool.publish_pieces(key, pieces, kinds)[nt.PARAMS_KEY]
            else:
                rec = {"pieces": []}
        except Exception as e:  # noqa: BLE001 - reported to process 0, which answers after the export instead
            logging.warning("rows of %s not offered to process 0: %s: %s", key, type(e).__name__, e)
            rec = {"error": f"{type(e).__name__}: {e}"}
        _client().key_value_set(self._key(key, self.me), json.dumps(rec))

    def collect(self, key: str) -> list:
        """Process 0: every peer's pieces of `key` (`(layer, a, b, k, v)`, views into buffers the next `collect`
        reuses). Raises RuntimeError naming the process whose offer failed or did not come within `timeout_s`,
        KVTransferError for a failed pull."""
        out = []
        for i, rec in enumerate(self.records(key)):
            buf = self._staging[i] = self._grown(self._staging.get(i), int(rec["nbytes"]))
            got = self.reader.pull({nt.PARAMS_KEY: rec}, out=buf)  # its release frees the peer's entry
            for j, (layer, a, b) in enumerate(rec["manifest"]["pieces"]):
                out.append((layer, a, b, got[j].k, got[j].v))
        return out

    def records(self, key: str) -> list[dict]:
        """Process 0: the peers' pool records of `key` (`KVPool.publish_pieces`' records, peers without pieces
        left out), nothing pulled: parts of a `nixl_transport.compose`d record, which the decode side pulls from each
        peer's pool itself. Raises RuntimeError naming the process whose offer failed or did not come within
        `timeout_s` (the other peers' entries are then dropped)."""
        out = []
        try:
            for pid, rec in self._records(key):
                if "error" in rec:
                    raise RuntimeError(f"process {pid} could not offer its rows of {key}: {rec['error']}")
                if rec.get("layers"):
                    out.append(rec)
        except BaseException:
            self.drop(out)
            raise
        return out

    def drop(self, records: list[dict]) -> None:
        """Process 0: tell the peers' pools nobody will pull these records (`records`); each entry is freed once
        no reader holds it. Never raises."""
        for rec in records:
            try:
                self.reader.done({nt.PARAMS_KEY: rec})
            except Exception as e:  # noqa: BLE001 - the peer's lease frees it
                logging.warning("peer entry %s not dropped: %s", rec.get("entry"), e)

    def joined(self, manifest: dict, pieces: list) -> dict[int, LayerKV]:
        """Process 0: `join` into this object's reused buffer (views valid until the next `joined`)."""
        need = sum(2 * p[3].nbytes for p in pieces) + 128 * len(manifest["layers"])  # K and V, each aligned
        self._joined = self._grown(self._joined, need, register=False)
        return nt.join(manifest, pieces, out=self._joined)

    def _grown(self, buf: np.ndarray | None, need: int, register: bool = True) -> np.ndarray:
        """`buf`, or a buffer of at least 1.5× its size holding `need` bytes, its pages touched now (and the old one
        deregistered from the reader)."""
        if buf is not None and buf.nbytes >= need:
            return buf
        if buf is not None and register:
            self.reader.drop_buffer(buf)
        size = max(need, 0 if buf is None else buf.nbytes * 3 // 2)
        out = np.empty(size, np.uint8)
        out.fill(0)
        return out

    def discard(self, key: str) -> None:
        """Process 0: drop the peers' offers of `key` without pulling them (their entries freed). Never raises."""
        try:
            for _, rec in self._records(key):
                if rec.get("layers"):
                    self.reader.done({nt.PARAMS_KEY: rec})
        except Exception as e:  # noqa: BLE001 - the peers' leases free what is left
            logging.warning("peer rows of %s not discarded: %s", key, e)

    def _records(self, key: str):
        """(process, its posted record) for every peer, each key deleted once read."""
        client = _client()
        for pid in range(1, self.count):
            name = self._key(key, pid)
            try:
                raw = client.blocking_key_value_get(name, int(self.timeout_s * 1e3))
            except Exception as e:  # noqa: BLE001 - the coordination service's timeout or error, named
                raise RuntimeError(f"process {pid} posted no rows of {key} within {self.timeout_s:g} s ({e})") from e
            client.key_value_delete(name)
            yield pid, json.loads(raw)

    @staticmethod
    def _key(key: str, pid: int) -> str:
        return f"{KEY_PREFIX}{key}/{pid}"

    def close(self) -> None:
        self._stop.set()
        if self._poster is not None:
            self._poster.join(timeout=5)
        for x in (self.pool, self.reader):
            if x is not None:
                x.close()


def start(config) -> PeerRows | None:
    """The launcher's PeerRows (`serve.launch_config.LaunchConfig`): several processes serving HTTP with a NIXL pool
    (`--kv_pool_gib` > 0, the endpoint's default) and `--kv_dir`, each peer's pool as large as process 0's. None
    otherwise, or when NIXL could not start on some process (logged; every process then gathers instead: the choice
    must be the same everywhere)."""
    import os
    import time

    import jax

    from slope_jax.serve.compute import any_process
    from slope_jax.serve.http import LEASE_ENV, POOL_GIB_ENV

    if jax.process_count() == 1 or config.http_port is None or not config.kv_dir:
        return None
    gib = float(os.environ.get(POOL_GIB_ENV, 1.0) if config.kv_pool_gib is None else config.kv_pool_gib)
    lease = float(os.environ.get(LEASE_ENV, 60.0) if config.kv_lease_s is None else config.kv_lease_s)
    if gib <= 0:
        return None
    out, t0 = None, time.perf_counter()
    try:
        out = PeerRows(int(gib * 2**30), lease_s=lease)
    except Exception as e:  # noqa: BLE001 - no NIXL here: every process gathers instead
        logging.warning("process %d: no NIXL for peer rows (%s: %s)", jax.process_index(), type(e).__name__, e)
    if any_process(out is None):
        if out is not None:
            out.close()
        logging.info("early P/D answers gather each step's K/V to every process (NIXL is missing on a process)")
        return None
    logging.info("early P/D answers: every process's rows reachable over NIXL (%s ready in %.1f s)",
                 "reader" if out.me == 0 else f"pool of {gib:g} GiB", time.perf_counter() - t0)
    return out
