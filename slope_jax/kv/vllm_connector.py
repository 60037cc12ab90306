"""A vLLM KV connector that decodes from slope_jax KV exports (the decode half of prefill/decode disaggregation).

    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(model=..., kv_transfer_config=KVTransferConfig(
        kv_connector="SlopeJaxConnector", kv_connector_module_path="slope_jax.kv.vllm_connector",
        kv_role="kv_consumer", kv_connector_extra_config={"kv_dir": "/data/kv"}))   # kv_dir optional

A request finds its export by `kv_transfer_params={"slope_jax_kv_path": "<abs dir>", ...}` (what slope_jax's
prefill endpoint returns), else by its prompt's token hash among the exports under `kv_dir`. The scheduler side
checks the manifest only (`slope_jax.kv.vllm_plan.validate` without hashing: model, weights digest, the request's
cache_salt, prompt, dtype, file sizes) before it reports n−1 external tokens; a refused export is logged with its
reason and vLLM prefills the request itself. The weights vLLM serves are digested once at start-up
(`slope_jax.checkpoints.digest.weights_digest` of its model directory, as the prefill engine records it), so an
export computed with other weights, or for another tenant's cache_salt, is never loaded.

The worker side reads each file into memory, hashing the bytes (the manifest's checksums: XXH3-128, or SHA-256 in
older exports) as they arrive,
parses the tensors from the verified bytes only, and writes each layer's rows through the attention backend's own
cache-update op (`impl.do_kv_cache_update`, the op vLLM's forward uses), so the connector never depends on a
backend's physical cache layout. Subclassing `SupportsHMA` keeps vLLM's hybrid KV cache manager on: sliding layers
then get blocks for their window only.

Notable:
- Asynchronous loads. An export of at least `async_min_bytes` (default 4 MiB), and every NIXL pull, is loaded
  asynchronously (`get_num_new_matched_tokens` returns load_async=True): a background thread reads or pulls it,
  checks each layer's digest and writes that layer's rows into vLLM's paged cache (from the bytes as they arrived:
  no second copy), while vLLM keeps running other requests; the request is reported in `get_finished`'s
  finished_recving once every layer is written. The rows go only to blocks vLLM allocated to that request and
  neither schedules nor frees before that report, so the writes never touch KV a forward pass reads. Smaller file
  exports are read and written inside the step (no thread), synchronously before the forward pass when vLLM has one
  KV cache group; with several groups (the hybrid manager) they are reported asynchronously too, because vLLM 0.32
  can fail a synchronous load only by block ids, which it refuses for more than one group.
- Fails closed. A load that fails after validation (file deleted or truncated, bytes whose digest differs, a manifest
  replaced) never leaves unwritten or foreign KV in use: an asynchronous load is reported as failed_recving
  (`get_transfer_results`), a synchronous one through `get_block_ids_with_load_errors`, and vLLM's
  `kv_load_failure_policy` decides: `fail` (vLLM's default) ends that request with an error, other requests are
  unaffected; `recompute` makes vLLM prefill it. A request aborted while its KV loads is reported finished once the
  load thread stops (at its next layer; vLLM frees the blocks then), and its rows are never used.

Outputs: each finished request's `kv_transfer_params` carries `slope_jax_loaded_tokens` (tokens injected) and
`slope_jax_status`: "loaded", "not used: <reason>" (refused before loading, vLLM prefilled it), "not needed: …"
(vLLM's prefix cache held the prompt's first n−1 tokens), "validated" (the export passed its checks but vLLM asked
for no external tokens — a request it computes itself, e.g. with `echo` or `prompt_logprobs` — so nothing was
loaded) or "recomputed: the KV load failed: <reason>" (0 tokens loaded, vLLM prefilled it under `recompute`).

No JAX is imported here (numpy, safetensors, ml_dtypes and torch only); docs/kv-format.md §6 lists the setup.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import vllm
from vllm.logger import init_logger

from slope_jax.kv import compat
from slope_jax.kv import format as kvfmt
from slope_jax.kv import nixl_transport as nt
from slope_jax.kv import vllm_handoff as handoff
from slope_jax.kv import vllm_plan as plan

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
        KVConnectorWorkerMetadata,
        SupportsHMA,
    )
except ImportError as e:  # an older vLLM: say which, instead of a missing name deep in its package
    raise ImportError(f"slope_jax.kv.vllm_connector needs vLLM >= {compat.MIN_VLLM} (its v1 KV connector API with "
                      f"KVConnectorTransferResults and KVConnectorWorkerMetadata); this environment has vLLM "
                      f"{getattr(vllm, '__version__', 'unknown')}: {e}") from e

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# under the "vllm" logger, so vLLM's logging configuration (level, format, VLLM_LOGGING_*) applies to these lines
logger = init_logger("vllm.slope_jax_connector")

ASYNC_MIN_BYTES = 4 << 20  # default kv_connector_extra_config.async_min_bytes
_READ_CHUNK = 8 << 20  # bytes per read(2) while hashing a file
_EXTRA_KEYS = ("kv_dir", "verify_checksums", "check_fingerprint", "weights_digest", "async_min_bytes",
               "nixl_timeout_s", "load_switch_interval_ms", "nixl_staging_mib")
LOAD_SWITCH_INTERVAL_MS = 0.2  # default kv_connector_extra_config.load_switch_interval_ms
STAGING_ROUND = 64 << 20  # the NIXL staging buffer grows in whole 64 MiB steps, at least 1.5x at a time
# how a load runs (`_Load.how`)
SYNC, INLINE, BACKGROUND = "sync", "inline", "background"
_Rows = tuple  # (attention layer, K rows [t, K_local, H], V rows, int64 slots [t]): one cache-update op's arguments
_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I32": torch.int32,
              "I64": torch.int64}


@dataclasses.dataclass
class _Done:
    """A load whose rows are all written: how the KV arrived (`slope_jax_transport`), its wall seconds on the thread
    that ran it, the seconds until its last byte was read and verified, and the seconds of cache-update ops (a NIXL
    pull's writes may overlap its reads: `wall_s - read_s` is then only their tail)."""

    via: str
    wall_s: float
    read_s: float
    write_s: float


class _Aborted(Exception):
    """A background load stopped because its request finished (aborted) while it loaded."""


@dataclasses.dataclass
class _Load:
    """One request's load for the worker: export, per KV cache group the token rows and their slots, and how it runs:
    SYNC (before this step's forward; failures reported by block id), INLINE (inside this step, reported through
    finished_recving) or BACKGROUND (read or pulled, verified and written layer by layer by the load thread, reported
    through finished_recving)."""

    req_id: str
    export: plan.Validated
    # (group index, layer kind) → (lo, hi, int64 slots [hi − lo]); None if the scheduler could not place the rows
    rows: dict[tuple[int, str], tuple[int, int, np.ndarray]] | None
    # the blocks this load writes: reported through get_block_ids_with_load_errors if a SYNC load fails
    block_ids: set[int]
    how: str = SYNC
    fallback: plan.Validated | None = None  # a NIXL load's file export, read if the pull fails
    source: str | None = None  # the export directory behind the pin `export.path` (messages)

    def where(self, text: str) -> str:
        """`text` naming the export rather than the connector's pin of it."""
        if self.source and isinstance(self.export, plan.Validated) and self.export.path != self.source:
            return text.replace(self.export.path, self.source)
        return text


@dataclasses.dataclass
class SlopeJaxConnectorMetadata(KVConnectorMetadata):
    loads: list[_Load] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class SlopeJaxWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker → scheduler, per step: the requests whose KV this worker wrote, and request id → why its load failed
    (the scheduler side turns them into the request's status; a failure on any tensor-parallel rank wins)."""

    loaded: set[str] = dataclasses.field(default_factory=set)
    failures: dict[str, str] = dataclasses.field(default_factory=dict)
    transports: dict[str, str] = dataclasses.field(default_factory=dict)  # how each loaded request's KV arrived

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, SlopeJaxWorkerMetadata):
            self.loaded |= other.loaded
            self.failures.update(other.failures)
            self.transports.update(other.transports)
        return self


@dataclasses.dataclass
class _Decision:
    export: plan.Validated | None
    # "validated", "loading" (blocks allocated, the worker has not confirmed), "loaded" (every worker wrote it),
    # "not used: …", "recomputed: …" / "failed: …" (the load failed after validation)
    status: str
    loaded: int = 0  # external tokens of the current load
    preemptions: int = 0  # vLLM preemptions of the request seen so far (each one loads the KV again)
    fallback: plan.Validated | None = None  # a NIXL hand-off's file export (read if the pull fails)
    pin: handoff.Pin | None = None  # the file export held open (closed when the request finishes)
    transport: str = handoff.FILE  # how the KV arrived (the worker's word once loaded)
    source: str | None = None  # the export directory behind a pin (messages, tests)

    def close(self) -> None:
        if self.pin is not None:
            self.pin.close()
            self.pin = None


class SlopeJaxConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM v1 KV connector (role kv_consumer) loading slope_jax exports.

    kv_connector_extra_config keys:
      kv_dir (str, optional): look exports up by the prompt's token hash under this directory.
      verify_checksums (bool, default True): the worker compares the digest of every file's bytes as it reads them
        (sizes are always compared, by the scheduler and again by the worker).
      check_fingerprint (bool, default True): also compare the model fingerprint (`slope_jax.kv.check_model`).
      weights_digest (str, optional): the served weights' digest (`slope_jax.checkpoints.digest.weights_digest` of
        the checkpoint directory), for a model that is not a local directory; default: computed from vLLM's model
        directory at start-up. Without either, every export is refused (model.weights_digest unknown).
      async_min_bytes (int, default 4 MiB): exports of at least this many bytes (all files) load asynchronously in a
        background thread; smaller ones within the step (module doc).
      nixl_timeout_s (float, default 30): the longest a NIXL pull waits for the pool's answer and its READs.
      load_switch_interval_ms (float, default 0.2; 0: leave it): the interpreter's GIL switch interval while a
        background load runs (`_GilBoost`; Python's default is 5 ms).
      nixl_staging_mib (int, default 0): size the NIXL staging buffer (every pull lands there before it is written
        into vLLM's blocks) to this many MiB at start-up, its pages touched then; default: allocated on the first
        pull and grown when a larger one comes (`_staging_for`).
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._read_options(extra)
        self._recompute = getattr(self._kv_transfer_config, "kv_load_failure_policy", "fail") == "recompute"
        self._index = plan.ExportIndex(extra["kv_dir"]) if extra.get("kv_dir") else None
        self._cfg = compat.model_config(vllm_config.model_config.hf_config)
        self._prefix_caching = bool(vllm_config.cache_config.enable_prefix_caching)
        # the served weights' digest (the scheduler side decides; the worker only loads what it validated)
        self._weights, self._weights_unknown = None, "not computed on the worker side"
        if role == KVConnectorRole.SCHEDULER:
            self._weights, self._weights_unknown = self._served_weights(vllm_config, extra)
            if self._index is not None:  # the first listing of kv_dir at start-up, not in a request's path
                t0 = time.perf_counter()
                self._index.refresh()
                logger.info("SlopeJaxConnector: indexed %s in %.1f ms", self._index.kv_dir,
                            (time.perf_counter() - t0) * 1e3)
        self._layers, self._groups = self._layer_groups(kv_cache_config)
        fixed = plan.vllm_model_differences(self._cfg)  # why vLLM computes another model than the exports hold
        self._model_differs = fixed[0] if fixed else self._kind_mismatch(kv_cache_config)
        if self._model_differs and role == KVConnectorRole.SCHEDULER:
            logger.warning("SlopeJaxConnector: every export will be refused: %s", self._model_differs)
        self._cache_dtype = self._find_cache_dtype(vllm_config, kv_cache_config)
        # scheduler side
        self._decisions: dict[str, _Decision] = {}
        self._pending: list[_Load] = []
        self._null_block: int | None = None
        # worker side
        self._failed_blocks: set[int] = set()  # SYNC loads that failed (get_block_ids_with_load_errors)
        self._failed_recving: set[str] = set()  # INLINE/BACKGROUND loads that failed (get_transfer_results)
        self._finished_recving: set[str] = set()
        self._worker_meta = SlopeJaxWorkerMetadata()  # this step's loads written / failed
        self._inflight: dict[str, tuple[_Load, concurrent.futures.Future]] = {}
        self._aborted: set[str] = set()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # the load thread
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None  # a NIXL load's cache writes
        self._releaser: concurrent.futures.ThreadPoolExecutor | None = None  # tells pools `done` (`_done_with`)
        self._static_layers: dict[str, Any] = {}
        # worker side, NIXL: one reader, one registered staging buffer (reused: the BACKGROUND thread is the only
        # puller, and it writes each layer before the next pull), request id → the record of a pulled entry (told
        # `done` when the request finishes)
        self._reader: nt.KVReader | None = None
        self._staging: np.ndarray | None = None
        self._pulled: dict[str, dict] = {}
        logger.info("SlopeJaxConnector (%s): kv_dir=%s, %d KV cache group(s) (kind, block size) %s, prefix caching "
                    "%s, cache dtype %s, async loads from %d bytes, kv_load_failure_policy %s", role.name,
                    self._index.kv_dir if self._index else None, len(self._groups),
                    [("sliding" if s else "full", b) for b, s in self._groups], self._prefix_caching,
                    self._cache_dtype, self._async_min_bytes, "recompute" if self._recompute else "fail")

    def _read_options(self, extra: dict) -> None:
        """kv_connector_extra_config (class doc). Raises ValueError naming the key and its rule."""
        unknown = sorted(set(extra) - set(_EXTRA_KEYS))
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown key(s) {unknown}; SlopeJaxConnector knows "
                             f"{', '.join(_EXTRA_KEYS)}")
        self._verify = bool(extra.get("verify_checksums", True))
        self._check_fp = bool(extra.get("check_fingerprint", True))
        self._async_min_bytes = extra.get("async_min_bytes", ASYNC_MIN_BYTES)
        if not isinstance(self._async_min_bytes, int) or isinstance(self._async_min_bytes, bool) or \
                self._async_min_bytes < 0:
            raise ValueError(f"kv_connector_extra_config.async_min_bytes={self._async_min_bytes!r}: expected a "
                             "non-negative integer (bytes)")
        self._nixl_timeout_s = float(extra.get("nixl_timeout_s", 30.0))
        switch_ms = extra.get("load_switch_interval_ms", LOAD_SWITCH_INTERVAL_MS)
        if isinstance(switch_ms, bool) or not isinstance(switch_ms, (int, float)) or not 0 <= switch_ms <= 5:
            raise ValueError(f"kv_connector_extra_config.load_switch_interval_ms={switch_ms!r}: expected a number of "
                             "milliseconds in [0, 5] (0: leave Python's switch interval alone)")
        self._gil = _GilBoost(switch_ms / 1e3)
        staging = extra.get("nixl_staging_mib", 0)
        if isinstance(staging, bool) or not isinstance(staging, int) or not 0 <= staging <= 1 << 20:
            raise ValueError(f"kv_connector_extra_config.nixl_staging_mib={staging!r}: expected an integer number of "
                             "MiB in [0, 1048576] (0: allocate on the first pull)")
        self._staging_bytes = staging << 20

    def _layer_groups(self, kv_cache_config) -> tuple[dict[str, tuple[int, str, int]], list[tuple[int, bool]]]:
        """(layer name → (global layer index, kind, group index), group → (block size, is a sliding-window group))."""
        layers: dict[str, tuple[int, str, int]] = {}
        groups: list[tuple[int, bool]] = []
        if kv_cache_config is None:
            return layers, groups
        from vllm.model_executor.models.utils import extract_layer_index
        from vllm.v1.kv_cache_interface import SlidingWindowSpec

        for g, group in enumerate(kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            groups.append((int(spec.block_size), isinstance(spec, SlidingWindowSpec)))
            for name in group.layer_names:
                try:
                    idx = extract_layer_index(name)
                except (AssertionError, ValueError):
                    continue
                if 0 <= idx < self._cfg.num_hidden_layers:
                    layers[name] = (idx, self._cfg.layer_types[idx], g)
        return layers, groups

    def _kind_mismatch(self, kv_cache_config) -> str | None:
        """Why vLLM's attention differs from the exports' model, or None: a layer vLLM runs with a sliding window
        (its KV cache group is a SlidingWindowSpec) that config.layer_types calls full, or the other way round, or
        another window. vLLM's gpt-oss model makes the even layers sliding whatever config.layer_types says, so a
        checkpoint of another pattern is another model there: its exports (computed as config.layer_types says, as
        transformers does) would decode wrongly. Seen only under the hybrid KV cache manager (the plain one turns
        every group into full attention); `_cut` checks each attention layer on the worker side in every case."""
        if kv_cache_config is None or not any(sliding for _, sliding in self._groups):
            return None
        for idx, kind, g in sorted(self._layers.values()):
            spec = kv_cache_config.kv_cache_groups[g].kv_cache_spec
            why = _kind_differs(idx, kind, getattr(spec, "sliding_window", None) if self._groups[g][1] else None,
                                self._cfg.sliding_window)
            if why:
                return why
        return None

    @staticmethod
    def _served_weights(vllm_config, extra) -> tuple[str | None, str]:
        t0 = time.perf_counter()
        weights, why = plan.served_weights(str(vllm_config.model_config.model), extra.get("weights_digest"))
        logger.info("SlopeJaxConnector: served weights digest %s (%.1f s)%s", weights, time.perf_counter() - t0,
                    f": {why}; every export will be refused" if weights is None else "")
        return weights, why

    @staticmethod
    def _find_cache_dtype(vllm_config, kv_cache_config) -> str:
        if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
            dt = getattr(kv_cache_config.kv_cache_groups[0].kv_cache_spec, "dtype", None)
            if isinstance(dt, torch.dtype):
                return str(dt).removeprefix("torch.")
        cache_dtype = vllm_config.cache_config.cache_dtype
        if cache_dtype not in (None, "auto"):
            return str(cache_dtype)
        return str(vllm_config.model_config.dtype).removeprefix("torch.")

    def _mode(self, group: int) -> str:
        """How sliding layers of KV cache `group` are filled (vllm_plan module doc)."""
        if not self._prefix_caching:
            return plan.WINDOW
        return plan.BLOCK if self._groups[group][1] else plan.ALL

    def _rows(self, export: plan.Validated, start: int) -> dict[tuple[int, str], tuple[int, int]]:
        """(group, layer kind) → token rows [lo, hi) to write; raises ExportRefused if the export lacks some."""
        rows = {}
        for g, (block_size, _) in enumerate(self._groups):
            for kind in {k for _, k, gg in self._layers.values() if gg == g}:
                lo, hi = plan.layer_rows(kind, start, export.num_tokens, self._cfg.sliding_window, block_size,
                                         self._mode(g))
                if kind == kvfmt.SLIDING:
                    plan.check_sliding(export, lo, hi, self._mode(g))
                rows[(g, kind)] = (lo, hi)
        return rows

    def _how(self, export: plan.Validated) -> str:
        """How `export` is loaded (`_Load.how`): BACKGROUND from async_min_bytes on; below, SYNC when vLLM has one KV
        cache group, else INLINE (vLLM 0.32 fails a synchronous load only by block ids, which are ambiguous — and
        refused — with several groups; a request id reported as failed_recving is not). A NIXL pull is always
        BACKGROUND: a peer's round trip never runs inside vLLM's step."""
        if isinstance(export, handoff.NixlExport):
            return BACKGROUND
        size = sum(int(d["bytes"]) for d in export.checksums.values())
        if size >= self._async_min_bytes:
            return BACKGROUND
        return SYNC if len(self._groups) <= 1 else INLINE

    # ------------------------------------------------------------------------------------------------------------
    # Scheduler side
    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        null = getattr(gpu_block_pool, "null_block", None)
        self._null_block = None if null is None else int(null.block_id)

    def _decide(self, request: "Request") -> _Decision:
        prompt = np.asarray(request.prompt_token_ids or [], dtype=np.int64)
        if len(prompt) <= 1:
            return _Decision(None, "not used: a 1-token prompt has nothing to load (vLLM computes the last token)")
        if self._model_differs:
            return _Decision(None, f"not used: {self._model_differs}")
        t0 = time.perf_counter()
        try:
            # the manifest and file sizes only: the worker hashes the bytes it reads (no hashing in this loop)
            d, how = self._choose(request, prompt)
            if d.export is None:
                return d
        except plan.ExportRefused as e:
            logger.warning("SlopeJaxConnector: request %s: export not used, vLLM prefills it itself: %s",
                           request.request_id, e)
            return _Decision(None, f"not used: {e}")
        except Exception as e:  # noqa: BLE001 - one bad export must never stop the engine
            logger.exception("SlopeJaxConnector: request %s: unexpected error validating its export; vLLM prefills "
                             "it itself", request.request_id)
            return _Decision(None, f"not used: {type(e).__name__}: {e}")
        logger.info("SlopeJaxConnector: request %s: export %s (found by %s%s) validated, %d tokens, %s load (manifest "
                    "checked in %.1f ms)", request.request_id, d.source or d.export.path, how,
                    f"; file fallback {d.fallback.path}" if d.fallback else "", d.export.num_tokens,
                    self._how(d.export), (time.perf_counter() - t0) * 1e3)
        return d

    def _choose(self, request: "Request", prompt: np.ndarray) -> tuple[_Decision, str]:
        """(decision, how its export was found). A NIXL record wins; the file export (pinned: `vllm_handoff.Pin`) is
        its fallback, or the export when there is no usable record. Raises ExportRefused if every one was refused."""
        params = request.kv_transfer_params
        kw = dict(cfg=self._cfg, cache_dtype=self._cache_dtype, weights=self._weights,
                  weights_unknown=self._weights_unknown, cache_salt=getattr(request, "cache_salt", None),
                  lora=_lora_name(request), check_fingerprint=self._check_fp)
        nixl, nixl_refused = None, None
        if nt.params_of(params) is not None:
            try:
                nixl = handoff.validate_record(params, prompt, **kw)
            except plan.ExportRefused as e:
                nixl_refused = e
        try:
            export, how, pin = handoff.choose_pinned(params, prompt, self._index, verify_checksums=False, **kw)
        except plan.ExportRefused:
            if nixl is None and nixl_refused is None:
                raise
            export, how, pin = None, "", None  # the file export was refused: the record decides
        source = pin.source if pin is not None else None
        if nixl is not None:
            return _Decision(nixl, "validated", fallback=export, pin=pin, transport=handoff.NIXL,
                             source=nixl.path), f"kv_transfer_params.{nt.PARAMS_KEY}"
        if nixl_refused is not None:
            if export is None:
                raise nixl_refused
            logger.warning("SlopeJaxConnector: request %s: NIXL record refused (%s); loading the file export",
                           request.request_id, nixl_refused)
            return _Decision(export, "validated", pin=pin, source=source,
                             transport=f"{handoff.FILE} (the NIXL record was refused: {nixl_refused})"), how
        return _Decision(export, "validated" if export else f"not used: {how}", pin=pin, source=source), how

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        d = self._decisions.get(request.request_id)
        if d is None:
            d = self._decisions[request.request_id] = self._decide(request)
        if d.export is None:
            return 0, False
        try:
            self._rows(d.export, num_computed_tokens)
        except plan.ExportRefused as e:
            logger.warning("SlopeJaxConnector: request %s: export not used, vLLM prefills it itself: %s",
                           request.request_id, e)
            d.export, d.status, d.loaded = None, f"not used: {e}", 0
            return 0, False
        if d.status == "loaded" and getattr(request, "num_preemptions", 0) > d.preemptions:
            d.preemptions = request.num_preemptions  # asked again each step until vLLM finds blocks: log once
            logger.info("SlopeJaxConnector: request %s: preempted after loading %d tokens; loading its KV again",
                        request.request_id, d.loaded)
        num = max(0, d.export.num_tokens - 1 - num_computed_tokens)
        if num == 0 and d.status == "validated":
            d.status = plan.CACHE_HELD  # vLLM's own prefix cache holds every token the export would give
        elif num > 0 and d.status == plan.CACHE_HELD:
            d.status = "validated"  # asked again (e.g. after its cached blocks were evicted)
        return num, num > 0 and self._how(d.export) != SYNC

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        if num_external_tokens <= 0:
            return
        d = self._decisions[request.request_id]
        n = d.export.num_tokens
        start = n - 1 - num_external_tokens
        block_ids = blocks.get_block_ids()
        rows, written = {}, set()
        try:
            for (g, kind), (lo, hi) in self._rows(d.export, start).items():
                block_size = self._groups[g][0]
                rows[(g, kind)] = (lo, hi, plan.slots(block_ids[g], block_size, lo, hi, self._null_block))
                if hi > lo:
                    written.update(int(b) for b in block_ids[g][lo // block_size:(hi - 1) // block_size + 1])
        except plan.ExportRefused as e:
            # The blocks are allocated and the count reported: too late to prefill instead. The worker reports the
            # load as failed and vLLM's kv_load_failure_policy decides.
            logger.error("SlopeJaxConnector: request %s: cannot place its KV: %s", request.request_id, e)
            rows = None
            written = {int(b) for group in block_ids for b in group}
        written.discard(self._null_block)
        how = self._how(d.export)
        self._pending.append(_Load(request.request_id, d.export, rows, written, how, d.fallback, d.source))
        # A SYNC load is in this step's forward pass: a failure comes back with the step's output (and vLLM then
        # recomputes or fails the request) before the request can finish. An asynchronous one is "loading" until the
        # worker confirms it (update_connector_output, before vLLM schedules the request again).
        d.status, d.loaded = ("loaded" if how == SYNC else "loading"), num_external_tokens

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = SlopeJaxConnectorMetadata(loads=self._pending)
        self._pending = []
        return meta

    def update_connector_output(self, connector_output) -> None:
        """The worker's failed loads (SlopeJaxWorkerMetadata): the request's status names the failure and it loads
        nothing more (vLLM recomputes it under `recompute`, or has already ended it with an error under `fail`)."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(meta, SlopeJaxWorkerMetadata):
            return
        for req_id in meta.loaded - set(meta.failures):
            d = self._decisions.get(req_id)
            if d is not None and d.status == "loading":
                d.status = "loaded"
            if d is not None and req_id in meta.transports:
                d.transport = meta.transports[req_id]
        for req_id, why in meta.failures.items():
            d = self._decisions.get(req_id)
            if d is None:
                continue  # already finished (policy `fail`: ended with an error)
            what = "recomputed" if self._recompute else "failed"
            d.export, d.loaded, d.status = None, 0, f"{what}: the KV load failed: {why}"
            logger.warning("SlopeJaxConnector: request %s: %s", req_id, d.status)

    def _finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        d = self._decisions.pop(request.request_id, None)
        if d is None:
            return False, None
        d.close()
        if d.status == "loading":
            d.status = "not loaded: the request finished while its KV was loading"
        if d.status != "loaded":
            return False, {plan.LOADED_KEY: 0, plan.STATUS_KEY: d.status}
        return False, {plan.LOADED_KEY: d.loaded, plan.STATUS_KEY: d.status, handoff.TRANSPORT_KEY: d.transport}

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    # ------------------------------------------------------------------------------------------------------------
    # Worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._static_layers = self._vllm_config.compilation_config.static_forward_context
        try:  # the NIXL agent now, not in the first request's pull (UCX start-up: ~0.1-0.4 s)
            self._reader = nt.KVReader(hold_s=self._nixl_timeout_s, timeout_s=self._nixl_timeout_s)
        except Exception as e:  # noqa: BLE001 - NIXL not installed: file exports only (a NIXL record then fails)
            logger.info("SlopeJaxConnector: no NIXL reader (%s: %s); NIXL hand-offs will fail over to files or "
                        "fail closed", type(e).__name__, e)
            return
        if self._staging_bytes:
            t0 = time.perf_counter()
            self._staging_for(self._staging_bytes)
            logger.info("SlopeJaxConnector: NIXL staging buffer of %d MiB ready (%.2f s)", self._staging_bytes >> 20,
                        time.perf_counter() - t0)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """SYNC and INLINE loads are read, verified and written here, on the worker's thread (vLLM calls this before
        the forward pass when the step has a synchronous load, else after it). BACKGROUND loads start on the load
        thread (`_load_background`), which writes each layer as it arrives."""
        if forward_context is not None and forward_context.no_compile_layers:
            self._static_layers = forward_context.no_compile_layers
        meta = self._get_connector_metadata()
        if not isinstance(meta, SlopeJaxConnectorMetadata):
            return
        for load in meta.loads:
            t0 = time.perf_counter()
            if load.how == BACKGROUND:
                if self._pool is None:
                    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="slope_jax_kv_load",
                                                                       initializer=_one_compute_thread)
                self._gil.on()
                self._inflight[load.req_id] = (load, self._pool.submit(self._load_background, load))
                logger.info("SlopeJaxConnector: request %s: loading %s in the background", load.req_id,
                            load.source or load.export.path)
                continue
            try:
                via = handoff.FILE  # NIXL records always load in the background (`_how`)
                rows = self._prepare(load)
                read_s = time.perf_counter() - t0
                write_s = self._write_rows(rows)
                self._loaded(load, _Done(via, time.perf_counter() - t0, read_s, write_s))
            except Exception as e:  # noqa: BLE001 - reported as a failed load, never a crash
                self._failed(load, e)
            if load.how == INLINE:
                self._finished_recving.add(load.req_id)

    def _prepare(self, load: _Load) -> list[_Rows]:
        """Read and verify a file export (`_read_export`) and cut each layer's rows for this rank (`_cut`), ready to
        write. Raises ExportRefused / KVFormatError / OSError."""
        if load.rows is None:
            raise plan.ExportRefused("the scheduler could not place the KV")
        kv = _read_export(load.export, self._verify)
        names = self._layer_names()
        return [row for idx in names for row in self._cut(load, idx, kv.get(idx), names[idx])]

    def _layer_names(self) -> dict[int, list[str]]:
        """Global layer id → the names of this worker's attention layers it fills (usually one)."""
        out: dict[int, list[str]] = {}
        for name, (idx, _, _) in self._layers.items():
            if self._static_layers.get(name) is not None:
                out.setdefault(idx, []).append(name)
        return out

    def _cut(self, load: _Load, idx: int, entry, names: list[str], piece: bool = False) -> list[_Rows]:
        """Export layer `idx` (`(kind, K [t, K, H], V, int positions [t])` or None if the export lacks it) cut for
        each attention layer it fills: [(layer, K rows `[hi - lo, K_local, H]`, V rows, int64 slots)] in the cache
        dtype (views where no cast or head split is needed); `names`: the attention layers (`_layer_names`). With
        `piece` (a composed NIXL record's piece of the layer), only the rows of [lo, hi) it holds. Raises
        ExportRefused."""
        if entry is None:
            raise plan.ExportRefused(f"layer {idx} is not in the export")
        tp_rank, tp_size = _tp()
        out = []
        for name in names:
            _, kind, g = self._layers[name]
            layer = self._static_layers[name]
            lo, hi, slot = load.rows[(g, kind)]
            src_kind, k, v, pos = entry
            if piece:  # the piece's share of [lo, hi), and of the slots
                a, b = (int(pos[0]), int(pos[-1]) + 1) if len(pos) else (lo, lo)
                a, b = max(lo, a), min(hi, b)
                lo, hi, slot = a, b, slot[a - lo: b - lo]
            if hi <= lo:
                continue
            if src_kind != kind:
                raise plan.ExportRefused(f"layer {idx} is {src_kind} in the export, {kind} in the model")
            why = self._model_differs or _kind_differs(idx, kind, getattr(layer, "sliding_window", None),
                                                       self._cfg.sliding_window)
            if why:
                raise plan.ExportRefused(why)
            a = int(torch.searchsorted(pos, lo))
            if a >= len(pos) or int(pos[a]) != lo or int(pos[-1]) < hi - 1:
                raise plan.ExportRefused(f"layer {idx} holds positions [{int(pos[0])}, {int(pos[-1]) + 1}), "
                                         f"needs [{lo}, {hi})")
            k, v = (_tp_heads(x[a:a + hi - lo], layer.num_kv_heads, tp_rank, tp_size) for x in (k, v))
            if k.shape[-1] != layer.head_size:
                raise plan.ExportRefused(f"layer {idx}: head_dim {k.shape[-1]} in the export, {layer.head_size} in "
                                         "vLLM")
            if not hasattr(layer.impl, "do_kv_cache_update"):
                raise plan.ExportRefused(f"attention backend {type(layer.impl).__name__} has no do_kv_cache_update")
            dt = layer.kv_cache.dtype
            k, v = (x.to(dtype=dt).contiguous() for x in (k, v))
            out.append((layer, k, v, torch.from_numpy(slot)))
        return out

    def _rows_wanted(self, load: _Load, names: list[str]) -> int:
        """Rows `_cut` writes for one export layer into these attention layers (0: none, e.g. a sliding layer whose
        rows vLLM's prefix cache already holds)."""
        out = 0
        for name in names:
            _, kind, g = self._layers[name]
            lo, hi, _ = load.rows[(g, kind)]
            out += max(0, hi - lo)
        return out

    def _load_background(self, load: _Load) -> _Done:
        """The load thread's whole load (`_Done`: how the KV arrived, its seconds). A NIXL pull hands each layer
        over once its bytes pass their digest and the pool has granted the hold (`KVReader.pull`'s `on_layer`), and
        a writer thread writes it into vLLM's cache straight from the staging buffer while this thread checks the
        next layers. Over shared memory the READs, done while they are posted, usually finish before the hold's
        answer is read, so the writes follow the pull; on 2 cores that suited vLLM's decoding requests better than
        overlapping them (benchmarks/handoff.py, 1 GiB: neighbours' ITL 1.25× vs 1.67-1.75× when the hold is awaited
        first and the writes overlap the READs, for the same ~0.34 s load). A failed pull falls back to the
        validated file export, which rewrites every layer. Raises ExportRefused / KVFormatError / OSError /
        KVTransferError, or `_Aborted` once the request has finished.

        Writing here, concurrently with vLLM's forward passes, is safe: the rows go only to blocks allocated to this
        request, which vLLM neither schedules nor frees until `get_finished` reports the load (the contract vLLM's
        own NixlConnector relies on for its RDMA writes); `_cut` and the cache-update op read and write nothing
        else. A load that fails after writing some layers is reported as failed: those rows are never used."""
        t0 = time.perf_counter()
        if load.rows is None:
            raise plan.ExportRefused("the scheduler could not place the KV")
        if isinstance(load.export, handoff.NixlExport):
            try:
                return self._load_nixl(load, t0)
            except nt.KVTransferError as e:
                if load.fallback is None:
                    raise
                logger.warning("SlopeJaxConnector: request %s: %s; reading the file export %s instead", load.req_id,
                               e, load.fallback.path)
                load = dataclasses.replace(load, export=load.fallback)
                via = f"{handoff.FILE} (the NIXL pull failed: {e.cause})"
        else:
            via = handoff.FILE
        rows = self._prepare(load)
        read_s = time.perf_counter() - t0
        if load.req_id in self._aborted:
            raise _Aborted(load.req_id)
        write_s = self._write_rows(rows)
        return _Done(via, time.perf_counter() - t0, read_s, write_s)

    def _load_nixl(self, load: _Load, t0: float) -> _Done:
        """`_load_background`'s NIXL pull: each verified layer (a composed record: each piece) cut for this rank and
        written by the writer thread while later ones arrive. Raises KVTransferError (the caller falls back to the
        file export), ExportRefused (a layer's rows not all pulled, or refused by `_cut`), `_Aborted`."""
        names = self._layer_names()
        pieces = nt.is_composed(load.export.record)  # each layer may come in several pieces
        left = {idx: self._rows_wanted(load, names[idx]) for idx in names}  # rows not yet cut, per layer
        writes = []
        if self._writer is None:
            self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="slope_jax_kv_write",
                                                                 initializer=_one_compute_thread)

        def on_layer(idx: int, lkv) -> None:
            if load.req_id in self._aborted:
                raise _Aborted(load.req_id)
            if left.get(idx):
                entry = (lkv.kind, _torch(lkv.k), _torch(lkv.v), torch.from_numpy(lkv.positions))
                rows = self._cut(load, idx, entry, names[idx], piece=pieces)
                left[idx] -= sum(int(r[1].shape[0]) for r in rows)
                writes.append(self._writer.submit(self._write_rows, rows))

        try:
            self._pull(load.req_id, load.export.record, on_layer)
            read_s = time.perf_counter() - t0
        finally:  # every write ends before the staging buffer is reused (the next pull) or the load fails
            concurrent.futures.wait(writes)
        write_s = sum(w.result() for w in writes)
        if any(left.values()):
            raise plan.ExportRefused(f"layers {sorted(i for i, n in left.items() if n)} are not (all) in the pulled KV")
        return _Done(handoff.NIXL, time.perf_counter() - t0, read_s, write_s)

    def _pull(self, req_id: str, record: dict, on_layer) -> None:
        """Pull a NIXL entry into the staging buffer (grown as needed; each layer's XXH3-128 checked as it arrives),
        handing each verified layer to `on_layer(layer id, LayerKV)` (views into the buffer, valid until the next
        pull). The pool is told `done` when the request finishes, whether this pull succeeds or not (a preempted
        request pulls again meanwhile). Raises KVTransferError, or what `on_layer` raises."""
        if self._reader is None:
            self._reader = nt.KVReader(hold_s=self._nixl_timeout_s, timeout_s=self._nixl_timeout_s)
        self._pulled[req_id] = record
        self._reader.pull(record, out=self._staging_for(int(record["nbytes"])), release=False, on_layer=on_layer)

    def _staging_for(self, need: int) -> np.ndarray:
        """The staging buffer, grown to hold `need` bytes: to at least 1.5× its size, in whole STAGING_ROUND steps,
        so a growing series of pulls reallocates a few times, not each time. A new buffer's pages are touched here
        (`fill`: NumPy releases the GIL for it), not by the first READ's copy into it (NIXL's post call): first-touch
        faults cost 1.3–2.9 s per GiB on the 2-core test VM. `nixl_staging_mib` moves this to start-up."""
        if self._staging is not None and self._staging.nbytes >= need:
            return self._staging
        old = 0 if self._staging is None else self._staging.nbytes
        size = -(-max(need, old + old // 2) // STAGING_ROUND) * STAGING_ROUND
        if self._staging is not None:
            self._reader.drop_buffer(self._staging)
            self._staging = None
        buf = np.empty(size, np.uint8)
        buf.fill(0)
        self._staging = buf
        return buf

    def _done_with(self, req_ids) -> None:
        """Tell the pools the KV of these finished requests is no longer needed (they free it), on a thread of its
        own: each release waits for its pool's answer (`KVReader.done`), up to seconds for a pool that is gone, and
        this runs on vLLM's step thread."""
        records = [(req_id, self._pulled.pop(req_id)) for req_id in set(req_ids) & set(self._pulled)]
        if not records:
            return
        if self._releaser is None:
            self._releaser = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="slope_jax_kv_release")
        self._releaser.submit(self._tell_done, records)

    def _tell_done(self, records: list) -> None:
        for req_id, record in records:
            try:
                self._reader.done(record)
            except Exception as e:  # noqa: BLE001 - best effort: the entry's lease frees it otherwise
                logger.warning("SlopeJaxConnector: request %s: telling the pool it is done failed: %r", req_id, e)

    @staticmethod
    def _write_rows(rows: list) -> float:
        """Write cut rows (`_cut`) through each layer's cache-update op. Returns the seconds it took."""
        t0 = time.perf_counter()
        for layer, k, v, slot in rows:
            cache = layer.kv_cache
            dev = cache.device
            layer.impl.do_kv_cache_update(layer, k.to(dev), v.to(dev), cache, slot.to(dev))
        return time.perf_counter() - t0

    def _loaded(self, load: _Load, done: _Done) -> None:
        """Record a load whose rows are all written (worker's thread)."""
        self._worker_meta.loaded.add(load.req_id)
        self._worker_meta.transports[load.req_id] = done.via
        lo = min((r[0] for r in (load.rows or {}).values()), default=0)  # vLLM's own tokens end here (full groups)
        hi = max((r[1] for r in (load.rows or {}).values()), default=0)
        logger.info("SlopeJaxConnector: request %s: injected tokens [%d, %d) (%d) from %s in %.1f ms (%s; read and "
                    "verified in %.1f ms, cache writes %.1f ms)", load.req_id, lo, hi, hi - lo,
                    load.source or load.export.path, done.wall_s * 1e3, load.how, done.read_s * 1e3,
                    done.write_s * 1e3)

    def _failed(self, load: _Load, e: Exception) -> None:
        why = str(e) if isinstance(e, (plan.ExportRefused, kvfmt.KVFormatError)) else f"{type(e).__name__}: {e}"
        why = load.where(why)
        logger.error("SlopeJaxConnector: request %s: loading %s failed (%s); reported as a failed load, "
                     "kv_load_failure_policy decides", load.req_id, load.source or load.export.path, why)
        self._worker_meta.failures[load.req_id] = why
        if load.how == SYNC:
            self._failed_blocks.update(load.block_ids)
        else:
            self._failed_recving.add(load.req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(None, requests whose asynchronous load ended this step). A BACKGROUND load has written its rows by the
        time its future is done; it is reported here, or, if its request finished meanwhile (aborted: the load
        thread stops at its next layer), reported finished so that vLLM frees its blocks, its rows unused."""
        self._aborted |= set(finished_req_ids or ()) & set(self._inflight)
        for req_id, (load, future) in list(self._inflight.items()):
            if not future.done():
                continue
            del self._inflight[req_id]
            self._finished_recving.add(req_id)
            if req_id in self._aborted:
                self._aborted.discard(req_id)
                self._done_with([req_id])
                logger.info("SlopeJaxConnector: request %s finished while its KV was loading; its rows are not used",
                            req_id)
                continue
            try:
                self._loaded(load, future.result())
            except Exception as e:  # noqa: BLE001 - reported as a failed load, never a crash
                self._failed(load, e)
        if not self._inflight:
            self._gil.off()
        self._done_with(finished_req_ids or ())
        done, self._finished_recving = self._finished_recving, set()
        return None, (done or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        _, done = self.get_finished(finished_req_ids)
        failed, self._failed_recving = self._failed_recving, set()
        return KVConnectorTransferResults(finished_recving=set(done or ()), failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._failed_blocks = set(self._failed_blocks), set()
        return out

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        meta = self._worker_meta
        if not meta.loaded and not meta.failures:
            return None
        self._worker_meta = SlopeJaxWorkerMetadata()
        return meta

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # synchronous loads are written before the forward pass, asynchronous ones before vLLM schedules them

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # a consumer saves nothing

    def wait_for_save(self):
        return

    def shutdown(self):
        self._gil.off()
        for pool in (self._pool, self._writer):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        if self._releaser is not None:  # the releases queued: sent before the reader goes
            self._releaser.shutdown(wait=True)
        for d in self._decisions.values():
            d.close()
        if self._reader is not None:
            self._reader.close()


def _one_compute_thread() -> None:
    """Run this thread's torch ops (the cache-update op) on one thread. The setting is this thread's own (OpenMP's
    per-thread ICV; vLLM's step thread keeps its count): without it each op called here starts a second OpenMP team
    of as many threads as vLLM's own, spinning on the cores vLLM's step runs on."""
    torch.set_num_threads(1)


class _GilBoost:
    """Shortens the interpreter's GIL switch interval while background loads run, and restores it after.

    vLLM's step loop holds the GIL between its torch calls; with nothing else scheduled (a request waiting for its
    KV) it is a tight Python loop. Each time the load thread returns from a call that released the GIL (a digest, a
    view, the cache-update op: a dozen per layer) it waits for the switch interval, 5 ms by default, so a 1 GiB pull
    spent most of its time waiting (benchmarks/handoff.py, vLLM otherwise idle: 1.40 s at 5 ms, 0.45 s at 0.2 ms).
    Process-wide, but only while a load is in flight; `seconds` 0 disables it."""

    def __init__(self, seconds: float):
        self.seconds, self._saved = seconds, None

    def on(self) -> None:
        if self.seconds > 0 and self._saved is None:
            self._saved = sys.getswitchinterval()
            sys.setswitchinterval(min(self.seconds, self._saved))

    def off(self) -> None:
        if self._saved is not None:
            sys.setswitchinterval(self._saved)
            self._saved = None


def _kind_differs(idx: int, kind: str, vllm_window: int | None, window: int) -> str | None:
    """Why layer `idx` (`kind` in config.layer_types, sliding window `window`) is another attention in vLLM, which
    runs it with sliding window `vllm_window` (None: full attention), or None."""
    if (kind == kvfmt.SLIDING) == (vllm_window is not None) and (vllm_window is None or vllm_window == window):
        return None
    theirs = "full attention" if vllm_window is None else f"a sliding window of {vllm_window}"
    ours = f"a sliding window of {window}" if kind == kvfmt.SLIDING else "full attention"
    return (f"layer {idx}: vLLM runs it with {theirs}, config.layer_types (what exports are computed with, as in "
            f"transformers) with {ours} (vLLM's gpt-oss model makes the even layers sliding whatever layer_types "
            "says): vLLM serves another model than the exports hold, so none is loaded")


def _lora_name(request: "Request") -> str | None:
    """The name of the LoRA adapter `request` runs (vLLM's `lora_request`), None for the base model."""
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return None
    return str(getattr(lora, "lora_name", None) or getattr(lora, "lora_int_id", None) or lora)


def _torch(a: np.ndarray) -> torch.Tensor:
    """A numpy array as a torch tensor sharing its memory (bfloat16 from ml_dtypes through its bits)."""
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _read_file(path: str, want: dict, verify: bool) -> np.ndarray:
    """The bytes of one export file, hashed (with `verify`: the manifest entry's digest, `kv.format.file_checksum`) as
    they arrive; raises ExportRefused if the file is gone, shorter or longer than `want["bytes"]`, or its bytes do not
    hash to the recorded digest."""
    size = int(want["bytes"])
    buf = np.empty(size, np.uint8)  # not bytearray: zero-filling a GiB would hold the GIL, stalling vLLM's steps
    view = memoryview(buf)
    algo, expect = kvfmt.file_checksum(want)
    digest = kvfmt.file_hasher(algo) if verify else None
    got = 0
    try:
        with open(path, "rb", buffering=0) as f:
            while got < size:
                k = f.readinto(view[got:got + _READ_CHUNK])
                if not k:
                    break
                if digest is not None:
                    digest.update(view[got:got + k])
                got += k
            longer = bool(f.read(1))
    except FileNotFoundError:
        raise plan.ExportRefused(f"{path}: the file does not exist (deleted after validation)") from None
    name = os.path.basename(path)
    if got != size or longer:
        raise plan.ExportRefused(f"{path}: checksums.{name}.bytes: read {got}{'+' if longer else ''} bytes, the "
                                 f"manifest records {size} (the file changed after validation)")
    if digest is not None and digest.hexdigest() != expect:
        raise plan.ExportRefused(f"{path}: checksums.{name}.{algo}: the bytes read differ from the manifest's "
                                 f"{kvfmt.FILE_DIGESTS[algo][0]} "
                                 "(the file was modified after validation)")
    return buf


def _safetensors(buf: np.ndarray, path: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in `buf` (views into it, no copy). Raises ExportRefused if the header
    is malformed or a tensor lies outside the buffer."""
    try:
        n = int.from_bytes(bytes(buf[:8]), "little")
        header = json.loads(bytes(buf[8:8 + n])) if len(buf) >= 8 + n else None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise plan.ExportRefused(f"{path}: not a safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise plan.ExportRefused(f"{path}: not a safetensors file (no header)")
    base, out = 8 + n, {}
    for key, d in header.items():
        if key == "__metadata__":
            continue
        ok = isinstance(d, dict) and d.get("dtype") in _ST_DTYPES and isinstance(d.get("shape"), list) and \
            isinstance(d.get("data_offsets"), list) and len(d["data_offsets"]) == 2
        if ok:
            dtype, count, (a, b) = _ST_DTYPES[d["dtype"]], int(np.prod(d["shape"])), d["data_offsets"]
            ok = 0 <= a and b - a == count * dtype.itemsize and base + b <= len(buf)
        if not ok:
            raise plan.ExportRefused(f"{path}: tensor {key!r}: malformed safetensors entry {d!r}")
        flat = torch.frombuffer(buf, dtype=dtype, count=count, offset=base + a) if count else torch.zeros(0, dtype)
        out[key] = flat.view(d["shape"])
    return out


def _read_export(exp: plan.Validated, verify: bool) -> dict[int, tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Global layer id → (kind, K `[t, K, H]`, V, int32 positions `[t]`) of a validated export, from bytes read and
    hashed once (`_read_file`): what is parsed is exactly what was verified. Raises ExportRefused if the manifest
    changed since validation, a file is gone, changed or malformed, or a tensor disagrees with the manifest."""
    m = kvfmt.read_manifest(exp.path)
    if m["run_nonce"] != exp.run_nonce or m["checksums"] != exp.checksums:
        raise plan.ExportRefused(f"{exp.path}: the export was replaced after it was validated (run_nonce "
                                 f"{exp.run_nonce} → {m['run_nonce']})")
    files = {name: _safetensors(_read_file(os.path.join(exp.path, name), m["checksums"][name], verify),
                                os.path.join(exp.path, name)) for name in m["files"]}
    kh, hd, dtype = m["model"]["num_key_value_heads"], m["model"]["head_dim"], m["dtype"]
    out = {}
    for rec in m["layers"]:
        layer, parts = rec["layer"], []
        for seg in sorted(rec["segments"], key=lambda s: s["start"]):
            try:
                k, v, pos = (files[seg["file"]][seg[x]] for x in ("k", "v", "positions"))
            except KeyError as e:
                raise plan.ExportRefused(f"{exp.path}: layers[{layer}].segments: tensor {e} missing from "
                                         f"{seg['file']}") from None
            want = (seg["end"] - seg["start"], kh, hd)
            if tuple(k.shape) != want or tuple(v.shape) != want or str(k.dtype) != f"torch.{dtype}" or \
                    str(v.dtype) != f"torch.{dtype}":
                raise plan.ExportRefused(f"{exp.path}: layers[{layer}].segments: K/V {list(k.shape)} {k.dtype}, the "
                                         f"manifest declares {list(want)} {dtype}")
            if not torch.equal(pos.to(torch.int64), torch.arange(seg["start"], seg["end"])):
                raise plan.ExportRefused(f"{exp.path}: layers[{layer}].segments: positions tensor {seg['positions']!r} "
                                         f"does not hold [{seg['start']}, {seg['end']})")
            parts.append((k, v, pos))
        if not parts:
            empty = torch.zeros((0, kh, hd), dtype=getattr(torch, dtype))
            parts = [(empty, empty, torch.zeros(0, dtype=torch.int32))]
        out[layer] = (rec["kind"], *(parts[0][i] if len(parts) == 1 else torch.cat([p[i] for p in parts])
                                     for i in range(3)))
    return out


def _tp() -> tuple[int, int]:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except (AssertionError, RuntimeError):
        return 0, 1


def _tp_heads(x: torch.Tensor, local_heads: int, rank: int, size: int) -> torch.Tensor:
    """This tensor-parallel rank's KV heads of `x` `[t, K, H]`: vLLM shards K heads over ranks when K ≥ size and
    replicates head rank·K // size otherwise."""
    heads = x.shape[1]
    if local_heads == heads:
        return x
    if heads >= size and local_heads * size == heads:
        return x[:, rank * local_heads:(rank + 1) * local_heads]
    if heads < size and local_heads == 1:
        h = rank * heads // size
        return x[:, h:h + 1]
    raise plan.ExportRefused(f"{heads} KV heads in the export, {local_heads} on tensor-parallel rank {rank} of {size}")
