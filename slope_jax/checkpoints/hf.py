"""Checkpoint loading: Hugging Face safetensors (single file or sharded index) and OpenAI's `original/` layout.

Notable:
- One key table (`tensor_table`) maps every checkpoint tensor to the parameter it feeds, with the shape the config
  implies (each dimension tagged with the config field it comes from) and the dtypes it may have. It is derived:
  the parameters, shapes and dtypes from the model declaration (`model.param_specs`), the names and axis
  transforms from the layout's name map (`checkpoints.names`, which the writer inverts).
- Everything is validated from the safetensors headers before any data is read: missing, unknown, duplicate
  (the same tensor in two shards) and misshaped tensors, truncated files — each error names the file, the tensor,
  and the expected and found shape.
- Reads are lazy and per tensor (safetensors memory-maps; `get_slice` reads only the rows asked for): each
  parameter is built with `jax.make_array_from_callback`, so a device — and a host — only reads the layers it holds,
  and host memory peaks at one device shard of one parameter family, not the checkpoint size.
- Full-content agreement: every byte read goes through `_HashedHandle` into a `digest.ReadDigests` as it is read
  (keyed by tensor name and the slice read); after the last parameter the processes compare the slices they share
  and refuse to start naming the tensor and the processes (`host.disagreements`). No extra read, no sampling.
- Expert weights: MXFP4 `_blocks`/`_scales` (released layout, kept packed), or unquantized HF `gate_up_proj
  [E, D, 2I]` / `down_proj [E, I, D]` (transposed to our (out, in) orientation — a square down_proj cannot be
  recognised from its shape, docs/model.md §3.1, so the layout is decided by the tensor names).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import time
from typing import Callable, Iterable

import jax
import numpy as np
from safetensors import SafetensorError, safe_open

from slope_jax.checkpoints.tree import flatten as _flatten
from slope_jax.checkpoints.tree import unflatten as _unflatten
from slope_jax.checkpoints import digest as digest_lib
from slope_jax.checkpoints import host as host_lib
from slope_jax.checkpoints import names as names_lib
from slope_jax.model import gpt_oss as model_lib
from slope_jax.model.config import ConfigError, ModelConfig

log = logging.getLogger(__name__)

HF_INDEX = "model.safetensors.index.json"
HF_SINGLE = "model.safetensors"
_CHUNK_BYTES = 128 << 20  # rows of the embedding tables are read in chunks of this size


class CheckpointError(ValueError):
    """The checkpoint on disk does not match what the config declares, or cannot be read."""


class WeightsDisagreeError(CheckpointError):
    """Processes of one run read different bytes for the same stored tensor slice (names tensors and processes)."""


def _hash(reads: digest_lib.ReadDigests, label: str, data) -> None:
    try:
        reads.add(label, data)
    except digest_lib.ContentChangedError as e:
        raise CheckpointError(str(e)) from e


class _HashedHandle:
    """A safetensors handle whose every read goes into `reads` (`digest.ReadDigests`) as it is read: `get_tensor`
    under the tensor's name, `get_slice(name)[index]` under `name[index]` (a whole-tensor slice under the name)."""

    def __init__(self, handle, reads: digest_lib.ReadDigests):
        self._h, self._reads = handle, reads

    def get_tensor(self, name: str):
        t = self._h.get_tensor(name)
        _hash(self._reads, name, t)
        return t

    def get_slice(self, name: str):
        return _HashedSlice(self._h.get_slice(name), name, self._reads)


class _HashedSlice:
    def __init__(self, sl, name: str, reads: digest_lib.ReadDigests):
        self._sl, self._name, self._reads = sl, name, reads

    def __getitem__(self, index):
        t = self._sl[index]
        _hash(self._reads, digest_lib.slice_label(self._name, index, tuple(self._sl.get_shape())), t)
        return t

    def __getattr__(self, attr):
        return getattr(self._sl, attr)


def check_agreement(reads: digest_lib.ReadDigests, path: str) -> None:
    """All processes compare the digests of the stored slices they share (a collective: every process calls it,
    after loading, before the first step). Raises WeightsDisagreeError naming each differing tensor and the
    processes; a no-op in a one-process run."""
    problems = host_lib.disagreements(reads)
    if problems:
        raise WeightsDisagreeError(host_lib.refusal(problems, path))


