"""Fast restarts: the placed, sharded parameters saved with orbax-checkpoint, restored shard by shard.

Layout of a converted directory:
  params/                 orbax PyTree checkpoint (OCDBT/zarr via tensorstore)
  slope_jax_orbax.json    the marker, written last: format, model config, dtype, the layout it was saved from,
                          the parameter shapes, a fingerprint, the source checkpoint
  tokenizer.json, …       small non-weight files of the source, copied (the launcher reads the tokenizer here)

What is stored (and why this shape): every per-layer parameter as one array per layer (`layers/<name>/<layer>`,
the `layers` axis dropped), each sharded over the devices of the pipeline stage that holds the layer; the other
parameters as placed (embedding/unembedding rows over `pipeline`). A restore into any layout reads, one parameter
family at a time, only the layers of the stages this process's devices belong to (orbax partial restore to host
arrays) and the embedding rows its devices hold (orbax with the target sharding; replicas share one read); the
target stacks `[P·n, …]` are assembled on the host and placed with `make_array_from_callback` (no device
computation, nothing compiled). So a different pipeline degree needs no permutation of a stacked array on disk.
Vocabulary rows are zero-padded or truncated to the target layout's multiple of P by orbax
(`ArrayRestoreArgs(strict=False)`), for the vocabulary axis only. MXFP4 experts stay packed (uint8 blocks and
scales). Float parameters are stored in the dtype of the conversion and cast on restore if another is asked for.
A stage whose devices span several processes is read whole by each of them (host arrays), which is correct but
reads more than the shard; with stages inside a host (the recommended mesh order) each layer is read once per host.

Every shape restored is the one the model declaration (`model.param_specs`) gives for the target layout, checked
against the saved metadata first: a directory converted under a different declaration or config is refused with a
message naming the parameter, never silently mis-read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as Ps

from slope_jax.checkpoints.tree import flatten as _flatten
from slope_jax.checkpoints.tree import unflatten as _unflatten
from slope_jax.atomic import atomic_json, atomic_write
from slope_jax.checkpoints.hf import CheckpointError
from slope_jax.model import gpt_oss as model_lib
from slope_jax.model.config import ModelConfig
from slope_jax.parallel import pipeline as pipe_lib
from slope_jax.parallel.config import AXES, ParallelConfig
from slope_jax.parallel.mesh import make_mesh

log = logging.getLogger(__name__)

MARKER = "slope_jax_orbax.json"
PARAMS_DIR = "params"
FORMAT = 1
# small non-weight files copied from the source checkpoint (the launcher reads the tokenizer from --checkpoint)
_COPY = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
         "chat_template.jinja")


def is_orbax_checkpoint(path) -> bool:
    """Whether `path` is a directory written by `save` (its marker file exists)."""
    return os.path.isfile(os.path.join(os.fspath(path), MARKER))


# ---------------------------------------------------------------------------------------------------------------
# Layout helpers
@dataclasses.dataclass(frozen=True)
class Placement:
    """A layout's mesh, stage plan and per-parameter PartitionSpecs / declared specs (stacked, padded shapes)."""

    mesh: Mesh
    plan: pipe_lib.StagePlan
    pspecs: dict  # flat "a/b" -> PartitionSpec
    specs: dict  # flat "a/b" -> model_lib.ParamSpec

    def stage_mesh(self, p: int) -> Mesh:
        """The sub-mesh of pipeline stage p (axes unchanged, `pipeline` of size 1)."""
        return Mesh(self.mesh.devices[p:p + 1], AXES)


def placement(cfg: ModelConfig, parallel: ParallelConfig, dtype, devices=None) -> Placement:
    """The mesh (also for one device), stage plan, PartitionSpecs and declared shapes of a layout."""
    devices = list(jax.devices() if devices is None else devices)
    if parallel.num_devices == 1:
        devices = devices[:1]
    parallel.validate(cfg, len(devices))
    mesh = make_mesh(parallel, devices)
    plan = pipe_lib.plan_stages(cfg, parallel.pipeline)
    slots, rows = plan.pipeline * plan.stack_per_stage, pipe_lib.vocab_rows(cfg, parallel.pipeline)
    pspecs = _flatten(pipe_lib.param_partition_specs(cfg, dtype, slots, rows, parallel.expert_degree(cfg)), leaf=Ps)
    specs = _flatten(model_lib.param_specs(cfg, dtype, num_layers=slots, vocab_rows=rows), leaf=model_lib.ParamSpec)
    return Placement(mesh, plan, pspecs, specs)




