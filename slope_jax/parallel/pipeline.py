"""The parallel prefill step: one builder (`build_prefill_step`), one `shard_map` over `(pipeline, ring, ulysses)`,
with the schedule as its only variable part (`Schedule`).

Stages (`parallel.stages`: the stated split, slots, stacks) run GPipe fill-and-drain over work items: with C = 1 an
item is a request (M requests take M + P − 1 ticks); with C = `seq_chunks` > 1 each request of T (padded) tokens is
cut into C equal chunks of Tc = T/C (a multiple of 2·R·U; the zigzag layout applies inside each chunk,
`layout.chunked_layout_positions`) and the items (request m, chunk i), request-major, take M·C + P − 1 ticks, so
stage p works on chunk i while stage p+1 works on chunk i − 1 (sequence-pipelined prefill: stages cut one request's
TTFT; the bubble shrinks from (P−1)/(M+P−1) to (P−1)/(M·C+P−1)). At each tick a stage runs its item and hands the
activation to stage p+1 with one `ppermute`. A fill/drain (bubble) tick gets no query positions, so its attention
visits no tile, for every C. K/V stay on the stage (and device) that computed them.

Chunks (C > 1), exactness: a stage keeps the K/V of every chunk of its own layers (it must, for the KV export). For
chunk i each layer computes (a) the usual context-parallel attention inside the chunk (`context_parallel`
`full_attention` — Ulysses × zigzag ring, causal — or `sliding_attention` — halo), and (b)
`context_parallel.prefix_attention` of the chunk's queries over the stored K/V of chunks < i of the same request
(rows of chunks ≥ i are masked by a negative position); (b) is merged into (a) with the online-softmax merge and the
sink enters once, at the end. Masks come from global positions, so causality and the sliding window are exact for
every chunk size. Cost of (b) per layer and chunk (stated): the queries travel, the keys stay — (R·U−1)·|q| +
R·U·|o, m, l| bytes per device, independent of i; work is the visible (query, key) pairs only, so summed over the
chunks the attention work equals the unchunked causal work (no recomputation). Chunk sizes are equal (stated rule):
later chunks take longer; `slope_jax.plan.seq_chunks` models the imbalance. See docs/seq-pipelining.md.

Embedding and head: the tables are split by vocabulary rows as the sharding table says (`parallel.stages`); the
embedding is one lookup-and-sum up front (`collectives.vocab_parallel_embed`); after the schedule the last stage's
final hidden states are shared (psum of `[M, D]`) and each device unembeds its vocabulary rows (all-gather of the
logit slices).

Expert parallelism (EP = R·U, the default when it divides the expert count): the expert weights of a stage are also
split over its ring × Ulysses devices (the sharding table), and each MoE block dispatches and combines tokens inside
the stage (`expert_parallel`), so a device holds 1/(P·R·U) of the expert bytes, for every schedule.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as Ps

from slope_jax.model import attention as attn_lib
from slope_jax.model import gpt_oss as model_lib
from slope_jax.model import options as options_lib
from slope_jax.model import rope, stack
from slope_jax.model.config import ModelConfig
from slope_jax.model.options import StepOptions
from slope_jax.parallel import collectives, context_parallel, expert_parallel, sharding, stages
from slope_jax.parallel.config import CP_AXES, ParallelConfig

def _stage_forward(x, layers, cfg: ModelConfig, parallel: ParallelConfig, *, positions, valid, slot_index, active,
                   options: StepOptions, prefix=None):
    """Run this stage's slots on local tokens.

    x `[2Pz, D]`; layers: the stage's weight stack `[n, …]`; slot_index int32 `[S]` (stack entry of each slot);
    active bool `[S]`; positions: `context_parallel.CPPositions`.
    prefix: None, or `(k [n, S, K, H], v [n, S, K, H], positions int32 [S])`, K/V as `stack.bits`: K/V this device
      stored for the stack entries from earlier sequence chunks (negative position = no key yet), attended by every
      layer too (`context_parallel.prefix_attention`; sequence-pipelined prefill).
    Returns `(x, k [n, 2Pz, K, H], v [n, 2Pz, K, H])`, K/V per stack entry (zeros for padding entries).
    """
    R, U = parallel.ring, parallel.ulysses
    n = jax.tree.leaves(layers)[0].shape[0]
    cos, sin = rope.cos_sin(cfg, positions.local, x.dtype)
    sliding = functools.partial(context_parallel.sliding_attention, pos=positions, ring=R, ulysses=U,
                                window=cfg.sliding_window, options=options)
    full = functools.partial(context_parallel.full_attention, pos=positions, ring=R, ulysses=U, options=options)

    moe_fn = model_lib.local_moe(cfg, options)
    if parallel.expert_degree(cfg) > 1:
        moe_fn = functools.partial(expert_parallel.moe_expert_parallel, ulysses=U,
                                   experts_per_token=cfg.experts_per_token, alpha=cfg.swiglu_alpha,
                                   limit=cfg.swiglu_limit, tile=options.moe_tile, impl=options.moe_impl,
                                   dispatch=options.ep_dispatch, capacity=options.ep_capacity,
                                   upcast=options.upcast_matmul)

    experts_stacked = options_lib.experts_read_from_stack(options.moe_impl)

    def run(x, i, act, attend, window):
        p = model_lib.take_layer(layers, i, experts_stacked=experts_stacked)

        def core(q, k, v, s):
            if prefix is None:
                return attend(q, k, v, sinks=s)
            pk, pv = (stack.unbits(stack.take(a, i), x.dtype) for a in prefix[:2])
            pre = context_parallel.prefix_attention(q, positions.local, pk, pv, prefix[2], ring=R, ulysses=U,
                                                    window=window, options=options)
            return attend(q, k, v, sinks=s, prefix=pre)

        y, k, v = model_lib.layer(x, p, cfg, cos=cos, sin=sin, valid=valid, attend=core, moe_fn=moe_fn,
                                  upcast=options.upcast_matmul)
        return jnp.where(act, y, x), k, v

    kinds = (("sliding_layer", sliding, cfg.sliding_window), ("full_layer", full, attn_lib.NO_WINDOW))

    def body(carry, xs):
        x, kst, vst = carry
        idx, act = xs
        for j, (scope, attend, window) in enumerate(kinds):
            with jax.named_scope(scope):
                x, k, v = run(x, idx[j], act[j], attend, window)
            dst = jnp.where(act[j], idx[j], n)  # an empty slot's K/V is dropped (index n is out of range)
            kst = kst.at[dst].set(stack.bits(k), mode="drop")  # bits: a bf16 update would widen the whole stack
            vst = vst.at[dst].set(stack.bits(v), mode="drop")
        return (x, kst, vst), None

    zeros = stack.bits(jnp.zeros((n, x.shape[0], cfg.num_key_value_heads, cfg.head_dim), x.dtype))
    (x, k, v), _ = jax.lax.scan(body, (x, zeros, zeros), (slot_index.reshape(-1, 2), active.reshape(-1, 2)))
    return x, stack.unbits(k, x.dtype), stack.unbits(v, x.dtype)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The variable part of the step: which work item a stage runs at each tick.

    Items j = 0 … M·C − 1 are (request j // C, chunk j % C), request-major; at tick t stage p runs item t − p (GPipe
    fill and drain), so M requests × C chunks take M·C + P − 1 ticks. chunks = 1 is GPipe over requests; chunks > 1
    is sequence-pipelined prefill, where chunk i also attends to the K/V its stage stored for chunks < i.
    """

    pipeline: int
    chunks: int

    def ticks(self, requests: int) -> int:
        """M·C + P − 1."""
        return requests * self.chunks + self.pipeline - 1

    def item(self, t, stage, requests: int):
        """(live, request, chunk) of the item `stage` runs at tick `t` (traced ints; a fill/drain tick is not live and
        is clipped to a valid item whose result is dropped)."""
        j = t - stage
        live = (j >= 0) & (j < requests * self.chunks)
        jc = jnp.clip(j, 0, requests * self.chunks - 1)
        return live, jc // self.chunks, jc % self.chunks


