"""Pallas flash-attention kernel: one query block × a range of KV blocks → the un-normalised partial `(o, m, l)`.

The kernel is the inner loop of `slope_jax.model.attention.attend` fused into one launch: for every (query block,
KV head) program it walks the KV blocks `[lo, hi)` that the caller proved may hold a visible key, with the online
softmax (Milakov & Gimelshein 2018; Dao et al. 2022, Alg. 1 without the final division) in float32. It returns the
state *before* normalisation and without sinks, so the ring merge and the once-only sink finalisation of
`model/attention.py` consume it unchanged (docs/design.md §3, §9).

Notable:
- Masks come from global positions, as in `attend`: key j is visible to query i iff `pos_k[j] >= 0`,
  `pos_q[i] − pos_k[j] >= 0` and `pos_q[i] − pos_k[j] < window` (docs/model.md §2.3). Negative key positions: padding.
- GQA packing: program (i, kv) serves all G = N/K query heads of KV head kv. Its `[bq, G, D]` query block is one
  `[bq·G, D]` matrix against each K/V tile, so every K/V tile is loaded once for G heads (not G times) and the
  matmuls are G× taller (the FlashAttention-3 / FlashInfer GQA layout). Row r of the packed block is query r // G.
- A row that sees no key stays finite: m = −inf, l = 0, o = 0 (the exponent is taken against 0 instead of −inf).
- GPU: Triton lowering (CUDA and ROCm jaxlib). Elsewhere (CPU) Pallas interpret mode, for tests only — it is slow.
  Triton needs power-of-two block sizes and head_dim (`check_shapes` says which one is not); a G that is not a
  power of two is padded with zero query heads (their rows are dropped) on the Triton path only.

Shapes: `Tq`, `Tk` padded lengths (multiples of the blocks), `N` query heads, `K` KV heads, `G = N/K`, `Gp` G padded
(to a power of two on GPUs, = G in interpret mode), `D` head_dim, `nq = Tq / block_q`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def check_shapes(block_q: int, block_k: int, head_dim: int, backend: str, group: int = 16) -> None:
    """Raise ValueError naming the field if the Triton lowering cannot take these sizes (interpret mode takes any):
    block_k, head_dim and the packed score rows `block_q·group` (group = G padded to a power of two) must be powers
    of two >= 16, block_q a power of two."""
    if backend in ("gpu", "cuda", "rocm"):
        for name, v in (("block_k", block_k), ("head_dim", head_dim), ("block_q·G", block_q * group)):
            if not _is_pow2(v) or v < 16:
                raise ValueError(f"pallas attention on {backend}: {name}={v} must be a power of two >= 16")
        if not _is_pow2(block_q):
            raise ValueError(f"pallas attention on {backend}: block_q={block_q} must be a power of two")


def _kernel(meta_ref, q_ref, qp_ref, k_ref, v_ref, kp_ref, o_ref, m_ref, l_ref, *, block_k: int, scale: float):
    """One program: query block i (`[bq, Gp, D]`, the query heads of one KV head) over KV blocks [meta[0], meta[1])."""
    lo, hi, window = meta_ref[0], meta_ref[1], meta_ref[2]
    bq, gp, d = q_ref.shape
    q = q_ref[...].reshape(bq * gp, d)  # row r = (query r // Gp, head r % Gp)
    qp = jnp.broadcast_to(qp_ref[...][:, None], (bq, gp)).reshape(bq * gp)

    def body(j, carry):
        o, m, l = carry
        start = pl.multiple_of(j * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :]  # one K/V tile load for all Gp heads
        v = v_ref[pl.ds(start, block_k), :]
        kp = kp_ref[pl.ds(start, block_k)]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        diff = qp[:, None] - kp[None, :]
        visible = (kp[None, :] >= 0) & (diff >= 0) & (diff < window)
        s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        ms = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - ms[:, None])
        alpha = jnp.exp(m - ms)
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return o * alpha[:, None] + pv, m_new, l * alpha + jnp.sum(p, axis=1)

    rows = bq * gp
    init = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    o, m, l = jax.lax.fori_loop(lo, hi, body, init)
    o_ref[...] = o.reshape(bq, gp, d)
    m_ref[...] = m.reshape(bq, gp)
    l_ref[...] = l.reshape(bq, gp)


@functools.partial(jax.jit, static_argnames=("block_q", "block_k", "interpret", "num_warps", "num_stages",
                                             "pad_group"))
def flash_partial(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array, kv_range: jax.Array,
                  window: jax.Array, *, block_q: int, block_k: int, interpret: bool = False, num_warps: int = 4,
                  num_stages: int = 2, pad_group: bool | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Un-normalised attention partial of padded queries over a per-query-block range of KV blocks.

    Args:
      q: `[Tq, N, D]` (Tq a multiple of block_q); k, v: `[Tk, K, D]` (Tk a multiple of block_k), same dtype as q.
        N must be a multiple of K (query head h uses KV head h // G).
      q_pos: int32 `[Tq]` global query positions (padding rows: any value; their output is discarded by the caller).
      k_pos: int32 `[Tk]` global key positions, negative = no key.
      kv_range: int32 `[nq, 2]`: KV blocks `[lo, hi)` each query block visits (blocks outside are fully masked).
      window: int32 scalar, keys visible to a query, itself included.
      block_q, block_k: block sizes (tokens; a program computes `block_q·G` score rows); interpret: run in Pallas
        interpret mode (CPU).
      num_warps, num_stages: Triton launch parameters (GPU only).
      pad_group: pad G to a power of two with zero query heads (default: on the Triton path only).
    Returns:
      `(o [Tq, N, D], m [Tq, N], l [Tq, N])` float32: `o = Σ_j e^(s_j − m)·v_j`, `m` the row max (−inf if no visible
      key), `l = Σ_j e^(s_j − m)`, with `s = q·k·D^-0.5` (docs/model.md §2.3).
    Raises:
      ValueError if N is not a multiple of K.
    """
    tq, n, d = q.shape
    tk, kh, _ = k.shape
    if n % kh:
        raise ValueError(f"flash_partial: query heads {n} not a multiple of KV heads {kh}")
    g = n // kh
    if pad_group is None:
        pad_group = not interpret
    gp = pow2_at_least(g) if pad_group else g  # Triton: power-of-two tensors; pad heads are zero queries, dropped
    qg = q.reshape(tq, kh, g, d)
    if gp != g:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    nq = tq // block_q
    meta = jnp.concatenate([kv_range.astype(jnp.int32), jnp.broadcast_to(jnp.asarray(window, jnp.int32), (nq, 1)),
                            jnp.zeros((nq, 1), jnp.int32)], axis=1)  # [nq, 4]: lo, hi, window, pad
    in_specs, out_specs = _block_specs(block_q, tk, gp, d)
    out_shape = [jax.ShapeDtypeStruct((tq, kh, gp, d), jnp.float32), jax.ShapeDtypeStruct((tq, kh, gp), jnp.float32),
                 jax.ShapeDtypeStruct((tq, kh, gp), jnp.float32)]
    params = None if interpret else _triton_params(num_warps, num_stages)
    o, m, l = pl.pallas_call(
        functools.partial(_kernel, block_k=block_k, scale=d ** -0.5),
        grid=(nq, kh), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape, interpret=interpret,
        compiler_params=params, name="slope_flash_attention",
    )(meta, qg, q_pos.astype(jnp.int32), k, v, k_pos.astype(jnp.int32))
    return o[:, :, :g].reshape(tq, n, d), m[:, :, :g].reshape(tq, n), l[:, :, :g].reshape(tq, n)


