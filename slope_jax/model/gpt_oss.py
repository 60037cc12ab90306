"""gpt-oss forward pass: Flax NNX parameter declarations + pure functions over the parameter pytree.

Notable:
- `GptOss` (an `nnx.Module`) declares every parameter once with its shape, dtype and logical axes; per-layer
  parameters are stacked `[L, …]` under `layers`. Shardings, random init and the checkpoint loader's shape checks
  are all derived from this declaration (`param_specs`). The compiled path never calls NNX: it runs the pure
  functions below on the plain dict `{"embed", "layers": {...}, "final_norm", "unembed"}` under `jax.jit`
  (NNX's own jit costs ~10× the dispatch time, docs/design.md §4).
- `layer` takes the attention core as an argument, so the single-device path (here) and the context-parallel path
  (`slope_jax.context_parallel`) share every other line of the block.
- Norms and sinks are float32 parameters; expert weights stay MXFP4-packed (uint8) or dense; the rest is the
  activation dtype. Logits are float32 and computed for the last real token only (never `[T, V]`).

Axis letters: T tokens, D hidden, N query heads, K KV heads, H head_dim, E experts, I expert intermediate, V vocab,
L layers.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from slope_jax.model import attention as attn_lib
from slope_jax.model import matmul
from slope_jax.model import moe as moe_lib
from slope_jax.model import options as options_lib
from slope_jax.model import rope, stack
from slope_jax.model.config import ModelConfig
from slope_jax.model.options import StepOptions


# ---------------------------------------------------------------------------------------------------------------
# Declarations
class Dim(NamedTuple):
    """One logical axis: its size and where the size comes from (the config field, for error messages)."""

    size: int
    source: str


def dims(cfg: ModelConfig, num_layers: int | None = None, vocab_rows: int | None = None) -> dict[str, Dim]:
    """Size of every logical axis a parameter may use. `num_layers` / `vocab_rows` override L and V for stacked
    pipeline layouts (padding entries, vocabulary rows rounded up to a multiple of the stages)."""
    D, I = cfg.hidden_size, cfg.intermediate_size
    return {
        "layers": Dim(cfg.num_hidden_layers if num_layers is None else num_layers, "num_hidden_layers"),
        "vocab": Dim(vocab_rows or cfg.vocab_size, "vocab_size"),
        "embed": Dim(D, "hidden_size"),
        "q_heads": Dim(cfg.num_attention_heads, "num_attention_heads"),
        "kv_heads": Dim(cfg.num_key_value_heads, "num_key_value_heads"),
        "head_dim": Dim(cfg.head_dim, "head_dim"),
        "experts": Dim(cfg.num_experts, "num_experts"),
        "router": Dim(cfg.num_experts, "num_experts"),  # the router's output axis: one logit per expert
        "mlp": Dim(I, "intermediate_size"),
        "mlp2": Dim(2 * I, "2*intermediate_size"),  # gate and up, interleaved (docs/model.md §2.3)
        "embed_blocks": Dim(D // 32, "hidden_size/32"),  # MXFP4 blocks of 32 values along an input axis
        "mlp_blocks": Dim(I // 32, "intermediate_size/32"),
        "block_bytes": Dim(16, "bytes"),  # 32 FP4 codes, two per byte
    }


class Init(NamedTuple):
    """How random parameters are drawn (declared with each parameter; used by `init_params` and the checkpoint
    writer's `random_params`). kind: "normal" (std = fan_in^-1/2 over the `fan_in` axes; 1 when empty), "bias",
    "norm" (1 + noise), "mxfp4_blocks" (uniform bytes), "mxfp4_scales" (exponent bytes near 127, weights ~0.1)."""

    kind: str
    fan_in: tuple[str, ...] = ()


NORMAL, BIAS, NORM = Init("normal"), Init("bias"), Init("norm")
BLOCKS, SCALES = Init("mxfp4_blocks"), Init("mxfp4_scales")


def fan_in(*axes: str) -> Init:
    return Init("normal", axes)


def _p(d: dict[str, Dim], axes: tuple[str, ...], dtype, init: Init) -> nnx.Param:
    """A parameter with logical `axes` (sizes from `dims`), its dtype and its random-init rule."""
    shape = tuple(d[a].size for a in axes)
    return nnx.Param(jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)), axes=tuple(axes), init=init)


class Layers(nnx.Module):
    """All decoder blocks, each parameter stacked over a leading `layers` axis of size L."""

    def __init__(self, cfg: ModelConfig, dtype, d: dict[str, Dim]):
        f32, u8 = jnp.float32, jnp.uint8
        self.attn_norm = _p(d, ("layers", "embed"), f32, NORM)
        self.wq = _p(d, ("layers", "q_heads", "head_dim", "embed"), dtype, fan_in("embed"))
        self.bq = _p(d, ("layers", "q_heads", "head_dim"), dtype, BIAS)
        self.wk = _p(d, ("layers", "kv_heads", "head_dim", "embed"), dtype, fan_in("embed"))
        self.bk = _p(d, ("layers", "kv_heads", "head_dim"), dtype, BIAS)
        self.wv = _p(d, ("layers", "kv_heads", "head_dim", "embed"), dtype, fan_in("embed"))
        self.bv = _p(d, ("layers", "kv_heads", "head_dim"), dtype, BIAS)
        self.wo = _p(d, ("layers", "embed", "q_heads", "head_dim"), dtype, fan_in("q_heads", "head_dim"))
        self.bo = _p(d, ("layers", "embed"), dtype, BIAS)
        self.sinks = _p(d, ("layers", "q_heads"), f32, NORMAL)
        self.mlp_norm = _p(d, ("layers", "embed"), f32, NORM)
        # the router's expert axis is "router" (replicated: every device routes its own tokens over all experts);
        # "experts" is the axis of the expert weights themselves (split over (ring, ulysses) under expert parallelism)
        self.router_w = _p(d, ("layers", "router", "embed"), dtype, fan_in("embed"))
        self.router_b = _p(d, ("layers", "router"), dtype, BIAS)
        if cfg.expert_format == "mxfp4":  # (out, in) orientation, packed along `in` (docs/model.md §3.1)
            self.w1_blocks = _p(d, ("layers", "experts", "mlp2", "embed_blocks", "block_bytes"), u8, BLOCKS)
            self.w1_scales = _p(d, ("layers", "experts", "mlp2", "embed_blocks"), u8, SCALES)
            self.w2_blocks = _p(d, ("layers", "experts", "embed", "mlp_blocks", "block_bytes"), u8, BLOCKS)
            self.w2_scales = _p(d, ("layers", "experts", "embed", "mlp_blocks"), u8, SCALES)
        else:
            self.w1 = _p(d, ("layers", "experts", "mlp2", "embed"), dtype, fan_in("embed"))
            self.w2 = _p(d, ("layers", "experts", "embed", "mlp"), dtype, fan_in("mlp"))
        self.b1 = _p(d, ("layers", "experts", "mlp2"), dtype, BIAS)
        self.b2 = _p(d, ("layers", "experts", "embed"), dtype, BIAS)


class GptOss(nnx.Module):
    """Parameter declaration of the whole model — the one place a parameter's name, shape (as logical axes), dtype
    and init rule are written. Build it abstractly with `declare`; never materialise it.

    Derived from it: `param_specs` (shapes for the loader's checks, the engine's placement, orbax restore targets),
    `init_params` and the writer's `random_params`, the PartitionSpecs (`parallel.pipeline.param_partition_specs`,
    logical axis → mesh axis rules), and the checkpoint key tables (`checkpoints.names`, which map each declared
    parameter to its checkpoint tensor).

    `num_layers` (default L) is the number of stacked layer slots; `vocab_rows` (default V) the rows of the embedding
    and unembedding tables, padded with zero rows when the vocabulary is sharded over pipeline stages.
    """

    def __init__(self, cfg: ModelConfig, dtype, num_layers: int | None = None, vocab_rows: int | None = None):
        d = dims(cfg, num_layers, vocab_rows)
        self.layers = Layers(cfg, dtype, d)
        self.embed = _p(d, ("vocab", "embed"), dtype, NORMAL)
        self.final_norm = _p(d, ("embed",), jnp.float32, NORM)
        self.unembed = _p(d, ("vocab", "embed"), dtype, fan_in("embed"))


class ParamSpec(NamedTuple):
    shape: tuple[int, ...]
    dtype: np.dtype
    axes: tuple[str | None, ...]
    init: Init = NORMAL


def declare(cfg: ModelConfig, dtype="bfloat16", num_layers: int | None = None,
            vocab_rows: int | None = None) -> GptOss:
    """The abstract model: every parameter holds a `jax.ShapeDtypeStruct` (nothing is allocated, as under
    `nnx.eval_shape`, but attribute order stays the declaration order)."""
    return GptOss(cfg, jnp.dtype(dtype), num_layers, vocab_rows)


def _walk(node, out: dict) -> None:
    """Declaration order (attribute assignment order), nested modules as nested dicts."""
    for name, value in vars(node).items():
        if isinstance(value, nnx.Variable):
            v = value.get_value() if hasattr(value, "get_value") else value.value
            meta = value.get_metadata()
            out[name] = ParamSpec(tuple(v.shape), np.dtype(v.dtype), tuple(meta["axes"]), meta["init"])
        elif isinstance(value, nnx.Module):
            _walk(value, out.setdefault(name, {}))


def param_specs(cfg: ModelConfig, dtype="bfloat16", num_layers: int | None = None,
                vocab_rows: int | None = None) -> dict:
    """Nested dict (same structure as the parameter pytree, in declaration order) of
    `ParamSpec(shape, dtype, logical axes, init)`."""
    out: dict = {}
    _walk(declare(cfg, dtype, num_layers, vocab_rows), out)
    return out


def init_params(cfg: ModelConfig, key: jax.Array, dtype="float32", scale: float = 0.05) -> dict:
    """Random parameters following the declaration (for tests and benchmarks; not a trained model).

    Floats ~ N(0, scale²) ("norm" weights ~ 1 + N(0, scale²)); MXFP4 codes uniform with scale bytes in [118, 121].
    One key per parameter, in sorted-path order.
    """
    specs = param_specs(cfg, dtype)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=lambda x: isinstance(x, ParamSpec))
    keys = jax.random.split(key, len(leaves))
    out = []
    for spec, k in zip(leaves, keys):
        if spec.init.kind == "mxfp4_blocks":
            out.append(jax.random.randint(k, spec.shape, 0, 256, jnp.int32).astype(jnp.uint8))
        elif spec.init.kind == "mxfp4_scales":
            out.append((jax.random.randint(k, spec.shape, 0, 4, jnp.int32) + 118).astype(jnp.uint8))
        elif spec.init.kind == "norm":
            out.append((1.0 + scale * jax.random.normal(k, spec.shape, jnp.float32)).astype(spec.dtype))
        else:
            out.append((scale * jax.random.normal(k, spec.shape, jnp.float32)).astype(spec.dtype))
    return jax.tree.unflatten(treedef, out)


# ---------------------------------------------------------------------------------------------------------------
# Pure functions
# The step's blocks that repeat on the same shapes (the sliding and the full layer of the layer scan's body, the two
# norms of a layer) are jitted functions: each is traced and lowered once per program and XLA inlines the calls again
# (the compiled program is the same). A compilation-cache hit still pays the step's tracing and lowering.
@functools.partial(jax.jit, static_argnames=("eps",))
def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32 (docs/model.md §2.1): `x·rsqrt(mean(x²) + eps)·w` in x's dtype. x `[..., D]`, w `[D]`."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (w.astype(jnp.float32) * y).astype(x.dtype)


def project(x: jax.Array, w: jax.Array, b: jax.Array | None = None, upcast: bool = False) -> jax.Array:
    """A linear layer `x·Wᵀ (+ b)` (docs/model.md §2.3, §3.1) as one 2-D matmul, float32 accumulation.

    x `[T, I…]` (activation dtype); w `[O…, I…]`: out axes, then x's trailing axes (the checkpoint's (out, in)
    orientation); b `[O…]` or None → float32 `[T, O…]`. A w whose trailing axes do not hold x's `I…` elements raises
    TypeError (the reshape). upcast: bf16 x and w widened to float32 for the matmul (`StepOptions.upcast_matmul`,
    `model.matmul`; the same products and float32 sums).

    The weight is flattened to `[O, I]` (a free reshape) and contracted on its last axis: XLA:CPU hands such a dot to
    its GEMM library as stored, where an einsum over several out or in axes is first rewritten to a canonical
    `[in, out]` operand — a transposed copy of the weight on every layer of every step (`wq`: `[N, H, D]` → `[D, N·H]`,
    `wo`: `[D, N, H]` → `[H·N, D]`, 4 ms per layer at 600 tokens for the peer config on 2 CPU cores; without them
    its bf16 forward took 0.95–0.98× the time at 608 tokens).
    """
    out_axes = w.shape[:w.ndim - (x.ndim - 1)]
    n_in = math.prod(x.shape[1:])
    y = jnp.einsum("ti,oi->to", matmul.widen(x.reshape(x.shape[0], n_in), upcast),
                   matmul.widen(w.reshape(-1, n_in), upcast), preferred_element_type=jnp.float32)
    if b is not None:
        y = y + b.reshape(-1).astype(jnp.float32)
    return y.reshape(x.shape[0], *out_axes)


@functools.partial(jax.jit, static_argnames=("upcast",))
def qkv(h: jax.Array, p: dict, cos: jax.Array, sin: jax.Array, upcast: bool = False):
    """Projections with biases, then RoPE on q and k. h `[T, D]` → q `[T, N, H]`, k, v `[T, K, H]` (post-RoPE k);
    upcast as in `project`.

    The three projections are one matmul against the weights stacked on their out axis (`[N·H + 2·K·H, D]`, as the
    original checkpoint stores `attn.qkv`), its float32 output split after the biases. Three matmuls, two of them
    only K·H wide, took 358 ms of the peer config's 8192-token bf16 step on a 2-core CPU, the stacked one 144 ms; the
    logits and K/V of that step are bit-identical to three matmuls' (each output is the same dot over D). The stacked
    weight is a copy per layer and step (3.5 MB for the peer config, 30 MB for gpt-oss-120b).
    """
    d = h.shape[-1]
    ws = [p[name].reshape(-1, d) for name in ("wq", "wk", "wv")]
    y = project(h, jnp.concatenate(ws), jnp.concatenate([p[name].reshape(-1) for name in ("bq", "bk", "bv")]),
                upcast).astype(h.dtype)
    q, k, v = jnp.split(y, np.cumsum([w.shape[0] for w in ws[:-1]]), axis=1)
    q, k, v = (x.reshape(h.shape[0], *p[name].shape[:-1]) for x, name in zip((q, k, v), ("wq", "wk", "wv")))
    return rope.apply_rope(q, cos, sin), rope.apply_rope(k, cos, sin), v


# attention core: (q [T, N, H], k [T, K, H], v [T, K, H], sinks [N] f32) -> [T, N, H] float32
AttendFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]
# MoE block: (h [T, D] normed, valid bool [T], layer params) -> [T, D] float32
MoeFn = Callable[[jax.Array, jax.Array, dict], jax.Array]


def local_moe(cfg: ModelConfig, options: StepOptions) -> MoeFn:
    """The MoE block with every expert on this device (`moe.moe` with `options`' tile and concrete impl).

    One traced call (`_moe_call`): the sliding and the full layer of the layer scan's body run the same MoE on the
    same shapes, so it is traced and lowered once per program (XLA inlines the call again).
    """
    options.require_resolved()

    def fn(h, valid, p):
        return _moe_call(h, valid, p, experts_per_token=cfg.experts_per_token, alpha=cfg.swiglu_alpha,
                         limit=cfg.swiglu_limit, tile=options.moe_tile, impl=options.moe_impl,
                         upcast=options.upcast_matmul)

    return fn


_moe_call = jax.jit(moe_lib.moe, static_argnames=("experts_per_token", "alpha", "limit", "tile", "impl", "upcast"))


def layer(x: jax.Array, p: dict, cfg: ModelConfig, *, cos: jax.Array, sin: jax.Array, valid: jax.Array,
          attend: AttendFn, moe_fn: MoeFn | None = None, upcast: bool = False):
    """One decoder block (docs/model.md §2 step 2) on local tokens.

    Args:
      x: `[T, D]` residual stream (activation dtype).  p: one layer's parameters (no `layers` axis).
      cos, sin: `[T, H/2]` RoPE tables at the tokens' global positions.  valid: bool `[T]`, False for padding.
      attend: the attention core (single-device blockwise, or context-parallel).
      moe_fn: the MoE block (default `local_moe` with the default options resolved for JAX's backend; the engine
        passes `local_moe(cfg, options)` or expert parallelism's own).
      upcast: the projections' bf16 operands widened to float32 (`StepOptions.upcast_matmul`; `project`).
    Returns:
      `(x [T, D], k [T, K, H], v [T, K, H])` — the new residual stream and this layer's post-RoPE K and V.
    """
    with jax.named_scope("attention"):
        h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
        q, k, v = qkv(h, p, cos, sin, upcast)
        o = attend(q, k, v, p["sinks"]).astype(x.dtype)
        o = project(o, p["wo"], p["bo"], upcast)
        x = x + o.astype(x.dtype)
    with jax.named_scope("moe"):
        h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
        y = (moe_fn or local_moe(cfg, StepOptions().resolve()))(h, valid, p)
        x = x + y.astype(x.dtype)
    return x, k, v


def unembed(x: jax.Array, final_norm: jax.Array, table: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final norm and unembedding of hidden states `[..., D]` with a table `[V', D]` (all or a shard of the vocabulary)
    → float32 logits `[..., V']`."""
    h = rms_norm(x, final_norm, cfg.rms_norm_eps)
    lead = h.shape[:-1]
    rows = h.reshape(-1, h.shape[-1])
    n = rows.shape[0]
    if n < options_lib.UNEMBED_MIN_ROWS:  # a matrix-vector product: XLA:CPU would upcast the whole table per call
        rows = jnp.pad(rows, ((0, options_lib.UNEMBED_MIN_ROWS - n), (0, 0)))
    logits = jnp.einsum("rd,vd->rv", rows, table, preferred_element_type=jnp.float32)
    return logits[:n].reshape(*lead, table.shape[0])




def take_layer(layers: dict, i: jax.Array, *, experts_stacked: bool = False) -> dict:
    """One layer's parameters from the stacked `[L, …]` pytree at a (traced) index `i` (`stack.take`: bf16 through
    its uint16 bits).

    experts_stacked (`options.experts_read_from_stack(moe_impl)`): leave the expert weights (`stack.EXPERT_WEIGHTS`)
    as the whole stack and record `i` under `stack.LAYER_INDEX`; the "loop" MoE then slices `[i, e]` per expert
    (`moe.expert_weights`) instead of copying the layer's experts first (`slope_jax/model/stack.py`).
    """
    keep = stack.EXPERT_WEIGHTS if experts_stacked else ()
    p = dict(_take_all({k: v for k, v in layers.items() if k not in keep}, i))
    if experts_stacked:
        p |= {k: v for k, v in layers.items() if k in keep}
        p[stack.LAYER_INDEX] = i
    return p


@jax.jit
def _take_all(tree, i):
    """Every leaf of `tree` at index `i` of its leading axis (`stack.take`), as one traced call (see `rms_norm`)."""
    return jax.tree.map(lambda a: stack.take(a, i), tree)


def layer_windows(cfg: ModelConfig) -> np.ndarray:
    """int32 `[L]`: the window of each layer (cfg.sliding_window on sliding layers, NO_WINDOW on full layers)."""
    return np.asarray([cfg.sliding_window if cfg.is_sliding(i) else attn_lib.NO_WINDOW
                       for i in range(cfg.num_hidden_layers)], np.int32)


def _prefix_state(q, k_bits, v_bits, dtype, q_pos, prefix, window, windows: tuple[int, ...], options: StepOptions):
    """The new tokens' state over a prefix's cached keys (`CachedPrefix`; this layer's k, v `[S, K, H]`, bf16 as
    uint16 bits); `window` traced, one of `windows`, each kind of layer under its own `lax.switch` branch.

    A sliding layer sees at most the W − 1 cached keys before `prefix.offset` (rows in natural order): it slices the
    last `window_rows` rows of the prefix before anything else, so that it neither widens nor relays out the whole
    cache (a 64-token hit over 16384 cached keys of the peer config spent 48 ms of 225 in those copies). A full
    layer runs the whole cache in tiles of `options.prefix_kv_tile_for` (widened for few queries), as
    `context_parallel.prefix_attention` and the planner (`plan.flops.cached_prefix_attention`) tile them."""
    full_tile = options.prefix_kv_tile_for(q.shape[0])

    def state(w):
        kb, vb, kp = k_bits, v_bits, prefix.positions
        sliding = isinstance(w, int) and w < attn_lib.NO_WINDOW
        rows = window_rows(w, options.kv_tile) if sliding else kb.shape[0]
        if rows < kb.shape[0]:
            start = jnp.clip(prefix.offset - rows, 0, kb.shape[0] - rows)
            kb, vb, kp = (jax.lax.dynamic_slice_in_dim(a, start, rows) for a in (kb, vb, kp))
        return attn_lib.attend(q, stack.unbits(kb, dtype), stack.unbits(vb, dtype), q_pos, kp, window=w,
                               q_tile=options.prefix_q_tile, kv_tile=options.kv_tile if sliding else full_tile,
                               impl=options.attention_impl, upcast=options.upcast_matmul)

    return attn_lib.switch_window(window, windows, state)


def window_rows(window: int, kv_tile: int) -> int:
    """Cached rows a sliding layer of `window` reads after a prefix (`_prefix_state`): the W − 1 keys before the
    first new token, rounded up to whole key tiles of `kv_tile`."""
    return -(-(window - 1) // kv_tile) * kv_tile


class CachedPrefix(NamedTuple):
    """KV of a prompt's first `offset` tokens, computed earlier (prefix reuse): keys the new tokens attend to.

    offset: int32 scalar, the number of reused tokens (the new tokens sit at positions offset, offset+1, …);
    k, v: `[L, S, K, H]` post-RoPE per layer (S ≥ offset rows, in natural order: row i holds position i, as
    `serve.reuse.prefix_arrays` lays them out on one device; sliding layers slice the rows before `offset` by
    index), in the activation dtype or, for bfloat16, as its uint16 bits (`stack.bits`: how the engine hands them
    over, so that nothing widens the cache);
    positions: int32 `[S]` (INVALID_POS = no key: capacity padding, or rows a sliding layer does not need).
    """

    offset: jax.Array
    k: jax.Array
    v: jax.Array
    positions: jax.Array


def forward(params: dict, cfg: ModelConfig, tokens: jax.Array, num_tokens: jax.Array,
            options: StepOptions = StepOptions(), prefix: CachedPrefix | None = None):
    """Single-device prefill of one sequence (the reference path every parallel layout is compared against).

    Args:
      params: the parameter pytree (`layers` stacked over all L layers).
      tokens: int32 `[T]` token ids, the first `num_tokens` real, the rest padding (any ids).
      num_tokens: int32 scalar, 1 ≤ num_tokens ≤ T.
      options: tiles and implementations (`options.StepOptions`; "auto" is resolved here for JAX's default backend,
        as the engine resolves it for its devices).
      prefix: None (a whole prompt), or the cached KV of the prompt's first `prefix.offset` tokens: then `tokens` are
        the prompt's tokens from that offset on, at positions offset + i, and every layer's queries also attend to
        the cached keys (one online-softmax state over both key sets; the sink enters once).
    Returns:
      `(logits [V] float32 at position num_tokens−1 of `tokens`, k [L, T, K, H], v [L, T, K, H])` with K/V
      post-RoPE in the activation dtype, natural token order (rows ≥ num_tokens are padding).
    """
    options = options.resolve()
    t = tokens.shape[0]
    positions = jnp.arange(t, dtype=jnp.int32)
    valid = positions < num_tokens
    if prefix is not None:
        positions = positions + prefix.offset
    x = stack.gather_rows(params["embed"], tokens)
    cos, sin = rope.cos_sin(cfg, positions, x.dtype)
    # the self-attention of the new tokens: consecutive positions (the fused cuDNN core may take it), layer windows
    tiles = dict(q_tile=options.q_tile, kv_tile=options.kv_tile, impl=options.attention_impl, contiguous=True,
                 windows=tuple(sorted({int(w) for w in layer_windows(cfg)})), upcast=options.upcast_matmul)

    def body(x, xs):
        i, window = xs[0], xs[1]
        p = take_layer(params["layers"], i, experts_stacked=options_lib.experts_read_from_stack(options.moe_impl))

        def attend(q, k, v, sinks):
            # Pad keys sit at positions >= num_tokens, after every real query: causality hides them.
            if prefix is None:
                return attn_lib.attention(q, k, v, positions, positions, sinks, window=window, **tiles)
            st = _prefix_state(q, xs[2], xs[3], x.dtype, positions, prefix, window, tiles["windows"], options)
            st = attn_lib.attend(q, k, v, positions, positions, window=window, state=st, **tiles)
            return attn_lib.finalize(st, sinks)

        x, k, v = layer(x, p, cfg, cos=cos, sin=sin, valid=valid, attend=attend, moe_fn=local_moe(cfg, options),
                        upcast=options.upcast_matmul)
        return x, (stack.bits(k), stack.bits(v))  # stacked as bits: a bf16 update would widen the whole stack

    xs = (jnp.arange(cfg.num_hidden_layers), jnp.asarray(layer_windows(cfg)))
    if prefix is not None:  # sliced per layer as bits: a bf16 slice would widen the whole cache (`stack` docstring)
        xs = xs + (stack.bits(prefix.k), stack.bits(prefix.v))
    x, (ks, vs) = jax.lax.scan(body, x, xs)
    ks, vs = stack.unbits(ks, x.dtype), stack.unbits(vs, x.dtype)
    x_last = jax.lax.dynamic_index_in_dim(x, num_tokens - 1, axis=0, keepdims=False)
    return unembed(x_last, params["final_norm"], params["unembed"], cfg), ks, vs
