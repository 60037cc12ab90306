"""Analytic FLOP counts of one gpt-oss prefill (multiply-add = 2 FLOPs), for MFU and for checking XLA's counts.

Per token and layer: q/k/v `2·D·(N+2K)·H`, o `2·N·H·D`, router `2·D·E`, k experts `k·(2·D·2I + 2·I·D)`.
Attention per layer: `4·N·H` per visible (query, key) pair (QKᵀ and PV): `T(T+1)/2` pairs on full layers,
`Σ_i min(i+1, W)` on sliding layers. Head: final norm + unembedding of the last token only, `2·D·V`.
gpt-oss-120b: 9.1 GFLOP/token of matmuls (design §8).
"""

from __future__ import annotations

from slope_jax.model.config import ModelConfig


def per_token_matmul(cfg: ModelConfig) -> float:
    """Matmul FLOPs per token over all layers (projections, router, the k selected experts)."""
    D, N, K, H = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    E, I, k = cfg.num_experts, cfg.intermediate_size, cfg.experts_per_token
    per_layer = 2 * D * (N + 2 * K) * H + 2 * N * H * D + 2 * D * E + k * (2 * D * 2 * I + 2 * I * D)
    return float(per_layer * cfg.num_hidden_layers)


def visible_pairs(t: int, window: int | None) -> int:
    """Number of (query, key) pairs a causal layer computes over t tokens (window: keys per query, or None)."""
    if window is None or window >= t:
        return t * (t + 1) // 2
    return window * (window + 1) // 2 + (t - window) * window


def attention(cfg: ModelConfig, t: int) -> float:
    """Attention-score and value FLOPs (QKᵀ + PV) over all layers for a t-token prompt."""
    per_pair = 4 * cfg.num_attention_heads * cfg.head_dim
    total = 0
    for layer in range(cfg.num_hidden_layers):
        total += per_pair * visible_pairs(t, cfg.sliding_window if cfg.is_sliding(layer) else None)
    return float(total)


def prefill(cfg: ModelConfig, t: int) -> dict[str, float]:
    """FLOPs of one t-token prefill: {"matmul", "attention", "head", "total"}."""
    out = {"matmul": per_token_matmul(cfg) * t, "attention": attention(cfg, t),
           "head": 2.0 * cfg.hidden_size * cfg.vocab_size}
    out["total"] = sum(out.values())
    return out