def num_ticks(parallel: ParallelConfig, requests: int) -> int:
    """Ticks of the compiled schedule for `requests` requests in flight: M·C + P − 1."""
    return Schedule(parallel.pipeline, parallel.seq_chunks).ticks(requests)


def build_prefill_step(cfg: ModelConfig, parallel: ParallelConfig, mesh, plan: stages.StagePlan, dtype,
                       options: StepOptions, *, with_prefix: bool = False):
    """The jitted parallel prefill step, for every schedule (`Schedule`: C = parallel.seq_chunks).

    Signature of the returned function:
      `(params, tokens [M, T] int32 layout order, positions [T] int32 layout order, num_tokens [M] int32)
       → (logits [M, V] float32 replicated, k [M, P·n, T, K, H], v [M, P·n, T, K, H])`
    with tokens, positions and K/V in layout order (`layout.chunked_layout_positions(T, R, U, C)`, the zigzag layout
    when C = 1), tokens sharded over `(ring, ulysses)`, stack entries (`plan.flat`) over `pipeline`. T must be a
    multiple of `parallel.token_multiple`. Parameters are placed by `sharding.param_partition_specs(cfg, parallel)`.
    options: resolved step options (tiles, attention core, MoE compute; ValueError if "auto" is left).
    with_prefix (prefix reuse): the step takes four more arguments, `offsets [M] int32` (replicated: request m's
      tokens sit at positions `positions + offsets[m]`; `num_tokens[m]` counts the whole prompt, offset included),
      `prefix_k, prefix_v [M, P·n, S, K, H]` (the cached K/V of each request's first offsets[m] tokens per stack
      entry, rows in any order, sharded like K/V; bf16 as its uint16 bits, `serve.reuse.step_kv_dtype`) and
      `prefix_pos [M, S] int32` (their positions, INVALID_POS = no key; sharded over `(ring, ulysses)`); every layer
      also attends to them (`context_parallel.prefix_attention`: the queries go round the stage's R·U devices, the
      cached keys stay where they were placed).
    """
    options.require_resolved()
    body = functools.partial(_step_local, cfg=cfg, parallel=parallel, plan=plan, dtype=jnp.dtype(dtype),
                             options=options, schedule=Schedule(parallel.pipeline, parallel.seq_chunks))
    tok_spec = Ps(None, CP_AXES)
    kv_spec = Ps(None, "pipeline", CP_AXES, None, None)
    in_specs = (sharding.param_partition_specs(cfg, parallel, dtype), tok_spec, Ps(CP_AXES), Ps())
    if with_prefix:
        in_specs += (Ps(), kv_spec, kv_spec, tok_spec)
    fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(Ps(), kv_spec, kv_spec), check_vma=False)
    return jax.jit(fn)


