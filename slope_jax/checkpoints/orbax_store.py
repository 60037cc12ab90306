"""Fast restarts: the placed, sharded parameters saved with orbax-checkpoint, restored shard by shard.

Layout of a converted directory:
  params/                 orbax PyTree checkpoint (OCDBT/zarr via tensorstore)
  slope_jax_orbax.json    the marker, written last: format, model config, dtype, the layout it was saved from,
                          the parameter shapes, a fingerprint, the source checkpoint, and the source's weights
                          digest where the conversion kept its values exactly (`source_weights_digest`)
  tokenizer.json, …       small non-weight files of the source, copied (the launcher reads the tokenizer here)

What is stored (and why this shape): every per-layer parameter as one array per layer (`layers/<name>/<layer>`,
the `layers` axis dropped), each sharded over the devices of the pipeline stage that holds the layer; the other
parameters as placed (embedding/unembedding rows over `pipeline`). So the stored arrays do not depend on the pipeline
degree, and a restore into another layout needs no permutation of a stacked array on disk.

Restore (`restore`), one parameter family at a time: the target layout's sharding names the distinct shards this
process's devices hold; each gets one 64-byte-aligned host block (`checkpoints.host`) that TensorStore fills
directly from the stored arrays (opened with orbax's read spec; all reads of a family in flight at once): a layer
stack's shard `[rows, …]` row by row from its stage's layer arrays, sliced to the device's experts/columns (padding
rows stay zero); an embedding shard from the stored rows it covers (rows past the stored ones are zero padding to
the layout's multiple of P). The blocks are placed with `make_array_from_callback` — no device computation,
nothing compiled; replicas share a block (on CPU the devices adopt it without a copy). A process reads exactly its
devices' shards, once per replica group, whatever layout the directory was converted in. orbax's own
`PyTreeRestore` is not used for this: it cannot express "rows of a stack from several stored arrays", and it copies
every replica. MXFP4 experts stay packed (uint8 blocks and scales). Float parameters are stored in the dtype of the
conversion and cast on restore (TensorStore cast) if another is asked for.

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
from slope_jax.atomic import atomic_json, atomic_write, unwritable_ancestor
from slope_jax.checkpoints import digest
from slope_jax.checkpoints import host as host_lib
from slope_jax.checkpoints.hf import CheckpointError, bar_interval
from slope_jax.model import gpt_oss as model_lib
from slope_jax.model.config import ModelConfig
from slope_jax.parallel import sharding, stages
from slope_jax.parallel.config import AXES, ParallelConfig
from slope_jax.parallel.mesh import make_mesh

log = logging.getLogger(__name__)

MARKER = digest.ORBAX_MARKER
PARAMS_DIR = "params"
FORMAT = 1
# Stored chunk budget (orbax `SaveArgs.chunk_byte_size`: each chunk is the largest divisor of the written shard that
# fits). Small chunks keep TensorStore's read buffers small and reused (measured on the 20b cut, 2-core VM: the
# embedding's 580 MiB shards read in 0.5 s as 360 KiB chunks vs 0.9-2.2 s as whole-shard chunks, page faults 3x
# fewer) and bound the read amplification when a restore's shards do not line up with the saved ones.
CHUNK_BYTES = 8 << 20
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
    plan: stages.StagePlan
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
    plan = stages.plan_stages(cfg, parallel.pipeline)
    pspecs = _flatten(sharding.param_partition_specs(cfg, parallel, dtype), leaf=Ps)
    specs = _flatten(sharding.stacked_param_specs(cfg, parallel, dtype), leaf=model_lib.ParamSpec)
    return Placement(mesh, plan, pspecs, specs)




def _per_layer(name: str, spec: model_lib.ParamSpec) -> bool:
    return bool(spec.axes) and spec.axes[0] == "layers"


def _is_table(spec: model_lib.ParamSpec) -> bool:
    """Whether the first axis is vocabulary rows (stored rows may differ from the layout's padded count)."""
    return bool(spec.axes) and spec.axes[0] == "vocab"


def _stage_of(plan: stages.StagePlan) -> dict[int, tuple[int, int]]:
    """Global layer → (stage, index in the stage's stack)."""
    return {int(g): (p, j) for p in range(plan.pipeline) for j, g in enumerate(plan.stack_layers[p]) if g >= 0}


def _layer_sharding(pl: Placement, name: str, p: int) -> NamedSharding:
    spec = pl.pspecs[name]
    if spec and spec[0] != "pipeline":
        raise CheckpointError(f"{name}: layer parameters must be split over 'pipeline' first, got {spec}")
    return NamedSharding(pl.stage_mesh(p), Ps(*spec[1:]))


def _split_layers(name: str, arr: jax.Array, pl: Placement) -> dict[int, jax.Array]:
    """A placed stack `[P·n, …]` → {global layer: `[…]` sharded over its stage's devices}, from local shards only
    (`host.place`: one host block per distinct shard; no device computation, so nothing is compiled)."""
    out = {}
    by_device = {s.device: s for s in arr.addressable_shards}
    shape = arr.shape[1:]
    for g, (p, j) in _stage_of(pl.plan).items():
        sh = _layer_sharding(pl, name, p)
        where = sh.addressable_devices_indices_map(shape)

        def row(index, j=j, where=where):
            # layer g's shard at `index` is row j of the stack shard held by any device of its stage at that index
            dev = next(d for d, idx in where.items() if host_lib.index_key(idx, shape) ==
                       host_lib.index_key(index, shape))
            return np.asarray(by_device[dev].data)[j]

        out[g] = host_lib.place(shape, sh, row)
    return out


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
    """Identity of an HF/original checkpoint for the marker: its tensor directory and a sampled content hash of every
    weight file (`digest.file_digest`), so conversions of two checkpoints of equal shapes but other weights get other
    fingerprints. A name, not a check: processes restoring a directory compare the bytes they read in full
    (`restore`), never this."""
    h = hashlib.sha256(digest.checkpoint_digest(ckpt.path)["checkpoint.tensors"].encode())
    for fname in sorted(set(ckpt.source.file_of.values())):
        h.update(f"{fname}:{digest.file_digest(os.path.join(ckpt.path, fname))}".encode())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------------
# Save / restore
def source_weights_digest(ckpt, path: str, dtype) -> str | None:
    """The source checkpoint's weights digest (`digest.weights_digest(path)`, the files' XXH3 that prefix-cache keys,
    KV exports and vLLM's connector compare) when a conversion in `dtype` keeps every source value exactly, else None.

    Exact when `dtype` is float32 (BF16, F16 and F32 values all are float32 values) or every float tensor of the
    source is BF16 (MXFP4 blocks and scales are stored as they are). Then a restore in any dtype casts the source's
    own values, so it holds bit for bit what loading the source in that dtype gives (checked in
    tests/test_checkpoint.py) and the engine can name the source's weights: a converted prefill's exports load into a
    vLLM that serves the source checkpoint. Otherwise (a float32 source converted to bfloat16) the restored weights
    are rounded copies: the engine digests its parameters instead and shares no KV with the source.
    """
    if jnp.dtype(dtype) != jnp.float32 and any(dt not in ("BF16", "U8") for dt, _ in ckpt.source.header.values()):
        return None
    try:
        return digest.weights_digest(path)
    except FileNotFoundError:
        return None


def weights_digest(path) -> str | None:
    """The weights digest a converted directory's marker records for its source (`source_weights_digest`), or None
    (a lossy conversion, or a marker written before it was recorded). Raises CheckpointError for a bad marker."""
    return read_marker(path).get("source_weights_digest")


def save(out: str, cfg: ModelConfig, params: dict, pl: Placement, dtype, *, source: str = "",
         source_id: str = "", source_weights: str | None = None) -> dict:
    """Save placed params (the pytree `PrefillEngine` holds for layout `pl`) under `out`; returns the marker dict.
    `source_weights`: the source's weights digest when the conversion kept its values exactly
    (`source_weights_digest`), recorded in the marker.

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
        save_args = {k: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES) for k in tree}
        ckptr.save(os.path.join(out, PARAMS_DIR),
                   args=ocp.args.PyTreeSave(_unflatten(tree), save_args=_unflatten(save_args)))
    nbytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in tree.values())
    log.info("saved %d arrays (%.1f MiB) to %s in %.1f s", len(tree), nbytes / 2**20, out,
             time.perf_counter() - t0)
    meta = {
        "format": FORMAT, "config": cfg.to_dict(), "dtype": jnp.dtype(dtype).name,
        "saved_layout": {"pipeline": pl.plan.pipeline, "ring": int(pl.mesh.shape["ring"]),
                         "ulysses": int(pl.mesh.shape["ulysses"])},
        "params": _declared(cfg, dtype), "bytes": nbytes, "source": source,
        "fingerprint": fingerprint(cfg, dtype, source_id), "source_id": source_id,
        "source_weights_digest": source_weights,
    }
    if jax.process_index() == 0:
        atomic_json(os.path.join(out, MARKER), meta)
    return meta


def _check_out(out: str, checkpoint: str | None = None) -> None:
    """Before any weight is read: `out` must not hold a converted checkpoint nor be the source `checkpoint` (or
    inside it: one directory would hold both kinds), and its nearest existing ancestor must be a writable directory
    (CheckpointError naming it), so a bad --out fails in a second, not after the load."""
    if checkpoint is not None:
        src = os.path.realpath(checkpoint)
        if os.path.realpath(out) == src or os.path.realpath(out).startswith(src + os.sep):
            raise CheckpointError(f"--out={out}: is the source checkpoint {checkpoint} (or inside it); the converted "
                                  "checkpoint needs its own directory")
    if os.path.exists(os.path.join(out, MARKER)) or os.path.exists(os.path.join(out, PARAMS_DIR)):
        raise CheckpointError(f"{out}: already holds a converted checkpoint; choose a new --out or delete it")
    base = unwritable_ancestor(out)
    if base is not None:
        raise CheckpointError(f"{out}: cannot be created: {base} is not a writable directory")


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


def model_config(path) -> ModelConfig:
    """The model config of a checkpoint directory of either kind, reading no weights: a converted directory's marker,
    or an HF / `original/` checkpoint's config.json (and safetensors headers). Raises CheckpointError/ConfigError."""
    from slope_jax.checkpoints import hf

    return config_of(read_marker(path)) if is_orbax_checkpoint(path) else hf.open_checkpoint(path).config


def config_of(meta: dict) -> ModelConfig:
    return ModelConfig.from_fields(meta["config"])


class _StoreReader:
    """The arrays of an orbax PyTree checkpoint opened as TensorStores (orbax's read spec for each stored name,
    one shared TensorStore context so the OCDBT manifest and B-tree caches are shared)."""

    def __init__(self, params_dir: str):
        import orbax.checkpoint as ocp
        from etils import epath

        try:
            with open(os.path.join(params_dir, "_METADATA")) as f:
                meta = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{params_dir}: orbax metadata unreadable ({e}); the conversion did not finish") \
                from e
        self._ocp, self.directory = ocp, epath.Path(params_dir)
        self._ocdbt, self._zarr3 = bool(meta.get("use_ocdbt", True)), bool(meta.get("use_zarr3", False))
        self._ctx = ocp.type_handlers.get_ts_context(use_ocdbt=self._ocdbt)
        self._names = {".".join(k["key"] for k in v["key_metadata"]) for v in meta["tree_metadata"].values()}

    def open(self, names: list[str]) -> dict:
        """`{"a/b": TensorStore}` for these stored paths, opened concurrently. Raises CheckpointError for a name
        the checkpoint does not hold."""
        import tensorstore as ts

        futures = {}
        for name in names:
            key = name.replace("/", ".")
            if key not in self._names:
                raise CheckpointError(f"{self.directory}: holds no array {name!r}; the conversion is incomplete or "
                                      "from another version — re-run convert")
            info = self._ocp.type_handlers.ParamInfo(name=key, parent_dir=self.directory,
                                                     is_ocdbt_checkpoint=self._ocdbt, use_zarr3=self._zarr3,
                                                     ts_context=self._ctx)
            spec = self._ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=self._ocdbt)
            futures[name] = ts.open(spec, open=True, context=self._ctx)
        return {name: f.result() for name, f in futures.items()}


