"""Schedule math of sequence-pipelined prefill (`parallel.pipeline`): predicted TTFT for (P, R, U, C). No JAX.

The compiled step is SPMD and lock-step: at tick k stage s runs chunk k − s, and a tick lasts as long as its slowest
live stage. With per-chunk stage times `t[s][i]` (seconds) the critical path of one request is

    TTFT = Σ_{k=0}^{C+P−2} max_{s : 0 ≤ k−s < C} t[s][k−s]          (C + P − 1 ticks)

and, with `τ_i = max_s t[s][i]` (the time of chunk i on the slowest stage), it splits as

    TTFT = ideal + fill + imbalance,   ideal = max_s Σ_i t[s][i]   (the stage's own work: perfect overlap)
                                       fill = (P − 1)·mean_i τ_i   (the pipeline fills and drains once)
                                       imbalance = TTFT − ideal − fill

Equal chunks (the implemented rule): chunk i's MLP/MoE and projection work is the same for every i, but its full-layer
attention grows with i (its queries see the i·Tc keys of earlier chunks), so τ_i increases and the drain runs at the
last, most expensive chunk: imbalance = (P − 1)·(τ_{C−1} − mean τ) for stage-equal times. With C = 1 the schedule is
P ticks of a whole stage, TTFT = P·ideal, so the gain `TTFT(C=1)/TTFT(C)` → P as C grows, less fill (~(P−1)/C of a
stage's work) and imbalance.

Per-chunk FLOPs follow `plan.flops` (multiply-add = 2 FLOPs): projections and experts per token per slot, and
`4·N·H` per visible (query, key) pair. Every stage computes the same number of slots (`stage_slots`: a slot left empty
by the stage split still costs a layer's compute, as in `parallel.pipeline`).
"""

from __future__ import annotations

from slope_jax.model.config import ModelConfig
from slope_jax.plan import flops as flops_lib


def stage_slots(cfg: ModelConfig, pipeline: int) -> tuple[int, int]:
    """(sliding, full) slots every stage computes under `parallel.stages.plan_stages`' stated split (half each of
    `flops.stage_slots`' slot count)."""
    slots, _ = flops_lib.stage_slots(cfg, pipeline)
    return slots // 2, slots // 2


def chunk_bounds(t: int, chunks: int) -> list[tuple[int, int]]:
    """Equal chunks [start, end) of a t-token (padded) request. Raises ValueError if chunks does not divide t."""
    if chunks < 1 or t % chunks:
        raise ValueError(f"seq_chunks={chunks} must be a positive divisor of the padded length {t}")
    tc = t // chunks
    return [(i * tc, (i + 1) * tc) for i in range(chunks)]


def _pairs(start: int, end: int, window: int | None) -> int:
    """Visible causal (query, key) pairs of queries [start, end) (each sees keys [max(0, q−W+1), q])."""
    return flops_lib.visible_pairs(end, window) - flops_lib.visible_pairs(start, window)


def chunk_stage_flops(cfg: ModelConfig, t: int, pipeline: int, chunks: int) -> list[dict[str, float]]:
    """FLOPs one stage spends on each chunk: [{"matmul", "attention", "total"}] per chunk, over all its slots."""
    sliding, full = stage_slots(cfg, pipeline)
    per_token_layer = flops_lib.per_token_matmul(cfg) / cfg.num_hidden_layers
    per_pair = 4 * cfg.num_attention_heads * cfg.head_dim
    out = []
    for a, b in chunk_bounds(t, chunks):
        mm = per_token_layer * (b - a) * (sliding + full)
        att = per_pair * (sliding * _pairs(a, b, cfg.sliding_window) + full * _pairs(a, b, None))
        out.append({"matmul": float(mm), "attention": float(att), "total": float(mm + att)})
    return out


def critical_path(stage_times: list[list[float]], hop_s: float = 0.0) -> dict[str, float]:
    """Lock-step schedule of one request: `stage_times[s][i]` seconds of stage s on chunk i; `hop_s`: the pipeline
    `ppermute` of one chunk's activation per tick. Returns {"ticks", "ttft_s", "ideal_s", "fill_s", "imbalance_s"}
    (module docstring)."""
    P, C = len(stage_times), len(stage_times[0])
    ticks = C + P - 1
    ttft = sum(max(stage_times[s][k - s] for s in range(P) if 0 <= k - s < C) + hop_s for k in range(ticks))
    ideal = max(sum(row) for row in stage_times)
    tau = [max(stage_times[s][i] for s in range(P)) for i in range(C)]
    fill = (P - 1) * (sum(tau) / C + hop_s)
    return {"ticks": ticks, "ttft_s": ttft, "ideal_s": ideal, "fill_s": fill, "imbalance_s": ttft - ideal - fill}


def predict(cfg: ModelConfig, t: int, *, pipeline: int, ring: int = 1, ulysses: int = 1, chunks: int = 1,
            flops_per_s: float, hop_s: float = 0.0) -> dict[str, float]:
    """Predicted TTFT of one t-token request on (P, R, U, C): each stage's chunk FLOPs split evenly over its R·U
    devices at `flops_per_s` achieved per device (peak × efficiency); context-parallel communication not included.
    Returns `critical_path`'s dict plus "stage_flops" (one stage, all chunks)."""
    per_chunk = chunk_stage_flops(cfg, t, pipeline, chunks)
    times = [c["total"] / (ring * ulysses * flops_per_s) for c in per_chunk]
    out = critical_path([times] * pipeline, hop_s)
    out["stage_flops"] = sum(c["total"] for c in per_chunk)
    return out


def table(cfg: ModelConfig, t: int, *, pipeline: int, chunk_options=(1, 4, 8, 16), ring: int = 1, ulysses: int = 1,
          flops_per_s: float, hop_s: float = 0.0) -> list[dict[str, float]]:
    """`predict` for each C, with "speedup" = TTFT(C=1)/TTFT(C) (→ P as C grows, less fill and imbalance)."""
    rows = []
    for c in chunk_options:
        row = {"chunks": c, **predict(cfg, t, pipeline=pipeline, ring=ring, ulysses=ulysses, chunks=c,
                                      flops_per_s=flops_per_s, hop_s=hop_s)}
        rows.append(row)
    for row in rows:
        row["speedup"] = rows[0]["ttft_s"] / row["ttft_s"] if rows[0]["chunks"] == 1 else float("nan")
    return rows
