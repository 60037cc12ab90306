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
import logging
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from slope_jax import checkpoint as ckpt_lib
from slope_jax import layout
from slope_jax import model as model_lib
from slope_jax import pipeline as pipe_lib
from slope_jax.config import ModelConfig
from slope_jax.parallel import ParallelConfig, make_mesh

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A prompt is invalid (empty, a token id out of range, too long); the message names the prompt and the limit."""


@dataclasses.dataclass
class LayerKV:
    """One layer's KV cache for one prompt: post-RoPE `k`, `v` `[T, K, H]` (activation dtype) in natural token order,
    `positions` int32 `[T]` (0…T−1), `kind` "sliding_attention" or "full_attention"."""

    k: np.ndarray
    v: np.ndarray
    positions: np.ndarray
    kind: str


@dataclasses.dataclass
class PrefillResult:
    """Outcome of one prompt: greedy `first_token`, float32 `logits [V]` at the last real position, `num_tokens`, and
    `kv`: global layer id → LayerKV."""

    first_token: int
    logits: np.ndarray
    num_tokens: int
    kv: dict[int, LayerKV]


class PrefillEngine:
    """Prefill worker for one model on one mesh.

    Args:
      cfg, params: from `slope_jax.load_checkpoint` (or `model.init_params`); params may be host or device arrays
        with `layers` stacked over the L layers.
      parallel: the layout; its device count must equal `jax.device_count()` (or `len(devices)`).
      dtype: activation dtype ("bfloat16" or "float32"); float params are cast to it.
      q_tile, kv_tile, moe_tile: attention and MoE tile sizes (tokens).
    Raises:
      LayoutError for a layout the model or the devices cannot take.
    """

    def __init__(self, cfg: ModelConfig, params: dict, parallel: ParallelConfig = ParallelConfig(),
                 dtype="bfloat16", *, devices=None, q_tile: int = 256, kv_tile: int = 256, moe_tile: int = 128,
                 _placed: bool = False):
        devices = list(jax.devices() if devices is None else devices)
        self.cfg = cfg
        self.parallel = parallel.validate(cfg, len(devices) if parallel.num_devices > 1 else None)
        self.dtype = jnp.dtype(dtype)
        self.tiles = dict(q_tile=q_tile, kv_tile=kv_tile, moe_tile=moe_tile)
        self._compiled: dict[tuple[int, int], object] = {}
        if parallel.num_devices == 1:
            self.mesh = None
            self.plan = pipe_lib.StagePlan.single_stage(cfg.num_hidden_layers)
            self.params = params if _placed else self._cast(params, devices[0])
            self._step = jax.jit(self._single_device_step)
        else:
            self.mesh = make_mesh(parallel, devices)
            self.plan = pipe_lib.plan_stages(cfg, parallel.pipeline)
            self.params = params if _placed else self._place(params)
            self._step = pipe_lib.build_prefill_step(cfg, parallel, self.mesh, self.plan, self.dtype, **self.tiles)
        log.info("engine: layout pipeline=%d ring=%d ulysses=%d on %d device(s), dtype=%s, %d empty slot(s)",
                 parallel.pipeline, parallel.ring, parallel.ulysses, parallel.num_devices, self.dtype.name,
                 self.plan.empty_slots)

    # ------------------------------------------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, path, parallel: ParallelConfig = ParallelConfig(), dtype="bfloat16", *,
                        devices=None, progress: bool = True, **kwargs) -> PrefillEngine:
        """Load a checkpoint directly into the layout: each device reads only the layers of its pipeline stage."""
        devices = list(jax.devices() if devices is None else devices)
        ck = ckpt_lib.open_checkpoint(path)
        cfg = ck.config
        parallel.validate(cfg, len(devices) if parallel.num_devices > 1 else None)
        if parallel.num_devices == 1:
            params = ckpt_lib.load_params(ck, dtype, progress=progress)
        else:
            mesh = make_mesh(parallel, devices)
            plan = pipe_lib.plan_stages(cfg, parallel.pipeline)
            shardings = cls._shardings(cfg, dtype, mesh, plan)
            params = ckpt_lib.load_params(ck, dtype, shardings=shardings, stack_layers=plan.flat,
                                          vocab_rows=pipe_lib.vocab_rows(cfg, parallel.pipeline), progress=progress)
        return cls(cfg, params, parallel, dtype, devices=devices, _placed=True, **kwargs)

    @staticmethod
    def _shardings(cfg, dtype, mesh, plan):
        specs = pipe_lib.param_partition_specs(cfg, dtype, plan.pipeline * plan.stack_per_stage,
                                               pipe_lib.vocab_rows(cfg, plan.pipeline))
        return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)

    def _cast(self, params, device):
        specs = model_lib.param_specs(self.cfg, self.dtype)
        return jax.tree.map(lambda a, s: jax.device_put(jnp.asarray(a).astype(s.dtype), device), params, specs,
                            is_leaf=lambda x: isinstance(x, model_lib.ParamSpec) or not isinstance(x, dict))

    def _place(self, params):
        """Host params `[L, …]` → device params: each stage's stack `[n, …]` (`plan.flat` order), sharded over the mesh."""
        slots = np.asarray(self.plan.flat)
        rows = pipe_lib.vocab_rows(self.cfg, self.parallel.pipeline)
        specs = model_lib.param_specs(self.cfg, self.dtype, num_layers=len(slots), vocab_rows=rows)
        shardings = self._shardings(self.cfg, self.dtype, self.mesh, self.plan)

        def put(path, a, spec, sh):
            a = np.asarray(a)
            if path[0].key == "layers":
                a = np.where((slots >= 0).reshape(-1, *([1] * (a.ndim - 1))), a[np.maximum(slots, 0)], 0)
            elif spec.axes[0] == "vocab" and a.shape[0] < rows:
                a = np.concatenate([a, np.zeros((rows - a.shape[0], *a.shape[1:]), a.dtype)])
            return jax.device_put(a.astype(spec.dtype), sh)

        return jax.tree_util.tree_map_with_path(put, params, specs, shardings,
                                                is_leaf=lambda x: not isinstance(x, dict))

    # ------------------------------------------------------------------------------------------------------------
    def _single_device_step(self, params, tokens, positions, num_tokens):
        del positions

        def one(args):
            t, n = args
            return model_lib.forward(params, self.cfg, t, n, **self.tiles)

        logits, k, v = jax.lax.map(one, (tokens, num_tokens))
        return logits, k, v  # k, v: [M, L, T, K, H]

    def validate_prompt(self, i: int, prompt) -> np.ndarray:
        """Check one prompt; returns it as int32 `[n]`. Raises RequestError naming prompt `i` and the violated limit."""
        try:
            ids = np.asarray(prompt)
        except Exception as e:  # noqa: BLE001 - anything numpy cannot read is a bad request
            raise RequestError(f"prompt {i}: not a sequence of token ids ({e})") from e
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

    def compiled(self, t: int, m: int):
        """The compiled step for bucket length t and m prompts in flight (compiled once, then reused)."""
        key = (t, m)
        if key not in self._compiled:
            t0 = time.perf_counter()
            args = (self.params, jax.ShapeDtypeStruct((m, t), jnp.int32), jax.ShapeDtypeStruct((t,), jnp.int32),
                    jax.ShapeDtypeStruct((m,), jnp.int32))
            self._compiled[key] = self._step.lower(*args).compile()
            log.info("compiled bucket T=%d x %d in %.1f s", t, m, time.perf_counter() - t0)
        return self._compiled[key]

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    def prefill(self, prompts: Sequence[Sequence[int]], *, return_kv: bool = True) -> list[PrefillResult]:
        """Prefill a batch of prompts (token ids). Returns one PrefillResult per prompt, in order.

        Raises RequestError (naming the prompt) before any compute if a prompt is invalid.
        """
        ids = [self.validate_prompt(i, p) for i, p in enumerate(prompts)]
        results: list[PrefillResult | None] = [None] * len(ids)
        groups: dict[int, list[int]] = {}
        for i, x in enumerate(ids):
            groups.setdefault(self.bucket(x.size), []).append(i)
        per_step = 1 if self.mesh is None else self.parallel.in_flight
        for t, members in sorted(groups.items()):
            for start in range(0, len(members), per_step):
                chunk = members[start:start + per_step]
                for i, res in zip(chunk, self._run(t, [ids[i] for i in chunk], return_kv)):
                    results[i] = res
        return results  # type: ignore[return-value]

    def _run(self, t: int, batch: list[np.ndarray], return_kv: bool) -> list[PrefillResult]:
        R, U = self.parallel.ring, self.parallel.ulysses
        m = len(batch)
        tokens = np.zeros((m, t), np.int32)
        for j, x in enumerate(batch):
            tokens[j, :x.size] = x
        n_tok = np.asarray([x.size for x in batch], np.int32)
        positions = layout.layout_positions(t, R, U) if self.mesh is not None else np.arange(t, dtype=np.int32)
        if self.mesh is not None:
            tokens = layout.to_layout(tokens, R, U, axis=1)
            sh = NamedSharding(self.mesh, jax.sharding.PartitionSpec(None, ("ring", "ulysses")))
            tokens_d = jax.device_put(tokens, sh)
            pos_d = jax.device_put(positions, NamedSharding(self.mesh, jax.sharding.PartitionSpec(("ring", "ulysses"))))
            n_d = jax.device_put(n_tok, NamedSharding(self.mesh, jax.sharding.PartitionSpec()))
        else:
            tokens_d, pos_d, n_d = tokens, positions, n_tok
        logits, k, v = self.compiled(t, m)(self.params, tokens_d, pos_d, n_d)
        logits = np.asarray(logits)
        if return_kv:
            k, v = np.asarray(k), np.asarray(v)
            if self.mesh is not None:
                k, v = layout.to_natural(k, R, U, axis=2), layout.to_natural(v, R, U, axis=2)
        out = []
        for j, x in enumerate(batch):
            n = x.size
            kv = {}
            if return_kv:
                for entry, layer in enumerate(self.plan.flat):
                    if layer >= 0:
                        kv[layer] = LayerKV(k[j, entry, :n], v[j, entry, :n], np.arange(n, dtype=np.int32),
                                            self.cfg.layer_types[layer])
            out.append(PrefillResult(int(np.argmax(logits[j])), logits[j], n, dict(sorted(kv.items()))))
        return out
