"""Expert parallelism (EP): a stage's experts split over its ring × Ulysses devices, dropless with static shapes.

Layout: with EP = R·U, device r·U + u of a stage holds experts [(r·U + u)·E/EP, (r·U + u + 1)·E/EP) of every layer
of the stage (the `experts` logical axis sharded over `(ring, ulysses)`); the router is replicated. Per MoE block:

  1. route the local tokens `[T_loc, D]` (top-k + softmax, pads routed nowhere);
  2. dispatch: all-gather the normed hidden states and the routing `(weights [T_loc, k] f32, ids [T_loc, k] i32)`
     over `(ring, ulysses)` → every device sees all T_stage = EP·T_loc tokens of the stage;
  3. each device runs `moe.experts` on the assignments that picked one of its experts (the others, and pad tokens,
     do no work) → float32 partial sums `[T_stage, D]`;
  4. combine: reduce-scatter (sum) over `(ring, ulysses)` back to the token owners → `[T_loc, D]`.

Choice (design §9): all-gather + reduce-scatter rather than a sorted all-to-all — shapes stay static with no capacity
factor (dropless for any routing, including every token on one expert), and the result is exact: each assignment is
computed on exactly one device and the expert output bias `b2` is added once per assignment, weighted, like the
single-device path; only the order of the final float32 sum of a token's k contributions differs.

Traffic per device and MoE block (`slope_jax.plan.moe_traffic`, b = activation bytes):
  operand bytes  T_loc·(D·b + 8k) (all-gather)  +  T_stage·D·4 (reduce-scatter, float32)
  wire bytes     (EP−1)·T_loc·(D·b + 8k)        +  (EP−1)/EP·T_stage·D·4
The all-to-all alternative would move ≈ k·T_loc·D·b each way, but with ragged (capacity-bound or padded) shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from slope_jax.model import moe as moe_lib
from slope_jax.parallel import collectives
from slope_jax.parallel.config import CP_AXES


def moe_expert_parallel(h: jax.Array, valid: jax.Array, p: dict, *, ulysses: int, experts_per_token: int,
                        alpha: float, limit: float, tile: int = 128, impl: str = "loop") -> jax.Array:
    """The MoE block with this device's slice of the experts; call inside `shard_map` over `(…, ring, ulysses)`.

    Args:
      h: `[T_loc, D]` normed hidden states of this device's tokens (activation dtype).
      valid: bool `[T_loc]`, False for pad tokens (routed nowhere; their output is zero).
      p: one layer's MoE parameters with the router replicated (`router_w [E, D]`, `router_b [E]`) and the expert
        parameters sliced to this device's E/EP experts (`b1 [E/EP, 2I]`, `b2 [E/EP, D]`, `w1*`, `w2*`).
      ulysses: U (the linear rank over `(ring, ulysses)` is r·U + u).
      tile, impl: the local grouped compute (`moe.experts`).
    Returns:
      `[T_loc, D]` float32, equal (up to float32 summation order) to `moe.moe` with all experts.
    """
    with jax.named_scope("expert_parallel"):
        weights, ids = moe_lib.route_valid(h, valid, p, experts_per_token)
        with jax.named_scope("dispatch"):
            h_all, w_all, ids_all = collectives.expert_dispatch((h, weights, ids), CP_AXES)
        e_local = p["b1"].shape[0]
        rank = jax.lax.axis_index("ring") * ulysses + jax.lax.axis_index("ulysses")
        local = ids_all - rank * e_local  # out of [0, e_local): another device's expert, or a pad (no work here)
        y = moe_lib.experts(h_all, w_all, local.astype(jnp.int32), p, alpha=alpha, limit=limit, tile=tile,
                            impl=impl)
        with jax.named_scope("combine"):
            return collectives.expert_combine(y, CP_AXES)
