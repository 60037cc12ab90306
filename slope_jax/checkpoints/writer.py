"""Write gpt-oss checkpoints in the released formats (for tests, benchmarks and the shipped tiny model).

Layouts (docs/model.md §3): "hf-mxfp4" — the released HF layout (`_blocks`/`_scales` experts, bf16 elsewhere, optionally
sharded with `model.safetensors.index.json`); "hf-dense" — HF's unquantized layout (`gate_up_proj [E, D, 2I]`,
`down_proj [E, I, D]`, as `save_pretrained` writes it); "original" — OpenAI's `original/` layout (fused qkv,
`block.N.…` names, `dtypes.json`). Every file is written to a temporary name and renamed; the index last.
"""

from __future__ import annotations

import dataclasses
import os

import ml_dtypes
import numpy as np

from slope_jax.atomic import atomic_json, atomic_safetensors
from slope_jax.checkpoints import hf
from slope_jax.checkpoints import names as names_lib
from slope_jax.checkpoints.hf import HF_INDEX, HF_SINGLE
from slope_jax.model import gpt_oss as model_lib
from slope_jax.model import mxfp4
from slope_jax.model.config import ModelConfig

BF16 = ml_dtypes.bfloat16


def random_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """Deterministic random parameters in the engine's layout (numpy; floats bf16, uint8 as declared), drawn in
    declaration order by each parameter's declared init rule (`model.gpt_oss.Init`).

    Scales keep activations O(1): "normal" ~ N(0, 1/fan_in) (N(0, 1) without fan-in axes: sinks, embedding),
    "bias" ~ N(0, 0.1²), "norm" ~ 1 + N(0, 0.1²), MXFP4 scale bytes in [120, 122] (weights ~ 0.1). Every bias and
    sink is non-zero.
    """
    rng = np.random.default_rng(seed)
    cfg = dataclasses.replace(cfg, expert_format="mxfp4")  # as released; `hf_tensors(experts="dense")` decodes
    d = model_lib.dims(cfg)

    def draw(spec: model_lib.ParamSpec):
        kind = spec.init.kind
        if kind == "mxfp4_blocks":
            return rng.integers(0, 256, spec.shape, dtype=np.uint8)
        if kind == "mxfp4_scales":
            return rng.integers(120, 123, spec.shape, dtype=np.uint8)
        if kind == "norm":
            return (1 + 0.1 * rng.standard_normal(spec.shape)).astype(BF16)
        std = 0.1 if kind == "bias" else float(np.prod([d[a].size for a in spec.init.fan_in])) ** -0.5
        return (rng.standard_normal(spec.shape, dtype=np.float32) * std).astype(BF16)

    def walk(tree):
        return {k: walk(v) if isinstance(v, dict) else draw(v) for k, v in tree.items()}

    return walk(model_lib.param_specs(cfg))


def dense_experts(params: dict) -> dict:
    """MXFP4 expert params (`X_blocks`, `X_scales`) → dense `X` (exact in bf16), in the dtype of the embedding."""
    dt = params["embed"].dtype
    layers = dict(params["layers"])
    for k in [k for k in layers if k.endswith("_blocks")]:
        base = k[:-len("_blocks")]
        b, s = layers.pop(k), layers.pop(base + "_scales")
        layers[base] = np.stack([mxfp4.decode_numpy(b[i], s[i]) for i in range(b.shape[0])]).astype(dt)
    return {**params, "layers": layers}


def checkpoint_tensors(cfg: ModelConfig, params: dict, layout: str) -> dict[str, np.ndarray]:
    """Engine-layout numpy params → the tensors of a `layout` ("hf" / "original") checkpoint: the name map
    (`checkpoints.names`) read backwards. Non-layer tensors first, then layer by layer in map order."""
    specs = hf._flatten(model_lib.param_specs(cfg))
    flat = hf._flatten(params)
    rows = [r for r in names_lib.table(layout) if r.param in specs]
    missing = sorted(set(specs) - {r.param for r in rows})
    if missing:
        raise ValueError(f"declared parameter(s) {missing} have no {layout!r} checkpoint name")
    out: dict[str, np.ndarray] = {}

    def emit(r, a, layer=None):
        spec = specs[r.param]
        axes = spec.axes[1:] if layer is not None else spec.axes
        t = names_lib.to_checkpoint(np.asarray(a), names_lib.axis_groups(r, axes))
        key = r.key if layer is None else r.key.format(layer=layer)
        out[key] = np.concatenate([out[key], t]) if key in out else t  # rows sharing a key are fused (axis 0)

    per_layer = [r for r in rows if specs[r.param].axes[0] == "layers"]
    for r in rows:
        if r not in per_layer:
            emit(r, flat[r.param])
    for layer in range(cfg.num_hidden_layers):
        for r in per_layer:
            emit(r, flat[r.param][layer], layer)
    return out