def _restore_family(reader: _StoreReader, name: str, spec: model_lib.ParamSpec, pl: Placement,
                    reads: digest.ReadDigests) -> tuple:
    """One parameter family placed for `pl`: `(jax.Array, bytes this process read)`.

    Every stored slice read is hashed into `reads` from its host block once TensorStore has filled it (the bytes as
    read — after the cast, if one was asked for; no second read), labelled `<stored name>[<slice>]`.

    Every distinct shard among this process's devices gets one aligned host block (`checkpoints.host`); the stored
    slices it holds are copied into it by TensorStore directly (all reads of the family in flight at once, cast to
    the target dtype on the way), so a process reads exactly its devices' shards, once per replica group. A per-layer
    family's shard `[rows of the stack, …]` is filled row by row from the stored layer arrays (`plan.flat`; padding
    rows stay zero); the vocabulary rows of a table beyond the stored ones are zeros (padding to the layout's
    multiple of P), stored rows beyond the target's are not read.
    """
    sharding = NamedSharding(pl.mesh, pl.pspecs[name])
    shards = host_lib.local_shards(spec.shape, sharding)
    flat = [int(g) for g in pl.plan.flat]
    stores = _open_family(reader, name, spec, shards, flat)
    blocks, writes, nbytes = {}, [], 0
    filled = []  # (label of the stored slice, the host view it was read into)
    for key, index in shards.items():
        block = host_lib.aligned_zeros(tuple(b - a for a, b in key), spec.dtype)
        nbytes += _start_shard_reads(block, key, index, name, spec, stores, flat, writes, filled)
        blocks[key] = block
    for w, (label, view) in zip(writes, filled):  # one filled view per write
        w.result()
        # hashed from the block just filled (the bytes as read, no second read), while later reads are in flight
        try:
            reads.add(label, view)
        except digest.ContentChangedError as e:
            raise CheckpointError(f"{reader.directory}: {e}") from e
    return host_lib.place(spec.shape, sharding, blocks), nbytes


