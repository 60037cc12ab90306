"""Memory per device of one compiled prefill step: parameters (exact, from the declared shapes), inputs, and an
estimate of XLA's temporaries, by part.

Parameters (`gpt_oss.Layers` declarations): per layer q/k/v/o weights and biases, router, expert biases in the
activation dtype; norms and sinks float32; experts MXFP4-packed — 16 bytes of 4-bit values per 32 weights plus one
scale byte, 4.25 bits per weight (OCP MX spec v1.0 §5; docs/model.md §3.3) — or dense; experts divided by the EP degree.
A stage stores ⌈L/P⌉ layers; embedding and unembedding rows are split over every device, as the sharding table says
(`parallel.stages.vocab_rows` / `vocab_shards`: V rounded up to a multiple of P·R·U, 1/(P·R·U) of it per device).

Temporaries (an estimate of the live set XLA's buffer assignment keeps; each term below was read off the
memory-usage report of compiled steps, `--xla_dump_to`):
  - the K/V of the stage's layers for the `M` requests in flight (`[M, n, T_local, K, H]` × 2; on one device the
    layer scan writes them into the output), the embedded inputs `[M, T_local, D]`, the residual stream, the layer's
    q and its float32 online-softmax state (`[T_local, N, H]` each), the ring's two K/V blocks in flight;
  - float32 score tiles `[bq, heads, bk]`: two of the widest attention call (scores and probabilities; the mask is
    fused into them) and one of the other layer kind's, which gets a buffer of its own (the two kinds' tile loops have
    different shapes). A ring step's key block is the peer's two zigzag chunks (`bk ≤ 2·U·Pz`), its queries one chunk;
  - per-layer weight copies of the layer scan (dynamic slices of the stack; none when a stage holds one layer): one on
    one device, two in a sharded step (the 2-D relayouts of q/o for the dots and the sliced MXFP4 expert blocks); the
    expert weights are not copied under `moe_impl="loop"` (sliced per expert straight from the stack,
    `model/stack.py`), but are for "ragged", "pallas" and an unresolved "auto";
    a pipelined stage whose stack holds one entry per layer kind (S = 2 slots, two layers) also copies its attention
    weights whole (the tick loop's carry), two more copies;
  - the dequantized weights of one expert, `[2I·D + D·I]`, twice (as dequantized from MXFP4 and in the dot's layout).
    They share their buffers with the attention weight copies (same size class, disjoint live ranges: the attention
    and the MoE block of a layer run one after the other), so the larger of the two counts;
  - under expert parallelism the rows a device computes — `[EP·c, D]` received by the all-to-all dispatch
    (c = `StepOptions.ep_rows`), or the stage's gathered tokens `[EP·T_local, D]` — and two float32 partial-sum
    buffers of that size (the expert loop's carry and the combine's operand).
Checked against `compiled.memory_analysis()` by benchmarks/plan_vs_xla.py (tiny and mid configs, 7 layouts incl.
pipeline 2 and 4, 1 to 8192 tokens: within 12.2 %, every layout's EP default included). XLA's buffer sharing is a heap
simulation, so this is an estimate of its live set, not a replay of it.
"""

from __future__ import annotations

from slope_jax.model.config import ModelConfig
from slope_jax.model.options import experts_read_from_stack
from slope_jax.plan.flops import Tiles, stage_slots

MXFP4_BITS = 4.25


def param_bytes(cfg: ModelConfig, dtype_bytes: int, pipeline: int = 1, expert: int = 1, *, ring: int = 1,
                ulysses: int = 1) -> dict[str, float]:
    """Parameter bytes per device of layout (pipeline, ring, ulysses) with EP degree `expert`: {"attention",
    "router", "experts", "embeddings", "total"}."""
    from slope_jax.parallel import stages  # numpy only
    from slope_jax.parallel.config import ParallelConfig

    D, N, K, H = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    E, I = cfg.num_experts, cfg.intermediate_size
    b = dtype_bytes
    _, n = stage_slots(cfg, pipeline)
    attn = (N * H * D + N * H + 2 * (K * H * D + K * H) + D * N * H + D) * b + (2 * D + N) * 4
    router = (E * D + E) * b
    if cfg.expert_format == "mxfp4":
        weights = E * (2 * I * D + D * I) * MXFP4_BITS / 8
    else:
        weights = E * (2 * I * D + D * I) * b
    experts = (weights + E * (2 * I + D) * b) / expert
    par = ParallelConfig(pipeline=pipeline, ring=ring, ulysses=ulysses)
    vrows = stages.vocab_rows(cfg, par) // stages.vocab_shards(par)
    out = {"attention": n * attn, "router": n * router, "experts": n * experts,
           "embeddings": 2 * vrows * D * b + D * 4}
    out["total"] = sum(out.values())
    return out