def _per_layer(name: str, spec: model_lib.ParamSpec) -> bool:
    return bool(spec.axes) and spec.axes[0] == "layers"


def _stage_of(plan: pipe_lib.StagePlan) -> dict[int, tuple[int, int]]:
    """Global layer → (stage, index in the stage's stack)."""
    return {int(g): (p, j) for p in range(plan.pipeline) for j, g in enumerate(plan.stack_layers[p]) if g >= 0}


def _layer_sharding(pl: Placement, name: str, p: int) -> NamedSharding:
    spec = pl.pspecs[name]
    if spec and spec[0] != "pipeline":
        raise CheckpointError(f"{name}: layer parameters must be split over 'pipeline' first, got {spec}")
    return NamedSharding(pl.stage_mesh(p), Ps(*spec[1:]))


def _split_layers(name: str, arr: jax.Array, pl: Placement) -> dict[int, jax.Array]:
    """A placed stack `[P·n, …]` → {global layer: `[…]` sharded over its stage's devices}, from local shards only
    (each stage's shard is copied to the host once; no device computation, so nothing is compiled)."""
    out = {}
    by_device = {s.device: s for s in arr.addressable_shards}
    for g, (p, j) in _stage_of(pl.plan).items():
        sh = _layer_sharding(pl, name, p)
        cache: dict = {}

        def cb(index, p=p, j=j, sh=sh, cache=cache):
            # the shard of layer g at `index` is row j of the stack shard held by any device of stage p at that index
            dev = next(d for d, idx in sh.addressable_devices_indices_map(arr.shape[1:]).items() if idx == index)
            s = by_device[dev]
            key = id(s.data)
            if key not in cache:
                cache[key] = np.asarray(s.data)
            return cache[key][j]

        out[g] = jax.make_array_from_callback(arr.shape[1:], sh, cb)
    return out


def _stack_layers(name: str, host: dict[int, np.ndarray], pl: Placement) -> jax.Array:
    """The target layout's stack `[P·n, …]` from host per-layer arrays: each device's shard is its stage's layers
    (zeros for a padding entry), built on the host and transferred once (no device computation)."""
    spec = pl.specs[name]
    flat = pl.plan.flat
    cache: dict = {}

    def cb(index):
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in cache:  # replicas of a shard share one block
            lo, hi, _ = index[0].indices(spec.shape[0])
            block = np.zeros((hi - lo, *spec.shape[1:]), spec.dtype)
            for r in range(lo, hi):
                if flat[r] >= 0:
                    block[r - lo] = host[flat[r]]
            cache[key] = block[(slice(None), *index[1:])]
        return cache[key]

    return jax.make_array_from_callback(spec.shape, NamedSharding(pl.mesh, pl.pspecs[name]), cb)


# ---------------------------------------------------------------------------------------------------------------
# Fingerprint
def _declared(cfg: ModelConfig, dtype) -> dict[str, list]:
    """Canonical (unstacked, unpadded) declared shape and dtype of every stored array, keyed by its stored path."""
    out = {}
    for name, spec in _flatten(model_lib.param_specs(cfg, dtype), leaf=model_lib.ParamSpec).items():
        if _per_layer(name, spec):
            out[name] = [list(spec.shape[1:]), spec.dtype.name, "per-layer", spec.shape[0]]
        else:
            out[name] = [list(spec.shape), spec.dtype.name, "whole", None]
    return out


