"""Collective traffic and parameter memory of expert parallelism (EP), analytically (no JAX needed).

EP (slope_jax.parallel.expert_parallel) runs, per MoE block and device, one all-gather of the local tokens' normed
hidden states and routing over the stage's EP = R·U devices, and one float32 reduce-scatter of the partial expert
outputs back to the token owners. With T_loc = T/(R·U) local tokens (padded length T), D hidden, k experts per
token, b activation bytes:

  per-device block  B_ag = T_loc·(D·b + 4k + 4k)     hidden states + routing weights (f32) + expert ids (i32)
                    B_rs = T_loc·D·4                   the device's share of the float32 outputs
  operand bytes     B_ag (all-gather input)  +  EP·B_rs (reduce-scatter input, all T_stage = EP·T_loc tokens)
  wire bytes        (EP−1)·B_ag              +  (EP−1)·B_rs      (ring algorithms; what leaves one device)

A step of M requests on P stages of S slots runs (M + P − 1)·S MoE blocks per device (empty slots included: every
stage runs the same program). With EP = 1 there is no MoE collective.
"""

from __future__ import annotations

import dataclasses

from slope_jax.model.config import ModelConfig
from slope_jax.parallel.config import ParallelConfig


@dataclasses.dataclass(frozen=True)
class MoeTraffic:
    """Bytes per device for one step. `*_block`: the per-device block of each collective (all-gather input,
    reduce-scatter output), summed over the step's MoE blocks; `operand` and `wire` as in the module docstring."""

    expert_degree: int
    moe_blocks: int
    all_gather_block: int
    reduce_scatter_block: int
    operand: int
    wire: int

    @property
    def block_total(self) -> int:
        return self.all_gather_block + self.reduce_scatter_block


def moe_traffic(cfg: ModelConfig, parallel: ParallelConfig, tokens: int, requests: int, slots_per_stage: int,
                activation_bytes: int) -> MoeTraffic:
    """EP collective bytes per device for one prefill step (module docstring).

    Args:
      tokens: the padded length T (a multiple of 2·R·U).  requests: M in flight.  slots_per_stage: S.
      activation_bytes: b, the element width of the hidden states in the all-gather.
    """
    ep = parallel.expert_degree(cfg)
    blocks = (requests + parallel.pipeline - 1) * slots_per_stage
    if ep == 1:
        return MoeTraffic(1, blocks, 0, 0, 0, 0)
    t_loc = tokens // (parallel.ring * parallel.ulysses)
    ag = t_loc * (cfg.hidden_size * activation_bytes + 8 * cfg.experts_per_token)
    rs = t_loc * cfg.hidden_size * 4
    return MoeTraffic(ep, blocks, blocks * ag, blocks * rs, blocks * (ag + ep * rs), blocks * (ep - 1) * (ag + rs))