# ---------------------------------------------------------------------------------------------------------------
# Key table
@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One checkpoint tensor feeding one parameter. `param` is the parameter path (e.g. "layers/wq"); `layer` the
    global layer or None; `shape` pairs of (size, config field) for messages; `read(handle, name)` returns the
    param-layout numpy array (one layer); `plain`: the tensor is the parameter as is (row ranges may be read)."""

    name: str
    param: str
    layer: int | None
    shape: tuple[tuple[int, str], ...]
    kind: str  # "float" or "uint8"
    read: Callable
    plain: bool = False


def _reader(groups: list[list[int]], shape: tuple[int, ...], rows: tuple[int, int] | None):
    def read(h, name, experts: tuple[int, int] | None = None):
        """The parameter-layout array of one layer; with `experts=(lo, hi)` only those experts (the leading axis of
        both the checkpoint tensor and the parameter), read lazily with `get_slice` (expert parallelism)."""
        if experts is None:
            t = h.get_slice(name)[rows[0]:rows[1]] if rows else h.get_tensor(name)
            return names_lib.from_checkpoint(t, groups, shape)
        if rows is not None or groups[0] != [0]:
            raise CheckpointError(f"{name}: experts must be the leading, unmerged axis to read a range of them")
        lo, hi = experts
        return names_lib.from_checkpoint(h.get_slice(name)[lo:hi], groups, (hi - lo, *shape[1:]))
    return read


def tensor_table(cfg: ModelConfig, layout: str) -> list[TensorEntry]:
    """Every tensor a checkpoint of `layout` ("hf" or "original") must hold for `cfg` (expert format from cfg):
    the declared parameters (`model.param_specs`) joined with the layout's name map (`checkpoints.names`)."""
    if layout == "original" and cfg.expert_format != "mxfp4":
        raise CheckpointError("the original/ layout always stores MXFP4 experts")
    specs = _flatten(model_lib.param_specs(cfg))
    d = model_lib.dims(cfg)
    rows = [r for r in names_lib.table(layout) if r.param in specs]
    unnamed = [p for p in specs if p not in {r.param for r in rows}]
    if unnamed:
        raise ValueError(f"declared parameter(s) {unnamed} have no {layout!r} checkpoint name: add a row to "
                         "slope_jax/checkpoints/names.py")
    fused: dict[str, list[names_lib.Name]] = {}
    for r in rows:
        fused.setdefault(r.key, []).append(r)

    def ck_dims(r):  # [(size, source)] of one row's checkpoint axes, and its axis groups and per-layer shape
        spec = specs[r.param]
        axes = spec.axes[1:] if spec.axes[0] == "layers" else spec.axes
        groups = names_lib.axis_groups(r, axes)
        dd = [(math.prod(d[axes[i]].size for i in g), "*".join(d[axes[i]].source for i in g)) for g in groups]
        return dd, groups, tuple(d[a].size for a in axes)

    def entries(r, layer):
        spec = specs[r.param]
        dd, groups, shape = ck_dims(r)
        group = fused[r.key]
        rows_range = None
        if len(group) > 1:  # concatenated along axis 0 in row order
            sizes = [ck_dims(x)[0][0] for x in group]
            off = sum(s for s, _ in sizes[:group.index(r)])
            rows_range = (off, off + dd[0][0])
            dd = [(sum(s for s, _ in sizes), "+".join(src for _, src in sizes)), *dd[1:]]
        key = r.key.format(layer=layer) if layer is not None else r.key
        kind = "uint8" if spec.dtype == np.uint8 else "float"
        plain = rows_range is None and groups == [[i] for i in range(len(shape))]
        return TensorEntry(key, r.param, layer, tuple(dd), kind, _reader(groups, shape, rows_range), plain)

    per_layer = [r for r in rows if specs[r.param].axes[0] == "layers"]
    out = [entries(r, None) for r in rows if r not in per_layer]
    for layer in range(cfg.num_hidden_layers):
        out += [entries(r, layer) for r in per_layer]
    return out


_FLOAT_DTYPES = {"BF16", "F16", "F32"}
_UINT8_DTYPES = {"U8"}


