"""FLOP counts of one gpt-oss prefill (multiply-add = 2 FLOPs): the model's useful work, and the work each device of
the engine actually executes (tile padding, masked tiles, empty pipeline slots, bubble ticks, MoE tile padding).

Model FLOPs (for MFU): per token and layer q/k/v `2·D·(N+2K)·H`, o `2·N·H·D`, router `2·D·E`, k experts
`k·(2·D·2I + 2·I·D)`; attention `4·N·H` per visible (query, key) pair (QKᵀ and PV): `T(T+1)/2` pairs on full layers,
`Σ_i min(i+1, W)` on sliding layers; head: final norm + unembedding of the last token only, `2·D·V`.
gpt-oss-120b: 9.1 GFLOP/token of matmuls (`prefill(cfg, 1)["matmul"]`).

Executed FLOPs per device (`per_device`) follow the engine's structure (`model/attention.py`,
`model/moe.py`, `parallel/pipeline.py`):
  * attention is blockwise: a (query tile × key tile) block costs `4·bq·bk·heads·H` whether or not every entry is
    visible; the key-tile range per query tile comes from the tokens' global positions exactly as `attention.attend`
    computes it (`visited_tiles`);
  * full layers on `R·U` devices: heads `N/U` after the Ulysses all-to-all, the zigzag ring's step 0 (causal diagonal
    + one full block) and `R−1` steps of two full blocks; sliding layers keep all `N` heads on the local pieces plus a
    halo of `W−1` keys;
  * MoE: tokens grouped by expert and run in tiles of the "loop" ladder (`options.moe_loop_tiles`: `min(moe_tile,
    T_local·k)` rows, then 4× shorter ones for the group's last rows; one height with the Pallas kernel); routing is
    assumed balanced (`assignments / E` per expert; pad tokens go to no expert, as the engine routes them);
  * pipeline: every stage runs all `S` slots (empty ones too) on each of the `M + P − 1` ticks, as the step's
    critical path: the ticks are synchronous, and on each some stage is live. A stage's own `P − 1` fill/drain ticks
    visit no attention tile and no expert (its tokens are pads without positions, `parallel.pipeline`), so the work
    a device actually does is less: `plan.verify.attention_work` compares the program's count with the live ticks.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from slope_jax.model.config import ModelConfig
from slope_jax.model.options import (MOE_KERNEL_MAX_TILE, UNEMBED_MIN_ROWS, StepOptions, moe_loop_rows,
                                     moe_loop_tiles)

INVALID_POS = -(2**30)  # attention.INVALID_POS (kept here so that this module needs no JAX)
NO_WINDOW = 2**30


def per_token_matmul(cfg: ModelConfig) -> float:
    """Model matmul FLOPs per token over all layers (projections, router, the k selected experts)."""
    return float(_proj_per_token(cfg) + _expert_per_row(cfg) * cfg.experts_per_token) * cfg.num_hidden_layers


def _proj_per_token(cfg: ModelConfig) -> int:
    D, N, K, H, E = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                     cfg.num_experts)
    return 2 * D * (N + 2 * K) * H + 2 * N * H * D + 2 * D * E


def _expert_per_row(cfg: ModelConfig) -> int:
    D, I = cfg.hidden_size, cfg.intermediate_size
    return 2 * D * 2 * I + 2 * I * D


def _elements_per_token(cfg: ModelConfig) -> int:
    """Activation elements one token's layer reads or writes around the matmuls (attention norm in/out, q/k/v out
    and RoPE, o-projection in/out, residual adds, MoE norm, router logits, the MoE output accumulation)."""
    D, N, K, H, E = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                     cfg.num_experts)
    return 7 * D + 2 * (N + 2 * K) * H + N * H + E


def _elements_per_row(cfg: ModelConfig) -> int:
    """Activation elements of one expert-matmul row (the gathered token, gate/up out and SwiGLU in, its output,
    the down-projection output and its weighted scatter-add)."""
    D, I = cfg.hidden_size, cfg.intermediate_size
    return 3 * D + 5 * I


def visible_pairs(t: int, window: int | None) -> int:
    """Number of (query, key) pairs a causal layer computes over t tokens (window: keys per query, or None)."""
    if window is None or window >= t:
        return t * (t + 1) // 2
    return window * (window + 1) // 2 + (t - window) * window


def attention(cfg: ModelConfig, t: int) -> float:
    """Model attention FLOPs (QKᵀ + PV over visible pairs) over all layers for a t-token prompt."""
    per_pair = 4 * cfg.num_attention_heads * cfg.head_dim
    total = 0
    for layer in range(cfg.num_hidden_layers):
        total += per_pair * visible_pairs(t, cfg.sliding_window if cfg.is_sliding(layer) else None)
    return float(total)


def prefill(cfg: ModelConfig, t: int) -> dict[str, float]:
    """Model FLOPs of one t-token prefill: {"matmul", "attention", "head", "total"}."""
    out = {"matmul": per_token_matmul(cfg) * t, "attention": attention(cfg, t),
           "head": 2.0 * cfg.hidden_size * cfg.vocab_size}
    out["total"] = sum(out.values())
    return out


# ---------------------------------------------------------------------------------------------------------------
# executed FLOPs per device

def visited_tiles(q_pos: np.ndarray, k_pos: np.ndarray, window: int, q_tile: int, kv_tile: int
                  ) -> tuple[int, int, int]:
    """(query tile × key tile) blocks `attention.attend` runs, and the tile shape `(bq, bk)`.

    q_pos `[Tq]`, k_pos `[Tk]` int global positions (negative = no key); window: keys per query (NO_WINDOW for full
    layers). Mirrors `attend`: tiles of `min(tile, length)`, padded with INVALID_POS; per query tile the contiguous
    range of key tiles from the first to the last that may hold a visible key.
    """
    tq, tk = len(q_pos), len(k_pos)
    bq, bk = min(q_tile, tq), min(kv_tile, tk)
    nq, nk = -(-tq // bq), -(-tk // bk)
    qp = np.full(nq * bq, INVALID_POS, np.int64)
    qp[:tq] = q_pos
    kp = np.full(nk * bk, INVALID_POS, np.int64)
    kp[:tk] = k_pos
    qp, kp = qp.reshape(nq, bq), kp.reshape(nk, bk)
    exists = kp >= 0
    big = 2**31
    k_lo = np.where(exists, kp, big - 1).min(1)
    k_hi = np.where(exists, kp, -big).max(1)
    vq = qp >= 0
    q_lo = np.where(vq, qp, big - 1).min(1)
    q_hi = np.where(vq, qp, -big).max(1)
    needed = exists.any(1)[None] & (k_lo[None] <= q_hi[:, None]) & (k_hi[None] > q_lo[:, None] - window)
    any_needed = needed.any(1)
    lo = np.where(any_needed, needed.argmax(1), 0)
    hi = np.where(any_needed, nk - needed[:, ::-1].argmax(1), 0)
    return int((hi - lo).sum()), bq, bk


@functools.lru_cache(maxsize=4096)
def _visited_tiles_in_order(t: int, window: int, q_tile: int, kv_tile: int) -> tuple[int, int, int]:
    """`visited_tiles` of the single-device path: queries and keys at positions 0..t−1 (cached per shape)."""
    pos = np.arange(t)
    return visited_tiles(pos, pos, window, q_tile, kv_tile)


def _layout_positions(t: int, ring: int, ulysses: int) -> np.ndarray:
    from slope_jax.parallel import layout  # numpy only

    return layout.layout_positions(t, ring, ulysses)


# The tile model is the step's own options (`model.options.StepOptions`: q_tile, kv_tile, moe_tile; the planner
# ignores the implementations): one definition, one set of defaults.
Tiles = StepOptions


def stage_slots(cfg: ModelConfig, pipeline: int) -> tuple[int, int]:
    """(slots per stage S, stack entries per stage n) of the engine's stage split (`parallel.stages.plan_stages`,
    the one implementation)."""
    from slope_jax.parallel import stages  # numpy only

    plan = stages.plan_stages(cfg, pipeline)
    return plan.slots_per_stage, plan.stack_per_stage


def _attention_calls(cfg: ModelConfig, t: int, ring: int, ulysses: int, tiles: Tiles) -> dict[str, np.ndarray]:
    """Attention FLOPs of one sliding and one full layer on each device `[R, U]` of the CP path, by call class
    (`sliding`, `step0`: the ring's causal step, `ring`: steps 1..R−1), each also as `<class>_pass`: the FLOPs of one
    key tile per query tile (what one pass of the dynamic key-tile loop costs; for checking compiled programs)."""
    return _attention_calls_cached(cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window, t, ring, ulysses,
                                   tiles.q_tile, tiles.kv_tile)


@functools.lru_cache(maxsize=256)
def _attention_calls_cached(N: int, H: int, W: int, t: int, R: int, U: int, q_tile: int, kv_tile: int):
    tiles = Tiles(q_tile, kv_tile)
    pz = t // (2 * R * U)
    c = U * pz
    pos = _layout_positions(t, R, U).reshape(R, U, 2, pz)
    halo = max(W - 1, 0)
    out = {k: np.zeros((R, U)) for k in ("sliding", "step0", "ring", "sliding_pass", "step0_pass", "ring_pass")}

    def add(cls, r, u, q, k, window, heads):
        n, bq, bk = visited_tiles(q, k, window, tiles.q_tile, tiles.kv_tile)
        out[cls][r, u] += n * 4 * bq * bk * heads * H
        out[cls + "_pass"][r, u] += -(-len(q) // bq) * 4 * bq * bk * heads * H

    for r in range(R):
        for u in range(U):
            for slot in range(2):
                q = pos[r, u, slot]
                keys = q
                if halo:
                    h = np.arange(int(q[0]) - halo, int(q[0]))
                    keys = np.concatenate([np.where(h >= 0, h, INVALID_POS), q])
                add("sliding", r, u, q, keys, W, N)
    chunk = [np.arange(i * c, (i + 1) * c) for i in range(2 * R)]
    for r in range(R):
        p0, p1 = chunk[r], chunk[2 * R - 1 - r]
        add("step0", r, 0, p0, p0, NO_WINDOW, N // U)
        add("step0", r, 0, p1, np.concatenate([p0, p1]), NO_WINDOW, N // U)
        for step in range(1, R):
            s = (r - step) % R
            before = s < r
            add("ring", r, 0, p0 if before else p1, chunk[s], NO_WINDOW, N // U)
            add("ring", r, 0, p1, chunk[s] if before else chunk[2 * R - 1 - s], NO_WINDOW, N // U)
        for cls in ("step0", "ring", "step0_pass", "ring_pass"):
            out[cls][r, :] = out[cls][r, 0]  # every Ulysses rank of a ring rank does the same work
    return out


def moe_rows(cfg: ModelConfig, tokens: int, real: int, tile: int, expert: int = 1,
             ladder: bool = True) -> dict[int, int]:
    """Expert-matmul rows one device runs, by tile height: `{height: rows}` (sum: all rows incl. tile padding).

    tokens: tokens the device's MoE sees (its local tokens, × `expert` when EP all-gathers them over the EP group);
    real: how many of them are real; tile: `moe_tile`. ladder: the "loop" MoE's tile ladder
    (`options.moe_loop_tiles`, rows per height as `options.moe_loop_rows` runs them); False: one height
    `h = min(tile, MOE_KERNEL_MAX_TILE)`, `⌈c/h⌉·h` (the Pallas kernel).
    Heights are clipped to `tokens·k` as the engine does. Balanced routing: `real·k` assignments split evenly over the
    E experts; pads are routed to no expert (`moe.route_valid`). Experts with no assignment run nothing.
    """
    k, E = cfg.experts_per_token, cfg.num_experts
    heights = moe_loop_tiles(tile, tokens * k) if ladder else (max(1, min(tile, MOE_KERNEL_MAX_TILE, tokens * k)),)
    q, rem = divmod(real * k, E)
    local = E // expert  # EP rank 0 holds the first E/EP experts: the busiest, with q + 1 assignments each first
    out = dict.fromkeys(heights, 0)
    for count, experts in ((q + 1, min(rem, local)), (q, local - min(rem, local))):
        for size, rows in moe_loop_rows(count, heights).items():
            out[size] += experts * rows
    return out


def _moe_totals(by_height: dict[int, int]) -> tuple[int, int]:
    """(rows, expert-loop iterations) of `moe_rows`' result."""
    return sum(by_height.values()), sum(r // h for h, r in by_height.items())


def _moe_classes(by_height: dict[int, int], passes: int, experts: int, cfg: ModelConfig) -> dict[str, tuple]:
    """`classes` entries of the MoE for checking compiled programs: per tile height h, `moe_<h>`: (FLOPs of all its
    tiles, FLOPs of one tile per expert: what one pass of that height's dynamic loop costs in the HLO); `moe`: the
    same over all heights (one loop of one height: the Pallas kernel's grid)."""
    per_row = _expert_per_row(cfg)
    out = {f"moe_{h}": (float(passes * r * per_row), float(passes * experts * h * per_row))
           for h, r in by_height.items()}
    out["moe"] = (sum(v[0] for v in out.values()), sum(v[1] for v in out.values()))
    return out


def per_device(cfg: ModelConfig, pipeline: int, ring: int, ulysses: int, t: int, n: int | None = None, m: int = 1,
               tiles: Tiles = Tiles(), expert: int = 1) -> dict[str, float]:
    """Executed FLOPs on the busiest device for one compiled step of `m` requests of bucket length `t` (`n` real
    tokens each, default t) on layout (P, R, U), by part: projections, attention, moe, head, and total.

    One device (P = R = U = 1) runs the single-device path (all L layers in order, window per layer); otherwise the
    pipelined shard_map step: `m + P − 1` ticks × S slots per tick.
    Also returned (not FLOPs, not in `total`): `elements`, the activation elements the layers read or write around
    the matmuls (`_elements_per_token` per local token, `_elements_per_row` per MoE row incl. tile padding), and
    `attention_entries`, the score entries computed (attention FLOPs / 4H), and `moe_tiles`, the expert-loop
    iterations (MoE rows / tile: a fixed cost each, which grows with the expert count), for the cost model.
    """
    n = t if n is None else n
    if pipeline * ring * ulysses == 1:
        return _per_device_single(cfg, t, n, m, tiles)
    return _per_device_sharded(cfg, pipeline, ring, ulysses, t, n, m, tiles, expert)


def _per_device_single(cfg: ModelConfig, t: int, n: int, m: int, tiles: Tiles) -> dict[str, float]:
    """`per_device` of the single-device path: all L layers in order, the window per layer."""
    D, V = cfg.hidden_size, cfg.vocab_size
    cls = {"sliding": [0.0, 0.0], "step0": [0.0, 0.0]}
    for layer in range(cfg.num_hidden_layers):
        w = cfg.sliding_window if cfg.is_sliding(layer) else NO_WINDOW
        nt, bq, bk = _visited_tiles_in_order(t, w, tiles.q_tile, tiles.kv_tile)
        per_tile = 4 * bq * bk * cfg.num_attention_heads * cfg.head_dim
        c = cls["sliding" if cfg.is_sliding(layer) else "step0"]
        c[0] += m * nt * per_tile
        c[1] += m * -(-t // bq) * per_tile
    by_height = moe_rows(cfg, t, n, tiles.moe_tile, ladder=tiles.moe_impl != "pallas")
    rows, iters = _moe_totals(by_height)
    L = cfg.num_hidden_layers
    out = {"projections": float(m * L * t * _proj_per_token(cfg)), "attention": cls["sliding"][0] + cls["step0"][0],
           "moe": float(m * L * rows * _expert_per_row(cfg)),
           "head": 2.0 * max(m, UNEMBED_MIN_ROWS) * D * V}  # the step unembeds ≥ UNEMBED_MIN_ROWS rows
    out["total"] = sum(out.values())
    out["elements"] = float(m * L * (t * _elements_per_token(cfg) + rows * _elements_per_row(cfg)))
    out["moe_tiles"] = float(m * L * iters)
    out["attention_entries"] = out["attention"] / (4 * cfg.head_dim)
    both = (cls["sliding"][0] + cls["step0"][0], cls["sliding"][1] + cls["step0"][1])
    out["classes"] = {"sliding": tuple(cls["sliding"]), "step0": tuple(cls["step0"]), "attention": both,
                      **_moe_classes(by_height, m * L, cfg.num_experts, cfg)}
    return out


def _per_device_sharded(cfg: ModelConfig, P: int, R: int, U: int, t: int, n: int, m: int, tiles: Tiles,
                        expert: int) -> dict[str, float]:
    """`per_device` of the pipelined shard_map step: `m + P − 1` ticks × S slots, the busiest device's share."""
    D, V = cfg.hidden_size, cfg.vocab_size
    S, _ = stage_slots(cfg, P)
    ticks = m + P - 1
    tl = t // (R * U)
    calls = _attention_calls(cfg, t, R, U, tiles)
    busiest = np.unravel_index(np.argmax(calls["sliding"] + calls["step0"] + calls["ring"]), (R, U))
    per = {k: float(v[busiest]) * ticks * S / 2 for k, v in calls.items()}
    pos = _layout_positions(t, R, U).reshape(R * U, tl)
    real = int((pos < n).sum(1).max()) if expert == 1 else int((pos < n).sum())  # EP: the whole EP group's tokens
    by_height = moe_rows(cfg, tl * expert, min(real, tl * expert), tiles.moe_tile, expert,
                         ladder=tiles.moe_impl != "pallas")
    rows, iters = _moe_totals(by_height)
    vrows = -(-V // (P * R * U))  # every device unembeds its vocabulary shard (`parallel.stages.vocab_shards`)
    out = {"projections": float(ticks * S * tl * _proj_per_token(cfg)),
           "attention": per["sliding"] + per["step0"] + per["ring"],
           "moe": float(ticks * S * rows * _expert_per_row(cfg)),
           "head": 2.0 * max(m, UNEMBED_MIN_ROWS) * D * vrows}
    out["total"] = sum(out.values())
    out["elements"] = float(ticks * S * (tl * _elements_per_token(cfg) + rows * _elements_per_row(cfg)))
    out["moe_tiles"] = float(ticks * S * iters)
    out["attention_entries"] = out["attention"] / (4 * cfg.head_dim)
    out["classes"] = {"sliding": (per["sliding"], per["sliding_pass"]), "step0": (per["step0"], per["step0_pass"]),
                      "ring": (per["ring"], per["ring_pass"]),
                      **_moe_classes(by_height, ticks * S, cfg.num_experts // expert, cfg)}
    return out


def padding_ratio(cfg: ModelConfig, n: int, tiles: Tiles = Tiles(), bucket: int | None = None) -> float:
    """Executed FLOPs of an n-token prompt in its bucket over the FLOPs of the same prompt compiled at exactly n
    tokens, on one device (`per_device`, P = R = U = 1): the work spent on padding. bucket: the padded length
    (default `parallel.layout.bucket_length(n)`). The bucket rule bounds this by (1 + 1/32)² ≤ 1.07 for n ≥ 256
    (`layout.bucket_length`); `benchmarks/bucket_waste.py` checks every length. Raises ValueError if bucket < n."""
    from slope_jax.parallel import layout  # numpy only

    t = layout.bucket_length(n) if bucket is None else bucket
    if t < n:
        raise ValueError(f"bucket {t} is shorter than the prompt ({n} tokens)")
    return per_device(cfg, 1, 1, 1, t, n, 1, tiles)["total"] / per_device(cfg, 1, 1, 1, n, n, 1, tiles)["total"]


def model_flops(cfg: ModelConfig, n: int) -> float:
    """Useful FLOPs of one n-token prefill (the MFU numerator)."""
    return prefill(cfg, n)["total"]


def floor_seconds(cfg: ModelConfig, n: int, devices: int, peak_flops: float) -> float:
    """Lower bound on TTFT: model FLOPs / (devices × peak)."""
    return model_flops(cfg, n) / (devices * peak_flops) if devices and peak_flops else math.inf


def cached_prefix_attention(cfg: ModelConfig, pipeline: int, ring: int, ulysses: int, t: int, cached: int, m: int = 1,
                            tiles: Tiles = Tiles()) -> float:
    """Attention FLOPs per device of a prefix-reuse step's new tokens (bucket t) over `cached` reused keys — beyond
    their own causal work, which `per_device` counts. The cached keys are spread evenly over a stage's g = R·U devices
    and every query of the stage visits every device (`context_parallel.prefix_attention`: queries travel, keys stay),
    so each device scores all t queries against its ⌈cached/g⌉ rows on a full layer; on a sliding layer only the last
    W − 1 cached keys are visible (one or two key tiles). Tiles are rounded as the engine visits them (the
    options' prefix_q_tile, `prefix_kv_tile_for` the local queries on full layers, kv_tile on sliding ones); a
    stage runs
    its slots (half sliding, half full) for each of the m requests."""
    if cached <= 0:
        return 0.0
    g = ring * ulysses
    rows = -(-cached // g)
    tq = t // g  # local queries per device
    bq = min(tiles.prefix_q_tile, tq)
    q_tiles = g * -(-tq // bq)
    # full layers: prefix_kv_tile tiles over all rows; sliding layers: kv_tile tiles over the last W − 1 rows
    bk_full, bk_sliding = min(tiles.prefix_kv_tile_for(tq), rows), min(tiles.kv_tile, rows)
    full = -(-rows // bk_full) * bk_full
    sliding = min(-(-rows // bk_sliding), -(-(max(cfg.sliding_window - 1, 1)) // bk_sliding) + 1) * bk_sliding
    if g * pipeline == 1:
        kinds = [cfg.is_sliding(i) for i in range(cfg.num_hidden_layers)]
        key_rows = sum(sliding if k else full for k in kinds)
    else:
        slots, _ = stage_slots(cfg, pipeline)
        key_rows = slots // 2 * (sliding + full)
    return float(m * q_tiles * key_rows * 4 * bq * cfg.num_attention_heads * cfg.head_dim)
