"""`PrefillEngine`: the Python API for batch prefill.

    engine = slope_jax.PrefillEngine.from_checkpoint("checkpoints/tiny-gpt-oss",
                                                     parallel=slope_jax.ParallelConfig(ring=2, ulysses=4))
    results = engine.prefill([[1, 2, 3], list(range(500))])
    results[0].first_token, results[0].logits, results[0].kv[3].k   # [T, K, H], natural order

One device runs the single-device reference path (`model.forward`). More devices run one `shard_map` over
`(pipeline, ring, ulysses)` (`pipeline.build_prefill_step`). Prompts are padded to a small set of bucket lengths
(`layout.bucket_length`), so repeated lengths reuse compiled programs.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import threading
import time
from typing import Callable, Collection, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from slope_jax import compile_cache
from slope_jax.checkpoints import hf as ckpt_lib
from slope_jax.checkpoints import orbax_store
from slope_jax.kv import prefix as prefix_lib
from slope_jax.kv.exporter import ExportFailed, KVExporter
from slope_jax.kv.format import LayerKV
from slope_jax.kv.store import KVStore
from slope_jax.model import gpt_oss as model_lib
from slope_jax.model import stack
from slope_jax.model.config import ModelConfig
from slope_jax.model.options import StepOptions
from slope_jax.parallel import layout
from slope_jax.parallel import pipeline as pipe_lib
from slope_jax.parallel import sharding, stages
from slope_jax.parallel.config import ParallelConfig
from slope_jax.parallel.mesh import format_device_map, make_mesh
from slope_jax.serve import agreement
from slope_jax.serve import reuse as reuse_lib
from slope_jax.serve.requests import RequestError, check_request_id
from slope_jax.serve.steps import group_steps

log = logging.getLogger(__name__)


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _one_at_a_time(method):
    """Run an engine method under the engine's lock: calls from several threads run one after another, never
    interleaved. A step's cached K/V is laid out in host buffers the engine keeps for the next step of that shape
    (`serve.reuse.PrefixBuffers`), which JAX's CPU client uses in place as the step's input; two steps laid out at
    once would read each other's rows (wrong logits, no error)."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


@dataclasses.dataclass
class PrefillResult:
    """Outcome of one prompt.

    first_token: greedy next token; logprob: its log-probability (natural log); top_k: [(token, logit)] best first;
    logits: float32 `[V]` at the last real position; num_tokens; kv: global layer id → LayerKV (natural order, all
    tokens; empty when not asked for; its arrays may be read-only: the prefix cache shares them, copy to edit);
    kv_path: the export directory (None without `kv_dir`); timings in ms:
    queue_ms (arrival → its step starts; includes compile_ms, the compilation of a new bucket for this step),
    compute_ms (step start → first token on the host), ttft_ms (the sum), export_ms (first token on the
    host → this request's KV export published, the batch's earlier exports included; not part of TTFT).
    cached_tokens: prompt tokens whose KV came from the prefix cache (0: computed cold); the step computed
    num_tokens − cached_tokens tokens.
    export_error: why this prompt's KV export was not written, where `kv_dir` takes no writes (read-only, full, over
    quota, no permission; `kv.store.unwritable`) and its store lets the request succeed without it
    (`KVStore.exports_required` False, as `PrefillEngine.kv_store` makes it); `kv_path` is then None. None otherwise.
    """

    first_token: int
    logits: np.ndarray
    num_tokens: int
    kv: dict[int, LayerKV]
    logprob: float = 0.0
    top_k: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    kv_path: str | None = None
    compile_ms: float = 0.0
    queue_ms: float = 0.0
    compute_ms: float = 0.0
    export_ms: float = 0.0
    cached_tokens: int = 0
    export_error: str | None = None

    @property
    def ttft_ms(self) -> float:
        return self.queue_ms + self.compute_ms


