"""The stage plan and the sharding table, in numpy only: imported by the step (`parallel.pipeline`), the planner
(`plan/`) and the checkpoint readers (`checkpoints/`), so none of them re-implements the split or imports the step.

Stage split (stated): the L layers are cut into P contiguous groups whose sizes differ by at most one (earlier stages
take the extra layer). A stage stores exactly its layers' weights, in a stack of n = ⌈L/P⌉ entries (one zero
padding entry on the smaller stages). Every stage runs the same program, so a stage *computes* in slots that
alternate sliding, full, sliding, full, …: a layer goes into the next slot of its kind, leaving a slot empty when the
kinds do not alternate at a stage boundary (a stage that starts on a full layer, or ends early). An empty slot reads
some stack entry and its output is discarded: it costs a layer's compute, no memory. gpt-oss-120b (36 layers) has
no empty slot for P ∈ {1, 2, 3, 6, 9, 18}, 4 of 40 for P = 4, 12 of 48 for P = 8; gpt-oss-20b (24 layers) none for
P ∈ {1, 2, 3, 4, 6, 12} and 8 of 32 for P = 8. The kind of a layer always follows its global index.

Sharding table (`LOGICAL_RULES`): logical axis (as declared in `model.gpt_oss.param_specs`) → mesh axis or axes.
Layers go to pipeline stages. The vocabulary rows of the embedding and unembedding tables are split over every
device — `(pipeline, ring, ulysses)` — so each device holds V'/(P·R·U) rows (`vocab_rows` pads V up to a multiple
of P·R·U with zero rows). With expert parallelism (EP = R·U > 1) the experts are split over a stage's ring ×
Ulysses devices. Any other axis is replicated. A mesh axis splits at most one dimension of a parameter (`mesh_axes`
checks); `shards` says over how many devices a parameter is split, which the planner's memory model reads.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from slope_jax.model.config import ModelConfig
from slope_jax.parallel.config import AXES, CP_AXES, ParallelConfig

# THE table that places every parameter (see the module docstring)
LOGICAL_RULES = {"layers": "pipeline", "vocab": AXES}
EXPERT_RULES = {"experts": CP_AXES}


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """Where every layer lives and runs.

    slot_layers `[P, S]`: the global layer computed in slot s of stage p (−1 = empty); slot 2j is sliding, 2j+1 full.
    stack_layers `[P, n]`: the global layer of each entry of a stage's weight (and KV) stack, n = the largest stage
      (−1 = padding on smaller stages). Weights are stored per stack entry, not per slot: empty slots cost compute,
      not memory.
    """

    slot_layers: np.ndarray
    stack_layers: np.ndarray

    @classmethod
    def single_stage(cls, num_layers: int) -> StagePlan:
        layers = np.arange(num_layers, dtype=np.int32)[None]
        return cls(layers, layers)

    @property
    def pipeline(self) -> int:
        return self.slot_layers.shape[0]

    @property
    def slots_per_stage(self) -> int:
        return self.slot_layers.shape[1]

    @property
    def stack_per_stage(self) -> int:
        return self.stack_layers.shape[1]

    @property
    def flat(self) -> list[int]:
        """Global layer of every stacked entry, stage-major: the order of the `[P·n, …]` layer parameters and K/V."""
        return [int(x) for x in self.stack_layers.reshape(-1)]

    @property
    def slot_index(self) -> np.ndarray:
        """int32 `[P, S]`: index into the stage's stack for each slot (0 for an empty slot, whose output is dropped)."""
        out = np.zeros(self.slot_layers.shape, np.int32)
        for p in range(self.pipeline):
            where = {int(g): i for i, g in enumerate(self.stack_layers[p]) if g >= 0}
            for s, g in enumerate(self.slot_layers[p]):
                out[p, s] = where.get(int(g), 0)
        return out

    def stage_layers(self, p: int) -> list[int]:
        return [int(x) for x in self.stack_layers[p] if x >= 0]

    @property
    def empty_slots(self) -> int:
        return int((self.slot_layers < 0).sum())


def plan_stages(cfg: ModelConfig, pipeline: int) -> StagePlan:
    """The stated split (module docstring) of `cfg`'s layers over `pipeline` stages."""
    L = cfg.num_hidden_layers
    sizes = [L // pipeline + (1 if p < L % pipeline else 0) for p in range(pipeline)]
    stages, stacks, start = [], [], 0
    for size in sizes:
        slots: list[int] = []
        for layer in range(start, start + size):
            parity = 0 if cfg.is_sliding(layer) else 1
            if len(slots) % 2 != parity:
                slots.append(-1)
            slots.append(layer)
        stages.append(slots)
        stacks.append(list(range(start, start + size)))
        start += size
    s = max(len(x) for x in stages)
    s += s % 2
    n = max(sizes)
    return StagePlan(np.array([x + [-1] * (s - len(x)) for x in stages], dtype=np.int32),
                     np.array([x + [-1] * (n - len(x)) for x in stacks], dtype=np.int32))


def vocab_shards(parallel: ParallelConfig) -> int:
    """Devices the vocabulary rows are split over: every device, P·R·U (`LOGICAL_RULES["vocab"]`)."""
    return math.prod(_degrees(parallel)[a] for a in _as_tuple(LOGICAL_RULES["vocab"]))


def vocab_rows(cfg: ModelConfig, parallel: ParallelConfig) -> int:
    """Rows of the embedding/unembedding tables: V rounded up to a multiple of `vocab_shards` (zero rows pad the
    last shard)."""
    shards = vocab_shards(parallel)
    return -(-cfg.vocab_size // shards) * shards


def logical_rules(expert_degree: int = 1) -> dict:
    """The logical-axis → mesh-axis table for an EP degree (1 = experts replicated, R·U = split; see ParallelConfig)."""
    return {**LOGICAL_RULES, **EXPERT_RULES} if expert_degree > 1 else LOGICAL_RULES


def rules_for(cfg: ModelConfig, parallel: ParallelConfig) -> dict:
    """The table for this model and layout (its EP degree decides whether experts are split)."""
    return logical_rules(parallel.expert_degree(cfg))


def mesh_axes(axes: tuple[str | None, ...], rules: dict) -> tuple:
    """Mesh axis (None, a name or a tuple of names) of each logical axis of one parameter under `rules`.
    Raises ValueError if two of its axes map to the same mesh axis (a mesh axis can split one dimension only)."""
    spec = tuple(rules.get(a) for a in axes)
    used = [m for s in spec if s is not None for m in _as_tuple(s)]
    if len(used) != len(set(used)):
        raise ValueError(f"logical axes {axes} map to mesh axes {spec}: a mesh axis is used twice")
    return spec


def shards(axes: tuple[str | None, ...], cfg: ModelConfig, parallel: ParallelConfig) -> int:
    """Over how many devices a parameter with these logical axes is split (its per-device bytes = total / this)."""
    deg = _degrees(parallel)
    return math.prod(deg[m] for s in mesh_axes(axes, rules_for(cfg, parallel)) if s is not None
                     for m in _as_tuple(s))


def _degrees(parallel: ParallelConfig) -> dict[str, int]:
    return {"pipeline": parallel.pipeline, "ring": parallel.ring, "ulysses": parallel.ulysses}


def _as_tuple(s) -> tuple[str, ...]:
    return (s,) if isinstance(s, str) else tuple(s)
