"""gpt-oss forward pass: Flax NNX parameter declarations + pure functions over the parameter pytree.

Notable:
- `GptOss` (an `nnx.Module`) declares every parameter once with its shape, dtype and logical axes; per-layer
  parameters are stacked `[L, …]` under `layers`. Shardings, random init and the checkpoint loader's shape checks
  are all derived from this declaration (`param_specs`). The compiled path never calls NNX: it runs the pure
  functions below on the plain dict `{"embed", "layers": {...}, "final_norm", "unembed"}` under `jax.jit`
  (NNX's own jit costs ~10× the dispatch time, design §4).
- `layer` takes the attention core as an argument, so the single-device path (here) and the context-parallel path
  (`slope_jax.context_parallel`) share every other line of the block.
- Norms and sinks are float32 parameters; expert weights stay MXFP4-packed (uint8) or dense; the rest is the
  activation dtype. Logits are float32 and computed for the last real token only (never `[T, V]`).

Axis letters: T tokens, D hidden, N query heads, K KV heads, H head_dim, E experts, I expert intermediate, V vocab,
L layers.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from slope_jax.model import attention as attn_lib
from slope_jax.model import moe as moe_lib
from slope_jax.model import rope
from slope_jax.model.config import ModelConfig


# ---------------------------------------------------------------------------------------------------------------
# Declarations
def _p(shape, dtype, axes):
    assert len(shape) == len(axes), (shape, axes)
    return nnx.Param(jnp.zeros(shape, dtype), axes=tuple(axes))


class Layers(nnx.Module):
    """All decoder blocks, each parameter stacked over a leading `layers` axis of size L."""

    def __init__(self, cfg: ModelConfig, dtype, num_layers: int):
        L, D, N, K, H = num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        E, I = cfg.num_experts, cfg.intermediate_size
        f32 = jnp.float32
        self.attn_norm = _p((L, D), f32, ("layers", "embed"))
        self.wq = _p((L, N, H, D), dtype, ("layers", "q_heads", "head_dim", "embed"))
        self.bq = _p((L, N, H), dtype, ("layers", "q_heads", "head_dim"))
        self.wk = _p((L, K, H, D), dtype, ("layers", "kv_heads", "head_dim", "embed"))
        self.bk = _p((L, K, H), dtype, ("layers", "kv_heads", "head_dim"))
        self.wv = _p((L, K, H, D), dtype, ("layers", "kv_heads", "head_dim", "embed"))
        self.bv = _p((L, K, H), dtype, ("layers", "kv_heads", "head_dim"))
        self.wo = _p((L, D, N, H), dtype, ("layers", "embed", "q_heads", "head_dim"))
        self.bo = _p((L, D), dtype, ("layers", "embed"))
        self.sinks = _p((L, N), f32, ("layers", "q_heads"))
        self.mlp_norm = _p((L, D), f32, ("layers", "embed"))
        self.router_w = _p((L, E, D), dtype, ("layers", "experts", "embed"))
        self.router_b = _p((L, E), dtype, ("layers", "experts"))
        if cfg.expert_format == "mxfp4":
            u8 = jnp.uint8
            self.w1_blocks = _p((L, E, 2 * I, D // 32, 16), u8, ("layers", "experts", "mlp2", "blocks", "bytes"))
            self.w1_scales = _p((L, E, 2 * I, D // 32), u8, ("layers", "experts", "mlp2", "blocks"))
            self.w2_blocks = _p((L, E, D, I // 32, 16), u8, ("layers", "experts", "embed", "blocks", "bytes"))
            self.w2_scales = _p((L, E, D, I // 32), u8, ("layers", "experts", "embed", "blocks"))
        else:
            self.w1 = _p((L, E, 2 * I, D), dtype, ("layers", "experts", "mlp2", "embed"))
            self.w2 = _p((L, E, D, I), dtype, ("layers", "experts", "embed", "mlp"))
        self.b1 = _p((L, E, 2 * I), dtype, ("layers", "experts", "mlp2"))
        self.b2 = _p((L, E, D), dtype, ("layers", "experts", "embed"))


class GptOss(nnx.Module):
    """Parameter declaration of the whole model. Build it abstractly with `declare`; never materialise it.

    `num_layers` (default L) is the number of stacked layer slots; `vocab_rows` (default V) the rows of the embedding
    and unembedding tables, padded with zero rows when the vocabulary is sharded over pipeline stages.
    """

    def __init__(self, cfg: ModelConfig, dtype, num_layers: int | None = None, vocab_rows: int | None = None):
        V, D = vocab_rows or cfg.vocab_size, cfg.hidden_size
        self.embed = _p((V, D), dtype, ("vocab", "embed"))
        self.layers = Layers(cfg, dtype, cfg.num_hidden_layers if num_layers is None else num_layers)
        self.final_norm = _p((D,), jnp.float32, ("embed",))
        self.unembed = _p((V, D), dtype, ("vocab", "embed"))


class ParamSpec(NamedTuple):
    shape: tuple[int, ...]
    dtype: np.dtype
    axes: tuple[str | None, ...]


def declare(cfg: ModelConfig, dtype="bfloat16", num_layers: int | None = None,
            vocab_rows: int | None = None) -> GptOss:
    """The abstract model (ShapeDtypeStruct values; nothing allocated)."""
    return nnx.eval_shape(lambda: GptOss(cfg, jnp.dtype(dtype), num_layers, vocab_rows))


def param_specs(cfg: ModelConfig, dtype="bfloat16", num_layers: int | None = None,
                vocab_rows: int | None = None) -> dict:
    """Nested dict (same structure as the parameter pytree) of `ParamSpec(shape, dtype, logical axes)`."""
    out: dict = {}
    for path, var in nnx.iter_graph(declare(cfg, dtype, num_layers, vocab_rows)):
        if isinstance(var, nnx.Variable):
            value = var.get_value() if hasattr(var, "get_value") else var.value
            node = out
            for key in path[:-1]:
                node = node.setdefault(str(key), {})
            axes = tuple(var.get_metadata()["axes"])
            node[str(path[-1])] = ParamSpec(tuple(value.shape), np.dtype(value.dtype), axes)
    return out


def init_params(cfg: ModelConfig, key: jax.Array, dtype="float32", scale: float = 0.05) -> dict:
    """Random parameters following the declaration (for tests and benchmarks; not a trained model).

    Floats ~ N(0, scale²) (norm weights ~ 1 + N(0, scale²)); MXFP4 codes uniform with scale bytes in [118, 121].
    """
    specs = param_specs(cfg, dtype)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=lambda x: isinstance(x, ParamSpec))
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, ParamSpec))[0]]
    keys = jax.random.split(key, len(leaves))
    out = []
    for path, spec, k in zip(paths, leaves, keys):
        name = str(path[-1].key)
        if spec.dtype == np.uint8:
            hi = 256 if name.endswith("blocks") else 4
            v = jax.random.randint(k, spec.shape, 0, hi, jnp.int32) + (0 if name.endswith("blocks") else 118)
            out.append(v.astype(jnp.uint8))
        elif "norm" in name:
            out.append((1.0 + scale * jax.random.normal(k, spec.shape, jnp.float32)).astype(spec.dtype))
        else:
            out.append((scale * jax.random.normal(k, spec.shape, jnp.float32)).astype(spec.dtype))
    return jax.tree.unflatten(treedef, out)


# ---------------------------------------------------------------------------------------------------------------
# Pure functions
def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32 (spec §2.1): `x·rsqrt(mean(x²) + eps)·w`, cast back to x's dtype. x `[..., D]`, w `[D]`."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (w.astype(jnp.float32) * y).astype(x.dtype)


def qkv(h: jax.Array, p: dict, cos: jax.Array, sin: jax.Array):
    """Projections with biases, then RoPE on q and k. h `[T, D]` → q `[T, N, H]`, k, v `[T, K, H]` (post-RoPE k)."""
    q = jnp.einsum("td,nhd->tnh", h, p["wq"], preferred_element_type=jnp.float32) + p["bq"].astype(jnp.float32)
    k = jnp.einsum("td,khd->tkh", h, p["wk"], preferred_element_type=jnp.float32) + p["bk"].astype(jnp.float32)
    v = jnp.einsum("td,khd->tkh", h, p["wv"], preferred_element_type=jnp.float32) + p["bv"].astype(jnp.float32)
    q, k, v = (a.astype(h.dtype) for a in (q, k, v))
    return rope.apply_rope(q, cos, sin), rope.apply_rope(k, cos, sin), v


# attention core: (q [T, N, H], k [T, K, H], v [T, K, H], sinks [N] f32) -> [T, N, H] float32
AttendFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def layer(x: jax.Array, p: dict, cfg: ModelConfig, *, cos: jax.Array, sin: jax.Array, valid: jax.Array,
          attend: AttendFn, moe_tile: int = 128, moe_impl: str = "loop"):
    """One decoder block (spec §2 step 2) on local tokens.

    Args:
      x: `[T, D]` residual stream (activation dtype).  p: one layer's parameters (no `layers` axis).
      cos, sin: `[T, H/2]` RoPE tables at the tokens' global positions.  valid: bool `[T]`, False for padding.
      attend: the attention core (single-device blockwise, or context-parallel).
      moe_tile, moe_impl: the MoE grouped compute (`moe.moe`: "loop", "ragged" or "auto").
    Returns:
      `(x [T, D], k [T, K, H], v [T, K, H])` — the new residual stream and this layer's post-RoPE K and V.
    """
    with jax.named_scope("attention"):
        h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
        q, k, v = qkv(h, p, cos, sin)
        o = attend(q, k, v, p["sinks"]).astype(x.dtype)
        o = jnp.einsum("tnh,dnh->td", o, p["wo"], preferred_element_type=jnp.float32) + p["bo"].astype(jnp.float32)
        x = x + o.astype(x.dtype)
    with jax.named_scope("moe"):
        h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
        y = moe_lib.moe(h, valid, p, experts_per_token=cfg.experts_per_token, alpha=cfg.swiglu_alpha,
                        limit=cfg.swiglu_limit, tile=moe_tile, impl=moe_impl)
        x = x + y.astype(x.dtype)
    return x, k, v


def unembed(x: jax.Array, final_norm: jax.Array, table: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final norm and unembedding of hidden states `[..., D]` with a table `[V', D]` (all or a shard of the vocabulary)
    → float32 logits `[..., V']`."""
    h = rms_norm(x, final_norm, cfg.rms_norm_eps)
    return jnp.einsum("...d,vd->...v", h, table, preferred_element_type=jnp.float32)


