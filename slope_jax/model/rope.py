"""Rotary position embedding with YaRN scaling, as gpt-oss uses it (docs/model.md §2.2).

Notable:
- `truncate: false`: the YaRN correction bounds stay fractional (8.0928 / 17.3980 for the released config); rounding
  them to 8 / 18 is a known bug of other engines (docs/model.md §5 pitfall 1).
- The concentration `0.1·ln(factor) + 1` multiplies both cos and sin, so q·k logits carry its square.
- Half-split ("NeoX") rotation on the full head_dim.
- Tables are computed from global token positions in float32, the order of operations following HF
  `_compute_yarn_parameters`; frequencies agree with HF's to 1 ulp.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from slope_jax.model.config import ModelConfig


def yarn_correction_range(cfg: ModelConfig) -> tuple[float, float]:
    """YaRN (low, high) dimension bounds (Peng et al. 2023, eq. 17-18; docs/model.md §2.2), clamped to [0, head_dim−1].

    `low = (D/2)·ln(L_orig / (beta_fast·2π)) / ln(theta)`, `high` likewise with `beta_slow`; floored/ceiled only when
    `rope_truncate` is set (gpt-oss: not set).
    """
    dim = cfg.head_dim

    def corr(rot: float) -> float:
        return (dim * math.log(cfg.rope_original_max_position_embeddings / (rot * 2 * math.pi))) / (
            2 * math.log(cfg.rope_theta))

    low, high = corr(cfg.rope_beta_fast), corr(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0.0), min(high, dim - 1.0)


def inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Per-pair inverse frequencies `[D/2]` float32 (radians per token), YaRN-blended (docs/model.md §2.2)."""
    dim = cfg.head_dim
    # theta^(2i/D): exponent in float32 as HF computes it, the power correctly rounded (float64, then float32), so
    # the table does not depend on a library's float32 pow (torch's differs from it by 1 ulp in 2 of 32 dims)
    exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = (np.float64(np.float32(cfg.rope_theta)) ** exponent.astype(np.float64)).astype(np.float32)
    extrapolation = np.float32(1.0) / pos_freqs
    if cfg.rope_type == "default":
        return extrapolation.astype(np.float32)
    interpolation = np.float32(1.0) / (np.float32(cfg.rope_scaling_factor) * pos_freqs)
    low, high = yarn_correction_range(cfg)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_factor = np.float32(1.0) - ramp
    out = interpolation * (np.float32(1.0) - extrapolation_factor) + extrapolation * extrapolation_factor
    return out.astype(np.float32)


def attention_scaling(cfg: ModelConfig) -> float:
    """YaRN concentration `0.1·ln(factor) + 1` (1.3465735902799727 for factor 32), applied to cos and sin."""
    if cfg.rope_type == "default" or cfg.rope_scaling_factor <= 1.0:
        return 1.0
    return 0.1 * math.log(cfg.rope_scaling_factor) + 1.0


def cos_sin(cfg: ModelConfig, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """RoPE tables for global token positions.

    Args:
      positions: int32 `[T]` global positions (any order; pad/invalid positions just give unused rows).
      dtype: activation dtype; the tables are computed in float32 and cast to it (as HF and the reference do).
    Returns:
      `(cos, sin)`, each `[T, D/2]` in `dtype`, already multiplied by the YaRN concentration.
    """
    angle = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq(cfg))[None, :]
    scale = jnp.float32(attention_scaling(cfg))
    return (jnp.cos(angle) * scale).astype(dtype), (jnp.sin(angle) * scale).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate `x[T, n, D]` by the tables `[T, D/2]` (half-split convention, docs/model.md §2.2):
    `[x1·cos − x2·sin, x2·cos + x1·sin]`, in x's dtype.

    Written as `x·[cos, cos] + swap(x)·[−sin, sin]` over the halves (a reversed size-2 axis), not as a concatenation
    of the two halves: XLA:CPU emits a concatenate inside the fused RoPE + query-tile copy as a branch per element
    (the 8192-token step of the peer config: 86 → 70 ms per layer). The products and sums are the same IEEE
    operations (`a + b·(−s)` is exactly `a − b·s`), so the result is bit-identical to the concatenated form.
    """
    t, n, d = x.shape
    halves = x.reshape(t, n, 2, d // 2)
    c = cos[:, None, None, :]
    s = sin[:, None, None, :] * jnp.asarray([-1, 1], sin.dtype)[None, None, :, None]
    return (halves * c + jnp.flip(halves, axis=2) * s).reshape(t, n, d)
