"""Dynamic indexing of stacks inside the step: parameters (`[L, …]` layer stacks, `[E, …]` expert stacks), the
embedding table, cached prefixes and the K/V a loop stacks up.

One rule: a bf16 array that a loop slices, updates or gathers from is held as its uint16 bits (`bits`, `unbits`;
`take` and `gather_rows` do it per call). XLA:CPU (jaxlib 0.10.2) runs a dynamic slice, dynamic update or gather of
bf16 through float32, and its loop-invariant code motion then hoists the convert of the *whole* array out of the
enclosing loop — every weight of the model re-written as float32 (2× its size) on each step (`wrapped_convert` of
`f32[L, E, 2I, D]` in the optimized HLO of the peer config's step); a dynamic update inside a loop (`lax.scan`'s
stacked outputs, a loop-carried buffer) converts the whole buffer there and back on every iteration. Where the
array comes from the host (a cached prefix), it is handed over as bits already: on the device a bitcast of a whole
input is a copy. `plan.hlo.widened_copies` finds a float32 copy of any bf16 input or output in a compiled step
(`tests/test_bf16_stacks.py` runs it over the step kinds).

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
    x = bits(a)
    starts = idx + (0,) * (a.ndim - n)
    x = jax.lax.dynamic_slice(x, starts, (1,) * n + a.shape[n:], allow_negative_indices=False)
    return unbits(x.reshape(a.shape[n:]), a.dtype)


def bits(a: jax.Array) -> jax.Array:
    """A bf16 array as its uint16 bits (a free bitcast), any other array unchanged: what a loop (`lax.scan`'s or
    `lax.map`'s `xs`, a `fori_loop` body) should slice instead of bf16 (module docstring). `unbits` undoes it."""
    return jax.lax.bitcast_convert_type(a, jnp.uint16) if a.dtype == jnp.bfloat16 else a


def unbits(x: jax.Array, dtype) -> jax.Array:
    """`x` back in `dtype` after `bits` (uint16 bits → bf16 when `dtype` is bf16; anything else unchanged)."""
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if dtype == jnp.bfloat16 and x.dtype == jnp.uint16 else x


def expert_index(p: dict, e: jax.Array):
    """The index of expert `e`'s weights in `p[name]` for a name in EXPERT_WEIGHTS: `e`, or `(layer, e)` when the
    layer's parameters left them stacked (`LAYER_INDEX`)."""
    return (p[LAYER_INDEX], e) if LAYER_INDEX in p else e


# `a[idx]` as one lax op: numpy-style indexing traces index normalisation around it (~6 equations), once per call
# site and step program — what a compilation-cache hit still pays.
_ROWS = jax.lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,))


def gather_rows(a: jax.Array, idx: jax.Array) -> jax.Array:
    """`a[idx]` for `a [T, D]`, `idx [R]` int32 (an index past the end reads the last row: clamped) → `[R, D]`.

    bf16 rows are gathered as their uint16 bits (module docstring): XLA:CPU gathers bf16 through float32, and inside
    a loop it hoists the convert of the whole `a` — in the expert loop that re-converted the tokens once per expert
    (T·D·6 bytes each; one MoE layer of the peer config ran 0.90–0.95× the time without it at 608–8192 tokens), in
    the map over a step's prompts the whole embedding table (V·D·4 bytes written per step).
    """
    rows = jax.lax.gather(bits(a), idx[:, None], _ROWS, (1, a.shape[1]), mode=jax.lax.GatherScatterMode.CLIP)
    return unbits(rows, a.dtype)
