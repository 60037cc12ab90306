"""Collective traffic of expert parallelism (EP), analytically (no JAX needed).

Per MoE block and device (slope_jax.parallel.expert_parallel), with EP = R·U, T_loc = T/(R·U) local tokens (padded
length T), D hidden, k experts per token, b activation bytes, and a row = one token's hidden state and its k routing
weights (f32) and expert ids (i32), D·b + 8k bytes:

all_to_all dispatch (`StepOptions.ep_dispatch`, the default), per round, c = `StepOptions.ep_rows(T_loc, k, EP)`
rows per (source, destination) pair:
  operand bytes     B_a2a = EP·c·(D·b + 8k)  +  EP·c·D·4      send buffer out, float32 partial sums back
                    + 4 once per block                        the rounds' count (an int32 all-reduce max)
  wire bytes        (EP−1)/EP · B_a2a  +  (EP−1)·4             (the block for the device itself stays)
  one round when no (source, destination) pair has more than c rows (uniform routing: a pair's expected rows are
  ≤ T_loc·k/EP ≤ c at capacity ≥ 1); at most ⌈T_loc/c⌉ rounds whatever the routing. Its wire bytes per round are
  c/T_loc of the all-gather's (≈ capacity·k/EP).
all_gather dispatch:
  per-device block  B_ag = T_loc·(D·b + 8k)   (all-gather input)      B_rs = T_loc·D·4   (reduce-scatter output)
  operand bytes     B_ag  +  EP·B_rs   (reduce-scatter input, all T_stage = EP·T_loc tokens)
  wire bytes        (EP−1)·B_ag  +  (EP−1)·B_rs      (ring algorithms; what leaves one device)

A step of M requests on P stages of S slots runs (M + P − 1)·S MoE blocks per device (empty slots included: every
stage runs the same program). With EP = 1 there is no MoE collective. The compiled HLO states the same numbers:
`plan.traffic.hlo_collectives` counts an all-to-all by its operand (one pass of the round loop), an all-gather by its
input, a reduce-scatter by its output.
"""

from __future__ import annotations

import dataclasses

from slope_jax.model import options as options_lib
from slope_jax.model.config import ModelConfig
from slope_jax.model.options import StepOptions
from slope_jax.parallel.config import ParallelConfig


@dataclasses.dataclass(frozen=True)
class MoeTraffic:
    """Bytes per device for one step (all_to_all: one round per MoE block). `*_block`: what the HLO reader counts
    for each kind of collective (all-to-all operand, all-reduce operand, all-gather input, reduce-scatter output),
    summed over the step's MoE blocks; `operand` and `wire` as in the module docstring. `rows`: c (all_to_all),
    else 0."""

    expert_degree: int
    moe_blocks: int
    all_gather_block: int
    reduce_scatter_block: int
    operand: int
    wire: int
    dispatch: str = "all_gather"
    rows: int = 0
    all_to_all_block: int = 0
    all_reduce_block: int = 0

    @property
    def block_total(self) -> int:
        return self.all_gather_block + self.reduce_scatter_block + self.all_to_all_block + self.all_reduce_block


def moe_traffic(cfg: ModelConfig, parallel: ParallelConfig, tokens: int, requests: int, slots_per_stage: int,
                activation_bytes: int, options: StepOptions = StepOptions()) -> MoeTraffic:
    """EP collective bytes per device for one prefill step (module docstring).

    Args:
      tokens: the padded length T (a multiple of 2·R·U).  requests: M in flight.  slots_per_stage: S.
      activation_bytes: b, the element width of the hidden states in the collectives.
      options: `ep_dispatch` ("auto" resolves as the engine does) and `ep_capacity`.
    Raises ValueError naming the field for an unknown `ep_dispatch`.
    """
    dispatch = options_lib.resolve_ep_dispatch(options.ep_dispatch, "")
    ep = parallel.expert_degree(cfg)
    blocks = (requests + parallel.pipeline - 1) * slots_per_stage
    if ep == 1:
        return MoeTraffic(1, blocks, 0, 0, 0, 0, dispatch)
    t_loc = tokens // (parallel.ring * parallel.ulysses)
    d, k = cfg.hidden_size, cfg.experts_per_token
    row = d * activation_bytes + 8 * k
    if dispatch == "all_to_all":
        c = options.ep_rows(t_loc, k, ep)
        a2a = ep * c * (row + 4 * d)
        return MoeTraffic(ep, blocks, 0, 0, blocks * (a2a + 4), blocks * (ep - 1) * (c * (row + 4 * d) + 4),
                          dispatch, c, blocks * a2a, blocks * 4)
    ag, rs = t_loc * row, t_loc * d * 4
    return MoeTraffic(ep, blocks, blocks * ag, blocks * rs, blocks * (ag + ep * rs), blocks * (ep - 1) * (ag + rs),
                      dispatch)
