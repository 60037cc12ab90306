"""Mixture of experts: top-k router, interleaved clamped SwiGLU experts, dropless grouped compute (docs/model.md §2.4).

Notable:
- Router: top-k of the logits first, then softmax over those k (docs/model.md §2.4, §5 pitfall 3); float32. Exact ties
  go to the lower expert index (`jax.lax.top_k`'s documented order); every slope_jax path (prefill, expert
  parallelism, the reference decoder) routes through `route`, and the transformers decode engine is patched to the
  same rule (`kv.transformers.lowest_index_ties`: `torch.topk`'s tie order is unspecified).
- SwiGLU: gate/up interleaved (`gu[0::2]`, `gu[1::2]`), gate clamped above only, up clamped both sides,
  `gate·σ(α·gate)·(up + 1)`; the down-projection bias comes before the routing weight (docs/model.md §5 pitfalls 4-7).
- Grouped compute: the T·k (token, expert) assignments are sorted by expert; each expert that was picked dequantizes
  its weights once and runs its rows in tiles of `tile` tokens, then its last rows in 4× and 16× shorter tiles
  (`options.moe_loop_tiles`: 512, 128, 32 rows at the default tile; a dynamic number of tiles of each height, a
  taller tile padded rather than several shorter ones when it pads fewer rows than the next height,
  `options.moe_loop_rows`). Work is O(T·k + E·128), never O(T·E) — no dense compute over all experts, and no token
  is dropped.
- Three interchangeable grouped computes (`impl`): "loop" is the tile loop above (the default everywhere: no dense
  work, and the fastest measured on an H200, where `tile=4096` suits long prompts);
  "ragged" runs the same sorted assignments through `jax.lax.ragged_dot` (one grouped matmul per projection over all
  experts, the layer's experts dequantized at once: transient `E·3·I·D` elements of the activation dtype). XLA
  lowers it to masked dense work over all experts (~E/k× the FLOPs) on the CPU and, measured, on an H200 too
  (jax 0.11.2). "pallas" pads each expert's group to whole tiles of `tile` rows (at most `tile − 1` pad rows per
  expert, as vLLM's `moe_align_block_size`) and runs all tiles through one grouped-matmul kernel per projection
  (`kernels.grouped_moe`) that dequantizes MXFP4 weight tiles inside the kernel (measured slower than the loop on an
  H200: `options.resolve_moe`).
- Tokens marked invalid (padding) are routed to no expert (weight 0, an out-of-range id that `experts` skips): pads
  do no expert work, and the grouping of the real tokens does not depend on pad values.
- `moe` = `route_valid` + `experts`; expert parallelism (`slope_jax.parallel.expert_parallel`) puts its dispatch and
  combine between the two and runs `experts` on a device's slice of the experts.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from slope_jax.model import matmul
from slope_jax.model import mxfp4
from slope_jax.model import options as options_lib
from slope_jax.model import stack


def route(h: jax.Array, w: jax.Array, b: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Router: `logits = h·Wᵀ + b`, top-k, softmax over the k (docs/model.md §2.4).

    Args:
      h: `[T, D]` normed hidden states.  w: `[E, D]`.  b: `[E]`.  k: experts per token.
    Returns:
      `(weights [T, k] float32 summing to 1 per token, expert ids [T, k] int32 in descending logit order; among
      equal logits the lower expert index first and only the lower ones kept — the tie rule decode engines must
      share, see `kv.transformers.lowest_index_ties`)`.
    """
    logits = jnp.einsum("td,ed->te", h, w, preferred_element_type=jnp.float32) + b.astype(jnp.float32)
    top, ids = jax.lax.top_k(logits, k)
    return jax.nn.softmax(top, axis=-1), ids.astype(jnp.int32)