def _step_local(params, tokens, positions, num_tokens, *cached, cfg: ModelConfig, parallel: ParallelConfig,
                plan: stages.StagePlan, dtype, options: StepOptions, schedule: Schedule):
    """One device's step: embed, the tick loop of `schedule`, the head. Shapes as `build_prefill_step`, local;
    `cached`: empty, or (offsets, prefix_k, prefix_v, prefix_pos) of a prefix-reuse step."""
    m_total, C = tokens.shape[0], schedule.chunks
    two_pz = tokens.shape[1] // C  # this device's rows of one chunk
    n, kh, hd = plan.stack_per_stage, cfg.num_key_value_heads, cfg.head_dim
    with jax.named_scope("embed"):
        x_all = collectives.vocab_parallel_embed(params["embed"], tokens, parallel.pipeline,
                                                 parallel.ring * parallel.ulysses)
    tick = _tick_fn(cfg, parallel, plan, options, schedule, params["layers"], x_all.reshape(m_total, C, two_pz, -1),
                    positions.reshape(C, two_pz), num_tokens, cached or None)
    kbuf = stack.bits(jnp.zeros((m_total, n, C, two_pz, kh, hd), dtype))
    carry = (jnp.zeros((two_pz, cfg.hidden_size), dtype), kbuf, kbuf, jnp.zeros((m_total, cfg.hidden_size),
                                                                                  jnp.float32))
    (_, kb, vb, finals), _ = jax.lax.scan(tick, carry, jnp.arange(schedule.ticks(m_total)))
    with jax.named_scope("logits"):
        if parallel.pipeline > 1:  # only the last stage holds the final hidden states; every device unembeds its rows
            finals = jax.lax.psum(finals, "pipeline")
        logits = model_lib.unembed(finals.astype(dtype), params["final_norm"], params["unembed"], cfg)
        logits = collectives.vocab_parallel_gather(logits, stages.vocab_shards(parallel))[:, :cfg.vocab_size]
    # [M, n, C, 2Pz, K, H] → [M, n, C·2Pz, K, H]: this device's rows in layout order
    return logits, *(stack.unbits(a.reshape(m_total, n, C * two_pz, kh, hd), dtype) for a in (kb, vb))