# ---------------------------------------------------------------------------------------------------------------
# Reading
class TensorSource:
    """Name → (file, lazily opened safetensors handle) over one directory's weight files."""

    def __init__(self, files: dict[str, str], directory: str):
        self.directory = directory
        self._handles: dict[str, object] = {}
        self.file_of: dict[str, str] = {}
        self.header: dict[str, tuple[str, tuple[int, ...]]] = {}  # name -> (dtype, shape)
        for fname in sorted(set(files.values())):
            path = os.path.join(directory, fname)
            if not os.path.exists(path):
                raise CheckpointError(f"{path}: weight file listed by the checkpoint does not exist")
            try:
                h = safe_open(path, framework="numpy")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{path}: cannot read safetensors file (truncated or corrupt?): {e}") from e
            self._handles[fname] = h
            for name in h.keys():
                if name in self.file_of:
                    raise CheckpointError(f"tensor {name!r} appears twice: in {self.file_of[name]} and in {fname}")
                sl = h.get_slice(name)
                self.file_of[name] = fname
                self.header[name] = (sl.get_dtype(), tuple(sl.get_shape()))
        for name, fname in files.items():
            if name in self.file_of and self.file_of[name] != fname:
                raise CheckpointError(f"{HF_INDEX}: maps {name!r} to {fname}, but it is stored in "
                                      f"{self.file_of[name]}")

    def handle(self, name: str):
        return self._handles[self.file_of[name]]

    def where(self, name: str) -> str:
        return os.path.join(self.directory, self.file_of.get(name, "?"))


def _weight_files(directory: str) -> dict[str, str]:
    """`{tensor name: file}` from the index, or `{"*": file}` for a single file."""
    index = os.path.join(directory, HF_INDEX)
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index (needs a 'weight_map' object): {e}") from e
        return dict(weight_map)
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no {HF_INDEX} and no *.safetensors file")
    return {f"*{f}": f for f in files}


@dataclasses.dataclass
class CheckpointDir:
    """A resolved checkpoint: its config, layout ("hf"/"original") and tensor source."""

    path: str
    layout: str
    config: ModelConfig
    source: TensorSource
    table: list[TensorEntry]


def open_checkpoint(path: str | os.PathLike, layout: str = "auto") -> CheckpointDir:
    """Resolve and validate a checkpoint directory without reading any tensor data.

    Args:
      path: a directory with `config.json` and `model.safetensors` or `model.safetensors.index.json` (HF), or an
        OpenAI `original/` directory, or an HF directory whose `original/` sub-directory should be used.
      layout: "auto" (HF if the top level has HF weights, else `original/`), "hf" or "original".
    Raises:
      CheckpointError / ConfigError naming the file and tensor for every inconsistency.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: checkpoint directory does not exist")
    has_weights = any(f.endswith(".safetensors") or f == HF_INDEX for f in os.listdir(path))
    top_is_original = _is_original_config(os.path.join(path, "config.json"))
    if layout == "auto":
        layout = "hf" if has_weights and not top_is_original else "original"
    if layout == "original" and not top_is_original and os.path.isdir(os.path.join(path, "original")):
        path = os.path.join(path, "original")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise CheckpointError(f"{path}: no config.json")
    cfg = ModelConfig.from_json(cfg_path)
    source = TensorSource(_weight_files(path), path)
    names = set(source.header)
    if layout == "hf":
        dense = any(n.endswith("mlp.experts.gate_up_proj") for n in names)
        packed = any(n.endswith("gate_up_proj_blocks") for n in names)
        if dense and packed:
            raise CheckpointError(f"{path}: holds both MXFP4 (_blocks/_scales) and unquantized expert tensors")
        fmt = "dense" if dense else "mxfp4"
        if dense and _declares_mxfp4(cfg_path):
            raise CheckpointError(f"{cfg_path}: quantization_config declares mxfp4 but the tensors hold "
                                  "unquantized experts (mlp.experts.gate_up_proj)")
        try:
            cfg = dataclasses.replace(cfg, expert_format=fmt)
        except ConfigError as e:
            raise CheckpointError(f"{cfg_path}: {e}") from e
    table = tensor_table(cfg, layout)
    _check_names_shapes(source, table, cfg_path)
    return CheckpointDir(path, layout, cfg, source, table)


def _is_original_config(cfg_path: str) -> bool:
    """Whether a config.json is OpenAI's dialect (has `num_experts`, no `model_type`)."""
    try:
        with open(cfg_path) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(d, dict) and "model_type" not in d and "num_experts" in d


def _declares_mxfp4(cfg_path: str) -> bool:
    with open(cfg_path) as f:
        return (json.load(f).get("quantization_config") or {}).get("quant_method") == "mxfp4"


