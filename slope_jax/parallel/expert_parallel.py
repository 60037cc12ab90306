"""Expert parallelism (EP): a stage's experts split over its ring × Ulysses devices, dropless with static shapes.

Layout: with EP = R·U, device r·U + u of a stage holds experts [(r·U + u)·E/EP, (r·U + u + 1)·E/EP) of every layer
of the stage (the `experts` logical axis sharded over `(ring, ulysses)`); the router is replicated. Per MoE block,
after routing the local tokens `[T_loc, D]` (top-k + softmax, pads routed nowhere), one of two dispatches
(`StepOptions.ep_dispatch`, resolved once per backend):

"all_to_all" (default). Each token goes only to the devices that hold one of its k experts, once per device (a row
  carries the hidden state and the token's k weights and ids, ids of other devices' experts masked to "none"):
  1. row j·c + s of the send buffer `[EP, c, D]` is the s-th token (in token order) bound for device j, where
     c = `StepOptions.ep_rows(T_loc, k, EP)` = min(T_loc, ⌈capacity·T_loc·k/EP⌉) static rows per pair;
  2. all-to-all out (`collectives.expert_exchange`), `moe.experts` on the EP·c received rows with this device's
     experts, all-to-all of the float32 partial sums back, scatter-add onto the owners' tokens;
  3. repeated in rounds: round i sends each pair's rows [i·c, (i+1)·c); the number of rounds is
     ⌈max over all pairs of the group of the pair's rows / c⌉ (a `pmax`, so every device runs the same count) —
     1 when no pair exceeds c. Dropless for any routing: a pair never has more than T_loc rows, so skewed routing
     costs at most ⌈T_loc/c⌉ rounds (≈ the all-gather's bytes), never a dropped token.
  Why rounds and not one exchange: a single static exchange must size every pair for its worst case (T_loc rows),
  which moves exactly the all-gather's bytes; `jax.lax.ragged_all_to_all` (dynamic sizes in static buffers) is not
  implemented by XLA:CPU (jax 0.10.2). Cost of a round: two all-to-alls and one `moe.experts` call (the picked
  experts are dequantized once per round).
"all_gather". Every device gets every token of the stage (all-gather of hidden states and routing over
  `(ring, ulysses)`), runs its experts on the assignments that picked them, and a float32 reduce-scatter sums the
  partial outputs back to the token owners. One collective each way whatever the routing.

Both are exact: each assignment is computed on exactly one device and the expert output bias `b2` is added once per
assignment, weighted, like the single-device path; only the order of the final float32 sum of a token's k
contributions differs. Exact ties in the router go to the lower expert index (`moe.route`), on every path.

Traffic per device and MoE block (`slope_jax.plan.moe_traffic`, b = activation bytes, per round for all_to_all):
  all_to_all   operand  EP·c·(D·b + 8k) (out)  +  EP·c·D·4 (back)       wire  (EP−1)/EP of the operand
               + once per block 4 bytes (the rounds' int32 `pmax`)        wire  (EP−1)·4
  all_gather   operand  T_loc·(D·b + 8k)       +  EP·T_loc·D·4          wire  (EP−1)·T_loc·(D·b + 8k + 4D)
so one all-to-all round moves c/T_loc ≈ capacity·k/EP of the all-gather's wire bytes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from slope_jax.model import moe as moe_lib
from slope_jax.model import options as options_lib
from slope_jax.parallel import collectives
from slope_jax.parallel.config import CP_AXES

DISPATCHES = ("all_to_all", "all_gather")


def moe_expert_parallel(h: jax.Array, valid: jax.Array, p: dict, *, ulysses: int, experts_per_token: int,
                        alpha: float, limit: float, tile: int = 128, impl: str = "loop",
                        dispatch: str = "all_to_all", capacity: float | None = None, upcast: bool = False) -> jax.Array:
    """The MoE block with this device's slice of the experts; call inside `shard_map` over `(…, ring, ulysses)`.

    Args:
      h: `[T_loc, D]` normed hidden states of this device's tokens (activation dtype).
      valid: bool `[T_loc]`, False for pad tokens (routed nowhere; their output is zero).
      p: one layer's MoE parameters with the router replicated (`router_w [E, D]`, `router_b [E]`) and the expert
        parameters sliced to this device's E/EP experts (`b1 [E/EP, 2I]`, `b2 [E/EP, D]`, `w1*`, `w2*`).
      ulysses: U (the linear rank over `(ring, ulysses)` is r·U + u).
      tile, impl, upcast: the local grouped compute (`moe.experts`).
      dispatch: "all_to_all" or "all_gather" (module docstring; resolved, `StepOptions.resolve`).
      capacity: all_to_all only, `StepOptions.ep_capacity`: c = `options.ep_rows(capacity, T_loc, k, EP)` rows per
        (source, destination) pair and round; None: c = T_loc (one round whatever the routing).
    Returns:
      `[T_loc, D]` float32, equal (up to float32 summation order) to `moe.moe` with all experts.
    Raises:
      ValueError: an unknown dispatch.
    """
    if dispatch not in DISPATCHES:
        raise ValueError(f"ep_dispatch={dispatch!r}: the step runs a concrete dispatch, one of {DISPATCHES} "
                         "(resolve 'auto' with StepOptions.resolve)")
    compute = dict(alpha=alpha, limit=limit, tile=tile, impl=impl, upcast=upcast)
    with jax.named_scope("expert_parallel"):
        weights, ids = moe_lib.route_valid(h, valid, p, experts_per_token)
        e_local = p["b1"].shape[0]
        if dispatch == "all_gather":
            with jax.named_scope("dispatch"):
                h_all, w_all, ids_all = collectives.expert_dispatch((h, weights, ids), CP_AXES)
            rank = jax.lax.axis_index("ring") * ulysses + jax.lax.axis_index("ulysses")
            local = ids_all - rank * e_local  # out of [0, e_local): another device's expert, or a pad (no work here)
            y = _experts_call(h_all, w_all, local.astype(jnp.int32), p, **compute)
            with jax.named_scope("combine"):
                return collectives.expert_combine(y, CP_AXES)
        t = h.shape[0]
        ep = jax.lax.axis_size(CP_AXES)
        rows = t if capacity is None else options_lib.ep_rows(capacity, t, experts_per_token, ep)
        return _all_to_all(h, weights, ids, p, rows, compute)


# The local grouped compute as one traced call: calls of the same shapes (the sliding and the full layer's
# expert-parallel blocks) share one trace of the expert loop and its tile ladder (as `gpt_oss._moe_call` does without
# EP), which a compilation-cache hit still pays for.
_experts_call = jax.jit(moe_lib.experts, static_argnames=("alpha", "limit", "tile", "impl", "upcast"))


def _all_to_all(h, weights, ids, p, rows, compute):
    """The all_to_all dispatch (module docstring): `h [T, D]`, routing `weights [T, k]` f32 / `ids [T, k]` i32
    (global expert ids, E = none) → `[T, D]` float32."""
    t, d = h.shape
    k = ids.shape[1]
    e_local = p["b1"].shape[0]
    ep = jax.lax.axis_size(CP_AXES)
    peers = jnp.arange(ep, dtype=jnp.int32)
    owner = ids // e_local  # [T, k]; a pad's id E gives EP: no device
    bound = (owner[:, :, None] == peers).any(axis=1)  # [T, EP] token t goes to device j (once, however many experts)
    slot = jnp.cumsum(bound, axis=0, dtype=jnp.int32) - bound  # [T, EP] its row in the pair's list
    rounds = -(-jax.lax.pmax(bound.sum(axis=0, dtype=jnp.int32).max(), CP_AXES) // rows)
    # row t of the padded arrays: no token (zero state, routed nowhere) for the empty rows of a send buffer
    h_pad = jnp.concatenate([h, jnp.zeros((1, d), h.dtype)])
    w_pad = jnp.concatenate([weights, jnp.zeros((1, k), weights.dtype)])
    owner_pad = jnp.concatenate([owner, jnp.full((1, k), ep, owner.dtype)])
    local_pad = jnp.concatenate([ids, jnp.zeros((1, k), ids.dtype)]) - owner_pad * e_local
    tokens = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[:, None], (t, ep))

    def one_round(i, out):
        s = slot - i * rows
        live = bound & (s >= 0) & (s < rows)
        # [EP, c] the token in each send row (t = none); live (pair, row) targets are distinct
        tok = jnp.full((ep, rows), t, jnp.int32).at[jnp.where(live, peers, ep), jnp.where(live, s, 0)].set(
            tokens, mode="drop")
        mine = owner_pad[tok] == peers[:, None, None]  # [EP, c, k] the slots whose expert the receiver holds
        send = (h_pad[tok], jnp.where(mine, w_pad[tok], 0.0), jnp.where(mine, local_pad[tok], e_local))
        with jax.named_scope("dispatch"):
            x_r, w_r, id_r = collectives.expert_exchange(send, CP_AXES)
        y = _experts_call(x_r.reshape(-1, d), w_r.reshape(-1, k), id_r.reshape(-1, k), p, **compute)
        with jax.named_scope("combine"):
            back = collectives.expert_exchange(y.reshape(ep, rows, d), CP_AXES)
        return out.at[tok].add(back, mode="drop")

    return jax.lax.fori_loop(0, rounds, one_round, jnp.zeros((t, d), jnp.float32))