def _tick_fn(cfg: ModelConfig, parallel: ParallelConfig, plan: stages.StagePlan, options: StepOptions,
             schedule: Schedule, layers, x_all, pos_c, num_tokens, cached=None):
    """The scan body of the tick loop: stage p runs its item (`schedule.item`) and passes its activation on.

    x_all `[M, C, 2Pz, D]` embedded inputs; pos_c int32 `[C, 2Pz]` positions of each chunk's local rows (request m
    adds `offsets[m]` with prefix reuse); cached: None or this device's (offsets [M], prefix_k [M, n, S, K, H],
    prefix_v, prefix_pos [M, S]) (`build_prefill_step(with_prefix=True)`).
    A fill/drain tick's queries get no position, so its attention visits no tile (its output is dropped).
    """
    P, R, U, C = parallel.pipeline, parallel.ring, parallel.ulysses, schedule.chunks
    p = jax.lax.axis_index("pipeline")
    active, slot_index = jnp.asarray(plan.slot_layers >= 0)[p], jnp.asarray(plan.slot_index)[p]
    m_total, two_pz = x_all.shape[0], pos_c.shape[1]
    n, kh, hd = plan.stack_per_stage, cfg.num_key_value_heads, cfg.head_dim

    def tick(carry, t):
        x_buf, kb, vb, finals = carry
        live, m, i = schedule.item(t, p, m_total)
        n_tok, pos_m = num_tokens[m], pos_c
        if cached is not None:
            pos_m = pos_c + cached[0][m]  # the request's tokens follow its cached prefix
        pos_i = pos_m[i]
        with jax.named_scope("positions"):
            cp_pos = context_parallel.exchange_positions(jnp.where(live, pos_i, attn_lib.INVALID_POS), ring=R,
                                                         ulysses=U, window=cfg.sliding_window)
        prefix = None
        if C > 1:  # stored K/V of this request's chunks < i (rows of chunks >= i hold no key yet: no position)
            prefix_pos = jnp.where(jnp.arange(C)[:, None] < i, pos_m, attn_lib.INVALID_POS).reshape(-1)
            prefix = (kb[m].reshape(n, C * two_pz, kh, hd), vb[m].reshape(n, C * two_pz, kh, hd), prefix_pos)
        if cached is not None:  # the cached prefix's keys this device holds, after the earlier chunks' (if any)
            loaded = (cached[1][m], cached[2][m], cached[3][m])
            prefix = loaded if prefix is None else tuple(jnp.concatenate([a, b], axis=1 if a.ndim > 1 else 0)
                                                         for a, b in zip(prefix, loaded))
        x_in = jnp.where(p == 0, x_all[m, i], x_buf)
        with jax.named_scope("stage"):
            # an idle tick's tokens (pipeline fill/drain) are pads: routed nowhere, no expert work and, under the
            # all-to-all EP dispatch, no round (its stale activations would otherwise route like skewed tokens)
            x_out, k, v = _stage_forward(x_in, layers, cfg, parallel, positions=cp_pos, valid=live & (pos_i < n_tok),
                                         slot_index=slot_index, active=active, options=options, prefix=prefix)
        # the chunk buffers hold bits (`model.stack`): bf16 slices and updates in this loop would widen them whole
        kb = kb.at[m, :, i].set(jnp.where(live, stack.bits(k), kb[m, :, i]))
        vb = vb.at[m, :, i].set(jnp.where(live, stack.bits(v), vb[m, :, i]))
        with jax.named_scope("head"):
            # the last real token lives in chunk (n−1)//Tc, on exactly one (ring, ulysses) rank: select it and sum
            # over the CP group
            pick = (pos_i == n_tok - 1)[:, None]
            x_last = jax.lax.psum(jnp.where(pick, x_out.astype(jnp.float32), 0.0).sum(0), CP_AXES)
        last = n_tok - 1 if cached is None else n_tok - 1 - cached[0][m]  # the last token's row in this step
        mine = live & (p == P - 1) & (i == last // (two_pz * R * U))
        finals = finals.at[m].set(jnp.where(mine, x_last, finals[m]))
        return (collectives.pipeline_pass(x_out, P), kb, vb, finals), None

    return tick