def hf_tensors(cfg: ModelConfig, params: dict, experts: str = "mxfp4") -> dict[str, np.ndarray]:
    """Map engine-layout numpy params (MXFP4 experts) to HF tensor names ("mxfp4" packed or "dense" experts)."""
    if experts == "dense":
        return checkpoint_tensors(dataclasses.replace(cfg, expert_format="dense"), dense_experts(params), "hf")
    if experts != "mxfp4":
        raise ValueError(f"experts={experts!r}: expected 'mxfp4' or 'dense'")
    return checkpoint_tensors(dataclasses.replace(cfg, expert_format="mxfp4"), params, "hf")


def original_tensors(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """Map engine-layout numpy params to OpenAI `original/` names (fused qkv, docs/model.md §3.2)."""
    return checkpoint_tensors(cfg, params, "original")


def _shard_names(tensors: dict[str, np.ndarray], num_shards: int) -> list[list[str]]:
    """Split tensor names into `num_shards` groups of similar byte size, keeping insertion order."""
    names = list(tensors)
    total = sum(tensors[n].nbytes for n in names)
    groups: list[list[str]] = [[]]
    acc = 0
    for n in names:
        if acc >= total * len(groups) / num_shards and len(groups) < num_shards:
            groups.append([])
        groups[-1].append(n)
        acc += tensors[n].nbytes
    return groups


def write_hf(directory: str, cfg: ModelConfig, params: dict, *, experts: str = "mxfp4", num_shards: int = 1,
             generation_config: bool = True) -> None:
    """Write an HF-layout checkpoint: `config.json`, weights (one file, or `num_shards` files named
    `model-0000i-of-0000{n-1}.safetensors` + index, 0-based as released), `generation_config.json`."""
    os.makedirs(directory, exist_ok=True)
    tensors = hf_tensors(cfg, params, experts)
    c = dataclasses.replace(cfg, expert_format="mxfp4" if experts == "mxfp4" else "dense")
    if num_shards <= 1:
        atomic_safetensors(os.path.join(directory, HF_SINGLE), tensors, {"format": "pt"})
    else:
        weight_map = {}
        groups = _shard_names(tensors, num_shards)
        for i, names in enumerate(groups):
            fname = f"model-{i:05d}-of-{len(groups) - 1:05d}.safetensors"
            atomic_safetensors(os.path.join(directory, fname), {n: tensors[n] for n in names}, {"format": "pt"})
            weight_map.update({n: fname for n in names})
        total = int(sum(t.nbytes for t in tensors.values()))
        atomic_json(os.path.join(directory, HF_INDEX), {"metadata": {"total_size": total}, "weight_map": weight_map})
    if generation_config:
        gen = {"bos_token_id": None, "eos_token_id": list(cfg.eos_token_ids), "pad_token_id": cfg.pad_token_id,
               "do_sample": False}
        atomic_json(os.path.join(directory, "generation_config.json"), gen)
    atomic_json(os.path.join(directory, "config.json"), c.to_hf_dict())


def write_original(directory: str, cfg: ModelConfig, params: dict) -> None:
    """Write OpenAI's layout into `directory` (typically `<checkpoint>/original`): config.json, dtypes.json,
    model.safetensors. Raises ConfigError (before writing anything) for a config the original/ format cannot
    express (`ModelConfig.to_original_dict`)."""
    config = cfg.to_original_dict()
    os.makedirs(directory, exist_ok=True)
    tensors = original_tensors(cfg, params)
    atomic_safetensors(os.path.join(directory, "model.safetensors"), tensors)
    dtypes = {n: ("FP4" if n.endswith(".blocks") else "UE8" if n.endswith(".scales") else "BF16") for n in tensors}
    atomic_json(os.path.join(directory, "dtypes.json"), dtypes)
    atomic_json(os.path.join(directory, "config.json"), config)
