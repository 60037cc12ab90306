"""Collective traffic of the parallel prefill step: read from compiled HLO, and predicted analytically.

Both count **operand bytes per device**: what one device hands to each collective (for an all-gather its input,
not the gathered output), summed over every execution — ops inside loops count once per trip (`known_trip_count`
of each `while`, nested multiplicatively; a loop of data-dependent trip count, the EP all-to-all's rounds, counts
once). `wire` bytes (what leaves the device) are also given analytically: an
all-to-all keeps 1/U of its operand, a ppermute sends all of it.

Per step of M requests, P stages of S slots (S/2 sliding + S/2 full), T tokens, Pz = T/(2RU), C = U·Pz, dtype of b
bytes, K' = max(K, U) KV heads after GQA replication, h = ⌈(W−1)/Pz⌉ halo hops of s = min(Pz, W−1) tokens through
(2 + [U>1]) ppermutes each when Pz ≥ W−1, else one all-gather of the sequence (`context_parallel.halo_by_gather`):
  sliding layer: h·(2 + [U>1])·s·2·K·H·b, or 2Pz·2·K·H·b when gathered    (the halo's K and V, nothing else)
  full layer:    [U>1]·(2·2Pz·N·H·b + 2·2Pz·K'·H·b) + [R>1]·(R−1)·2·2C·(K'/U)·H·b   (Ulysses q, out, kv; ring kv)
  per tick:      S/2 · (sliding + full) + [RU>1]·4D (last-token psum) + [P>1]·2Pz·D·b (stage hand-off)
                 + positions: [U>1]·4·2Pz + [R>1]·4·2C (all-gathers) + h·(2 + [U>1])·4s or 4·2Pz (halo positions)
  per step:      (M + P − 1) ticks
                 + vocabulary-parallel embedding (rows over all P·R·U devices), per request: [RU>1]·(4·2Pz (ids
                   all-gather) + 2Pz·D·b (reduce-scatter of [T, D], counted by its result, as the HLO reader
                   does; wire (RU−1)·2Pz·D·b)) + [P>1]·2Pz·D·b (psum over stages)
                 + head: [P>1]·4·M·D (final states) + [PRU>1]·4·M·V'/(PRU) (logits all-gather)
"""

from __future__ import annotations

import collections
import dataclasses
import re

from slope_jax.model.config import ModelConfig
from slope_jax.model.options import StepOptions
from slope_jax.parallel.config import ParallelConfig
from slope_jax.plan import hlo, moe_traffic

COLLECTIVES = ("all-to-all", "collective-permute", "all-gather", "all-reduce", "reduce-scatter")
_shape_bytes = hlo.shape_bytes


@dataclasses.dataclass
class HloCollective:
    kind: str
    bytes: int  # operand bytes per device, one execution
    executions: int  # trip-count multiplier
    scope: str  # sliding_layer, full_layer, head, positions, embed, logits, pipeline or other (op_name metadata)
    loop: str = ""  # op_name of an enclosing loop of data-dependent trip count ("" if none): counted for one pass

    @property
    def total(self) -> int:
        return self.bytes * self.executions


def hlo_collectives(hlo_text: str) -> list[HloCollective]:
    """Every collective of a compiled module with its per-device operand bytes and execution count.

    A collective inside a loop whose trip count depends on the data (the rounds of the all-to-all expert dispatch,
    `parallel.expert_parallel`) is counted for one pass of that loop and names the loop in `loop`; its operand bytes
    are static, the number of passes is the caller's to apply (`plan.moe_traffic` states bytes per round).
    """
    mod = hlo.parse(hlo_text)
    out = []
    for name, lines in mod.comps.items():
        if mod.mult.get(name, 0) == 0:
            continue
        for line in lines:
            m = hlo._INSTR.match(line)
            if not m:
                continue
            op = m.group(4)
            base = op[:-6] if op.endswith("-start") else op
            if base not in COLLECTIVES:
                continue
            sizes = _shape_bytes(m.group(3))
            if op.endswith("-start"):
                nbytes = sizes[0]  # (operand, output, ...) of an async start
            elif base == "all-gather":
                groups = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
                gsize = len(groups.group(1).split(",")) if groups else 1
                nbytes = sum(sizes) // gsize
            else:
                nbytes = sum(sizes)
            op_name = re.search(r'op_name="([^"]*)"', line)
            op_name = op_name.group(1) if op_name else ""
            scope = next((s for s in ("sliding_layer", "full_layer", "head", "positions", "embed", "logits")
                          if f"/{s}/" in op_name), None)
            if scope is None:
                scope = "pipeline" if base == "collective-permute" else "other"
            out.append(HloCollective(base, nbytes, int(mod.mult[name]), scope, mod.dynamic.get(name, "")))
    return out


def schedule_ticks(hlo_text: str) -> int:
    """Trip count of the pipeline schedule's tick loop (the outermost `while` of the step; 1 if XLA removed it)."""
    for line in hlo_text.splitlines():
        if " while(" not in line:
            continue
        name = re.search(r'op_name="([^"]+)"', line)
        trip = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
        if name and trip and name.group(1).endswith("shard_map/while"):
            return int(trip.group(1))
    return 1


def hlo_bytes_by_scope(hlo_text: str) -> dict[str, int]:
    """Total operand bytes per device, by scope and by collective kind, plus "total"."""
    out: dict[str, int] = collections.defaultdict(int)
    for c in hlo_collectives(hlo_text):
        out[c.scope] += c.total
        out[c.kind] += c.total
        out["total"] += c.total
    return dict(out)