class PrefillEngine:
    """Prefill worker for one model on one mesh.

    Thread-safe: calls from several threads (`prefill`, `precompile`, …) run one after another on the engine's devices;
    put prompts in one `prefill` call to batch them. Under several processes every process calls in the same order.

    Args:
      cfg, params: from `slope_jax.load_checkpoint` (or `model.init_params`); params may be host or device arrays
        with `layers` stacked over the L layers.
      parallel: the layout; its device count must equal `jax.device_count()` (or `len(devices)`).
      dtype: activation dtype ("bfloat16" or "float32"); float params are cast to it.
      options: the step's compute options (`model.options.StepOptions`: tiles, attention core, MoE compute),
        resolved once here for the devices' platform ("auto" → concrete) and kept as `self.options`.
      **option_fields: StepOptions fields given one by one instead (q_tile=…, attention_impl=…; not with
        `options`).
      allow_cross_host_ulysses: let a Ulysses group span processes (hosts); default False (LayoutError), see
        `parallel.mesh`.
      reuse: prefix reuse (`kv.prefix.ReuseOptions`: on by default, 128-token blocks, 2 GiB host tier).
      weights_digest: the identity of the weights (`checkpoints.digest.weights_digest`; `from_checkpoint` passes
        the checkpoint files' digest, for a converted directory its source's where the conversion kept the values
        exactly, `checkpoints.orbax_store.weights_digest`); default: a digest of `params` as placed, computed when
        first needed.
      kv_dir_max_bytes, kv_dir_max_age_s: retention of every `kv_dir` this engine exports to (`kv.store.KVStore`;
        default None: unbounded).
    Compiled programs go to the persistent XLA compilation cache (`slope_jax.compile_cache`: on by default,
    `SLOPE_JAX_COMPILE_CACHE=<dir>|off`), keyed by the lowered program, which the step options shape;
    `compile_ms[(bucket, m)]` is the time to get a bucket's program (ms) and `compile_source[(bucket, m)]` says
    whether it was loaded from the cache ("cache") or compiled.
    Raises:
      LayoutError for a layout the model or the devices cannot take; ValueError for a bad option (named), or both
      `options` and option fields; TypeError for an unknown keyword.
    """

    def __init__(self, cfg: ModelConfig, params: dict, parallel: ParallelConfig = ParallelConfig(),
                 dtype="bfloat16", *, devices=None, options: StepOptions | None = None,
                 allow_cross_host_ulysses: bool = False, reuse: prefix_lib.ReuseOptions | None = None,
                 weights_digest: str | None = None, kv_dir_max_bytes: int | None = None,
                 kv_dir_max_age_s: float | None = None, _placed: bool = False, _mesh=None, **option_fields):
        compile_cache.enable()  # the persistent XLA cache (default dir, SLOPE_JAX_COMPILE_CACHE, or the launcher's)
        devices = list(jax.devices() if devices is None else devices)
        self.run_nonce = agreement.agreed_run_nonce()  # names this run's KV export staging directories and barriers
        self.cfg = cfg
        self.parallel = parallel.validate(cfg, len(devices) if parallel.num_devices > 1 else None)
        self.dtype = jnp.dtype(dtype)
        self.options = agreement.agreed_options(_step_options(options, option_fields).resolve(devices[0].platform))
        self._lock = threading.RLock()  # `_one_at_a_time`: the public entry points take it (re-entrant: prefill
        # compiles and runs steps through them)
        self._compiled: dict[tuple[int, int], object] = {}
        self.compile_ms: dict[tuple[int, int], float] = {}  # (bucket, prompts per step) -> XLA compile time, ms
        # (bucket, prompts per step) -> "cache" (loaded from the persistent compilation cache), "compiled" or
        # "compiled, cache off"
        self.compile_source: dict[tuple[int, int], str] = {}
        self._met: set[tuple[int, int]] = set()  # steps whose first run every process reached (multi-process)
        # names host-tier entries uniquely for this engine (an object id would be reused once its step is freed, and
        # the new entry would replace an older one of another prompt under the same key)
        self._host_seq = itertools.count()
        if parallel.num_devices == 1:
            self.mesh = None
            self.plan = stages.StagePlan.single_stage(cfg.num_hidden_layers)
            self.params = params if _placed else self._cast(params, devices[0])
            self._step = jax.jit(self._single_device_step)
        else:
            # from_checkpoint built the mesh already (to place the weights as they are read): one mesh per engine
            self.mesh = _mesh or make_mesh(parallel, devices, allow_cross_host_ulysses=allow_cross_host_ulysses)
            self.plan = stages.plan_stages(cfg, parallel.pipeline)
            self.params = params if _placed else self._place(params)
            log.info("engine: device -> (process, stage, ring, ulysses): %s", format_device_map(self.mesh))
            self._step = pipe_lib.build_prefill_step(cfg, parallel, self.mesh, self.plan, self.dtype, self.options)
        log.info("engine: layout pipeline=%d ring=%d ulysses=%d expert=%d seq_chunks=%d on %d device(s), dtype=%s, "
                 "%d empty slot(s), options %s", parallel.pipeline, parallel.ring, parallel.ulysses,
                 parallel.expert_degree(cfg), parallel.seq_chunks, parallel.num_devices, self.dtype.name,
                 self.plan.empty_slots, self.options)
        self._exporter = KVExporter(cfg, self.plan.flat, self.dtype.name, self.run_nonce)
        self.reuse = reuse if reuse is not None else prefix_lib.ReuseOptions()
        self._weights = weights_digest
        if self._weights is None and jax.process_count() > 1:
            # a collective (every process hashes its shards): now, while every process is here, never later from
            # one process alone (process 0's admission asks for the prefix identity)
            self._weights = reuse_lib.params_digest(self.params)
        self._retention = (kv_dir_max_bytes, kv_dir_max_age_s)
        self._stores: dict[str, KVStore] = {}
        self._prefix_steps: dict = {}
        self._prefix_buffers = reuse_lib.PrefixBuffers()  # a hit's host K/V rows, kept for the next hit's
        # the host tier holds whole prompts' KV gathered to this process: single-process runs only
        self.host_tier = (prefix_lib.HostTier(self.reuse.host_bytes)
                          if self.reuse.enabled and self.reuse.host_bytes and jax.process_count() == 1 else None)
        # several processes: how `rows_for` prompts' rows reach process 0 (`serve.peer_rows.PeerRows`, over NIXL;
        # None: the step's K/V is all-gathered). The same choice on every process (the launcher agrees on it).
        self.peer_rows = None
        self._offers = 0  # steps whose rows were offered, advanced identically on every process

    @property
    def weights_digest(self) -> str:
        """The identity of this engine's weights (32 hex digits): the checkpoint files' digest, or one of the
        parameters as placed (`serve.reuse.params_digest`). Prefix-cache keys and export manifests record it."""
        if self._weights is None:
            self._weights = reuse_lib.params_digest(self.params)
        return self._weights

    @_one_at_a_time
    def use_store(self, store: KVStore) -> None:
        """Export to `store.kv_dir` under this `KVStore`'s policy (overwrite, retention) and index: the launcher's
        one owner of the directory, shared by its intake and this engine."""
        self._open_store(store)
        self._stores[os.path.realpath(store.kv_dir)] = store

    def _open_store(self, store: KVStore) -> None:
        """Index a store's directory (with reuse on) and apply its retention now: a smaller budget or an age limit
        given at start-up holds before the first export, also for a server that stays idle."""
        if self.reuse.enabled:
            n = store.scan()
            if n:
                log.info("kv_dir %s: %d export(s) indexed for prefix reuse", store.kv_dir, n)
        store.retain()

    @_one_at_a_time
    def kv_store(self, kv_dir: str) -> KVStore:
        """The policy owner of `kv_dir` (`kv.store.KVStore`), made once per directory: its reuse index is built from
        the manifests already there, so prefixes exported by earlier runs are reused. A directory that takes no writes
        does not fail the requests exporting to it (`exports_required=False`: `PrefillResult.export_error`)."""
        key = os.path.realpath(kv_dir)
        if key not in self._stores:
            store = KVStore(kv_dir, max_bytes=self._retention[0], max_age_s=self._retention[1],
                            exports_required=False)
            self._open_store(store)
            self._stores[key] = store
        return self._stores[key]

    @property
    def impls(self) -> dict:
        """The concrete attention / MoE implementations this engine runs (from `options`)."""
        return {"attention_impl": self.options.attention_impl, "moe_impl": self.options.moe_impl}

    # ------------------------------------------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, path, parallel: ParallelConfig = ParallelConfig(), dtype="bfloat16", *,
                        devices=None, progress: bool = True, **kwargs) -> PrefillEngine:
        """Load a checkpoint directly into the layout: each device reads only the layers of its pipeline stage.

        `path` is an HF / `original/` checkpoint, or a directory written by `python -m slope_jax.convert` (detected
        by its marker file), which is restored with orbax into this layout (any layout; shards are re-cut on read).
        Keywords as `PrefillEngine` (options or its fields, allow_cross_host_ulysses).
        """
        devices = list(jax.devices() if devices is None else devices)
        if orbax_store.is_orbax_checkpoint(path):
            kwargs.setdefault("weights_digest", orbax_store.weights_digest(path))  # the source's, if kept exactly
            cfg, params, _ = orbax_store.restore(path, parallel, dtype, devices=devices, progress=progress)
            return cls(cfg, params, parallel, dtype, devices=devices, _placed=True, **kwargs)
        ck = ckpt_lib.open_checkpoint(path)
        cfg = ck.config
        kwargs.setdefault("weights_digest", reuse_lib.checkpoint_weights_digest(path))
        parallel.validate(cfg, len(devices) if parallel.num_devices > 1 else None)
        mesh = None
        if parallel.num_devices == 1:
            params = ckpt_lib.load_params(ck, dtype, progress=progress)
        else:
            mesh = make_mesh(parallel, devices,
                             allow_cross_host_ulysses=kwargs.get("allow_cross_host_ulysses", False))
            params = ckpt_lib.load_params(ck, dtype, shardings=sharding.param_shardings(cfg, parallel, dtype, mesh),
                                          stack_layers=stages.plan_stages(cfg, parallel.pipeline).flat,
                                          vocab_rows=stages.vocab_rows(cfg, parallel), progress=progress)
        return cls(cfg, params, parallel, dtype, devices=devices, _placed=True, _mesh=mesh, **kwargs)

    def _cast(self, params, device):
        specs = model_lib.param_specs(self.cfg, self.dtype)
        return jax.tree.map(lambda a, s: jax.device_put(jnp.asarray(a).astype(s.dtype), device), params, specs,
                            is_leaf=lambda x: isinstance(x, model_lib.ParamSpec) or not isinstance(x, dict))

    def _place(self, params):
        """Host params `[L, …]` → device params: each stage's stack `[n, …]` (`plan.flat` order), sharded over the
        mesh."""
        entries = np.asarray(self.plan.flat)
        specs = sharding.stacked_param_specs(self.cfg, self.parallel, self.dtype)
        rows = stages.vocab_rows(self.cfg, self.parallel)
        shardings = sharding.param_shardings(self.cfg, self.parallel, self.dtype, self.mesh)

        def put(path, a, spec, sh):
            a = np.asarray(a)
            if path[0].key == "layers":
                a = np.where((entries >= 0).reshape(-1, *([1] * (a.ndim - 1))), a[np.maximum(entries, 0)], 0)
            elif spec.axes[0] == "vocab" and a.shape[0] < rows:
                a = np.concatenate([a, np.zeros((rows - a.shape[0], *a.shape[1:]), a.dtype)])
            a = a.astype(spec.dtype)
            return jax.make_array_from_callback(a.shape, sh, lambda idx: a[idx])  # multi-process safe

        return jax.tree_util.tree_map_with_path(put, params, specs, shardings,
                                                is_leaf=lambda x: not isinstance(x, dict))

    # ------------------------------------------------------------------------------------------------------------
    def _single_device_step(self, params, tokens, positions, num_tokens):
        del positions

        def one(args):
            t, n = args
            return _as_bits(model_lib.forward(params, self.cfg, t, n, self.options))

        logits, k, v = jax.lax.map(one, (tokens, num_tokens))
        return logits, stack.unbits(k, self.dtype), stack.unbits(v, self.dtype)  # k, v: [M, L, T, K, H]

    def _single_device_prefix_step(self, params, tokens, positions, num_tokens, offsets, pk, pv, ppos):
        """`_single_device_step` after cached prefixes: `num_tokens` counts each prompt's tokens in this step,
        pk, pv `[M, L, S, K, H]` (bf16 as uint16 bits: `_arg_shapes`), ppos `[M, S]`, offsets `[M]`
        (`model.gpt_oss.CachedPrefix`)."""
        del positions

        def one(args):
            t, n, off, k, v, pos = args
            return _as_bits(model_lib.forward(params, self.cfg, t, n, self.options,
                                              model_lib.CachedPrefix(off, k, v, pos)))

        logits, k, v = jax.lax.map(one, (tokens, num_tokens, offsets, pk, pv, ppos))
        return logits, stack.unbits(k, self.dtype), stack.unbits(v, self.dtype)

    def validate_prompt(self, i: int, prompt) -> np.ndarray:
        """Check one prompt; returns it as int32 `[n]`. Raises RequestError naming prompt `i` and the violated limit."""
        try:
            ids = np.asarray(prompt)
        except Exception as e:  # noqa: BLE001 - anything numpy cannot read is a bad request
            raise RequestError(f"prompt {i}: not a sequence of token ids ({e})") from e
        if isinstance(prompt, str):
            raise RequestError(f"prompt {i}: a string; prefill takes token ids (tokenize it first, e.g. with the "
                               "checkpoint's tokenizer.json; the launcher and the HTTP endpoint take text)")
        if ids.ndim == 0 and isinstance(prompt, Iterator):  # a generator: numpy cannot size it
            ids = np.asarray(list(prompt))
        if ids.ndim == 0:
            raise RequestError(f"prompt {i}: a single value ({ids.item()!r}); prompts must be a list of prompts, "
                               "each a sequence of token ids (one prompt: [ids])")
        if ids.ndim != 1 or ids.size == 0:
            raise RequestError(f"prompt {i}: expected a non-empty 1-D sequence of token ids, got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise RequestError(f"prompt {i}: token ids must be integers, got dtype {ids.dtype}")
        bad = np.nonzero((ids < 0) | (ids >= self.cfg.vocab_size))[0]
        if bad.size:
            raise RequestError(f"prompt {i}: token id {int(ids[bad[0]])} at index {int(bad[0])} is outside the "
                               f"vocabulary [0, {self.cfg.vocab_size})")
        if ids.size > self.cfg.max_position_embeddings:
            raise RequestError(f"prompt {i}: {ids.size} tokens exceeds max_position_embeddings="
                               f"{self.cfg.max_position_embeddings}")
        return ids.astype(np.int32)

    def bucket(self, n: int) -> int:
        """Compiled length for an n-token prompt."""
        return layout.bucket_length(n, multiple=self.parallel.token_multiple)

    def _input_shardings(self, t: int, m: int, prefix_rows: int = 0) -> tuple:
        """Shardings of the step's arguments after the parameters (None each on one device): tokens, positions,
        num_tokens, and with a cached prefix offsets, prefix K, V and positions (`pipeline.build_prefill_step`)."""
        n = 3 + (4 if prefix_rows else 0)
        if self.mesh is None:
            return (None,) * n
        Ps = jax.sharding.PartitionSpec
        cp = ("ring", "ulysses")
        specs = [Ps(None, cp), Ps(cp), Ps()]
        if prefix_rows:
            specs += [Ps(), Ps(None, "pipeline", cp, None, None), Ps(None, "pipeline", cp, None, None), Ps(None, cp)]
        return tuple(NamedSharding(self.mesh, sp) for sp in specs)

    def _arg_shapes(self, t: int, m: int, cap: int) -> list:
        """ShapeDtypeStructs of the step's arguments after the parameters (`_input_shardings`)."""
        c = self.cfg
        shapes = [((m, t), jnp.int32), ((t,), jnp.int32), ((m,), jnp.int32)]
        if cap:
            kv = ((m, len(self.plan.flat), cap, c.num_key_value_heads, c.head_dim), reuse_lib.step_kv_dtype(self.dtype))
            shapes += [((m,), jnp.int32), kv, kv, ((m, cap), jnp.int32)]
        return [jax.ShapeDtypeStruct(shape, dt, sharding=sh)
                for (shape, dt), sh in zip(shapes, self._input_shardings(t, m, cap))]

    @_one_at_a_time
    def precompile(self, lengths: Sequence[int], in_flight: Sequence[int] | None = None) -> None:
        """Compile the buckets of these prompt lengths ahead of traffic, so first requests do not wait for XLA.
        Raises RequestError, before compiling anything, for a length that is not an integer in
        [1, max_position_embeddings] (no prompt outside it is ever prefilled)."""
        top = self.cfg.max_position_embeddings
        for i, n in enumerate(lengths := list(lengths)):
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= top:
                raise RequestError(f"precompile lengths[{i}]={n!r}: must be an integer prompt length in [1, {top}] "
                                   "(max_position_embeddings)")
        per_step = [1] if self.mesh is None else (in_flight or sorted({1, self.parallel.in_flight}))
        for n in lengths:
            for m in per_step:
                self.compiled(self.bucket(int(n)), m)

    @_one_at_a_time
    def compiled(self, t: int, m: int, prefix_rows: int = 0):
        """The compiled step for bucket length t, m prompts in flight and (prefix reuse) `prefix_rows` rows of cached
        prefix per prompt (compiled once, then reused). Keys of `compile_ms`: (t, m), or (t, m, prefix_rows)."""
        key = (t, m) if prefix_rows == 0 else (t, m, prefix_rows)
        if key not in self._compiled:
            t0, hits = time.perf_counter(), compile_cache.hits()
            fn = self._step if prefix_rows == 0 else self._prefix_step()
            self._compiled[key] = fn.lower(self.params, *self._arg_shapes(t, m, prefix_rows)).compile()
            self.compile_ms[key] = (time.perf_counter() - t0) * 1e3
            self.compile_source[key] = ("cache" if compile_cache.hits() > hits else
                                        "compiled" if compile_cache.directory() else "compiled, cache off")
            log.info("bucket T=%d x %d%s ready in %.1f s (%s)", t, m,
                     f" after a cached prefix of up to {prefix_rows} tokens" if prefix_rows else "",
                     self.compile_ms[key] / 1e3,
                     {"cache": "cache hit: loaded from the compilation cache",
                      "compiled": "cache miss: compiled, now cached"}.get(self.compile_source[key],
                                                                            "compiled; compilation cache off"))
        return self._compiled[key]

    def _prefix_step(self):
        """The jitted step of prompts after a cached prefix (built once)."""
        if "fn" not in self._prefix_steps:
            self._prefix_steps["fn"] = (jax.jit(self._single_device_prefix_step) if self.mesh is None else
                                        pipe_lib.build_prefill_step(self.cfg, self.parallel, self.mesh, self.plan,
                                                                    self.dtype, self.options, with_prefix=True))
        return self._prefix_steps["fn"]

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    def device_memory_limit(self) -> int | None:
        """Bytes one device can hold (the smallest over this process's devices), from `Device.memory_stats()`;
        None where the backend does not report it (CPU)."""
        devices = [d for d in (self.mesh.devices.reshape(-1) if self.mesh is not None else jax.local_devices()[:1])
                   if d.process_index == jax.process_index()]
        limits = []
        for d in devices:
            stats = d.memory_stats() if hasattr(d, "memory_stats") else None
            if stats and stats.get("bytes_limit"):
                limits.append(int(stats["bytes_limit"]))
        return min(limits) if limits else None

    def memory_per_device(self, n: int, m: int = 1) -> int:
        """Bytes per device XLA plans for an n-token prompt's step (arguments incl. weights + outputs + temps), from
        `compiled.memory_analysis()` of its bucket (compiling it if needed)."""
        mem = self.compiled(self.bucket(n), m).memory_analysis()
        return int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                   - mem.alias_size_in_bytes)

    def check_fits(self, n: int, limit_bytes: int | None = None) -> None:
        """Raise RequestError if an n-token prompt's step needs more memory per device than `limit_bytes` (default:
        what the device reports; no check where it reports nothing)."""
        limit = limit_bytes if limit_bytes is not None else self.device_memory_limit()
        if limit is None:
            return
        m = 1 if self.mesh is None else self.parallel.in_flight
        need = self.memory_per_device(n, m)
        if need > limit:
            raise RequestError(f"{n} tokens (bucket {self.bucket(n)}) need {_mib(need)} per device for the compiled "
                               f"step, devices have {_mib(limit)}: use more context-parallel devices, more pipeline "
                               "stages, or a shorter prompt")

    def prefix_identity(self, cache_salt: str | None = None) -> str:
        """The prefix-cache identity of this engine's KV for a request with `cache_salt` (`kv.prefix.identity`:
        config fingerprint, weights digest, dtype, KV layout, salt)."""
        c = self.cfg
        return prefix_lib.identity(fingerprint=c.fingerprint(), weights=self.weights_digest, dtype=self.dtype.name,
                                   kv_heads=c.num_key_value_heads, head_dim=c.head_dim, window=c.sliding_window,
                                   layer_types=c.layer_types, cache_salt=cache_salt)

    @_one_at_a_time
    def prefill(self, prompts: Sequence[Sequence[int]], kv_dir: str | None = None, *,
                ids: Sequence[str] | None = None, kv_full: bool | None = None, return_kv: bool | None = None,
                top_k: int = 5, arrival_times: Sequence[float] | None = None, overwrite: bool = False,
                cache_salt: str | Sequence[str | None] | None = None, prefix_reuse: bool | None = None,
                on_computed=None, rows_for: Collection[str] = ()) -> list[PrefillResult]:
        """Prefill a batch of prompts (token ids); one PrefillResult per prompt, in order.

        Args:
          prompts: token-id sequences (any lengths; they are bucketed and grouped into compiled steps).
          kv_dir: if given, each prompt's KV cache is exported to `kv_dir/<id>/` (`slope_jax.kv` format) after its
            first token is known, and the directory's earlier exports are prefix-cache entries.
          ids: export directory names (default "0", "1", …); each must be a plain file name.
          kv_full: export every token of sliding layers (default while prefix reuse is on: reusable from any block
            boundary), else the last W and back to the vLLM KV-block boundary before them (`kv.format`); a hit from
            a `last_window` entry keeps its sliding rows from that entry's first (`KVExporter.sliding_from`).
          return_kv: fill `PrefillResult.kv` (default: True without `kv_dir` in a single-process run, else False:
            under several processes it gathers the whole cache to each, ~10 GB per 128K tokens of gpt-oss-120b).
          top_k: how many (token, logit) pairs to report (≥ 1; at most the vocabulary size are).
          arrival_times: `time.perf_counter()` of each prompt's arrival, for queue_ms (default: now).
          overwrite: replace an existing export `kv_dir/<id>/` atomically, a reader sees old or new (default: error).
          cache_salt: one string for every prompt, or one per prompt (None: no salt): prompts share cached prefixes
            only with prompts of the same salt (vLLM's `cache_salt`; tenants).
          prefix_reuse: look up and reuse cached prefixes, and cache these prompts' KV (default: `reuse.enabled`).
          on_computed: called as `on_computed(ids, results, exports)` after each compiled step, once its first
            tokens are on the host, before its KV is kept or exported: the step's ids and PrefillResults (`kv_path`
            still None) and, with `kv_dir`, one `PendingExport` per prompt (the manifest its export will carry and
            the rows it will hold; else None). The P/D endpoint answers from it (`serve.http`); an exception it
            raises fails the step.
          rows_for: ids of the prompts whose `PendingExport.rows()` `on_computed` may ask for (the same on every
            process; how their rows reach process 0: `_share_rows`). No effect in a single-process run.
        Raises:
          RequestError (naming the prompt) before any compute if a prompt or id is invalid, or its export exists
          and `overwrite` is False; under several processes also when the processes did not all pass the same
          prompts, ids and options (checked by an all-gather of a hash before any step, so a mismatch is an error on
          every process instead of mixed results or a hang), or for a `top_k` below 1.
        """
        prompts, arrival, arrival_error = _check_call(prompts, top_k, arrival_times)
        now, salts = time.perf_counter(), _salts(cache_salt, len(prompts))
        on = self.reuse.enabled if prefix_reuse is None else bool(prefix_reuse)
        kv_full = on if kv_full is None else bool(kv_full)
        if jax.process_count() > 1:
            agreement.check_same_on_all_processes(prompts, ids, kv_dir is not None, kv_full, return_kv, top_k,
                                                  overwrite, salts, on, sorted(map(str, rows_for)),
                                                  arrival_error is None)  # one bad list: an error on every process
        if arrival_error is not None:
            raise RequestError(arrival_error)
        tokens = [self.validate_prompt(i, p) for i, p in enumerate(prompts)]
        ids = self._check_ids(ids, len(tokens), kv_dir, overwrite)
        return_kv = (kv_dir is None and jax.process_count() == 1) if return_kv is None else return_kv
        # reuse off: no lookup, no index, but the export names its identity (the decode side checks salt, weights)
        hits = (reuse_lib.find(self, tokens, salts, kv_dir) if on
                else [reuse_lib.Hit([], identity=self.prefix_identity(s)) for s in salts])
        try:
            return self._run_steps(tokens, ids, arrival or [now] * len(tokens), hits, kv_dir=kv_dir, kv_full=kv_full,
                                   overwrite=overwrite, cache=on, return_kv=return_kv, top_k=top_k,
                                   on_computed=on_computed, rows_for=frozenset(map(str, rows_for)))
        finally:
            for h in hits:
                if h.release is not None:
                    h.release()

    def _run_steps(self, tokens, ids, arrival, hits, *, kv_dir, kv_full, overwrite, cache, return_kv, top_k,
                   on_computed=None, rows_for=frozenset()) -> list[PrefillResult]:
        """`prefill`'s batch path: group into steps (`steps.group_steps` on `step_key`), run, tell `on_computed`
        (under several processes, once the rows of its `rows_for` prompts can reach process 0: `_share_rows`),
        keep, export."""
        results: list[PrefillResult | None] = [None] * len(tokens)
        per_step = 1 if self.mesh is None else self.parallel.in_flight
        keys = [self.step_key(x.size, h.cached) for x, h in zip(tokens, hits)]
        for (t, cap), members in group_steps(range(len(tokens)), lambda i: keys[i], per_step):
            step = Step(t, cap, [tokens[i] for i in members], [ids[i] for i in members],
                        [arrival[i] for i in members], [hits[i] for i in members])
            out = self.run_step(step, top_k=top_k)
            if kv_dir is not None and jax.process_count() > 1 and not rows_for.isdisjoint(step.ids):
                self._share_rows(step, rows_for, kv_full)
            try:
                if on_computed is not None:
                    on_computed(step.ids, out, None if kv_dir is None else self.pending_exports(step, out, kv_full))
            finally:
                for key in step.offers.values():  # offered by the peers, never collected: dropped
                    self.peer_rows.discard(key)
            self._keep(step, out, cache=cache, return_kv=return_kv)
            step.host_kv = step.host_shards = None  # copies: not held through the export
            if kv_dir is not None:
                self.export_step(step, out, kv_dir, kv_full=kv_full, overwrite=overwrite)
            for i, res in zip(members, out):
                results[i] = res
        return results  # type: ignore[return-value]

    def _share_rows(self, step: Step, rows_for: frozenset, kv_full: bool) -> None:
        """Several processes, a step holding prompts of `rows_for`, before `on_computed`: make their rows reachable
        from process 0. With `peer_rows`, every other process offers its pieces of each (`PeerRows.offer`) and
        process 0 notes the offers' keys (`Step.offers`; collected by `_collected_rows`); without, the step's K/V is
        all-gathered to every process (`_host_kv`, a collective)."""
        t0 = time.perf_counter()
        if self.peer_rows is None:
            kh, _ = self._host_kv(step)  # collective, on every process alike: the rows are then local everywhere
            log.info("step of %s: K/V gathered to every process for an early answer (%s in %.0f ms)",
                     ", ".join(step.ids), _mib(2 * kh.nbytes), (time.perf_counter() - t0) * 1e3)
            return
        self._offers += 1
        step.host_shards = self._exporter.host_shards(step.k, step.v)
        for j, rid in enumerate(step.ids):
            if rid not in rows_for:
                continue
            key = f"{self.run_nonce}-{self._offers}-{j}"
            if jax.process_index() == 0:
                step.offers[j] = key
            else:
                self.peer_rows.offer(key, self._own_pieces(step, j, kv_full), self.cfg.layer_types)
        if jax.process_index() != 0:
            log.info("step of %s: rows offered to process 0 in %.0f ms", ", ".join(step.ids),
                     (time.perf_counter() - t0) * 1e3)

    def _own_pieces(self, step: Step, j: int, kv_full: bool) -> list:
        """This process's pieces of prompt j's export (`KVExporter.own_pieces`)."""
        return self._exporter.own_pieces(j, step.tokens, step.host_shards, self._layout_positions(step.bucket),
                                         kv_full, offsets=[h.cached for h in step.hits],
                                         prefixes=[h.prefix for h in step.hits])

    def _collected_rows(self, step: Step, j: int, kv_full: bool, manifest: dict) -> dict[int, LayerKV]:
        """Process 0: prompt j's export rows from its own pieces and the ones its peers offered (`_share_rows`).
        Views into `peer_rows`' buffers, valid until the next prompt's rows are asked. Raises what
        `PeerRows.collect` and `nixl_transport.join` raise."""
        key = step.offers.pop(j)  # collected, or failed: nothing left to discard
        return self.peer_rows.joined(manifest, self._own_pieces(step, j, kv_full) + self.peer_rows.collect(key))

    def _offered_parts(self, step: Step, j: int, kv_full: bool) -> Offered:
        """Process 0: prompt j's own pieces and its peers' offered records (`_share_rows`), nothing pulled. Raises
        what `PeerRows.records` raises."""
        key = step.offers.pop(j)  # taken, or failed: nothing left to discard
        records = self.peer_rows.records(key)
        return Offered(self._own_pieces(step, j, kv_full), records, self.cfg.layer_types,
                       functools.partial(self.peer_rows.drop, records))

    def step_key(self, n: int, cached: int = 0) -> tuple[int, int]:
        """(bucket of the tokens the step computes, rows compiled for the cached prefix) of an n-token prompt of
        which `cached` tokens come from the prefix cache."""
        group = 1 if self.mesh is None else self.parallel.ring * self.parallel.ulysses
        if not cached:
            return self.bucket(n), 0
        # a hit's new tokens get coarse buckets (a quarter octave, like the cached rows): the turns of a growing
        # conversation then share compiled programs instead of compiling one per new length
        return (reuse_lib.suffix_bucket(n - cached, self.parallel.token_multiple),
                reuse_lib.prefix_capacity(cached, group))

    def _check_ids(self, ids, count: int, kv_dir: str | None, overwrite: bool) -> list[str]:
        ids = [str(i) for i in range(count)] if ids is None else [str(x) for x in ids]
        if len(ids) != count or len(set(ids)) != len(ids):
            raise RequestError(f"ids: need {count} distinct ids, got {len(ids)} ({len(set(ids))} distinct)")
        for i, x in enumerate(ids):
            check_request_id(x, f"prompt {i}")
        if kv_dir is not None and not overwrite:
            self._refuse_existing_exports(kv_dir, ids)
        return ids

    def _refuse_existing_exports(self, kv_dir: str, ids: list[str]) -> None:
        """RequestError naming the first prompt whose export `kv_dir/<id>` exists (process 0 asks the directory's
        `KVStore`; in a multi-process run its answer is broadcast, so every process raises or none does)."""
        store = self.kv_store(kv_dir)
        exists = agreement.process0_answer(np.asarray([store.exists(x) for x in ids]))
        for i, x in enumerate(ids):
            if exists[i]:
                raise RequestError(f"prompt {i}: KV export {os.path.join(kv_dir, x)!r} already exists: pass "
                                   "overwrite=True (launcher: --overwrite) to replace it, or use a new id")

    def _global_input(self, host: np.ndarray, sharding):
        if sharding is None:
            return host
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    def _ready(self, t: int, m: int, cap: int):
        """The compiled step, meeting the peers before its first run (multi-process); (step, ms getting it)."""
        key = (t, m) if cap == 0 else (t, m, cap)
        c0 = time.perf_counter()
        try:
            step = self.compiled(t, m, cap)
        finally:
            if jax.process_count() > 1 and key not in self._met:
                # a program loaded from the compilation cache is ready in seconds, while a peer may still compile it
                # (its entry missing): meet before its first collective, which waits only 30 s for every peer (Gloo).
                # Met even if compiling failed here, so that the peers are not held at the barrier.
                self._met.add(key)
                w0 = time.perf_counter()
                agreement.meet_peers(f"slope_jax-{self.run_nonce}-step-{'x'.join(map(str, key))}")
                if key in self.compile_ms:
                    self.compile_ms[key] += (time.perf_counter() - w0) * 1e3  # ready = ready on every process
        return step, 1e3 * (time.perf_counter() - c0)

    def _step_inputs(self, step: Step) -> list:
        """The step's arguments after the parameters, as global arrays (tokens in layout order)."""
        m, t = len(step.tokens), step.bucket
        tokens = np.zeros((m, t), np.int32)
        for j, (x, h) in enumerate(zip(step.tokens, step.hits)):
            tokens[j, :x.size - h.cached] = x[h.cached:]
        positions = self._layout_positions(t)
        if self.mesh is not None:
            tokens = tokens[:, positions]  # natural → layout order (positions is a permutation of [0, t))
        # the single-device path counts the step's own tokens; the mesh step counts the whole prompt
        n_tok = np.asarray([x.size - (h.cached if self.mesh is None else 0) for x, h in zip(step.tokens, step.hits)],
                           np.int32)
        host = [tokens, positions, n_tok]
        if step.prefix_rows:
            host += list(reuse_lib.prefix_arrays(self, step.hits, step.prefix_rows, self._prefix_buffers))
        return [self._global_input(a, sh) for a, sh in zip(host, self._input_shardings(t, m, step.prefix_rows))]

    @_one_at_a_time
    def run_step(self, step: Step, *, top_k: int = 5) -> list[PrefillResult]:
        """Run one compiled step (prompts of one bucket and one cached-prefix capacity): first tokens and timings.
        The step's K/V stay on the devices (`step.k`, `step.v`) for `export_step`."""
        fn, compile_ms = self._ready(step.bucket, len(step.tokens), step.prefix_rows)
        t0 = time.perf_counter()
        logits, step.k, step.v = fn(self.params, *self._step_inputs(step))
        logits = np.asarray(logits.addressable_shards[0].data) if self.mesh is not None else np.asarray(logits)
        t1 = step.first_tokens_at = time.perf_counter()
        out = []
        for j, x in enumerate(step.tokens):
            lg = logits[j]
            first = int(np.argmax(lg))
            lse = float(np.log(np.sum(np.exp(lg.astype(np.float64) - lg.max()))) + lg.max())
            top = np.argsort(-lg, kind="stable")[:top_k]
            out.append(PrefillResult(first, lg, int(x.size), {}, logprob=float(lg[first]) - lse,
                                     top_k=[(int(i), float(lg[i])) for i in top], compile_ms=compile_ms,
                                     queue_ms=1e3 * (t0 - step.arrival[j]), compute_ms=1e3 * (t1 - t0),
                                     cached_tokens=step.hits[j].cached))
        return out

    def pending_exports(self, step: Step, results: list[PrefillResult], kv_full: bool) -> list[PendingExport]:
        """What each of a run step's exports will be, before any is written (`PendingExport`: nothing is computed
        until asked)."""
        self._exporter.weights_digest = self.weights_digest

        def manifest(j: int) -> dict:
            return self._exporter.manifest(
                j, step.ids[j], step.tokens, step.k, self._layout_positions(step.bucket), kv_full,
                results[j].first_token, offsets=[h.cached for h in step.hits],
                prefixes=[h.prefix for h in step.hits], reuse=self._reuse_records(step))

        def rows(j: int):  # several processes: gathered or offered (`_share_rows`)
            if j in step.offers:
                return functools.partial(self._collected_rows, step, j, kv_full)
            return functools.partial(self.export_rows, step, j)

        return [PendingExport(functools.partial(manifest, j), rows(j),
                              jax.process_count() == 1 or step.host_kv is not None or j in step.offers,
                              functools.partial(self._offered_parts, step, j, kv_full) if j in step.offers else None)
                for j in range(len(step.ids))]

    def export_rows(self, step: Step, j: int, manifest: dict) -> dict[int, LayerKV]:
        """The rows request j's export holds (the manifest's `token_range` per layer), from the step's K/V on the
        host (views where they are whole; a prefix hit's cached rows joined before the computed ones): global layer
        id → LayerKV `[b − a, K, H]`, int32 positions. Under several processes only once the step's K/V is gathered
        (`prefill`'s `rows_for`): the gather is a collective."""
        kh, vh = self._host_kv(step)
        entry_of = {layer: e for e, layer in enumerate(self.plan.flat) if layer >= 0}
        hit = step.hits[j]
        p, out = hit.cached, {}
        for rec in manifest["layers"]:
            i, (a, b) = int(rec["layer"]), (int(x) for x in rec["token_range"])
            e = entry_of[i]
            k, v = kh[j, e, max(a, p) - p:b - p], vh[j, e, max(a, p) - p:b - p]
            if a < p:
                pk, pv = hit.prefix.rows(i, a, p)
                k, v = np.concatenate([pk, k]), np.concatenate([pv, v])
            out[i] = LayerKV(k, v, np.arange(a, b, dtype=np.int32), rec["kind"])
        return out

    def _host_kv(self, step: Step):
        """The step's whole K/V on the host (`_gather_kv`), gathered once per step."""
        if step.host_kv is None:
            step.host_kv = self._gather_kv(step.k, step.v)
        return step.host_kv

    def _reuse_records(self, step: Step) -> list[dict]:
        return [{"block_size": self.reuse.block_size, "hashes": h.hashes, "identity": h.identity} for h in step.hits]

    @_one_at_a_time
    def export_step(self, step: Step, results: list[PrefillResult], kv_dir: str, *, kv_full: bool,
                    overwrite: bool) -> None:
        """Export a finished step's requests to `kv_dir/<id>/` (whole prompts: a hit's cached rows are written
        beside the computed ones), and hand them to the directory's store (indexed for prefix reuse when they carry
        block hashes; retention). RequestError if an export fails, except where the directory takes no writes and
        its store lets the requests succeed without their export (`PrefillResult.export_error`; one warning)."""
        self._exporter.weights_digest = self.weights_digest
        try:
            refused = self._exporter.export_batch(
                kv_dir, step.ids, step.tokens, step.k, step.v, self._layout_positions(step.bucket), kv_full, results,
                overwrite, offsets=[h.cached for h in step.hits], prefixes=[h.prefix for h in step.hits],
                reuse=self._reuse_records(step), started=step.first_tokens_at)
        except ExportFailed as e:  # a request's error: RequestError like every other
            raise RequestError(str(e)) from e
        store = self.kv_store(kv_dir)
        if refused:
            store.note_unwritable(next(iter(refused.values())))
        if jax.process_index() == 0:
            for rid in step.ids:
                if rid not in refused:
                    store.record(rid)
        if refused and store.exports_required:
            raise RequestError(next(r.export_error for r in results if r.export_error))

    def _keep(self, step: Step, results: list[PrefillResult], *, cache: bool, return_kv: bool) -> None:
        """Whole prompts' KV on the host: into the results (`return_kv`) and the host tier (`cache`)."""
        tier = self.host_tier if cache else None
        if not return_kv and tier is None:
            return
        kh, vh = self._host_kv(step)
        for j, (res, hit) in enumerate(zip(results, step.hits)):
            n, p = res.num_tokens, hit.cached
            ks, vs = {}, {}
            for entry, layer in enumerate(self.plan.flat):
                if layer >= 0:
                    # copies, not views: a view would keep the whole gathered batch alive in the host tier; read-only,
                    # since the results' K/V share them with the tier (an edit would change later hits silently)
                    ks[layer], vs[layer] = (_read_only(x[j, entry, :n - p].copy()) for x in (kh, vh))
                    if p:  # the cached rows by reference (`kv.prefix.Rows`), the computed ones after them
                        pk, pv = hit.prefix.shared_rows(layer, hit.prefix.start.get(layer, 0), p)
                        ks[layer], vs[layer] = pk.extend(ks[layer]), pv.extend(vs[layer])
                    else:
                        ks[layer], vs[layer] = prefix_lib.Rows((ks[layer],)), prefix_lib.Rows((vs[layer],))
            whole = all(hit.prefix is None or hit.prefix.start.get(i, 0) == 0 for i in ks)
            if tier is not None and whole and hit.hashes:
                tier.add(prefix_lib.HostEntry(f"{step.ids[j]}@{self.run_nonce}-{next(self._host_seq)}", step.tokens[j],
                                              hit.hashes, ks, vs))
            if return_kv:
                res.kv = {i: LayerKV(ks[i].array(), vs[i].array(), np.arange(n - len(ks[i]), n, dtype=np.int32),
                                     self.cfg.layer_types[i]) for i in sorted(ks)}

    def _gather_kv(self, k, v):
        """Whole K/V `[M, stack, T, K, H]` on the host, natural token order (gathers across processes if needed)."""
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            k, v = multihost_utils.process_allgather(k, tiled=True), multihost_utils.process_allgather(v, tiled=True)
        k, v = np.asarray(k), np.asarray(v)
        if self.mesh is not None:
            inv = np.argsort(self._layout_positions(k.shape[2]))
            k, v = np.take(k, inv, axis=2), np.take(v, inv, axis=2)
        return k, v

    def _layout_positions(self, t: int) -> np.ndarray:
        if self.mesh is None:
            return np.arange(t, dtype=np.int32)
        par = self.parallel
        if par.seq_chunks > 1:
            return layout.chunked_layout_positions(t, par.ring, par.ulysses, par.seq_chunks)
        return layout.layout_positions(t, par.ring, par.ulysses)


