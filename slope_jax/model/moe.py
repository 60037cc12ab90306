"""Mixture of experts: top-k router, interleaved clamped SwiGLU experts, exact dropless grouped compute (spec §2.4).

Notable:
- Router: top-k of the logits first, then softmax over those k (spec §2.4 step 2, pitfall 3); float32.
- SwiGLU: gate/up interleaved (`gu[0::2]`, `gu[1::2]`), gate clamped above only, up clamped both sides,
  `gate·σ(α·gate)·(up + 1)`; the down-projection bias is added before the routing weight (pitfalls 4-7).
- Grouped compute: the T·k (token, expert) assignments are sorted by expert; each expert that was picked dequantizes
  its weights once and runs its rows in tiles of `tile` tokens (a dynamic number of tiles per expert). Work is
  O(T·k + tile padding), never O(T·E) — no dense compute over all experts, and no token is dropped.
- Tokens marked invalid (padding) are routed to no expert (weight 0, an out-of-range id that `experts` skips): pads
  do no expert work, and the grouping of the real tokens does not depend on pad values.
- `moe` = `route_valid` + `experts`; expert parallelism (`slope_jax.parallel.expert_parallel`) puts its dispatch and
  combine between the two and runs `experts` on a device's slice of the experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from slope_jax.model import mxfp4


def route(h: jax.Array, w: jax.Array, b: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Router: `logits = h·Wᵀ + b`, top-k, softmax over the k (spec §2.4).

    Args:
      h: `[T, D]` normed hidden states.  w: `[E, D]`.  b: `[E]`.  k: experts per token.
    Returns:
      `(weights [T, k] float32 summing to 1 per token, expert ids [T, k] int32 in descending logit order)`.
    """
    logits = jnp.einsum("td,ed->te", h, w, preferred_element_type=jnp.float32) + b.astype(jnp.float32)
    top, ids = jax.lax.top_k(logits, k)
    return jax.nn.softmax(top, axis=-1), ids.astype(jnp.int32)


def swiglu(gate_up: jax.Array, *, alpha: float, limit: float) -> jax.Array:
    """gpt-oss activation on interleaved `gate_up[..., 2I]` → `[..., I]` (spec §2.4 step 3).

    `gate = min(gu[0::2], limit)`, `up = clip(gu[1::2], −limit, limit)`, `out = gate·σ(α·gate)·(up + 1)`.
    """
    gate = jnp.minimum(gate_up[..., 0::2], limit)
    up = jnp.clip(gate_up[..., 1::2], -limit, limit)
    return gate * jax.nn.sigmoid(gate * alpha) * (up + 1.0)


