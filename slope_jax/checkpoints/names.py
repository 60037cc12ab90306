"""Checkpoint name maps: each declared parameter ↔ tensor in the HF and OpenAI `original/` layouts (docs/model.md §3).

Each map is written once, as rows `Name(param, key, dims)`, and read both ways: the loader (`hf.tensor_table`)
turns a checkpoint tensor into the parameter's layout, the writer (`writer.checkpoint_tensors`) the reverse.
- `param`: the parameter path in the model declaration (`model.gpt_oss.GptOss`), e.g. "layers/wq".
- `key`: the tensor name; `{layer}` is the global layer index for per-layer parameters (the leading `layers` axis
  of the declaration is dropped: one tensor per layer).
- `dims`: the checkpoint tensor's axes in terms of the parameter's logical axes, comma-separated, `*` merging
  adjacent axes (row-major), e.g. "q_heads*head_dim, embed" for HF's `[N·H, D]` q_proj; any order (a transpose):
  "experts, embed, mlp2" is HF's unquantized `gate_up_proj [E, D, 2I]` for our `[E, 2I, D]`. Omitted: the
  parameter's own axes.
- Rows sharing a key are fused: the tensor is their concatenation along axis 0, in row order (`original/`'s qkv).

Shapes are never written here: they come from the declaration for the config (`model.gpt_oss.dims`), so a
contradicting checkpoint is reported with the config fields each size comes from. Rows of parameters the config
does not declare (the other expert format) are skipped; a declared parameter without a row is a programming error
(`hf.tensor_table` names it).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Name:
    param: str
    key: str
    dims: str | None = None


_L = "model.layers.{layer}."
HF: tuple[Name, ...] = (
    Name("embed", "model.embed_tokens.weight"),
    Name("final_norm", "model.norm.weight"),
    Name("unembed", "lm_head.weight"),
    Name("layers/attn_norm", _L + "input_layernorm.weight"),
    Name("layers/wq", _L + "self_attn.q_proj.weight", "q_heads*head_dim, embed"),
    Name("layers/bq", _L + "self_attn.q_proj.bias", "q_heads*head_dim"),
    Name("layers/wk", _L + "self_attn.k_proj.weight", "kv_heads*head_dim, embed"),
    Name("layers/bk", _L + "self_attn.k_proj.bias", "kv_heads*head_dim"),
    Name("layers/wv", _L + "self_attn.v_proj.weight", "kv_heads*head_dim, embed"),
    Name("layers/bv", _L + "self_attn.v_proj.bias", "kv_heads*head_dim"),
    Name("layers/wo", _L + "self_attn.o_proj.weight", "embed, q_heads*head_dim"),
    Name("layers/bo", _L + "self_attn.o_proj.bias"),
    Name("layers/sinks", _L + "self_attn.sinks"),
    Name("layers/mlp_norm", _L + "post_attention_layernorm.weight"),
    Name("layers/router_w", _L + "mlp.router.weight"),
    Name("layers/router_b", _L + "mlp.router.bias"),
    Name("layers/b1", _L + "mlp.experts.gate_up_proj_bias"),
    Name("layers/b2", _L + "mlp.experts.down_proj_bias"),
    # MXFP4 (released layout): packed along the input axis, our orientation
    Name("layers/w1_blocks", _L + "mlp.experts.gate_up_proj_blocks"),
    Name("layers/w1_scales", _L + "mlp.experts.gate_up_proj_scales"),
    Name("layers/w2_blocks", _L + "mlp.experts.down_proj_blocks"),
    Name("layers/w2_scales", _L + "mlp.experts.down_proj_scales"),
    # unquantized (HF save_pretrained): [E, in, out]
    Name("layers/w1", _L + "mlp.experts.gate_up_proj", "experts, embed, mlp2"),
    Name("layers/w2", _L + "mlp.experts.down_proj", "experts, mlp, embed"),
)

_B = "block.{layer}."
ORIGINAL: tuple[Name, ...] = (
    Name("embed", "embedding.weight"),
    Name("final_norm", "norm.scale"),
    Name("unembed", "unembedding.weight"),
    Name("layers/attn_norm", _B + "attn.norm.scale"),
    # fused qkv: rows 0:NH → q, NH:(N+K)H → k, (N+K)H: → v (docs/model.md §3.2)
    Name("layers/wq", _B + "attn.qkv.weight", "q_heads*head_dim, embed"),
    Name("layers/wk", _B + "attn.qkv.weight", "kv_heads*head_dim, embed"),
    Name("layers/wv", _B + "attn.qkv.weight", "kv_heads*head_dim, embed"),
    Name("layers/bq", _B + "attn.qkv.bias", "q_heads*head_dim"),
    Name("layers/bk", _B + "attn.qkv.bias", "kv_heads*head_dim"),
    Name("layers/bv", _B + "attn.qkv.bias", "kv_heads*head_dim"),
    Name("layers/sinks", _B + "attn.sinks"),
    Name("layers/wo", _B + "attn.out.weight", "embed, q_heads*head_dim"),
    Name("layers/bo", _B + "attn.out.bias"),
    Name("layers/mlp_norm", _B + "mlp.norm.scale"),
    Name("layers/router_w", _B + "mlp.gate.weight"),
    Name("layers/router_b", _B + "mlp.gate.bias"),
    Name("layers/w1_blocks", _B + "mlp.mlp1_weight.blocks"),
    Name("layers/w1_scales", _B + "mlp.mlp1_weight.scales"),
    Name("layers/b1", _B + "mlp.mlp1_bias"),
    Name("layers/w2_blocks", _B + "mlp.mlp2_weight.blocks"),
    Name("layers/w2_scales", _B + "mlp.mlp2_weight.scales"),
    Name("layers/b2", _B + "mlp.mlp2_bias"),
)

TABLES = {"hf": HF, "original": ORIGINAL}


def table(layout: str) -> tuple[Name, ...]:
    """The name map of `layout` ("hf" or "original"), looked up at call time (so a test may extend it)."""
    if layout not in TABLES:
        raise ValueError(f"layout={layout!r}: expected 'hf' or 'original'")
    return TABLES[layout]


def axis_groups(name: Name, axes: tuple[str, ...]) -> list[list[int]]:
    """The checkpoint axes of `name` as groups of indices into the parameter's (per-layer) `axes`.
    Raises ValueError if the row does not use each axis exactly once."""
    if name.dims is None:
        return [[i] for i in range(len(axes))]
    groups = [[a.strip() for a in d.split("*")] for d in name.dims.split(",")]
    used = [a for g in groups for a in g]
    if sorted(used) != sorted(axes):
        raise ValueError(f"{name.key} ({name.param}): dims {name.dims!r} must use each of the declared axes {axes} "
                         "exactly once")
    return [[axes.index(a) for a in g] for g in groups]


def to_checkpoint(a: np.ndarray, groups: list[list[int]]) -> np.ndarray:
    """Parameter layout (one layer) → checkpoint tensor: permute the axes, then merge each group."""
    perm = [i for g in groups for i in g]
    t = a.transpose(perm) if perm != sorted(perm) else a
    return np.ascontiguousarray(t.reshape([math.prod(a.shape[i] for i in g) for g in groups]))


def from_checkpoint(t: np.ndarray, groups: list[list[int]], shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of `to_checkpoint`: checkpoint tensor → the parameter layout `shape` (one layer)."""
    perm = [i for g in groups for i in g]
    t = t.reshape([shape[i] for i in perm])
    return np.ascontiguousarray(t.transpose(np.argsort(perm))) if perm != sorted(perm) else t
