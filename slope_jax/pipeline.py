"""Pipeline parallelism over layers, and the whole parallel prefill step as one `shard_map` over
`(pipeline, ring, ulysses)`.

Stage split (stated): the L layers are cut into P contiguous groups whose sizes differ by at most one (earlier stages
take the extra layer). Every stage runs the same program, so each stage's layers are placed into *slots* that
alternate sliding, full, sliding, full, …: a layer goes into the next slot of its kind, leaving a slot empty when the
kinds do not alternate at a stage boundary (e.g. a stage that starts on a full layer). All stages get the same
(even) slot count S; an empty slot holds zero weights and its output is discarded (it costs a layer's compute on
that stage). gpt-oss-120b (36 layers) has no empty slot for P ∈ {1, 2, 3, 6, 9, 18}, and 4 of 40 slots empty for
P = 4 (or 5); gpt-oss-20b (24 layers) none for P ∈ {1, 2, 3, 4, 6, 12}. The kind of a layer always follows its
global index.

Schedule: GPipe fill-and-drain over the M requests in flight: at step t stage p runs request t − p, then hands its
activation to stage p+1 with one `ppermute`; M requests take M + P − 1 steps. The last stage computes the last-token
logits; K/V stay on the stage (and device) that computed them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as Ps

from slope_jax import collectives, context_parallel, rope
from slope_jax import model as model_lib
from slope_jax.config import ModelConfig
from slope_jax.parallel import CP_AXES, ParallelConfig

# logical axis -> mesh axis; every other logical axis is replicated (context parallelism replicates weights)
LOGICAL_RULES = {"layers": "pipeline"}


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """`slot_layers[p, s]`: global layer in slot s of stage p (−1 = empty). Slot 2j is sliding, 2j+1 full."""

    slot_layers: np.ndarray

    @property
    def pipeline(self) -> int:
        return self.slot_layers.shape[0]

    @property
    def slots_per_stage(self) -> int:
        return self.slot_layers.shape[1]

    @property
    def flat(self) -> list[int]:
        """Global layer of every stacked slot, stage-major (the order of the `[P·S, …]` parameter arrays)."""
        return [int(x) for x in self.slot_layers.reshape(-1)]

    def stage_layers(self, p: int) -> list[int]:
        return [int(x) for x in self.slot_layers[p] if x >= 0]

    @property
    def empty_slots(self) -> int:
        return int((self.slot_layers < 0).sum())


def plan_stages(cfg: ModelConfig, pipeline: int) -> StagePlan:
    """The stated split (module docstring) of `cfg`'s layers over `pipeline` stages."""
    L = cfg.num_hidden_layers
    sizes = [L // pipeline + (1 if p < L % pipeline else 0) for p in range(pipeline)]
    stages, start = [], 0
    for size in sizes:
        slots: list[int] = []
        for layer in range(start, start + size):
            parity = 0 if cfg.is_sliding(layer) else 1
            if len(slots) % 2 != parity:
                slots.append(-1)
            slots.append(layer)
        stages.append(slots)
        start += size
    s = max(len(x) for x in stages)
    s += s % 2
    return StagePlan(np.array([x + [-1] * (s - len(x)) for x in stages], dtype=np.int32))


def param_partition_specs(cfg: ModelConfig, dtype, num_slots: int) -> dict:
    """PartitionSpec per parameter, from the declared logical axes and LOGICAL_RULES."""
    specs = model_lib.param_specs(cfg, dtype, num_layers=num_slots)
    return jax.tree.map(lambda s: Ps(*(LOGICAL_RULES.get(a) for a in s.axes)), specs,
                        is_leaf=lambda x: isinstance(x, model_lib.ParamSpec))


def _stage_forward(x, layers, cfg: ModelConfig, parallel: ParallelConfig, *, positions, valid, active,
                   q_tile, kv_tile, moe_tile):
    """Run this stage's slots on local tokens. x `[2Pz, D]`; layers: params `[S, …]`; active: bool `[S]`.
    Returns `(x, k [S, 2Pz, K, H], v [S, 2Pz, K, H])`."""
    R, U = parallel.ring, parallel.ulysses
    cos, sin = rope.cos_sin(cfg, positions, x.dtype)
    sliding = functools.partial(context_parallel.sliding_attention, pos=positions, ring=R, ulysses=U,
                                window=cfg.sliding_window, q_tile=q_tile, kv_tile=kv_tile)
    full = functools.partial(context_parallel.full_attention, pos=positions, ring=R, ulysses=U,
                             q_tile=q_tile, kv_tile=kv_tile)

    def run(x, p, act, attend):
        y, k, v = model_lib.layer(x, p, cfg, cos=cos, sin=sin, valid=valid,
                                  attend=lambda q, k, v, s: attend(q, k, v, sinks=s), moe_tile=moe_tile)
        return jnp.where(act, y, x), k, v

    pairs = jax.tree.map(lambda a: a.reshape(a.shape[0] // 2, 2, *a.shape[1:]), layers)

    def body(x, xs):
        p, act = xs
        with jax.named_scope("sliding_layer"):
            x, ks, vs = run(x, jax.tree.map(lambda a: a[0], p), act[0], sliding)
        with jax.named_scope("full_layer"):
            x, kf, vf = run(x, jax.tree.map(lambda a: a[1], p), act[1], full)
        return x, (jnp.stack([ks, kf]), jnp.stack([vs, vf]))

    x, (k, v) = jax.lax.scan(body, x, (pairs, active.reshape(-1, 2)))
    return x, k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])


def build_prefill_step(cfg: ModelConfig, parallel: ParallelConfig, mesh, plan: StagePlan, dtype, *,
                       q_tile: int = 256, kv_tile: int = 256, moe_tile: int = 128):
    """The jitted parallel prefill step.

    Signature of the returned function:
      `(params, tokens [M, T] int32 layout order, positions [T] int32 layout order, num_tokens [M] int32)
       → (logits [M, V] float32 replicated, k [M, P·S, T, K, H], v [M, P·S, T, K, H])`
    with K/V in layout order, slots sharded over `pipeline` and tokens over `(ring, ulysses)`.
    """
    P = parallel.pipeline
    active_table = jnp.asarray(plan.slot_layers >= 0)

    def step_local(params, tokens, positions, num_tokens):
        m_total = tokens.shape[0]
        p = jax.lax.axis_index("pipeline")
        active = active_table[p]
        layers = params["layers"]
        two_pz = tokens.shape[1]
        kh, hd = cfg.num_key_value_heads, cfg.head_dim
        s_local = plan.slots_per_stage
        x0 = jnp.zeros((two_pz, cfg.hidden_size), jnp.dtype(dtype))
        kbuf = jnp.zeros((m_total, s_local, two_pz, kh, hd), jnp.dtype(dtype))
        logits0 = jnp.zeros((m_total, cfg.vocab_size), jnp.float32)

        def tick(carry, t):
            x_buf, kb, vb, logits = carry
            m = t - p
            live = (m >= 0) & (m < m_total)
            mc = jnp.clip(m, 0, m_total - 1)
            n_tok = num_tokens[mc]
            valid = positions < n_tok
            x_in = jnp.where(p == 0, params["embed"][tokens[mc]], x_buf)
            with jax.named_scope("stage"):
                x_out, k, v = _stage_forward(x_in, layers, cfg, parallel, positions=positions, valid=valid,
                                             active=active, q_tile=q_tile, kv_tile=kv_tile, moe_tile=moe_tile)
            kb = kb.at[mc].set(jnp.where(live, k, kb[mc]))
            vb = vb.at[mc].set(jnp.where(live, v, vb[mc]))
            with jax.named_scope("head"):
                # the last real token lives on exactly one (ring, ulysses) rank: select it and sum over the CP group
                pick = (positions == n_tok - 1)[:, None]
                x_last = jax.lax.psum(jnp.where(pick, x_out.astype(jnp.float32), 0.0).sum(0), CP_AXES)
                lg = model_lib.unembed_last(x_last.astype(x_out.dtype), params, cfg)
            logits = logits.at[mc].set(jnp.where(live & (p == P - 1), lg, logits[mc]))
            x_buf = collectives.pipeline_pass(x_out, P)
            return (x_buf, kb, vb, logits), None

        (_, kb, vb, logits), _ = jax.lax.scan(tick, (x0, kbuf, kbuf, logits0), jnp.arange(m_total + P - 1))
        if P > 1:  # only the last stage holds logits; the others hold zeros
            logits = jax.lax.psum(logits, "pipeline")
        return logits, kb, vb

    pspecs = param_partition_specs(cfg, dtype, plan.pipeline * plan.slots_per_stage)
    tok_spec = Ps(None, CP_AXES)
    kv_spec = Ps(None, "pipeline", CP_AXES, None, None)
    fn = jax.shard_map(step_local, mesh=mesh, in_specs=(pspecs, tok_spec, Ps(CP_AXES), Ps()),
                       out_specs=(Ps(), kv_spec, kv_spec), check_vma=False)
    return jax.jit(fn)