def collective_element_bytes(dtype, backend: str) -> int:
    """Bytes per element that collectives of `dtype` move on `backend`. XLA:CPU widens 16-bit float collectives to
    float32 (a CPU-only pass, seen in its HLO as convert → collective → convert); GPUs move them as they are."""
    import jax.numpy as jnp

    size = jnp.dtype(dtype).itemsize
    return 4 if backend == "cpu" and size == 2 and jnp.issubdtype(dtype, jnp.floating) else size


def analytic_bytes(cfg: ModelConfig, parallel: ParallelConfig, t: int, m: int, slots_per_stage: int,
                   dtype_bytes: int) -> dict[str, float]:
    """Predicted operand bytes per device for one step (module docstring), by scope, plus `wire` bytes."""
    P, R, U = parallel.pipeline, parallel.ring, parallel.ulysses
    N, K, H, D, V, W = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size,
                        cfg.vocab_size, cfg.sliding_window)
    b = dtype_bytes
    pz = t // (2 * R * U)
    c = U * pz
    kr = max(K, U)
    pairs = slots_per_stage // 2
    ticks = m + P - 1

    sliding = halo_pos = 0.0
    gather = (R * U - 1) if R * U > 1 and 0 < pz < W - 1 else 0  # wire factor: halo by all-gather (short buckets)
    if gather:  # one all-gather of the whole sequence's K/V per sliding layer (context_parallel.halo_by_gather)
        sliding = 2 * pz * 2 * K * H * b
        halo_pos = 4 * 2 * pz
    elif R * U > 1 and W > 1:
        hops = -(-(W - 1) // pz)
        s = min(pz, W - 1)
        perms = 2 + (U > 1)
        sliding = hops * perms * s * 2 * K * H * b
        halo_pos = hops * perms * 4 * s
    full = wire_full = 0.0
    if U > 1:
        a2a = 2 * (2 * pz) * N * H * b + 2 * (2 * pz) * kr * H * b
        full += a2a
        wire_full += a2a * (U - 1) / U
    if R > 1:
        ring = (R - 1) * 2 * 2 * c * (kr // U) * H * b
        full += ring
        wire_full += ring
    positions = halo_pos + (4 * 2 * pz if U > 1 else 0) + (4 * 2 * c if R > 1 else 0)
    head = 4 * D if R * U > 1 else 0
    pipe = 2 * pz * D * b if P > 1 else 0
    cp, shards = R * U, P * R * U
    vslice = -(-V // shards)  # vocabulary rows per device (parallel.stages.vocab_rows / vocab_shards)
    ids, scatter = (4 * 2 * pz, 2 * pz * D * b) if cp > 1 else (0, 0)
    stage_sum = 2 * pz * D * b if P > 1 else 0
    embed = m * (ids + scatter + stage_sum)
    logits = (4 * m * D if P > 1 else 0) + (4 * m * vslice if shards > 1 else 0)
    out = {"sliding_layer": ticks * pairs * sliding, "full_layer": ticks * pairs * full, "head": ticks * head,
           "pipeline": ticks * pipe, "positions": ticks * positions, "embed": embed, "logits": logits}
    out["total"] = sum(out.values())
    wire_pos = (halo_pos * max(gather, 1) + (4 * 2 * pz * (U - 1) if U > 1 else 0)
                + (4 * 2 * c * (R - 1) if R > 1 else 0))
    wire_reduce = 2 * (P - 1) / P if P > 1 else 0  # ring all-reduce
    wire_embed = m * (ids * (cp - 1) + scatter * (cp - 1) + wire_reduce * stage_sum)
    out["wire"] = (ticks * (pairs * (sliding * max(gather, 1) + wire_full) + head + pipe + wire_pos) + wire_embed
                   + wire_reduce * 4 * m * D + (shards - 1) * 4 * m * vslice)
    return out


LINK_KINDS = ("ulysses_all_to_all", "ring_ppermute", "halo_ppermute", "pipeline_handoff", "ep_dispatch", "other")


def link_bytes(cfg: ModelConfig, parallel: ParallelConfig, t: int, m: int, slots_per_stage: int, dtype_bytes: int,
               expert: int = 1, options: StepOptions = StepOptions()) -> dict[str, float]:
    """Wire bytes per device for one step, by link kind (LINK_KINDS), from `analytic_bytes`: an all-to-all sends
    (U−1)/U of its operand, a ppermute all of it; `ep_dispatch`: the wire bytes of `moe_traffic` for the dispatch
    `options.ep_dispatch` (all_to_all: one round per MoE block) when `expert` > 1.
    Also `ring_step`: the K/V block one ring step passes (bytes), and `total`."""
    P, R, U = parallel.pipeline, parallel.ring, parallel.ulysses
    a = analytic_bytes(cfg, parallel, t, m, slots_per_stage, dtype_bytes)
    ticks, pairs = m + P - 1, slots_per_stage // 2
    pz = t // (2 * R * U)
    kr = max(cfg.num_key_value_heads, U)
    a2a = ticks * pairs * (2 * 2 * pz * cfg.num_attention_heads * cfg.head_dim * dtype_bytes
                           + 2 * 2 * pz * kr * cfg.head_dim * dtype_bytes) * (U - 1) / U if U > 1 else 0.0
    ring_step = 2 * 2 * U * pz * (kr // U) * cfg.head_dim * dtype_bytes if R > 1 else 0.0
    ring = ticks * pairs * (R - 1) * ring_step
    out = {"ulysses_all_to_all": a2a, "ring_ppermute": ring, "halo_ppermute": a["sliding_layer"],
           "pipeline_handoff": a["pipeline"],
           "ep_dispatch": (moe_traffic.moe_traffic(cfg, parallel, t, m, slots_per_stage, dtype_bytes, options).wire
                           if expert > 1 else 0.0),
           "other": a["head"] + a["positions"] + a["embed"] + a["logits"]}
    out["total"] = sum(out.values())
    out["ring_step"] = ring_step
    return out