def _open_family(reader: _StoreReader, name: str, spec: model_lib.ParamSpec, shards: dict, flat: list[int]) -> dict:
    """The stored arrays one family's local shards read, opened: `{layer: TensorStore}` for a per-layer family (only
    the layers those shards' stack rows hold), else `{name: TensorStore}`. Raises CheckpointError when a stored shape
    differs from the declared one (a table may hold a different number of vocabulary rows)."""
    if _per_layer(name, spec):
        layers = sorted({flat[r] for key in shards for r in range(*key[0]) if flat[r] >= 0})
        opened = reader.open([f"{name}/{g}" for g in layers])
        stores = {g: opened[f"{name}/{g}"] for g in layers}
        for g, s in stores.items():
            if tuple(s.shape) != tuple(spec.shape[1:]):
                raise CheckpointError(f"{reader.directory}: {name} layer {g} has shape {list(s.shape)}, declared "
                                      f"{list(spec.shape[1:])}")
        return stores
    vocab = _is_table(spec)
    stores = reader.open([name])
    s = stores[name]
    if tuple(s.shape[vocab:]) != tuple(spec.shape[vocab:]):
        raise CheckpointError(f"{reader.directory}: {name} has shape {list(s.shape)}, declared {list(spec.shape)}")
    return stores


