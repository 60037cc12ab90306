"""Dynamic indexing of stacked parameters (`[L, …]` layer stacks, `[E, …]` expert stacks) inside the step.

`take` is the one way the step slices a stack at a traced index. bfloat16 leaves are sliced as their uint16 bits
and bitcast back (free): XLA:CPU (jaxlib 0.10.2) runs a dynamic slice of bf16 through float32, and its loop-invariant
code motion then hoists the convert of the *whole* stacked array out of the enclosing loop — every weight of the
model re-written as float32 (2× its size) on each step (`wrapped_convert` of `f32[L, E, 2I, D]` in the optimized HLO
of the peer config's step).

The expert weights of the layer loop (`EXPERT_WEIGHTS`) are the bulk of a layer's bytes (peer config: 127 MB of
131 MB in bf16). Slicing a layer out of the stack and then an expert out of the layer copies all of them once per
layer (XLA materialises the layer's slice: its consumer runs inside the expert loop); `gpt_oss.take_layer(…,
experts_stacked=True)` instead leaves them stacked and records the layer (`LAYER_INDEX`), and `moe.expert_weights`
slices `[layer, expert]` at once — the one copy of an expert's weights the expert loop makes anyway.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

EXPERT_WEIGHTS = ("w1", "w2", "w1_blocks", "w1_scales", "w2_blocks", "w2_scales")
LAYER_INDEX = "layer_index"  # key of a layer's parameters whose EXPERT_WEIGHTS are still the whole `[n, E, …]` stack


def take(a: jax.Array, index) -> jax.Array:
    """`a[index]` for an int32 scalar or a tuple of them (leading axes), each in `[0, size)`: one `dynamic_slice`
    and a reshape, bf16 through its uint16 bits (module docstring). Same dtype as `a`.

    Indices are not wrapped (no negative indexing) and, as in any dynamic slice, an out-of-range index is clamped:
    callers index with loop counters and expert ids. `a[index]` would trace ~6 equations per axis (wrap the index,
    then normalise each constant zero of the other axes) — with a stack sliced per layer leaf and per expert, that
    was a fifth of the step's jaxpr equations, traced and lowered again on every compilation-cache hit.
    """
    idx = tuple(index) if isinstance(index, (tuple, list)) else (index,)
    n = len(idx)
    bf16 = a.dtype == jnp.bfloat16
    x = jax.lax.bitcast_convert_type(a, jnp.uint16) if bf16 else a
    starts = idx + (0,) * (a.ndim - n)
    x = jax.lax.dynamic_slice(x, starts, (1,) * n + a.shape[n:], allow_negative_indices=False)
    x = x.reshape(a.shape[n:])
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if bf16 else x


def expert_index(p: dict, e: jax.Array):
    """The index of expert `e`'s weights in `p[name]` for a name in EXPERT_WEIGHTS: `e`, or `(layer, e)` when the
    layer's parameters left them stacked (`LAYER_INDEX`)."""
    return (p[LAYER_INDEX], e) if LAYER_INDEX in p else e