@dataclasses.dataclass
class Step:
    """One compiled step of a batch: `bucket` (padded length of the tokens it computes), `prefix_rows` (cached-prefix
    capacity S, 0 for cold prompts), and per prompt its token ids (whole prompt), export id, arrival time and
    `serve.reuse.Hit`; `k`, `v` hold the step's K/V (device arrays, layout order of the computed tokens) once it ran,
    and `first_tokens_at` the `time.perf_counter()` its first tokens reached the host."""

    bucket: int
    prefix_rows: int
    tokens: list[np.ndarray]
    ids: list[str]
    arrival: list[float]
    hits: list
    k: object = None
    v: object = None
    first_tokens_at: float | None = None
    host_kv: tuple | None = None  # (k, v) on the host, natural order: `PrefillEngine._host_kv`
    host_shards: list | None = None  # this process's shards on the host (`KVExporter.host_shards`), when offered
    offers: dict = dataclasses.field(default_factory=dict)  # process 0: prompt index → key of its peers' offers


class PendingExport:
    """A computed prompt's export before it is written (`PrefillEngine.prefill`'s `on_computed`), computed only when
    asked: `manifest`, the one it will carry (`kv.format.build_manifest`: no files or checksums yet), and `rows()`,
    the rows it will hold (global layer id → `kv.format.LayerKV`, as `kv.format.load` returns them). `local`:
    whether `rows()` may be asked (one process, or process 0 of several for `prefill`'s `rows_for`; otherwise this
    process holds only its shards). The rows are views: of the step's K/V (valid until `on_computed` returns) or,
    under several processes with `peer_rows`, of its reused buffers (valid until the next `rows()`). There, `offer()`
    instead hands over process 0's own pieces and the peers' pool records without pulling them (`Offered`: what a
    composed NIXL record names)."""

    def __init__(self, manifest: Callable[[], dict], rows: Callable[[dict], dict], local: bool,
                 offered: Callable[[], "Offered"] | None = None):
        self._manifest, self._rows, self.local = manifest, rows, local
        self._offered = offered

    @functools.cached_property
    def manifest(self) -> dict:
        return self._manifest()

    def rows(self) -> dict:
        if not self.local:
            raise RuntimeError("the rows of a multi-process step are spread over its processes")
        return self._rows(self.manifest)

    @property
    def offered(self) -> bool:
        """Whether `offer()` may be asked: process 0 of several whose peers offered their pieces (`peer_rows`)."""
        return self._offered is not None

    def offer(self) -> "Offered":
        """Process 0 of several, instead of `rows()` (one or the other, once): its own pieces and the peers' pool
        records, nothing pulled (`Offered`). Raises RuntimeError when a peer could not offer (`PeerRows.records`)."""
        if self._offered is None:
            raise RuntimeError("no peer offered pieces of this prompt (one process, or no peer_rows)")
        return self._offered()