def _start_shard_reads(block: np.ndarray, key: tuple, index: tuple, name: str, spec: model_lib.ParamSpec,
                       stores: dict, flat: list[int], writes: list, filled: list) -> int:
    """Start TensorStore's reads of one shard into its host `block` (`key`: the shard's `(start, stop)` per axis,
    `index`: its slices), appending each pending write to `writes` and its `(label, host view)` to `filled`, in
    step. Returns the bytes those reads fill (cast to `spec.dtype` on the way when the stored dtype differs)."""
    import tensorstore as ts

    def source(store):
        return store if store.dtype.numpy_dtype == spec.dtype else ts.cast(store, spec.dtype)

    dst = ts.array(block, copy=False, write=True)
    lo, hi = key[0]
    nbytes = 0
    if _per_layer(name, spec):
        for r in range(lo, hi):
            if flat[r] >= 0:
                writes.append(dst[r - lo].write(source(stores[flat[r]])[index[1:]]))
                nbytes += block[r - lo].nbytes
                filled.append((digest.slice_label(f"{name}/{flat[r]}", index[1:], spec.shape[1:]), block[r - lo]))
    elif not _is_table(spec):
        writes.append(dst.write(source(stores[name])[index]))
        nbytes += block.nbytes
        filled.append((digest.slice_label(name, index, spec.shape), block))
    else:
        rows = min(hi, stores[name].shape[0]) - lo
        if rows > 0:
            src = (slice(lo, lo + rows), *index[1:])
            writes.append(dst[:rows].write(source(stores[name])[src]))
            nbytes += block[:rows].nbytes
            filled.append((digest.slice_label(name, src, stores[name].shape), block[:rows]))
    return nbytes


