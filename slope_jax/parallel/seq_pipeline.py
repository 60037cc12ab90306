"""Sequence-pipelined prefill (chunked pipeline parallelism): pipeline stages that cut ONE request's TTFT.

A request of T (padded) tokens is cut into C equal sequence chunks of Tc = T/C tokens (Tc a multiple of 2·R·U; the
zigzag layout of `parallel.layout` applies inside each chunk, `layout.chunked_layout_positions`). The work items
(request m, chunk i), request-major, stream through the P stages: at tick t stage p runs item t − p, so stage p
works on chunk i while stage p+1 works on chunk i − 1, and M requests × C chunks take M·C + P − 1 ticks (GPipe over
requests × chunks) inside one compiled step. The bubble shrinks from (P−1)/(M+P−1) to (P−1)/(M·C+P−1).

Exactness: a stage keeps the K/V of every chunk of its own layers (it must, for the KV export). For chunk i each layer
computes (a) the usual context-parallel attention inside the chunk (`context_parallel.full_attention` — Ulysses ×
zigzag ring, causal — or `sliding_attention` — halo), and (b) `context_parallel.prefix_attention` of the chunk's
queries over the stored K/V of chunks < i of the same request (rows of chunks ≥ i are masked by a negative position);
(b) is merged into (a) with the online-softmax merge and the sink enters once, at the end. Masks come from global
positions, so causality and the sliding window (the W−1 tokens before a piece may lie in chunk i−1 or earlier, on
other devices) are exact for every chunk size, also chunks shorter than W.

Cost of (b), per layer and chunk i (stated): the queries travel, the keys stay — (q, positions, state) go once round
the R·U devices of the stage, (R·U−1)·|q| + R·U·|o, m, l| bytes per device, independent of i (a K/V ring would move
i·Tc/(R·U) rows). Work is the visible (query, key) pairs only — full layers i·Tc·Tc/(R·U) per device (each device
holds 2Pz rows of every earlier chunk, so it is balanced), sliding layers ≤ Tc·W/(R·U) (fully masked key tiles are
skipped) — so summed over the chunks the attention work equals the unchunked causal work: no recomputation.

Chunk sizes are equal (stated rule): the attention part of chunk i grows linearly with i (the MLP/MoE part does not),
so later chunks take longer; `slope_jax.plan.seq_chunks` models the resulting imbalance term.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as Ps

from slope_jax.model import attention as attn_lib
from slope_jax.model import gpt_oss as model_lib
from slope_jax.model.config import ModelConfig
from slope_jax.parallel import collectives, context_parallel
from slope_jax.parallel import pipeline as pipe_lib
from slope_jax.parallel.config import CP_AXES, ParallelConfig


def num_ticks(parallel: ParallelConfig, requests: int) -> int:
    """Ticks of the chunked schedule: M·C + P − 1."""
    return requests * parallel.seq_chunks + parallel.pipeline - 1


def build_chunked_prefill_step(cfg: ModelConfig, parallel: ParallelConfig, mesh, plan: pipe_lib.StagePlan, dtype, *,
                               q_tile: int = 256, kv_tile: int = 256, moe_tile: int = 128, attention_impl: str = "xla",
                               moe_impl: str = "loop"):
    """The jitted sequence-pipelined prefill step (same signature and outputs as `pipeline.build_prefill_step`;
    attention_impl / moe_impl as there).

      `(params, tokens [M, T] int32, positions [T] int32, num_tokens [M] int32)
       → (logits [M, V] float32 replicated, k [M, P·n, T, K, H], v [M, P·n, T, K, H])`

    with tokens, positions and K/V in the chunked layout order (`layout.chunked_layout_positions(T, R, U, C)`), tokens
    sharded over `(ring, ulysses)`, stack entries over `pipeline`. T must be a multiple of 2·R·U·C.
    """
    P, C = parallel.pipeline, parallel.seq_chunks
    R, U = parallel.ring, parallel.ulysses
    active_table = jnp.asarray(plan.slot_layers >= 0)
    index_table = jnp.asarray(plan.slot_index)

    def step_local(params, tokens, positions, num_tokens):
        m_total = tokens.shape[0]
        items = m_total * C
        p = jax.lax.axis_index("pipeline")
        active, slot_index = active_table[p], index_table[p]
        layers = params["layers"]
        two_pz = tokens.shape[1] // C  # this device's rows of one chunk
        tc = two_pz * R * U  # tokens of one chunk
        n = plan.stack_per_stage
        kh, hd = cfg.num_key_value_heads, cfg.head_dim
        pos_c = positions.reshape(C, two_pz)  # [C, 2Pz] global positions of each chunk's local rows
        kbuf = jnp.zeros((m_total, n, C, two_pz, kh, hd), jnp.dtype(dtype))
        finals0 = jnp.zeros((m_total, cfg.hidden_size), jnp.float32)

        with jax.named_scope("embed"):
            x_all = collectives.vocab_parallel_embed(params["embed"], tokens, P).reshape(m_total, C, two_pz, -1)

        def tick(carry, t):
            x_buf, kb, vb, finals = carry
            j = t - p  # the (request, chunk) item this stage works on at tick t
            live = (j >= 0) & (j < items)
            jc = jnp.clip(j, 0, items - 1)
            m, i = jc // C, jc % C
            n_tok = num_tokens[m]
            pos_i = pos_c[i]
            # a fill/drain tick's queries get no position: its attention visits no tile (its output is dropped)
            pos_run = jnp.where(live, pos_i, attn_lib.INVALID_POS)
            with jax.named_scope("positions"):
                cp_pos = context_parallel.exchange_positions(pos_run, ring=R, ulysses=U, window=cfg.sliding_window)
            # stored K/V of this request's chunks < i (rows of chunks >= i hold no key yet: negative positions)
            prefix_pos = jnp.where(jnp.arange(C)[:, None] < i, pos_c, attn_lib.INVALID_POS).reshape(-1)
            prefix = (kb[m].reshape(n, C * two_pz, kh, hd), vb[m].reshape(n, C * two_pz, kh, hd), prefix_pos)
            x_in = jnp.where(p == 0, x_all[m, i], x_buf)
            with jax.named_scope("stage"):
                x_out, k, v = pipe_lib._stage_forward(x_in, layers, cfg, parallel, positions=cp_pos,
                                                      valid=pos_i < n_tok, slot_index=slot_index, active=active,
                                                      q_tile=q_tile, kv_tile=kv_tile, moe_tile=moe_tile,
                                                      prefix=prefix, attention_impl=attention_impl,
                                                      moe_impl=moe_impl)
            kb = kb.at[m, :, i].set(jnp.where(live, k, kb[m, :, i]))
            vb = vb.at[m, :, i].set(jnp.where(live, v, vb[m, :, i]))
            with jax.named_scope("head"):
                # the last real token lives in chunk (n−1)//Tc, on exactly one (ring, ulysses) rank
                pick = (pos_i == n_tok - 1)[:, None]
                x_last = jax.lax.psum(jnp.where(pick, x_out.astype(jnp.float32), 0.0).sum(0), CP_AXES)
            mine = live & (p == P - 1) & (i == (n_tok - 1) // tc)
            finals = finals.at[m].set(jnp.where(mine, x_last, finals[m]))
            x_buf = collectives.pipeline_pass(x_out, P)
            return (x_buf, kb, vb, finals), None

        x0 = jnp.zeros((two_pz, cfg.hidden_size), jnp.dtype(dtype))
        (_, kb, vb, finals), _ = jax.lax.scan(tick, (x0, kbuf, kbuf, finals0), jnp.arange(items + P - 1))
        with jax.named_scope("logits"):
            if P > 1:
                finals = jax.lax.psum(finals, "pipeline")
            logits = model_lib.unembed(finals.astype(jnp.dtype(dtype)), params["final_norm"], params["unembed"], cfg)
            logits = collectives.vocab_parallel_gather(logits, P)[:, :cfg.vocab_size]
        # [M, n, C, 2Pz, K, H] → [M, n, C·2Pz, K, H]: this device's rows in the chunked layout order
        return logits, kb.reshape(m_total, n, C * two_pz, kh, hd), vb.reshape(m_total, n, C * two_pz, kh, hd)

    # the same specs as the unchunked step, expert-parallel degree included (issue 19: the degree was once left out
    # here, so with EP the step declared the experts replicated and jit gathered them onto every device)
    pspecs = pipe_lib.param_partition_specs(cfg, parallel, dtype)
    tok_spec = Ps(None, CP_AXES)
    kv_spec = Ps(None, "pipeline", CP_AXES, None, None)
    fn = jax.shard_map(step_local, mesh=mesh, in_specs=(pspecs, tok_spec, Ps(CP_AXES), Ps()),
                       out_specs=(Ps(), kv_spec, kv_spec), check_vma=False)
    return jax.jit(fn)
