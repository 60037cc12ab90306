"""Pipeline parallelism over layers, and the whole parallel prefill step as one `shard_map` over
`(pipeline, ring, ulysses)`.

Stage split (stated): the L layers are cut into P contiguous groups whose sizes differ by at most one (earlier stages
take the extra layer). A stage stores exactly its layers' weights, in a stack of n = ⌈L/P⌉ entries (one zero
padding entry on the smaller stages). Every stage runs the same program, so a stage *computes* in slots that
alternate sliding, full, sliding, full, …: a layer goes into the next slot of its kind, leaving a slot empty when the
kinds do not alternate at a stage boundary (a stage that starts on a full layer, or ends early). An empty slot reads
some stack entry and its output is discarded: it costs a layer's compute, no memory. gpt-oss-120b (36 layers) has
no empty slot for P ∈ {1, 2, 3, 6, 9, 18}, 4 of 40 for P = 4, 12 of 48 for P = 8; gpt-oss-20b (24 layers) none for
P ∈ {1, 2, 3, 4, 6, 12} and 8 of 32 for P = 8. The kind of a layer always follows its global index.

Schedule: GPipe fill-and-drain over the M requests in flight: at step t stage p runs request t − p, then hands its
activation to stage p+1 with one `ppermute`; M requests take M + P − 1 steps. K/V stay on the stage (and device)
that computed them. The embedding and unembedding tables are split by vocabulary rows over the stages too (so each
device holds ~1/P of every parameter): one psum over `pipeline` embeds all M requests up front; after the schedule
the last stage's final hidden states are shared (psum of `[M, D]`) and each stage unembeds its vocabulary slice
(all-gather of `[M, V/P]`).

Expert parallelism (EP = R·U, the default when it divides the expert count): the expert weights of a stage are also
split over its ring × Ulysses devices (`logical_rules`), and each MoE block dispatches and combines tokens inside the
stage (`expert_parallel`), so a device holds 1/(P·R·U) of the expert bytes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as Ps

from slope_jax.model import attention as attn_lib
from slope_jax.model import gpt_oss as model_lib
from slope_jax.model import rope
from slope_jax.model.config import ModelConfig
from slope_jax.parallel import collectives, context_parallel, expert_parallel
from slope_jax.parallel.config import CP_AXES, ParallelConfig

# Logical axis (as declared in model.gpt_oss) -> mesh axis (or tuple of mesh axes): THE table that places every
# parameter. Any logical axis not listed is replicated (context parallelism replicates weights over ring x ulysses).
# Layers are split into pipeline stages; the embedding/unembedding vocabulary rows are split over the same stages.
# Expert parallelism adds EXPERT_RULES ("experts" -> (ring, ulysses)). Within one parameter a mesh axis may be used
# at most once (`logical_to_partition_spec` checks).
LOGICAL_RULES = {"layers": "pipeline", "vocab": "pipeline"}
# with expert parallelism (EP = R·U > 1) the expert weights are also split over a stage's ring × Ulysses devices
EXPERT_RULES = {"experts": CP_AXES}


def logical_rules(expert_degree: int = 1) -> dict:
    """The logical-axis → mesh-axis table for an EP degree (1 = experts replicated, R·U = split; see ParallelConfig)."""
    return {**LOGICAL_RULES, **EXPERT_RULES} if expert_degree > 1 else LOGICAL_RULES


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


def logical_to_partition_spec(axes: tuple[str | None, ...], rules: dict | None = None) -> Ps:
    """PartitionSpec of a parameter with these logical axes under `rules` (default LOGICAL_RULES).
    Raises ValueError if two of its axes map to the same mesh axis (a mesh axis can split one dimension only)."""
    rules = LOGICAL_RULES if rules is None else rules
    spec = [rules.get(a) for a in axes]
    used = [m for s in spec if s is not None for m in ((s,) if isinstance(s, str) else s)]
    if len(used) != len(set(used)):
        raise ValueError(f"logical axes {axes} map to mesh axes {spec}: a mesh axis is used twice")
    return Ps(*spec)


def param_partition_specs(cfg: ModelConfig, parallel: ParallelConfig, dtype) -> dict:
    """PartitionSpec per parameter of a layout (same tree as the params): the declared logical axes of the stacked
    parameters (`[P·n, …]` layers, `vocab_rows(cfg, P)` vocabulary rows) under `logical_rules` of the layout's
    expert-parallel degree. Every step builder, loader and restore asks this one function with the whole
    ParallelConfig, so no caller can leave out a degree (a step that declared the experts replicated while they are
    split made jit all-gather them onto every device). Raises ValueError as `logical_to_partition_spec`."""
    plan = plan_stages(cfg, parallel.pipeline)
    specs = model_lib.param_specs(cfg, dtype, num_layers=plan.pipeline * plan.stack_per_stage,
                                  vocab_rows=vocab_rows(cfg, parallel.pipeline))
    rules = logical_rules(parallel.expert_degree(cfg))
    return jax.tree.map(lambda s: logical_to_partition_spec(s.axes, rules), specs,
                        is_leaf=lambda x: isinstance(x, model_lib.ParamSpec))


def _stage_forward(x, layers, cfg: ModelConfig, parallel: ParallelConfig, *, positions, valid, slot_index, active,
                   q_tile, kv_tile, moe_tile, prefix=None, attention_impl="xla", moe_impl="loop"):
    """Run this stage's slots on local tokens.

    x `[2Pz, D]`; layers: the stage's weight stack `[n, …]`; slot_index int32 `[S]` (stack entry of each slot);
    active bool `[S]`; positions: `context_parallel.CPPositions`.
    prefix: None, or `(k [n, S, K, H], v [n, S, K, H], positions int32 [S])`: K/V this device stored for the stack
      entries from earlier sequence chunks (negative position = no key yet), attended by every layer too
      (`context_parallel.prefix_attention`; sequence-pipelined prefill).
    Returns `(x, k [n, 2Pz, K, H], v [n, 2Pz, K, H])`, K/V per stack entry (zeros for padding entries).
    """
    R, U = parallel.ring, parallel.ulysses
    n = jax.tree.leaves(layers)[0].shape[0]
    cos, sin = rope.cos_sin(cfg, positions.local, x.dtype)
    sliding = functools.partial(context_parallel.sliding_attention, pos=positions, ring=R, ulysses=U,
                                window=cfg.sliding_window, q_tile=q_tile, kv_tile=kv_tile, impl=attention_impl)
    full = functools.partial(context_parallel.full_attention, pos=positions, ring=R, ulysses=U,
                             q_tile=q_tile, kv_tile=kv_tile, impl=attention_impl)

    moe_fn = None
    if parallel.expert_degree(cfg) > 1:
        moe_fn = functools.partial(expert_parallel.moe_expert_parallel, ulysses=U,
                                   experts_per_token=cfg.experts_per_token, alpha=cfg.swiglu_alpha,
                                   limit=cfg.swiglu_limit, tile=moe_tile, impl=moe_impl)

    def run(x, i, act, attend, window):
        p = jax.tree.map(lambda a: a[i], layers)

        def core(q, k, v, s):
            if prefix is None:
                return attend(q, k, v, sinks=s)
            pre = context_parallel.prefix_attention(q, positions.local, prefix[0][i], prefix[1][i], prefix[2], ring=R,
                                                    ulysses=U, window=window, q_tile=q_tile, kv_tile=kv_tile,
                                                    impl=attention_impl)
            return attend(q, k, v, sinks=s, prefix=pre)

        y, k, v = model_lib.layer(x, p, cfg, cos=cos, sin=sin, valid=valid, attend=core, moe_tile=moe_tile,
                                  moe_impl=moe_impl, moe_fn=moe_fn)
        return jnp.where(act, y, x), k, v

    kinds = (("sliding_layer", sliding, cfg.sliding_window), ("full_layer", full, attn_lib.NO_WINDOW))

    def body(carry, xs):
        x, kst, vst = carry
        idx, act = xs
        for j, (scope, attend, window) in enumerate(kinds):
            with jax.named_scope(scope):
                x, k, v = run(x, idx[j], act[j], attend, window)
            dst = jnp.where(act[j], idx[j], n)  # an empty slot's K/V is dropped (index n is out of range)
            kst = kst.at[dst].set(k, mode="drop")
            vst = vst.at[dst].set(v, mode="drop")
        return (x, kst, vst), None

    zeros = jnp.zeros((n, x.shape[0], cfg.num_key_value_heads, cfg.head_dim), x.dtype)
    (x, k, v), _ = jax.lax.scan(body, (x, zeros, zeros), (slot_index.reshape(-1, 2), active.reshape(-1, 2)))
    return x, k, v


def vocab_rows(cfg: ModelConfig, pipeline: int) -> int:
    """Rows of the embedding/unembedding tables: V rounded up to a multiple of P (zero rows pad the last stage)."""
    return -(-cfg.vocab_size // pipeline) * pipeline


def build_prefill_step(cfg: ModelConfig, parallel: ParallelConfig, mesh, plan: StagePlan, dtype, *,
                       q_tile: int = 256, kv_tile: int = 256, moe_tile: int = 128, attention_impl: str = "xla",
                       moe_impl: str = "loop"):
    """The jitted parallel prefill step.

    Signature of the returned function:
      `(params, tokens [M, T] int32 layout order, positions [T] int32 layout order, num_tokens [M] int32)
       → (logits [M, V] float32 replicated, k [M, P·n, T, K, H], v [M, P·n, T, K, H])`
    with K/V in layout order, stack entries (`plan.flat`) sharded over `pipeline` and tokens over `(ring, ulysses)`.
    The embedding and unembedding tables are sharded over `pipeline` by vocabulary rows; with expert parallelism
    (`parallel.expert_degree(cfg)` > 1) the expert weights over `(ring, ulysses)` (`expert_parallel`).
    attention_impl / moe_impl: the local attention core and MoE grouped compute (see `model.gpt_oss.forward`).
    """
    P = parallel.pipeline
    active_table = jnp.asarray(plan.slot_layers >= 0)
    index_table = jnp.asarray(plan.slot_index)

    def step_local(params, tokens, positions, num_tokens):
        m_total = tokens.shape[0]
        p = jax.lax.axis_index("pipeline")
        active, slot_index = active_table[p], index_table[p]
        layers = params["layers"]
        two_pz = tokens.shape[1]
        kh, hd = cfg.num_key_value_heads, cfg.head_dim
        kbuf = jnp.zeros((m_total, plan.stack_per_stage, two_pz, kh, hd), jnp.dtype(dtype))
        finals0 = jnp.zeros((m_total, cfg.hidden_size), jnp.float32)

        with jax.named_scope("positions"):
            cp_pos = context_parallel.exchange_positions(positions, ring=parallel.ring, ulysses=parallel.ulysses,
                                                         window=cfg.sliding_window)
        with jax.named_scope("embed"):
            x_all = collectives.vocab_parallel_embed(params["embed"], tokens, P)  # [M, 2Pz, D], all stages

        def tick(carry, t):
            x_buf, kb, vb, finals = carry
            m = t - p  # the request this stage works on at tick t (GPipe)
            live = (m >= 0) & (m < m_total)
            mc = jnp.clip(m, 0, m_total - 1)
            n_tok = num_tokens[mc]
            x_in = jnp.where(p == 0, x_all[mc], x_buf)
            with jax.named_scope("stage"):
                x_out, k, v = _stage_forward(x_in, layers, cfg, parallel, positions=cp_pos,
                                             valid=positions < n_tok, slot_index=slot_index, active=active,
                                             q_tile=q_tile, kv_tile=kv_tile, moe_tile=moe_tile,
                                             attention_impl=attention_impl, moe_impl=moe_impl)
            kb = kb.at[mc].set(jnp.where(live, k, kb[mc]))
            vb = vb.at[mc].set(jnp.where(live, v, vb[mc]))
            with jax.named_scope("head"):
                # the last real token lives on exactly one (ring, ulysses) rank: select it and sum over the CP group
                pick = (positions == n_tok - 1)[:, None]
                x_last = jax.lax.psum(jnp.where(pick, x_out.astype(jnp.float32), 0.0).sum(0), CP_AXES)
            finals = finals.at[mc].set(jnp.where(live & (p == P - 1), x_last, finals[mc]))
            x_buf = collectives.pipeline_pass(x_out, P)
            return (x_buf, kb, vb, finals), None

        x0 = jnp.zeros((two_pz, cfg.hidden_size), jnp.dtype(dtype))
        (_, kb, vb, finals), _ = jax.lax.scan(tick, (x0, kbuf, kbuf, finals0), jnp.arange(m_total + P - 1))
        with jax.named_scope("logits"):
            if P > 1:  # only the last stage holds the final hidden states; every stage unembeds its vocab rows
                finals = jax.lax.psum(finals, "pipeline")
            logits = model_lib.unembed(finals.astype(jnp.dtype(dtype)), params["final_norm"], params["unembed"], cfg)
            logits = collectives.vocab_parallel_gather(logits, P)[:, :cfg.vocab_size]
        return logits, kb, vb

    pspecs = param_partition_specs(cfg, parallel, dtype)
    tok_spec = Ps(None, CP_AXES)
    kv_spec = Ps(None, "pipeline", CP_AXES, None, None)
    fn = jax.shard_map(step_local, mesh=mesh, in_specs=(pspecs, tok_spec, Ps(CP_AXES), Ps()),
                       out_specs=(Ps(), kv_spec, kv_spec), check_vma=False)
    return jax.jit(fn)