def restore(path, parallel: ParallelConfig = ParallelConfig(), dtype=None, *, devices=None,
            progress: bool = False, reads: digest.ReadDigests | None = None) -> tuple[ModelConfig, dict, Placement]:
    """Restore a converted directory into `parallel`'s layout (any layout valid for the model).

    Args:
      path: a directory written by `save` / `python -m slope_jax.convert`.
      parallel: the target layout (may differ from the saved one: shards are re-cut by orbax on read).
      dtype: float parameter dtype (default: the dtype it was converted in); norms/sinks stay float32, MXFP4 uint8.
      progress: show a tqdm bar over parameter families.
      reads: collects the digest of every stored slice read (default: a fresh `digest.ReadDigests`); after the
        restore the processes compare them (`hf.check_agreement`; every process must call `restore`).
    Returns:
      `(cfg, params, placement)`: params stacked in `placement.plan.flat` order and sharded as the engine expects.
    Raises:
      CheckpointError when the directory is incomplete or does not match the model declaration; LayoutError for a
      layout the model cannot take; WeightsDisagreeError if two processes read different bytes for a stored slice.
    """
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
    t0 = time.perf_counter()
    reader = _StoreReader(os.path.join(path, PARAMS_DIR))
    from tqdm.auto import tqdm

    reads = digest.ReadDigests() if reads is None else reads
    out, total = {}, 0
    # one family at a time: host staging memory peaks at one family; the bar is drawn on every family and stays
    for name, spec in tqdm(pl.specs.items(), desc="restoring weights", unit="tensor", disable=not progress,
                           leave=True, miniters=1, mininterval=bar_interval()):
        out[name], n = _restore_family(reader, name, spec, pl, reads)
        total += n
    log.info("restored %s into pipeline=%d ring=%d ulysses=%d in %.1f s (%.1f MiB of local shards read, hashing "
             "%.2f s; fingerprint %s)", path, parallel.pipeline, parallel.ring, parallel.ulysses,
             time.perf_counter() - t0, total / 2**20, reads.seconds, meta["fingerprint"])
    from slope_jax.checkpoints import hf

    hf.check_agreement(reads, path)
    return cfg, _unflatten(out), pl


def convert(checkpoint, out, parallel: ParallelConfig = ParallelConfig(), dtype="bfloat16", *, devices=None,
            progress: bool = True) -> dict:
    """Load an HF/original checkpoint into `parallel`'s layout (each device reads only its shard) and save it under
    `out` with `save`; copies the tokenizer and generation config. Returns the marker dict."""
    from slope_jax.checkpoints import hf

    out = os.path.abspath(os.fspath(out))
    _check_out(out, os.fspath(checkpoint))
    ck = hf.open_checkpoint(checkpoint)
    cfg = ck.config
    pl = placement(cfg, parallel, dtype, devices)
    shardings = jax.tree.map(lambda s: NamedSharding(pl.mesh, s), _unflatten(pl.pspecs),
                             is_leaf=lambda x: isinstance(x, Ps))
    t0 = time.perf_counter()
    params = hf.load_params(ck, dtype, shardings=shardings, stack_layers=pl.plan.flat,
                            vocab_rows=stages.vocab_rows(cfg, parallel), progress=progress)
    log.info("loaded %s in %.1f s", ck.path, time.perf_counter() - t0)
    if jax.process_index() == 0:  # before `save`, which writes the marker last
        os.makedirs(out, exist_ok=True)
        for f in _COPY:
            src = os.path.join(ck.path if os.path.isfile(os.path.join(ck.path, f)) else os.fspath(checkpoint), f)
            if os.path.isfile(src):
                atomic_write(os.path.join(out, f), lambda tmp, src=src: shutil.copyfile(src, tmp))
    return save(out, cfg, params, pl, dtype, source=os.path.abspath(os.fspath(checkpoint)), source_id=_source_id(ck),
                source_weights=source_weights_digest(ck, os.fspath(checkpoint), dtype))