def fingerprint(cfg: ModelConfig, dtype, source_id: str = "") -> str:
    """sha256 (hex, 16 chars) of the format version, the config, the declared parameters and the source checkpoint's
    identity: two processes (or two restarts) restoring the same fingerprint hold the same weights."""
    blob = json.dumps({"format": FORMAT, "config": cfg.to_dict(), "params": _declared(cfg, dtype),
                       "source": source_id}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _source_id(ckpt) -> str:
    """Identity of an HF/original checkpoint from its safetensors headers (names, dtypes, shapes) and file sizes."""
    h = hashlib.sha256()
    for name in sorted(ckpt.source.header):
        dtype, shape = ckpt.source.header[name]
        h.update(f"{name}:{dtype}:{shape};".encode())
    for f in sorted(set(ckpt.source.file_of.values())):
        h.update(f"{f}:{os.path.getsize(os.path.join(ckpt.source.directory, f))};".encode())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------------
# Save / restore
def save(out: str, cfg: ModelConfig, params: dict, pl: Placement, dtype, *, source: str = "",
         source_id: str = "") -> dict:
    """Save placed params (the pytree `PrefillEngine` holds for layout `pl`) under `out`; returns the marker dict.

    Every process must call this (orbax writes each process's shards); process 0 writes the marker last, so a
    directory without it is an interrupted conversion. Raises CheckpointError if `out` already holds one.
    """
    import orbax.checkpoint as ocp

    out = os.path.abspath(os.fspath(out))
    _check_out(out)
    os.makedirs(out, exist_ok=True)
    flat = _flatten(params)
    tree: dict = {}
    for name, arr in flat.items():
        if _per_layer(name, pl.specs[name]):
            for g, a in _split_layers(name, arr, pl).items():
                tree[f"{name}/{g}"] = a
        else:
            tree[name] = arr
    t0 = time.perf_counter()
    # Each unique shard is written once, from its first replica. (orbax's default splits a replicated shard into
    # slices written by each replica: a device slice per replica, compiled per device — minutes of compiles for a
    # few MiB on CPU; the write is I/O bound either way.) Uncompressed: weights (random bits of bf16 mantissas,
    # MXFP4 codes) barely compress, and a restart should not pay for decompression.
    registry = ocp.type_handlers.create_type_handler_registry(
        (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False)))
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=registry,
                                                                use_compression=False)) as ckptr:
        ckptr.save(os.path.join(out, PARAMS_DIR), args=ocp.args.PyTreeSave(_unflatten(tree)))
    nbytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in tree.values())
    log.info("saved %d arrays (%.1f MiB) to %s in %.1f s", len(tree), nbytes / 2**20, out,
             time.perf_counter() - t0)
    meta = {
        "format": FORMAT, "config": cfg.to_dict(), "dtype": jnp.dtype(dtype).name,
        "saved_layout": {"pipeline": pl.plan.pipeline, "ring": int(pl.mesh.shape["ring"]),
                         "ulysses": int(pl.mesh.shape["ulysses"])},
        "params": _declared(cfg, dtype), "bytes": nbytes, "source": source,
        "fingerprint": fingerprint(cfg, dtype, source_id), "source_id": source_id,
    }
    if jax.process_index() == 0:
        atomic_json(os.path.join(out, MARKER), meta)
    return meta


def _check_out(out: str) -> None:
    if os.path.exists(os.path.join(out, MARKER)) or os.path.exists(os.path.join(out, PARAMS_DIR)):
        raise CheckpointError(f"{out}: already holds a converted checkpoint; choose a new --out or delete it")


def read_marker(path) -> dict:
    """The marker dict of a converted directory. Raises CheckpointError if missing, unreadable or of another
    format version."""
    path = os.fspath(path)
    f = os.path.join(path, MARKER)
    try:
        with open(f) as fh:
            meta = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f}: not a slope_jax orbax checkpoint marker ({e})") from e
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{f}: format={meta.get('format')!r}, this version reads format {FORMAT}; re-run "
                              "`python -m slope_jax.convert`")
    return meta


def config_of(meta: dict) -> ModelConfig:
    d = dict(meta["config"])
    d["layer_types"] = tuple(d["layer_types"])
    d["eos_token_ids"] = tuple(d["eos_token_ids"])
    return ModelConfig(**d)