def swiglu(gate_up: jax.Array, *, alpha: float, limit: float) -> jax.Array:
    """gpt-oss activation on interleaved `gate_up[..., 2I]` → `[..., I]` (docs/model.md §2.4 step 3).

    `gate = min(gu[0::2], limit)`, `up = clip(gu[1::2], −limit, limit)`, `out = gate·σ(α·gate)·(up + 1)`.
    """
    gate = jnp.minimum(gate_up[..., 0::2], limit)
    up = jnp.minimum(jnp.maximum(gate_up[..., 1::2], -limit), limit)  # clip, spelled without jnp.clip's nested jit
    return gate * jax.nn.sigmoid(gate * alpha) * (up + 1.0)


def gate_up_halves(x: jax.Array) -> jax.Array:
    """Rows of an interleaved `[2I, …]` gate/up weight or bias (gate at even rows, up at odd, as the checkpoint
    stores them) reordered to `[gate rows; up rows]`: a matmul against it gives `[..., gate I | up I]`, the layout
    `swiglu_halves` takes. Each output is the same dot as before, in another column."""
    return x.reshape(x.shape[0] // 2, 2, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)


def swiglu_halves(gate_up: jax.Array, *, alpha: float, limit: float) -> jax.Array:
    """`swiglu` on `[..., gate I | up I]` (`gate_up_halves`' layout), the same operations on every element: two
    contiguous halves instead of strided even/odd columns (the peer config's 8192-token bf16 step on 2 CPU cores:
    195–218 ms in `swiglu`, 118–135 ms here)."""
    i = gate_up.shape[-1] // 2
    gate = jnp.minimum(gate_up[..., :i], limit)
    up = jnp.minimum(jnp.maximum(gate_up[..., i:], -limit), limit)
    return gate * jax.nn.sigmoid(gate * alpha) * (up + 1.0)


def expert_weights(p: dict, e: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Expert `e`'s `(W1 [2I, D], W2 [D, I])` in (out, in) orientation, dequantized from MXFP4 when packed; sliced
    straight from the layer stack when `p` left the expert weights stacked (`stack.LAYER_INDEX`)."""
    idx = stack.expert_index(p, e)
    if "w1_blocks" in p:
        w1 = mxfp4.decode(stack.take(p["w1_blocks"], idx), stack.take(p["w1_scales"], idx), dtype)
        w2 = mxfp4.decode(stack.take(p["w2_blocks"], idx), stack.take(p["w2_scales"], idx), dtype)
    else:
        w1, w2 = stack.take(p["w1"], idx).astype(dtype), stack.take(p["w2"], idx).astype(dtype)
    return w1, w2


MOE_IMPLS = options_lib.MOE_IMPLS


def resolve_impl(impl: str, platform: str | None = None) -> str:
    """`moe_impl` → the concrete grouped compute (`options.resolve_moe`: "auto" is "loop" everywhere, the fastest
    measured on an H200 and the CPU; platform default: JAX's default backend). Raises ValueError naming the field
    for an unknown value."""
    return options_lib.resolve_moe(impl, platform or jax.default_backend())


def all_expert_weights(p: dict, dtype) -> tuple[jax.Array, jax.Array]:
    """Every expert's `(W1 [E, 2I, D], W2 [E, D, I])`, dequantized from MXFP4 when packed."""
    if "w1_blocks" in p:
        return (mxfp4.decode(p["w1_blocks"], p["w1_scales"], dtype),
                mxfp4.decode(p["w2_blocks"], p["w2_scales"], dtype))
    return p["w1"].astype(dtype), p["w2"].astype(dtype)


def grouped_ragged(x: jax.Array, group_sizes: jax.Array, expert: jax.Array, p: dict, *, alpha: float,
                   limit: float) -> jax.Array:
    """Expert MLPs of rows sorted by expert, with `jax.lax.ragged_dot`.

    Args:
      x: `[M, D]` rows grouped by expert (expert 0's rows first); group_sizes: int32 `[E]` rows per expert (sum M);
      expert: int32 `[M]` the expert of each row (for the biases).
    Returns:
      `[M, D]` float32 `W2 a(W1 x + b1) + b2` per row, with its own expert's weights.
    """
    w1, w2 = all_expert_weights(p, x.dtype)
    dn = jax.lax.RaggedDotDimensionNumbers(  # contract x's D with W1's last axis (weights stay (out, in))
        dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    gu = jax.lax.ragged_dot_general(x, w1, group_sizes, dn, preferred_element_type=jnp.float32)
    gu = gu + p["b1"].astype(jnp.float32)[expert]
    act = swiglu(gu, alpha=alpha, limit=limit).astype(x.dtype)
    y = jax.lax.ragged_dot_general(act, w2, group_sizes, dn, preferred_element_type=jnp.float32)
    return y + p["b2"].astype(jnp.float32)[expert]


def moe(h: jax.Array, valid: jax.Array, p: dict, *, experts_per_token: int, alpha: float, limit: float,
        tile: int = 512, impl: str = "loop", upcast: bool = False) -> jax.Array:
    """Exact dropless MoE block on local tokens (all experts on this device).

    Args:
      h: `[T, D]` normed hidden states (activation dtype).
      valid: bool `[T]`, False for pad tokens (their output is zero: they are routed to no expert).
      p: one layer's MoE parameters: `router_w [E, D]`, `router_b [E]`, `b1 [E, 2I]`, `b2 [E, D]` and either
        `w1_blocks [E, 2I, D/32, 16]`, `w1_scales [E, 2I, D/32]`, `w2_blocks [E, D, I/32, 16]`, `w2_scales [E, D, I/32]`
        (MXFP4) or `w1 [E, 2I, D]`, `w2 [E, D, I]`.
      tile: rows per expert matmul (`StepOptions.moe_tile`; loop: the first height of its ladder,
        `options.moe_loop_tiles`; pallas: capped at `options.MOE_KERNEL_MAX_TILE`).
      impl: "loop", "ragged" or "pallas" ("auto" is resolved before, `options.StepOptions.resolve`, and raises
        ValueError here); the result is the same up to float32 summation order.
      upcast: "loop" dequantizes the experts to float32 and widens its bf16 rows for the matmuls
        (`StepOptions.upcast_matmul`, `model.matmul`); "ragged" and "pallas" ignore it.
    Returns:
      `[T, D]` float32: `Σ_k w_k · (W2 a(W1 h + b1) + b2)` over each token's k experts.
    """
    weights, ids = route_valid(h, valid, p, experts_per_token)
    return experts(h, weights, ids, p, alpha=alpha, limit=limit, tile=tile, impl=impl, upcast=upcast)


def route_valid(h: jax.Array, valid: jax.Array, p: dict, k: int) -> tuple[jax.Array, jax.Array]:
    """`route`, with pad tokens routed nowhere: weight 0 and expert id E (out of range, so `experts` skips them).

    Returns `(weights [T, k] float32, ids [T, k] int32 in [0, E], E = no expert)`.
    """
    n_exp = p["router_w"].shape[0]
    weights, ids = route(h, p["router_w"], p["router_b"], k)
    return jnp.where(valid[:, None], weights, 0.0), jnp.where(valid[:, None], ids, n_exp)


def experts(h: jax.Array, weights: jax.Array, ids: jax.Array, p: dict, *, alpha: float, limit: float,
            tile: int = 512, impl: str = "loop", upcast: bool = False) -> jax.Array:
    """Grouped, dropless compute of the (token, expert) assignments on the experts held in `p`.

    Args:
      h: `[T, D]` tokens (activation dtype).  weights: float32 `[T, k]`.
      ids: int32 `[T, k]`, the index into `p`'s expert axis (size E'); an id outside `[0, E')` does no work (pad
        tokens, or under expert parallelism an expert held by another device).
      p: expert parameters with E' experts (`b1`, `b2`, `w1*`/`w2*` as in `moe`; the router is not read).
      tile, impl, upcast: as in `moe`.
    Returns:
      `[T, D]` float32: `Σ_k w_k · (W2 a(W1 h + b1) + b2)` over the assignments with an id in range (0 elsewhere).
    """
    k = ids.shape[1]
    flat_ids, flat_w, order, counts, starts = _group_assignments(weights, ids, p["b1"].shape[0])
    if impl not in ("loop", "ragged", "pallas"):
        raise ValueError(f"moe_impl={impl!r}: the step runs a concrete compute, 'loop', 'ragged' or 'pallas' "
                         "(resolve 'auto' with StepOptions.resolve)")
    if impl == "pallas":
        return _experts_pallas(h, flat_ids, flat_w, order, counts, starts, p, k=k, tile=tile, alpha=alpha,
                               limit=limit)
    if impl == "ragged":
        return _experts_ragged(h, flat_ids, flat_w, order, counts, p, k=k, alpha=alpha, limit=limit)
    return _experts_loop(h, flat_w, order, counts, starts, p, k=k, tile=tile, alpha=alpha, limit=limit, upcast=upcast)


def _group_assignments(weights: jax.Array, ids: jax.Array, n_exp: int) -> tuple[jax.Array, ...]:
    """The T·k (token, slot) assignments grouped by expert, shared by every grouped compute.

    Args:
      weights: float32 `[T, k]`; ids: int32 `[T, k]` (outside `[0, n_exp)`: no work).
    Returns:
      `(flat_ids, flat_w, order, counts, starts)`: int32 `[T·k]` expert per assignment (n_exp = no work, so it sorts
      last), float32 `[T·k]` its weight, int32 `[T·k]` the stable sort by expert (assignment a is token a // k),
      int32 `[n_exp]` assignments per expert and int32 `[n_exp]` each expert's first position in `order`.
    """
    flat_ids = ids.reshape(-1)
    flat_ids = jnp.where((flat_ids >= 0) & (flat_ids < n_exp), flat_ids, n_exp)  # n_exp = no work, sorts last
    flat_w = weights.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True).astype(jnp.int32)  # assignments grouped by expert
    counts = jnp.bincount(flat_ids, length=n_exp + 1)[:n_exp].astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts
    return flat_ids, flat_w, order, counts, starts


def _experts_ragged(h, flat_ids, flat_w, order, counts, p, *, k, alpha, limit) -> jax.Array:
    """`experts` through `jax.lax.ragged_dot` (`grouped_ragged`) over the sorted assignments, same contract.

    Args as `_group_assignments` returns them (`counts` doubles as ragged_dot's group sizes); `h [T, D]`.
    Returns `[T, D]` float32.
    """
    t, d = h.shape
    n_exp = p["b1"].shape[0]
    expert = flat_ids[order]
    # assignments with no expert here sort last, past every group: ragged_dot leaves them 0, and the weight mask
    # drops the bias their clamped index would add
    w_sorted = jnp.where(expert < n_exp, flat_w[order], 0.0)
    y = grouped_ragged(h[order // k], counts, expert, p, alpha=alpha, limit=limit) * w_sorted[:, None]
    # back to (token, slot) order with the inverse permutation (a gather), then the k slots summed in order
    inv = jnp.zeros_like(order).at[order].set(jnp.arange(t * k, dtype=jnp.int32))
    return y[inv].reshape(t, k, d).sum(axis=1)


class _Expert(NamedTuple):
    """One expert's operands inside the tile loop: weights in the activation dtype, or float32 when bf16 matmuls are
    widened (`upcast`; the tile's rows follow them) (`w1 [2I, D]`, `w2 [D, I]`),
    float32 biases (`b1 [2I]`, `b2 [D]`), and its group of sorted assignments (int32 scalars `start`, `count`)."""
    w1: jax.Array
    w2: jax.Array
    b1: jax.Array
    b2: jax.Array
    start: jax.Array
    count: jax.Array


def _experts_loop(h, flat_w, order, counts, starts, p, *, k, tile, alpha, limit, upcast=False) -> jax.Array:
    """`experts` as a loop over the experts, each running its rows through the tile ladder, same contract.

    Args as `_group_assignments` returns them; `h [T, D]`. Returns `[T, D]` float32 (scatter-added per tile).
    """
    t, d = h.shape
    n_exp = p["b1"].shape[0]
    ladder = options_lib.moe_loop_tiles(tile, t * k)
    # the tokens as uint16 bits once (`model.stack`): made inside the tile loop, XLA:CPU copied all T rows per tile
    h_bits = stack.bits(h)
    # the sorted assignments' tokens and weights, padded with `ladder[0]` rows of no token (t: out of range, so the
    # scatter drops them), so that every tile reads a contiguous dynamic slice, never past the end
    tok_sorted = jnp.concatenate([order // k, jnp.full((ladder[0],), t, jnp.int32)])
    w_sorted = jnp.concatenate([flat_w[order], jnp.zeros((ladder[0],), flat_w.dtype)])

    def per_expert(e, out):
        w1, w2 = expert_weights(p, e, matmul.operand_dtype(h.dtype, upcast))
        # gate and up rows apart (a reordering of the per-expert weight copy): the tiles' swiglu reads two halves
        w1 = gate_up_halves(w1)
        b1 = gate_up_halves(stack.take(p["b1"], e)).astype(jnp.float32)
        b2 = stack.take(p["b2"], e).astype(jnp.float32)
        count, start = stack.take(counts, e), stack.take(starts, e)
        ex = _Expert(w1, w2, b1, b2, start, count)
        return _run_ladder(ladder, count, lambda size, base: _tiles_of(h_bits, h.dtype, tok_sorted, w_sorted, ex,
                                                                       size, base, alpha=alpha, limit=limit), out)

    def maybe_expert(e, out):  # an expert no token picked is not even dequantized (short prompts, many experts)
        return jax.lax.cond(counts[e] > 0, per_expert, lambda e, out: out, e, out)

    return jax.lax.fori_loop(0, n_exp, maybe_expert, jnp.zeros((t, d), jnp.float32))


def _run_ladder(ladder: tuple[int, ...], count: jax.Array, tiles_of, out: jax.Array) -> jax.Array:
    """One expert's `count` rows (int32 scalar) through the tile ladder, accumulated into `out [T, D]` float32.

    The ladder (`options.moe_loop_rows`): whole tiles of each height, one more when the rows left would pad it by
    fewer than the next height; the last height takes what is left. `tiles_of(size, base)` is the loop body for the
    tiles of height `size` starting at the group's row `base` (`_tiles_of` bound to the expert).
    """
    done = jnp.int32(0)
    for j, size in enumerate(ladder):
        n = jnp.maximum(count - done + options_lib.moe_loop_slack(ladder, j), 0) // size
        with jax.named_scope(f"tiles{size}"):  # `plan.verify` tells the ladder's loops apart by this name
            out = jax.lax.fori_loop(0, n, tiles_of(size, done), out)
        done = done + n * size
    return out


def _tiles_of(h_bits, dtype, tok_sorted, w_sorted, ex: _Expert, size: int, base, *, alpha: float, limit: float):
    """The `fori_loop` body over tiles of `size` rows of expert `ex`'s group, the first from the group's row `base`.

    Args:
      h_bits: `[T, D]` tokens, bf16 ones as their uint16 bits (`stack.bits`); dtype: the tokens' dtype;
      tok_sorted: int32 `[T·k + pad]` token of each sorted assignment (T = none);
      w_sorted: float32 `[T·k + pad]` its weight.
    Returns:
      `per_tile(i, out)`: `out [T, D]` float32 plus tile i's weighted rows `w · (W2 a(W1 h[tok] + b1) + b2)`.
    """
    t = h_bits.shape[0]
    rows = jnp.arange(size, dtype=jnp.int32)

    def per_tile(i, out):
        first = base + i * size  # the tile's first row in the expert's group
        tok = jax.lax.dynamic_slice(tok_sorted, (ex.start + first,), (size,), allow_negative_indices=False)
        wt = jax.lax.dynamic_slice(w_sorted, (ex.start + first,), (size,), allow_negative_indices=False)
        x = stack.unbits(stack.gather_rows(h_bits, tok), dtype)
        x = matmul.widen(x, ex.w1.dtype == jnp.float32)  # rows as the weights: widened or not
        gu = jnp.einsum("td,od->to", x, ex.w1, preferred_element_type=jnp.float32) + ex.b1
        act = matmul.through(swiglu_halves(gu, alpha=alpha, limit=limit), dtype, ex.w1.dtype == jnp.float32)
        y = jnp.einsum("ti,oi->to", act, ex.w2, preferred_element_type=jnp.float32) + ex.b2
        # rows past the group's end hold the next group's assignments (or none): drop their update (index t is out
        # of range)
        dst = jax.lax.select(first + rows < ex.count, tok, jnp.full_like(tok, t))
        return _scatter_add_rows(out, dst, y * wt[:, None])

    return per_tile


# The scatter-add of the expert loop as one lax op: `out.at[dst].add(y, mode="drop")` traces index normalisation
# around it (~6 equations), once per tile height and step program — what a compilation-cache hit still pays.
_ROWS_UPDATE = jax.lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(0,),
                                               scatter_dims_to_operand_dims=(0,))


def _scatter_add_rows(out: jax.Array, idx: jax.Array, rows: jax.Array) -> jax.Array:
    """`out.at[idx].add(rows, mode="drop")` for `out [T, D]`, `idx [R]` int32, `rows [R, D]`: an index outside `[0, T)`
    adds nothing."""
    return jax.lax.scatter_add(out, idx[:, None], rows, _ROWS_UPDATE, mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


def _experts_pallas(h, flat_ids, flat_w, order, counts, starts, p, *, k, tile, alpha, limit) -> jax.Array:
    """`experts` through the grouped Pallas kernel (`kernels.grouped_moe`; interpret mode off GPUs), same contract.

    Layout: expert e's `counts[e]` sorted assignments fill `ceil(counts[e]/bm)` whole row tiles starting at tile
    `Σ_{e'<e} ceil(counts[e']/bm)`; the static tile count `(T·k + E·(bm−1)) // bm` bounds every routing, and tiles
    past the last live one do no work. Work is O(T·k + E·bm) rows, never O(T·E), and no assignment is dropped.
    """
    from slope_jax.kernels import grouped_moe

    t, d = h.shape
    n_exp = counts.shape[0]
    m = t * k
    # rows per tile: moe_tile capped at the kernel's tile, and no taller than the (power-of-two rounded) assignments of
    # a short prompt
    bm = max(1, min(tile, options_lib.MOE_KERNEL_MAX_TILE, grouped_moe.pow2_at_least(max(m, 16))))
    nt = max(1, (m + n_exp * (bm - 1)) // bm)
    tiles = (counts + bm - 1) // bm
    tile_end = jnp.cumsum(tiles)
    tile_expert = jnp.searchsorted(tile_end, jnp.arange(nt, dtype=jnp.int32), side="right")  # E: past the live ones
    meta = jnp.stack([jnp.minimum(tile_expert, n_exp - 1), tile_expert < n_exp], axis=1).astype(jnp.int32)
    e_sorted = flat_ids[order]  # n_exp: an assignment with no expert here (sorted last)
    live = e_sorted < n_exp
    e_c = jnp.minimum(e_sorted, n_exp - 1)
    row = (tile_end[e_c] - tiles[e_c]) * bm + jnp.arange(m, dtype=jnp.int32) - starts[e_c]
    row = jnp.where(live, row, nt * bm)  # padded row of each sorted assignment (nt·bm = none)
    src = jnp.zeros((nt * bm,), jnp.int32).at[row].set(order // k, mode="drop")  # pad rows read token 0, dropped
    y = grouped_moe.grouped_mlp(h[src], meta, p, block_m=bm, alpha=alpha, limit=limit,
                                interpret=jax.default_backend() not in options_lib.GPU_PLATFORMS)
    w_sorted = jnp.where(live, flat_w[order], 0.0)
    ys = jnp.where(live[:, None], y[jnp.minimum(row, nt * bm - 1)], 0.0) * w_sorted[:, None]
    # back to (token, slot) order with the inverse permutation, then the k slots summed in order (as "ragged")
    inv = jnp.zeros_like(order).at[order].set(jnp.arange(m, dtype=jnp.int32))
    return ys[inv].reshape(t, k, d).sum(axis=1)
