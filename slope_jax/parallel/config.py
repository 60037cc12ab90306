"""Parallel layout: `ParallelConfig(pipeline, ring, ulysses)` and its validation (no JAX needed to import).

Mesh axes, outermost first: `pipeline` (stages of layers), `ring` (ring attention over zigzag sequence chunks),
`ulysses` (all-to-all that trades sequence shards for head shards). `ulysses` is innermost so that its all-to-all
stays on the fastest links (inside a host); `ring` and `pipeline` may cross hosts (docs/design.md §5).
"""

from __future__ import annotations

import dataclasses

from slope_jax.model.config import ModelConfig

AXES = ("pipeline", "ring", "ulysses")
CP_AXES = ("ring", "ulysses")  # the axes a sequence is split over


class LayoutError(ValueError):
    """A parallel layout breaks a rule; the message names the value and the rule."""


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Degrees of parallelism for one prefill.

    pipeline: stages of consecutive layers (P). ring: ring-attention ranks (R). ulysses: Ulysses ranks (U).
    microbatches: requests in flight through the pipeline per compiled step (default: `pipeline`).
    expert: expert-parallel degree (EP): each stage's experts are split evenly over its R·U ring × Ulysses devices
      (EP = R·U), or replicated on every device (EP = 1). Default None = R·U when it divides num_experts, else 1
      (`expert_degree`). Sub-groups (1 < EP < R·U, experts replicated over R·U/EP groups) are not supported.
    seq_chunks: sequence chunks per request (C, default 1): each request is cut into C equal chunks that stream
      through the pipeline stages (sequence-pipelined prefill, `parallel.pipeline`), so stages cut one request's
      TTFT; the zigzag layout applies inside each chunk. Padded lengths become multiples of 2·R·U·C.
    The mesh needs exactly P·R·U devices.
    """

    pipeline: int = 1
    ring: int = 1
    ulysses: int = 1
    microbatches: int | None = None
    expert: int | None = None
    seq_chunks: int = 1

    def __post_init__(self):
        for name in ("pipeline", "ring", "ulysses"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise LayoutError(f"{name}={v!r}: must be a positive integer")
        if self.microbatches is not None and (not isinstance(self.microbatches, int) or self.microbatches < 1):
            raise LayoutError(f"microbatches={self.microbatches!r}: must be a positive integer or None")
        if self.expert is not None and (not isinstance(self.expert, int) or isinstance(self.expert, bool)
                                        or self.expert < 1):
            raise LayoutError(f"expert={self.expert!r}: must be a positive integer or None")
        if not isinstance(self.seq_chunks, int) or isinstance(self.seq_chunks, bool) or self.seq_chunks < 1:
            raise LayoutError(f"seq_chunks={self.seq_chunks!r}: must be a positive integer (1 = no sequence chunking)")
        if self.seq_chunks > 1 and self.num_devices == 1:
            raise LayoutError(f"seq_chunks={self.seq_chunks} needs a multi-device layout: chunks stream through "
                              "pipeline stages of a shard_map step (one device runs the unchunked reference path)")

    def replace(self, **changes) -> ParallelConfig:
        """A copy with `changes` (field name → value), validated like a new one (LayoutError naming the field;
        TypeError for an unknown field). Every field is carried over, so no caller rebuilds a layout by hand."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Field name → value (JSON-ready); `ParallelConfig.from_dict` round-trips it."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ParallelConfig:
        """The layout from `to_dict` (or any mapping of its fields; missing fields take their defaults). Raises
        LayoutError naming unknown fields or a field that breaks its rule."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise LayoutError(f"unknown ParallelConfig field(s) {unknown}: expected some of {sorted(names)}")
        return cls(**d)

    @classmethod
    def from_row(cls, row: dict, **overrides) -> ParallelConfig:
        """The layout a planner/calibration table row describes: the row's ParallelConfig fields (other keys, such as
        predicted times, are ignored; missing fields take their defaults), then `overrides`. Raises LayoutError as
        the constructor does."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls.from_dict({**{k: v for k, v in row.items() if k in names}, **overrides})

    def expert_degree(self, cfg: ModelConfig) -> int:
        """The EP degree for this model: `expert` if set, else R·U when it divides num_experts, else 1."""
        if self.expert is not None:
            return self.expert
        cp = self.ring * self.ulysses
        return cp if cfg.num_experts % cp == 0 else 1

    @property
    def num_devices(self) -> int:
        return self.pipeline * self.ring * self.ulysses

    @property
    def in_flight(self) -> int:
        return self.microbatches or self.pipeline

    @property
    def token_multiple(self) -> int:
        """Padded lengths are multiples of 2·R·U·C: C sequence chunks, each cut into 2R zigzag chunks split over U
        Ulysses ranks."""
        return 2 * self.ring * self.ulysses * self.seq_chunks

    def validate(self, cfg: ModelConfig, num_devices: int | None = None) -> ParallelConfig:
        """Check the layout against the model and the device count. Returns self; raises LayoutError naming the rule."""
        if num_devices is not None and self.num_devices != num_devices:
            raise LayoutError(f"pipeline*ring*ulysses = {self.pipeline}*{self.ring}*{self.ulysses} = "
                              f"{self.num_devices} devices, but {num_devices} are available: the mesh must use "
                              "every device exactly once")
        n, k = cfg.num_attention_heads, cfg.num_key_value_heads
        if n % self.ulysses:
            raise LayoutError(f"ulysses={self.ulysses} must divide num_attention_heads={n}: each Ulysses rank "
                              "holds an equal slice of query heads")
        if k % self.ulysses and self.ulysses % k:
            raise LayoutError(f"ulysses={self.ulysses} must divide num_key_value_heads={k} or be a multiple of it "
                              "(KV heads are split, or replicated so that query head h meets KV head h//G); "
                              "padding heads would break the GQA ratio")
        ep, cp = self.expert_degree(cfg), self.ring * self.ulysses
        if ep not in (1, cp):
            raise LayoutError(f"expert={ep}: the expert-parallel degree must be 1 (experts replicated) or "
                              f"ring*ulysses = {self.ring}*{self.ulysses} = {cp} (experts split over the devices of a "
                              "stage); sub-groups are not supported")
        if cfg.num_experts % ep:
            raise LayoutError(f"expert={ep} must divide num_experts={cfg.num_experts}: each of the {ep} devices of a "
                              "stage holds an equal slice of the experts (use expert=1 to replicate them)")
        if self.pipeline > cfg.num_hidden_layers:
            raise LayoutError(f"pipeline={self.pipeline} exceeds num_hidden_layers={cfg.num_hidden_layers}: "
                              "a stage would hold no layer")
        return self
