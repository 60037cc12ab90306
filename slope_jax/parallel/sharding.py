"""Parameter placement on the mesh: PartitionSpecs and NamedShardings from the declared logical axes and the one
sharding table (`parallel.stages.LOGICAL_RULES`). Used by the step, the engine and the checkpoint readers."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as Ps

from slope_jax.model import gpt_oss as model_lib
from slope_jax.model.config import ModelConfig
from slope_jax.parallel import stages
from slope_jax.parallel.config import ParallelConfig


def logical_to_partition_spec(axes: tuple[str | None, ...], rules: dict | None = None) -> Ps:
    """PartitionSpec of a parameter with these logical axes under `rules` (default `stages.LOGICAL_RULES`).
    Raises ValueError if two of its axes map to the same mesh axis."""
    return Ps(*stages.mesh_axes(axes, stages.LOGICAL_RULES if rules is None else rules))


def stacked_param_specs(cfg: ModelConfig, parallel: ParallelConfig, dtype) -> dict:
    """Declared ParamSpecs of the layout's stored parameters: layers stacked per stage (`plan_stages`, P·n entries),
    vocabulary tables padded to `stages.vocab_rows` rows."""
    plan = stages.plan_stages(cfg, parallel.pipeline)
    return model_lib.param_specs(cfg, dtype, num_layers=plan.pipeline * plan.stack_per_stage,
                                 vocab_rows=stages.vocab_rows(cfg, parallel))


def param_partition_specs(cfg: ModelConfig, parallel: ParallelConfig, dtype) -> dict:
    """PartitionSpec per parameter (same tree as the params) of this layout: every degree (stages, vocabulary
    shards, expert parallelism) comes from `parallel`, so no caller can forget one."""
    rules = stages.rules_for(cfg, parallel)
    return jax.tree.map(lambda s: logical_to_partition_spec(s.axes, rules), stacked_param_specs(cfg, parallel, dtype),
                        is_leaf=lambda x: isinstance(x, model_lib.ParamSpec))


def param_shardings(cfg: ModelConfig, parallel: ParallelConfig, dtype, mesh) -> dict:
    """NamedSharding per parameter on `mesh` (`param_partition_specs`)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_partition_specs(cfg, parallel, dtype))