def restore(path, parallel: ParallelConfig = ParallelConfig(), dtype=None, *,
            devices=None) -> tuple[ModelConfig, dict, Placement]:
    """Restore a converted directory into `parallel`'s layout (any layout valid for the model).

    Args:
      path: a directory written by `save` / `python -m slope_jax.convert`.
      parallel: the target layout (may differ from the saved one: shards are re-cut by orbax on read).
      dtype: float parameter dtype (default: the dtype it was converted in); norms/sinks stay float32, MXFP4 uint8.
    Returns:
      `(cfg, params, placement)`: params stacked in `placement.plan.flat` order and sharded as the engine expects.
    Raises:
      CheckpointError when the directory is incomplete or does not match the model declaration; LayoutError for a
      layout the model cannot take.
    """
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    meta = read_marker(path)
    cfg = config_of(meta)
    dtype = jnp.dtype(dtype or meta["dtype"])
    saved_dtype = jnp.dtype(meta["dtype"])
    want = _declared(cfg, saved_dtype)
    if meta["params"] != want:
        bad = sorted(k for k in set(want) | set(meta["params"]) if want.get(k) != meta["params"].get(k))
        raise CheckpointError(f"{path}: converted under a different parameter declaration ({bad[0]}: saved "
                              f"{meta['params'].get(bad[0])}, declared {want.get(bad[0])}); re-run convert")
    pl = placement(cfg, parallel, dtype, devices)
    # layers held by this process's devices (a process reads only those)
    local = sorted({int(g) for p in range(pl.plan.pipeline) if pl.stage_mesh(p).local_devices
                    for g in pl.plan.stack_layers[p] if g >= 0})
    t0 = time.perf_counter()
    out = {}
    with ocp.PyTreeCheckpointer() as ckptr:
        for name, spec in pl.specs.items():  # one parameter family at a time: host memory peaks at one family
            if _per_layer(name, spec):
                args = {f"{name}/{g}": ocp.RestoreArgs(restore_type=np.ndarray, dtype=spec.dtype) for g in local}
            else:  # vocabulary rows: zero-padded / truncated to this layout's multiple of P
                args = {name: ocp.ArrayRestoreArgs(sharding=NamedSharding(pl.mesh, pl.pspecs[name]),
                                                   global_shape=spec.shape, dtype=spec.dtype,
                                                   strict="vocab" not in spec.axes)}
            tree = _unflatten(args)
            got = _flatten(ckptr.restore(os.path.join(path, PARAMS_DIR), args=ocp.args.PyTreeRestore(
                item=tree, restore_args=tree, partial_restore=True)))
            if _per_layer(name, spec):
                host = {g: got.pop(f"{name}/{g}") for g in local}
                for g, a in host.items():
                    if a.shape != spec.shape[1:]:
                        raise CheckpointError(f"{path}: {name} layer {g} has shape {list(a.shape)}, declared "
                                              f"{list(spec.shape[1:])}")
                out[name] = _stack_layers(name, host, pl)
                del host
            else:
                out[name] = got.pop(name)
    log.info("restored %s into pipeline=%d ring=%d ulysses=%d in %.1f s (fingerprint %s)", path,
             parallel.pipeline, parallel.ring, parallel.ulysses, time.perf_counter() - t0, meta["fingerprint"])
    return cfg, _unflatten(out), pl


def convert(checkpoint, out, parallel: ParallelConfig = ParallelConfig(), dtype="bfloat16", *, devices=None,
            progress: bool = True) -> dict:
    """Load an HF/original checkpoint into `parallel`'s layout (each device reads only its shard) and save it under
    `out` with `save`; copies the tokenizer and generation config. Returns the marker dict."""
    from slope_jax.checkpoints import hf

    out = os.path.abspath(os.fspath(out))
    _check_out(out)
    ck = hf.open_checkpoint(checkpoint)
    cfg = ck.config
    pl = placement(cfg, parallel, dtype, devices)
    shardings = jax.tree.map(lambda s: NamedSharding(pl.mesh, s), _unflatten(pl.pspecs),
                             is_leaf=lambda x: isinstance(x, Ps))
    t0 = time.perf_counter()
    params = hf.load_params(ck, dtype, shardings=shardings, stack_layers=pl.plan.flat,
                            vocab_rows=pipe_lib.vocab_rows(cfg, parallel.pipeline), progress=progress)
    log.info("loaded %s in %.1f s", ck.path, time.perf_counter() - t0)
    if jax.process_index() == 0:  # before `save`, which writes the marker last
        os.makedirs(out, exist_ok=True)
        for f in _COPY:
            src = os.path.join(ck.path if os.path.isfile(os.path.join(ck.path, f)) else os.fspath(checkpoint), f)
            if os.path.isfile(src):
                atomic_write(os.path.join(out, f), lambda tmp, src=src: shutil.copyfile(src, tmp))
    return save(out, cfg, params, pl, dtype, source=os.path.abspath(os.fspath(checkpoint)), source_id=_source_id(ck))
