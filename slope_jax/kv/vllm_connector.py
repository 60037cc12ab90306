"""A vLLM KV connector that decodes from slope_jax KV exports (the decode half of prefill/decode disaggregation).

    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(model=..., kv_transfer_config=KVTransferConfig(
        kv_connector="SlopeJaxConnector", kv_connector_module_path="slope_jax.kv.vllm_connector",
        kv_role="kv_consumer", kv_connector_extra_config={"kv_dir": "/data/kv"}))   # kv_dir optional

A request finds its export by `kv_transfer_params={"slope_jax_kv_path": "<abs dir>", ...}` (what slope_jax's
prefill endpoint returns), else by its prompt's token hash among the exports under `kv_dir`. The scheduler side
validates the export (`slope_jax.kv.vllm_plan.validate`: manifest, model, weights digest, the request's cache_salt,
prompt, dtype, files and checksums) before it reports n−1 external tokens; a refused export is logged with its
reason and vLLM prefills the request itself. The weights vLLM serves are digested once at start-up
(`slope_jax.checkpoints.digest.weights_digest` of its model directory, as the prefill engine records it), so an
export computed with other weights, or for another tenant's cache_salt, is never loaded.
The worker side reads the export (`slope_jax.kv.load`, any prefill layout or process count) and writes each layer's
rows through the attention backend's own cache-update op (`impl.do_kv_cache_update`, the op vLLM's forward uses),
so the connector never depends on a backend's physical cache layout. Subclassing `SupportsHMA` keeps vLLM's hybrid
KV cache manager on: sliding layers then get blocks for their window only.

Outputs: each finished request's `kv_transfer_params` carries `slope_jax_loaded_tokens` (tokens injected) and
`slope_jax_status` ("loaded", or "not used: <reason>").

No JAX is imported here (numpy, safetensors, ml_dtypes and torch only); docs/kv-format.md §7 lists the setup.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.logger import init_logger

from slope_jax.kv import compat
from slope_jax.kv import format as kvfmt
from slope_jax.kv import vllm_plan as plan

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# under the "vllm" logger, so vLLM's logging configuration (level, format, VLLM_LOGGING_*) applies to these lines
logger = init_logger("vllm.slope_jax_connector")


@dataclasses.dataclass
class _Load:
    """One request's load for the worker: export, and per KV cache group the token rows and their slots."""

    req_id: str
    export: plan.Validated
    # (group index, layer kind) → (lo, hi, int64 slots [hi − lo]); None if the scheduler could not place the rows
    rows: dict[tuple[int, str], tuple[int, int, np.ndarray]] | None
    # the request's blocks, reported as failed loads if anything goes wrong
    block_ids: set[int]


@dataclasses.dataclass
class SlopeJaxConnectorMetadata(KVConnectorMetadata):
    loads: list[_Load] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Decision:
    export: plan.Validated | None
    status: str


class SlopeJaxConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM v1 KV connector (role kv_consumer) loading slope_jax exports.

    kv_connector_extra_config keys:
      kv_dir (str, optional): look exports up by the prompt's token hash under this directory.
      verify_checksums (bool, default True): compare every file's SHA-256 before use (sizes are always compared).
      check_fingerprint (bool, default True): also compare the model fingerprint (`slope_jax.kv.check_model`).
      weights_digest (str, optional): the served weights' digest (`slope_jax.checkpoints.digest.weights_digest` of
        the checkpoint directory), for a model that is not a local directory; default: computed from vLLM's model
        directory at start-up. Without either, every export is refused (model.weights_digest unknown).
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        unknown = sorted(set(extra) - {"kv_dir", "verify_checksums", "check_fingerprint", "weights_digest"})
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown key(s) {unknown}; SlopeJaxConnector knows kv_dir, "
                             "verify_checksums, check_fingerprint, weights_digest")
        self._verify = bool(extra.get("verify_checksums", True))
        self._check_fp = bool(extra.get("check_fingerprint", True))
        self._index = plan.ExportIndex(extra["kv_dir"]) if extra.get("kv_dir") else None
        self._cfg = compat.model_config(vllm_config.model_config.hf_config)
        self._prefix_caching = bool(vllm_config.cache_config.enable_prefix_caching)
        # the served weights' digest (the scheduler side decides; the worker only loads what it validated)
        self._weights, self._weights_unknown = None, "not computed on the worker side"
        if role == KVConnectorRole.SCHEDULER:
            self._weights, self._weights_unknown = self._served_weights(vllm_config, extra)
        # layer name → (global layer index, kind, group index); group → (block size, is a sliding-window group)
        self._layers: dict[str, tuple[int, str, int]] = {}
        self._groups: list[tuple[int, bool]] = []
        if kv_cache_config is not None:
            from vllm.model_executor.models.utils import extract_layer_index
            from vllm.v1.kv_cache_interface import SlidingWindowSpec

            for g, group in enumerate(kv_cache_config.kv_cache_groups):
                spec = group.kv_cache_spec
                self._groups.append((int(spec.block_size), isinstance(spec, SlidingWindowSpec)))
                for name in group.layer_names:
                    try:
                        idx = extract_layer_index(name)
                    except (AssertionError, ValueError):
                        continue
                    if 0 <= idx < self._cfg.num_hidden_layers:
                        self._layers[name] = (idx, self._cfg.layer_types[idx], g)
        self._cache_dtype = self._find_cache_dtype(vllm_config, kv_cache_config)
        # scheduler side
        self._decisions: dict[str, _Decision] = {}
        self._pending: list[_Load] = []
        self._null_block: int | None = None
        # worker side
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._failed_blocks: set[int] = set()
        self.load_seconds: list[float] = []
        logger.info("SlopeJaxConnector (%s): kv_dir=%s, %d KV cache group(s) (kind, block size) %s, prefix caching "
                    "%s, cache dtype %s", role.name, self._index.kv_dir if self._index else None, len(self._groups),
                    [("sliding" if s else "full", b) for b, s in self._groups], self._prefix_caching, self._cache_dtype)

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

    # ------------------------------------------------------------------------------------------------------------
    # Scheduler side
    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        null = getattr(gpu_block_pool, "null_block", None)
        self._null_block = None if null is None else int(null.block_id)

    def _decide(self, request: "Request") -> _Decision:
        prompt = np.asarray(request.prompt_token_ids or [], dtype=np.int64)
        params = request.kv_transfer_params
        if len(prompt) <= 1:
            return _Decision(None, "not used: a 1-token prompt has nothing to load (vLLM computes the last token)")
        try:
            export, how = plan.choose(params, prompt, self._index, cfg=self._cfg, cache_dtype=self._cache_dtype,
                                      weights=self._weights, weights_unknown=self._weights_unknown,
                                      cache_salt=getattr(request, "cache_salt", None), verify_checksums=self._verify,
                                      check_fingerprint=self._check_fp)
            if export is None:
                return _Decision(None, f"not used: {how}")
        except plan.ExportRefused as e:
            logger.warning("SlopeJaxConnector: request %s: export not used, vLLM prefills it itself: %s",
                           request.request_id, e)
            return _Decision(None, f"not used: {e}")
        except Exception as e:  # noqa: BLE001 - one bad export must never stop the engine
            logger.exception("SlopeJaxConnector: request %s: unexpected error validating its export; vLLM prefills "
                             "it itself", request.request_id)
            return _Decision(None, f"not used: {type(e).__name__}: {e}")
        logger.info("SlopeJaxConnector: request %s: export %s (found by %s) validated, %d tokens",
                    request.request_id, export.path, how, export.num_tokens)
        return _Decision(export, "validated")

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
            d.export, d.status = None, f"not used: {e}"
            return 0, False
        return max(0, d.export.num_tokens - 1 - num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        if num_external_tokens <= 0:
            return
        d = self._decisions[request.request_id]
        n = d.export.num_tokens
        start = n - 1 - num_external_tokens
        block_ids = blocks.get_block_ids()
        rows = {}
        try:
            for (g, kind), (lo, hi) in self._rows(d.export, start).items():
                rows[(g, kind)] = (lo, hi, plan.slots(block_ids[g], self._groups[g][0], lo, hi, self._null_block))
        except plan.ExportRefused as e:
            # The blocks are allocated and the count reported: too late to prefill instead. vLLM's own invalid-block
            # path handles it (the worker reports these blocks as failed loads).
            logger.error("SlopeJaxConnector: request %s: cannot place its KV: %s", request.request_id, e)
            rows = None
        all_blocks = {int(b) for group in block_ids for b in group if b != self._null_block}
        self._pending.append(_Load(request.request_id, d.export, rows, all_blocks))
        d.status = f"loaded {num_external_tokens} tokens"

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = SlopeJaxConnectorMetadata(loads=self._pending)
        self._pending = []
        return meta

    def _finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        d = self._decisions.pop(request.request_id, None)
        if d is None:
            return False, None
        loaded = int(d.status.split()[1]) if d.status.startswith("loaded ") else 0
        return False, {plan.LOADED_KEY: loaded, plan.STATUS_KEY: "loaded" if loaded else d.status}

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    # ------------------------------------------------------------------------------------------------------------
    # Worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._kv_caches = dict(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, SlopeJaxConnectorMetadata):
            return
        for load in meta.loads:
            t0 = time.perf_counter()
            try:
                self._inject(load, forward_context)
            except Exception as e:  # noqa: BLE001 - reported as failed blocks below, never a crash
                logger.error("SlopeJaxConnector: request %s: loading %s failed (%s: %s); its blocks are reported "
                             "as failed loads", load.req_id, load.export.path, type(e).__name__, e)
                self._failed_blocks.update(load.block_ids)
                continue
            dt = time.perf_counter() - t0
            self.load_seconds.append(dt)
            logger.info("SlopeJaxConnector: request %s: injected %d tokens from %s in %.1f ms", load.req_id,
                        load.export.num_tokens - 1, load.export.path, dt * 1e3)

    def _inject(self, load: _Load, forward_context) -> None:
        if load.rows is None:
            raise plan.ExportRefused("the scheduler could not place the KV")
        exp = load.export
        m = kvfmt.read_manifest(exp.path)
        if m["run_nonce"] != exp.run_nonce or m["checksums"] != exp.checksums:
            raise plan.ExportRefused(f"{exp.path}: the export was replaced after it was validated (run_nonce "
                                     f"{exp.run_nonce} → {m['run_nonce']})")
        kv = kvfmt.load(exp.path, framework="pt", verify=False)  # sizes, shapes, dtype, positions are checked
        tp_rank, tp_size = _tp()
        layers = forward_context.no_compile_layers
        for name, (idx, kind, g) in self._layers.items():
            layer = layers.get(name)
            if layer is None:
                continue
            lo, hi, slot = load.rows[(g, kind)]
            if hi <= lo:
                continue
            src = kv[idx]
            if src.kind != kind:
                raise plan.ExportRefused(f"layer {idx} is {src.kind} in the export, {kind} in the model")
            pos = src.positions
            a = int(torch.searchsorted(pos, lo))
            if a >= len(pos) or int(pos[a]) != lo or int(pos[-1]) < hi - 1:
                raise plan.ExportRefused(f"layer {idx} holds positions [{int(pos[0])}, {int(pos[-1]) + 1}), "
                                         f"needs [{lo}, {hi})")
            k, v = src.k[a:a + hi - lo], src.v[a:a + hi - lo]
            k, v = _tp_heads(k, layer.num_kv_heads, tp_rank, tp_size), _tp_heads(v, layer.num_kv_heads, tp_rank,
                                                                                 tp_size)
            if k.shape[-1] != layer.head_size:
                raise plan.ExportRefused(f"layer {idx}: head_dim {k.shape[-1]} in the export, {layer.head_size} in "
                                         "vLLM")
            cache = layer.kv_cache
            impl = layer.impl
            if not hasattr(impl, "do_kv_cache_update"):
                raise plan.ExportRefused(f"attention backend {type(impl).__name__} has no do_kv_cache_update")
            dev = cache.device
            impl.do_kv_cache_update(layer, k.to(device=dev, dtype=cache.dtype).contiguous(),
                                    v.to(device=dev, dtype=cache.dtype).contiguous(), cache,
                                    torch.from_numpy(slot).to(dev))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv writes every layer before the forward pass (measured in docs/kv-format.md §7)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # a consumer saves nothing

    def wait_for_save(self):
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._failed_blocks = set(self._failed_blocks), set()
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