@dataclasses.dataclass
class Offered:
    """Process 0's view of a prompt's rows spread over several processes (`PendingExport.offer`): `pieces`, its own
    `(layer, a, b, K [b − a, K, H], V)`; `records`, the peers' `KVPool.publish_pieces` records (parts of a
    `nixl_transport.compose`d record); `kinds`, each global layer's kind (`layer_types`); `drop()` frees the peers'
    entries when no reader will pull them."""

    pieces: list
    records: list
    kinds: tuple
    drop: Callable[[], None]


def _check_top_k(top_k) -> None:
    if not isinstance(top_k, (int, np.integer)) or isinstance(top_k, bool) or top_k < 1:
        raise RequestError(f"top_k={top_k!r}: must be an integer >= 1 (the (token, logit) pairs each result reports)")


def _check_call(prompts, top_k, arrival_times) -> tuple[Sequence, list | None, str | None]:
    """`prefill`'s arguments checked before anything runs: the prompts as a sequence (any iterable is taken), `top_k`
    (RequestError), and `arrival_times` as a list with what is wrong with it (None: nothing; the caller raises it
    once every process has said whether its own list is good)."""
    _check_top_k(top_k)
    prompts = prompts if isinstance(prompts, (list, tuple, np.ndarray)) else list(prompts)
    times = None if arrival_times is None or isinstance(arrival_times, (str, bytes)) else _as_list(arrival_times)
    return prompts, times, _arrival_error(arrival_times, times, len(prompts))