def _check_names_shapes(source: TensorSource, table: list[TensorEntry], cfg_path: str) -> None:
    expected = {}
    for e in table:
        expected.setdefault(e.name, e)
    missing = [n for n in expected if n not in source.header]
    if missing:
        raise CheckpointError(
            f"{source.directory}: {len(missing)} tensor(s) required by {cfg_path} are missing, e.g. "
            + ", ".join(repr(n) for n in missing[:5]))
    unknown = sorted(n for n in source.header if n not in expected)
    if unknown:
        raise CheckpointError(
            f"{source.where(unknown[0])}: {len(unknown)} unknown tensor(s) for this config, e.g. "
            + ", ".join(repr(n) for n in unknown[:5])
            + " (a layer index beyond num_hidden_layers, or another model's weights?)")
    for name, e in expected.items():
        dtype, shape = source.header[name]
        want = tuple(s for s, _ in e.shape)
        if shape != want:
            fields = ", ".join(f"{s} ({f})" for s, f in e.shape)
            raise CheckpointError(
                f"{source.where(name)}: tensor {name!r} has shape {list(shape)}, expected {list(want)} = [{fields}] "
                f"from {cfg_path}")
        allowed = _FLOAT_DTYPES if e.kind == "float" else _UINT8_DTYPES
        if dtype not in allowed:
            raise CheckpointError(f"{source.where(name)}: tensor {name!r} has dtype {dtype}, expected one of "
                                  f"{sorted(allowed)}")


# ---------------------------------------------------------------------------------------------------------------
# Materialisation



def bar_interval() -> float:
    """Seconds between redraws of a loading bar: every tensor on a terminal (it moves even when each tensor takes
    long); every 15 s when stderr is a file or pipe, where each redraw is another carriage-return update in the log."""
    import sys

    return 0.0 if sys.stderr.isatty() else 15.0

def load_params(ckpt: CheckpointDir, dtype="bfloat16", *, shardings: dict | None = None,
                stack_layers: Iterable[int] | None = None, vocab_rows: int | None = None,
                progress: bool = True, reads: digest_lib.ReadDigests | None = None) -> dict:
    """Read the parameters into device arrays.

    Args:
      ckpt: from `open_checkpoint`.
      dtype: activation/weight dtype for float parameters (norms and sinks are always float32, MXFP4 stays uint8).
      shardings: optional pytree (same structure as the params) of `jax.sharding.Sharding`; default: the first
        local device. Each device's callback reads only its own shard (its stage's layers, its vocabulary rows,
        its experts under expert parallelism); devices holding the same shard share one read.
      stack_layers: the global layer held by each entry of the stacked layer parameters (−1 = padding, zero
        weights); default 0..L−1.
      vocab_rows: rows of the embedding/unembedding tables (≥ V; rows past V are zeros); default V.
      progress: show a tqdm bar over parameter families.
      reads: collects the digest of every byte read (default: a fresh `digest.ReadDigests`); after loading, the
        processes compare them (`check_agreement`; every process of a multi-process run must call `load_params`).
    Returns:
      The parameter pytree of `model.param_specs` with `layers` stacked in `stack_layers` order.
    Raises:
      WeightsDisagreeError if two processes read different bytes for one stored slice.
    """
    from tqdm.auto import tqdm

    cfg = ckpt.config
    stack = list(range(cfg.num_hidden_layers)) if stack_layers is None else list(stack_layers)
    specs = _flatten(model_lib.param_specs(cfg, dtype, num_layers=len(stack), vocab_rows=vocab_rows))
    by_param: dict[str, dict[int | None, TensorEntry]] = {}
    for e in ckpt.table:
        by_param.setdefault(e.param, {})[e.layer] = e
    flat_shard = _flatten(shardings) if shardings is not None else {}
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    reads = digest_lib.ReadDigests() if reads is None else reads
    t_load = time.perf_counter()
    out = {}
    # leave=True and a bar refreshed on every tensor: it moves even when each tensor takes long, and stays
    for pname, spec in tqdm(specs.items(), desc="loading weights", unit="tensor", disable=not progress,
                            leave=True, miniters=1, mininterval=bar_interval()):
        read = functools.partial(_read_entry, ckpt.source, reads)
        shard = functools.partial(_read_shard, read=read, entries=by_param[pname], spec=spec, pname=pname,
                                  stack=stack, vocab_size=cfg.vocab_size)
        # replicas of a shard (ring/ulysses devices of a stage) share one read and one aligned host block
        out[pname] = host_lib.place(spec.shape, flat_shard.get(pname, default), shard)
        log.debug("loaded %s %s %s", pname, spec.shape, spec.dtype)
    log.info("read %.1f MiB of %s in %.1f s; hashing it took %.2f s", reads.nbytes / 2**20, ckpt.path,
             time.perf_counter() - t_load, reads.seconds)
    check_agreement(reads, ckpt.path)
    return _unflatten(out)