def layer_windows(cfg: ModelConfig) -> np.ndarray:
    """int32 `[L]`: the window of each layer (cfg.sliding_window on sliding layers, NO_WINDOW on full layers)."""
    return np.asarray([cfg.sliding_window if cfg.is_sliding(i) else attn_lib.NO_WINDOW
                       for i in range(cfg.num_hidden_layers)], np.int32)


def forward(params: dict, cfg: ModelConfig, tokens: jax.Array, num_tokens: jax.Array, *,
            q_tile: int = 256, kv_tile: int = 256, moe_tile: int = 128, attention_impl: str = "xla",
            moe_impl: str = "loop"):
    """Single-device prefill of one sequence (the reference path every parallel layout is compared against).

    Args:
      params: the parameter pytree (`layers` stacked over all L layers).
      tokens: int32 `[T]` token ids, the first `num_tokens` real, the rest padding (any ids).
      num_tokens: int32 scalar, 1 ≤ num_tokens ≤ T.
      attention_impl: "xla" | "pallas" | "auto" (`attention.attend`); moe_impl: "loop" | "ragged" | "auto" (`moe.moe`).
    Returns:
      `(logits [V] float32 at position num_tokens−1, k [L, T, K, H], v [L, T, K, H])` with K/V post-RoPE in the
      activation dtype, natural token order (rows ≥ num_tokens are padding).
    """
    t = tokens.shape[0]
    positions = jnp.arange(t, dtype=jnp.int32)
    valid = positions < num_tokens
    x = params["embed"][tokens]
    cos, sin = rope.cos_sin(cfg, positions, x.dtype)

    def body(x, xs):
        p, window = xs

        def attend(q, k, v, sinks):
            # Pad keys sit at positions >= num_tokens, after every real query: causality hides them.
            return attn_lib.attention(q, k, v, positions, positions, sinks, window=window,
                                      q_tile=q_tile, kv_tile=kv_tile, impl=attention_impl)

        x, k, v = layer(x, p, cfg, cos=cos, sin=sin, valid=valid, attend=attend, moe_tile=moe_tile,
                        moe_impl=moe_impl)
        return x, (k, v)

    x, (ks, vs) = jax.lax.scan(body, x, (params["layers"], jnp.asarray(layer_windows(cfg))))
    x_last = jax.lax.dynamic_index_in_dim(x, num_tokens - 1, axis=0, keepdims=False)
    return unembed(x_last, params["final_norm"], params["unembed"], cfg), ks, vs