def _as_list(x) -> list | None:
    try:
        return list(x)
    except TypeError:
        return None


def _arrival_error(given, times: list | None, count: int) -> str | None:
    """What is wrong with `arrival_times` (None: nothing): it must be None or one finite number (a
    `time.perf_counter()` stamp) per prompt, so a bad list never fails a batch half-way through its exports."""
    if given is None:
        return None
    if times is None:
        return (f"arrival_times: a sequence of one time.perf_counter() stamp per prompt, got "
                f"{type(given).__name__}")
    if len(times) != count:
        return f"arrival_times: {len(times)} stamps for {count} prompts (one per prompt)"
    for i, t in enumerate(times):
        if isinstance(t, bool) or not isinstance(t, (int, float, np.integer, np.floating)) or not np.isfinite(t):
            return f"arrival_times[{i}]={t!r}: must be a finite number (a time.perf_counter() stamp)"
    return None


def _salts(cache_salt, count: int) -> list[str | None]:
    """One `cache_salt` per prompt (ValueError for a list of the wrong length or a salt that is not a string)."""
    if cache_salt is None or isinstance(cache_salt, str):
        salts = [cache_salt] * count
    elif isinstance(cache_salt, (list, tuple)):
        salts = list(cache_salt)
    else:
        raise RequestError(f"cache_salt: expected a string, a list of strings (one per prompt) or None, got "
                           f"{type(cache_salt).__name__}")
    if len(salts) != count:
        raise RequestError(f"cache_salt: {len(salts)} salts for {count} prompts")
    for i, s in enumerate(salts):
        if s is not None and not isinstance(s, str):
            raise RequestError(f"prompt {i}: cache_salt must be a string, got {type(s).__name__}")
    return salts


def _step_options(options: StepOptions | None, fields: dict) -> StepOptions:
    """`options`, or a StepOptions built from its fields given one by one (ValueError when both are given)."""
    if options is not None and fields:
        raise ValueError(f"give options= or its fields ({sorted(fields)}), not both")
    return options if options is not None else StepOptions(**fields)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _as_bits(out):
    """A forward's `(logits, k, v)` with K/V as `stack.bits`: the per-prompt map stacks its outputs with a dynamic
    update, which XLA:CPU runs through float32 on bf16, re-writing the whole `[M, …]` stack per prompt."""
    logits, k, v = out
    return logits, stack.bits(k), stack.bits(v)