def temp_bytes(cfg: ModelConfig, pipeline: int, ring: int, ulysses: int, t: int, m: int, dtype_bytes: int,
               tiles: Tiles = Tiles(), expert: int = 1) -> dict[str, float]:
    """Estimated temporaries per device (module docstring), by part, plus "total"."""
    D, N, K, H, W = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                     cfg.sliding_window)
    b = dtype_bytes
    R, U = ring, ulysses
    single = pipeline * R * U == 1
    tl = t if single else t // (R * U)
    _, n = stage_slots(cfg, pipeline)
    kv = 0 if single else 2 * m * n * tl * K * H * b  # one device: the layer scan writes K/V into its output
    per_layer = param_bytes(cfg, b, 1, expert)
    # the scan body's per-layer weight copies (module docstring; none when a stage holds one layer)
    copies = 1 if single else 0 if n == 1 else 2
    L = cfg.num_hidden_layers
    attention_w = (per_layer["attention"] + per_layer["router"]) / L
    att_slices = copies * attention_w
    # an MoE that reads each expert straight from the stack makes no per-layer expert copy (`model/stack.py`)
    exp_slices = 0.0 if experts_read_from_stack(tiles.moe_impl) else copies * per_layer["experts"] / L
    S, _ = stage_slots(cfg, pipeline)
    stack_copy = 2 * attention_w if pipeline > 1 and S == 2 and n > 1 else 0.0
    layer = tl * N * H * (b + 4) + tl * D * b
    if single:
        bq, bk = min(tiles.q_tile, t), min(tiles.kv_tile, t)
        sliding = full = bq * bk * N
    else:
        pz = t // (2 * R * U)
        c = U * pz
        sliding = min(tiles.q_tile, pz) * min(tiles.kv_tile, pz + max(W - 1, 0)) * N
        full = min(tiles.q_tile, c) * min(tiles.kv_tile, 2 * c if R > 1 else c) * (N // U)
        layer += (2 * 2 * 2 * c * (max(K, U) // U) * H * b) if R > 1 else 0
    # two float32 tiles of the widest attention call live at once (scores, probabilities; the mask is fused into
    # them) and one of the other layer kind's call, which XLA places in a buffer of its own
    scores = (2 * max(sliding, full) + min(sliding, full)) * 4
    # the dequantized weights of one expert, twice: as dequantized from MXFP4 and as laid out for the dot; they share
    # buffers with the attention weight copies (the larger of the two counts)
    moe = 2 * (2 * cfg.intermediate_size * D + D * cfg.intermediate_size) * b
    # expert parallelism: the block sees EP·c received rows (all_to_all, c = tiles.ep_rows) or the stage's
    # T_stage = EP·T_local tokens (all_gather) — their hidden states (b) and two float32 partial-sum buffers of that
    # size (the expert loop's carry and the combine's operand)
    rows = tiles.ep_rows(tl, cfg.experts_per_token, expert) if tiles.resolve("").ep_dispatch == "all_to_all" else tl
    ep_tokens = 0 if single or expert == 1 else (b + 2 * 4) * expert * rows * D
    out = {"kv": float(kv), "inputs": float(m * tl * D * b), "layer": float(layer), "scores": float(scores),
           "expert_params": float(exp_slices), "stage_weights": float(stack_copy),
           "attention_params_or_dequantized_expert": float(max(att_slices, moe)),
           "expert_parallel": float(ep_tokens)}
    out["total"] = sum(out.values())
    return out


def input_bytes(t: int, m: int, devices_in_group: int) -> float:
    """Token ids, positions and lengths per device (int32)."""
    return float((m * t + t) * 4 // devices_in_group + m * 4)


def kv_export_bytes(cfg: ModelConfig, pipeline: int, ring: int, ulysses: int, t: int, m: int, dtype_bytes: int
                    ) -> float:
    """The step's K/V output per device (kept for export): `2 · M · n · T_local · K · H · b`."""
    _, n = stage_slots(cfg, pipeline)
    tl = t // (ring * ulysses)
    return float(2 * m * n * tl * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes)