def expert_weights(p: dict, e: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Expert `e`'s `(W1 [2I, D], W2 [D, I])` in (out, in) orientation, dequantized from MXFP4 when packed."""
    if "w1_blocks" in p:
        w1 = mxfp4.decode(p["w1_blocks"][e], p["w1_scales"][e], dtype)
        w2 = mxfp4.decode(p["w2_blocks"][e], p["w2_scales"][e], dtype)
    else:
        w1, w2 = p["w1"][e].astype(dtype), p["w2"][e].astype(dtype)
    return w1, w2


def moe(h: jax.Array, valid: jax.Array, p: dict, *, experts_per_token: int, alpha: float, limit: float,
        tile: int = 128) -> jax.Array:
    """Exact dropless MoE block on local tokens (all experts on this device).

    Args:
      h: `[T, D]` normed hidden states (activation dtype).
      valid: bool `[T]`, False for pad tokens (their output is zero: they are routed to no expert).
      p: one layer's MoE parameters: `router_w [E, D]`, `router_b [E]`, `b1 [E, 2I]`, `b2 [E, D]` and either
        `w1_blocks [E, 2I, D/32, 16]`, `w1_scales [E, 2I, D/32]`, `w2_blocks [E, D, I/32, 16]`, `w2_scales [E, D, I/32]`
        (MXFP4) or `w1 [E, 2I, D]`, `w2 [E, D, I]`.
      tile: rows per expert matmul.
    Returns:
      `[T, D]` float32: `Σ_k w_k · (W2 a(W1 h + b1) + b2)` over each token's k experts.
    """
    weights, ids = route_valid(h, valid, p, experts_per_token)
    return experts(h, weights, ids, p, alpha=alpha, limit=limit, tile=tile)


def route_valid(h: jax.Array, valid: jax.Array, p: dict, k: int) -> tuple[jax.Array, jax.Array]:
    """`route`, with pad tokens routed nowhere: weight 0 and expert id E (out of range, so `experts` skips them).

    Returns `(weights [T, k] float32, ids [T, k] int32 in [0, E], E = no expert)`.
    """
    n_exp = p["router_w"].shape[0]
    weights, ids = route(h, p["router_w"], p["router_b"], k)
    return jnp.where(valid[:, None], weights, 0.0), jnp.where(valid[:, None], ids, n_exp)


def experts(h: jax.Array, weights: jax.Array, ids: jax.Array, p: dict, *, alpha: float, limit: float,
            tile: int = 128) -> jax.Array:
    """Grouped, dropless compute of the (token, expert) assignments on the experts held in `p`.

    Args:
      h: `[T, D]` tokens (activation dtype).  weights: float32 `[T, k]`.
      ids: int32 `[T, k]`, the index into `p`'s expert axis (size E'); an id outside `[0, E')` does no work (pad
        tokens, or under expert parallelism an expert held by another device).
      p: expert parameters with E' experts (`b1`, `b2`, `w1*`/`w2*` as in `moe`; the router is not read).
    Returns:
      `[T, D]` float32: `Σ_k w_k · (W2 a(W1 h + b1) + b2)` over the assignments with an id in range (0 elsewhere).
    """
    t, d = h.shape
    k = ids.shape[1]
    n_exp = p["b1"].shape[0]
    flat_ids = ids.reshape(-1)
    flat_ids = jnp.where((flat_ids >= 0) & (flat_ids < n_exp), flat_ids, n_exp)  # n_exp = no work, sorts last
    flat_w = weights.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True).astype(jnp.int32)  # assignments grouped by expert
    counts = jnp.bincount(flat_ids, length=n_exp + 1)[:n_exp].astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts
    n_assign = t * k
    tile = max(1, min(tile, n_assign))
    rows = jnp.arange(tile, dtype=jnp.int32)

    def per_expert(e, out):
        w1, w2 = expert_weights(p, e, h.dtype)
        b1 = p["b1"][e].astype(jnp.float32)
        b2 = p["b2"][e].astype(jnp.float32)

        def per_tile(i, out):
            r = i * tile + rows
            live = r < counts[e]
            a = order[jnp.minimum(starts[e] + r, n_assign - 1)]
            tok = a // k
            x = h[tok]
            gu = jnp.einsum("td,od->to", x, w1, preferred_element_type=jnp.float32) + b1
            act = swiglu(gu, alpha=alpha, limit=limit).astype(h.dtype)
            y = jnp.einsum("ti,oi->to", act, w2, preferred_element_type=jnp.float32) + b2
            # rows past the group's end hold a clamped, foreign assignment: drop their update (index t is out of range)
            dst = jnp.where(live, tok, t)
            return out.at[dst].add(y * flat_w[a][:, None], mode="drop")

        n_tiles = (counts[e] + tile - 1) // tile
        return jax.lax.fori_loop(0, n_tiles, per_tile, out)

    def maybe_expert(e, out):  # an expert no token picked is not even dequantized (short prompts, many experts)
        return jax.lax.cond(counts[e] > 0, per_expert, lambda e, out: out, e, out)

    return jax.lax.fori_loop(0, n_exp, maybe_expert, jnp.zeros((t, d), jnp.float32))