def _block_specs(block_q: int, tk: int, gp: int, d: int) -> tuple[list, list]:
    """`(in_specs, out_specs)` of the kernel over the grid (query block i, KV head h).

    Inputs: meta `[nq, 4]` int32, the packed queries `[Tq, K, Gp, D]`, q_pos `[Tq]`, k and v `[Tk, K, D]`, k_pos
    `[Tk]`; a program sees its query block's row of meta, its `[block_q, Gp, D]` queries and positions, and all `Tk`
    keys of its KV head (the kernel walks only `[lo, hi)` of them). Outputs: o `[Tq, K, Gp, D]`, m and l `[Tq, K, Gp]`.
    """
    sq = pl.Squeezed()
    in_specs = [
        pl.BlockSpec((sq, 4), lambda i, h: (i, 0)),
        pl.BlockSpec((block_q, sq, gp, d), lambda i, h: (i, h, 0, 0)),  # the Gp query heads of KV head h
        pl.BlockSpec((block_q,), lambda i, h: (i,)),
        pl.BlockSpec((tk, sq, d), lambda i, h: (0, h, 0)),
        pl.BlockSpec((tk, sq, d), lambda i, h: (0, h, 0)),
        pl.BlockSpec((tk,), lambda i, h: (0,)),
    ]
    out_specs = [
        pl.BlockSpec((block_q, sq, gp, d), lambda i, h: (i, h, 0, 0)),
        pl.BlockSpec((block_q, sq, gp), lambda i, h: (i, h, 0)),
        pl.BlockSpec((block_q, sq, gp), lambda i, h: (i, h, 0)),
    ]
    return in_specs, out_specs


def _triton_params(num_warps: int, num_stages: int):
    """Triton launch parameters (imported only off interpret mode: the Triton module needs a GPU-capable jaxlib)."""
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
