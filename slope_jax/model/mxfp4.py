"""MXFP4 (OCP Microscaling, FP4 E2M1 elements + E8M0 block scales, block size 32): decode and encode.

Spec §3.3. A weight `W[E, O, I]` is stored as `blocks[E, O, I/32, 16]` (uint8, two 4-bit codes per byte, element
2j in the low nibble of byte j, element 2j+1 in the high nibble) and `scales[E, O, I/32]` (uint8 `s` meaning
2^(s−127)). Blocks run along the input (contraction) axis. Every decoded value is exact in bfloat16.

`decode` is the jit-able path used inside the compiled step (experts stay packed in device memory);
`decode_numpy` is the host reference; `encode_numpy` quantizes (used to write test checkpoints).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32  # elements per block (OCP MX block size)
FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # E2M1 code table, bit 3 = sign (docs/model.md §3.3)
SCALE_BIAS = 127  # E8M0: byte s encodes 2^(s - 127)


def e2m1(codes: jax.Array) -> jax.Array:
    """FP4 E2M1 codes (int32 0..15, bit 3 the sign) → float32 `FP4_VALUES` (docs/model.md §3.3), by arithmetic:
    e = bits 2..1, m = bit 0; e = 0 gives m/2, else (1 + m/2)·2^(e−1). No table lookup: XLA:CPU runs a gather from
    a table element by element (a gather-based decode of the peer config's 16 experts took 1.6× as long), and Triton
    has none (`kernels.grouped_moe` decodes its weight tiles with this too)."""
    e = (codes >> 1) & 3
    m = (codes & 1).astype(jnp.float32)
    mag = jnp.where(e == 0, 0.5 * m, (2.0 + m) * jnp.left_shift(jnp.int32(1), e).astype(jnp.float32) * 0.25)
    return jnp.where(codes >= 8, -mag, mag)


def decode(blocks: jax.Array, scales: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
    """Dequantize MXFP4 inside a compiled program.

    Args:
      blocks: uint8 `[..., O, G, 16]` (G = I/32 blocks per row).
      scales: uint8 `[..., O, G]`.
      dtype: output dtype (bfloat16 or float32; both are exact).
    Returns:
      `[..., O, G*32]` in `dtype`, i.e. `W[..., o, 32g + 2j] = E2M1(lo(B[..., o, g, j])) · 2^(S[..., o, g] − 127)` and
      the high nibble at `32g + 2j + 1` (docs/model.md §3.3).
    """
    c = blocks.astype(jnp.int32)
    # element 2j is the low nibble of byte j, 2j+1 the high nibble: [..., O, G, 16, 2] → [..., O, G, 32]
    vals = jnp.stack([e2m1(c & 15), e2m1(c >> 4)], axis=-1).reshape(*blocks.shape[:-1], BLOCK)
    # 2^(s−127) built from its exponent bits (exact for s = 1…254); s = 255 is 2^127 · 2, so that 0 · 2^128 stays 0
    # and the rest overflows to ±inf exactly as ldexp does. s = 0 gives 0 (2^-127 is subnormal; XLA flushes it).
    s = scales.astype(jnp.int32)
    pow2 = jax.lax.bitcast_convert_type(jnp.minimum(s, 254) << 23, jnp.float32)
    vals = vals * pow2[..., None] * jnp.where(s == 255, 2.0, 1.0).astype(jnp.float32)[..., None]
    return vals.reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK).astype(dtype)


def decode_numpy(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Host reference decoder (float32), same contract as `decode`."""
    lut = np.asarray(FP4_VALUES, dtype=np.float32)
    blocks = np.asarray(blocks, dtype=np.uint8)
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 2 * blocks.shape[-1])
    vals = np.ldexp(lut[codes], (np.asarray(scales, dtype=np.int32) - SCALE_BIAS)[..., None])
    return vals.reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK).astype(np.float32)


def encode_numpy(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantize `w[..., I]` (I a multiple of 32) to MXFP4 `(blocks[..., I/32, 16], scales[..., I/32])`.

    The scale is the smallest power of two that maps the block's max |w| into [0, 6]; each element is rounded to the
    nearest E2M1 value (ties to the lower magnitude). Used to write test checkpoints; round-trips exactly for values
    that are already representable. Raises ValueError if the last axis is not a multiple of 32.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 encode: last axis {w.shape[-1]} is not a multiple of {BLOCK}")
    g = w.reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    amax = np.abs(g).max(axis=-1)
    e = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), -SCALE_BIAS)
    e = np.clip(e, -SCALE_BIAS, 255 - SCALE_BIAS).astype(np.int32)
    scaled = g / np.ldexp(np.float32(1.0), e)[..., None]
    mags = np.asarray(FP4_VALUES[:8], dtype=np.float32)
    idx = np.abs(np.abs(scaled)[..., None] - mags).argmin(axis=-1)
    codes = (idx | np.where(scaled < 0, 8, 0)).astype(np.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (e + SCALE_BIAS).astype(np.uint8)
