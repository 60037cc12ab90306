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
    """`a[index]` for an int32 scalar or a tuple of them (leading axes), bf16 through its uint16 bits (module
    docstring). Same dtype as `a`; raises what `a[index]` raises."""
    if a.dtype == jnp.bfloat16:
        return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(a, jnp.uint16)[index], jnp.bfloat16)
    return a[index]


def expert_index(p: dict, e: jax.Array):
    """The index of expert `e`'s weights in `p[name]` for a name in EXPERT_WEIGHTS: `e`, or `(layer, e)` when the
    layer's parameters left them stacked (`LAYER_INDEX`)."""
    return (p[LAYER_INDEX], e) if LAYER_INDEX in p else e