def _read_entry(source: TensorSource, reads: digest_lib.ReadDigests, entry: TensorEntry,
                rows: tuple[int, int] | None = None, experts: tuple[int, int] | None = None) -> np.ndarray:
    """One checkpoint tensor as the parameter takes it (`entry.read`: transposed / decoded as the layout needs), or
    only its rows `[rows[0], rows[1])` of a plain (untransformed) tensor, or only the experts `[experts[0],
    experts[1])` (leading axis) of a per-layer expert tensor. Every byte read is hashed into `reads`."""
    h = _HashedHandle(source.handle(entry.name), reads)  # every byte hashed as it is read
    if experts is not None:  # only these experts (leading axis) of a per-layer expert tensor
        return entry.read(h, entry.name, experts=experts)
    return h.get_slice(entry.name)[rows[0]:rows[1]] if rows else entry.read(h, entry.name)


def _read_shard(index: tuple, *, read: Callable, entries: dict, spec: model_lib.ParamSpec, pname: str,
                stack: list[int], vocab_size: int) -> np.ndarray:
    """The host block of one device shard of parameter `pname` (`index`: its slices of `spec.shape`), read from the
    checkpoint tensors `entries` (by layer; `None` for a non-layer parameter) with `read` (`_read_entry`).

    The block is allocated once in the target dtype and filled piece by piece (assignment converts the dtype): host
    memory peaks at the block plus one layer tensor or one chunk of table rows. Stacked layers come in `stack` order
    (−1: padding, zeros); vocabulary rows past `vocab_size` are zero padding.
    """
    first = index[0] if index else slice(None)
    lo, hi, _ = first.indices(spec.shape[0])
    if pname.startswith("layers/") and len(spec.axes) > 1 and spec.axes[1] == "experts":
        return _read_expert_shard(index, lo, hi, read=read, entries=entries, spec=spec, stack=stack)
    block = host_lib.aligned_zeros((hi - lo, *spec.shape[1:]), spec.dtype)
    if pname.startswith("layers/"):
        for j, g in enumerate(stack[lo:hi]):
            if g >= 0:
                block[j] = read(entries[g])
    elif spec.axes[0] == "vocab" and entries[None].plain:  # row range of the table; rows past V: padding
        stop = min(hi, vocab_size)
        step = max(1, _CHUNK_BYTES // max(1, int(np.prod(spec.shape[1:])) * spec.dtype.itemsize))
        for a in range(lo, stop, step):
            b = min(stop, a + step)
            block[a - lo:b - lo] = read(entries[None], rows=(a, b))
    elif spec.axes[0] == "vocab":  # a transformed table: read whole, keep this block's rows
        stop = min(hi, vocab_size)
        block[:stop - lo] = read(entries[None])[lo:stop]
    else:
        block[...] = read(entries[None])
    return block[(slice(None), *index[1:])]


def _read_expert_shard(index: tuple, lo: int, hi: int, *, read: Callable, entries: dict,
                       spec: model_lib.ParamSpec, stack: list[int]) -> np.ndarray:
    """`_read_shard` of a per-layer expert parameter (`[layers, experts, ...]`), stack rows `[lo, hi)`: under expert
    parallelism a device holds a range of experts, and only those rows of each layer tensor are read."""
    e_lo, e_hi, _ = (index[1] if len(index) > 1 else slice(None)).indices(spec.shape[1])
    part = (e_lo, e_hi) if (e_lo, e_hi) != (0, spec.shape[1]) else None
    block = host_lib.aligned_zeros((hi - lo, e_hi - e_lo, *spec.shape[2:]), spec.dtype)
    for j, g in enumerate(stack[lo:hi]):
        if g >= 0:
            block[j] = read(entries[g], experts=part) if part else read(entries[g])
    return block[(slice(None), slice(None), *index[2:])]


def load_checkpoint(path: str | os.PathLike, dtype="bfloat16", *, layout: str = "auto",
                    progress: bool = True) -> tuple[ModelConfig, dict]:
    """Load a gpt-oss checkpoint onto the first local device.

    Args:
      path: checkpoint directory (see `open_checkpoint`).
      dtype: "bfloat16" (default, as released) or "float32" for float parameters.
      layout: "auto", "hf" or "original".
    Returns:
      `(ModelConfig, params)` — params is the plain pytree the forward functions take.
    Raises:
      CheckpointError, ConfigError with the file, tensor, expected and found shape.
    """
    ckpt = open_checkpoint(path, layout)
    log.info("checkpoint %s: layout=%s experts=%s layers=%d", ckpt.path, ckpt.layout, ckpt.config.expert_format,
             ckpt.config.num_hidden_layers)
    return ckpt.config, load_params(ckpt, dtype, progress=progress)

