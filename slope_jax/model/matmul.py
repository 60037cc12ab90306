"""Matmul operands widened to float32 on CPUs without bfloat16 dot instructions (`StepOptions.bf16_matmul`).

A bfloat16 × bfloat16 product is exact in float32 and every slope_jax matmul accumulates in float32, so widening the
operands first computes the same sums (up to float32 summation order); XLA:CPU then runs its float32 GEMM, faster
than its bfloat16 one on such CPUs (`options.resolve_bf16_matmul` has the measurements). What the bf16 path rounds
to bf16 between matmuls is still rounded (`through`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def operand_dtype(dtype, upcast: bool):
    """The dtype a matmul operand of `dtype` runs in: float32 for bfloat16 when `upcast`, else `dtype` itself."""
    return jnp.dtype(jnp.float32) if upcast and jnp.dtype(dtype) == jnp.bfloat16 else jnp.dtype(dtype)


def widen(x: jax.Array, upcast: bool) -> jax.Array:
    """`x` in its `operand_dtype` (float32 when `upcast` and x is bfloat16; otherwise `x` unchanged)."""
    return x.astype(operand_dtype(x.dtype, upcast))


def through(x: jax.Array, dtype, upcast: bool) -> jax.Array:
    """`x` rounded to `dtype` (the activation dtype), then widened to float32 when `upcast` (`widen`): the operand a
    bf16 matmul would see, in the dtype the widened matmul takes. One fused elementwise op."""
    return widen(x.astype(dtype), upcast)
