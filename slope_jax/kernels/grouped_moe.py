"""Pallas grouped expert MLP: rows sorted by expert → `W2 a(W1 x + b1) + b2`, with MXFP4 weights dequantized per tile.

Two launches over the same row tiles, each a grouped matmul (every row tile belongs to one expert, whose weight
tiles the program reads by that expert's index):
  1. `up`:   `act[r, c] = swiglu(gate, up)` with `gate = x[r]·W1[e, 2c] + b1[e, 2c]`, `up = x[r]·W1[e, 2c+1] + …`
     (gpt-oss interleaving, docs/model.md §2.4; the two rows are read as strided views of the packed W1, no copy);
  2. `down`: `y[r, o] = act[r]·W2[e, o] + b2[e, o]`, float32.
The weight tile `[block_n, block_k]` is dequantized inside the program from its packed bytes and E8M0 scales
(docs/model.md §3.3: low nibble = element 2j, high = 2j+1, value = E2M1(code)·2^(s−127)), so the experts stay packed in
device memory and no dequantized copy of a layer is ever materialised; accumulation is float32.

Rows come in tiles of `block_m` rows that hold one expert each (`meta[i] = (expert, live)`); a group is padded to a
multiple of `block_m` by the caller (`model.moe`), as vLLM's `moe_align_block_size` does, so the work is the routed
rows plus at most `block_m − 1` pad rows per expert, and programs of tiles past the last live one store zeros and
return (the grid is sized statically for the worst case).

GPU: Triton lowering. Elsewhere (CPU) Pallas interpret mode, for tests only. Triton needs power-of-two tensors:
`check_shapes` names a block size that is not; `pick_block` chooses block_n / block_k as powers of two that divide
the widths (gpt-oss: 2880 = 64·45, so 64).

Shapes: `Mp` padded rows (a multiple of block_m), `nt = Mp / block_m` row tiles, `E` experts, `D` hidden,
`I` intermediate (`2I` gate/up rows), `Gd = D/32`, `Gi = I/32` MXFP4 blocks per row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from slope_jax.model import mxfp4

MX_BLOCK = 32  # elements per MXFP4 block (OCP MX)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def pick_block(width: int, cap: int, multiple: int = 1) -> int:
    """The largest power of two <= cap that divides `width` and is a multiple of `multiple` (0 if none)."""
    b = 1 << max(cap, 1).bit_length() - 1
    while b >= max(multiple, 1):
        if width % b == 0 and b % multiple == 0:
            return b
        b //= 2
    return 0


def check_shapes(block_m: int, block_n: int, block_k: int, backend: str) -> None:
    """Raise ValueError naming the field when the Triton lowering cannot take these block sizes (any on CPU):
    each must be a power of two >= 16 (block_m is `StepOptions.moe_tile`)."""
    if backend in ("gpu", "cuda", "rocm"):
        for name, v in (("moe_tile (block_m)", block_m), ("block_n", block_n), ("block_k", block_k)):
            if not _is_pow2(v) or v < 16:
                raise ValueError(f"pallas MoE on {backend}: {name}={v} must be a power of two >= 16")


def decode_tile(codes: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """Packed MXFP4 tile → values, inside a kernel (also a plain jnp function; tested against `model.mxfp4.decode`).

    Args:
      codes: uint8 `[bn, nb·16]` (two E2M1 codes per byte); scales: uint8 `[bn, nb]` (E8M0).
    Returns:
      `[bn, nb·32]` in `dtype`: `mxfp4.decode` of the tile seen as `[bn, nb, 16]` blocks (arithmetic E2M1, no table
      lookup, which Triton lacks): element 2j the low nibble of byte j, 2j+1 the high nibble, times 2^(s−127).
    """
    bn, nb = scales.shape
    return mxfp4.decode(codes.reshape(bn, nb, MX_BLOCK // 2), scales, dtype)


def _weight_tile(w_ref, s_ref, e, o0, k0, block_n: int, block_k: int, dtype) -> jax.Array:
    """Expert e's weight rows `[o0, o0+block_n)`, inputs `[k0, k0+block_k)` → `[block_n, block_k]` in `dtype`.

    Packed (`s_ref` given): `w_ref` uint8 `[E, O, G·16]`, `s_ref` uint8 `[E, O, G]`; dense: `w_ref` `[E, O, K]`."""
    if s_ref is None:
        return w_ref[e, pl.ds(o0, block_n), pl.ds(k0, block_k)].astype(dtype)
    nb = block_k // MX_BLOCK
    codes = w_ref[e, pl.ds(o0, block_n), pl.ds(k0 // 2, block_k // 2)]  # [bn, nb·16]
    scales = s_ref[e, pl.ds(o0, block_n), pl.ds(k0 // MX_BLOCK, nb)]  # [bn, nb]
    return decode_tile(codes, scales, dtype)


def _matmul(x_ref, w_ref, s_ref, e, o0, *, width: int, block_n: int, block_k: int) -> jax.Array:
    """`x[bm, width] · W[e, o0:o0+bn, :]ᵀ` → float32 `[bm, bn]`, over the contraction in block_k steps."""
    bm = x_ref.shape[0]

    def body(kk, acc):
        k0 = pl.multiple_of(kk * block_k, block_k)
        x = x_ref[:, pl.ds(k0, block_k)]
        w = _weight_tile(w_ref, s_ref, e, o0, k0, block_n, block_k, x.dtype)
        return acc + jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    return jax.lax.fori_loop(0, width // block_k, body, jnp.zeros((bm, block_n), jnp.float32))


def _up_kernel(meta_ref, x_ref, gw_ref, gs_ref, uw_ref, us_ref, gb_ref, ub_ref, act_ref, *, width, block_n, block_k,
               alpha, limit):
    """Program (row tile i, activation tile j): `act[i-th rows, j·bn:(j+1)·bn]`."""
    e, live = meta_ref[0], meta_ref[1]
    o0 = pl.multiple_of(pl.program_id(1) * block_n, block_n)

    @pl.when(live > 0)
    def _():
        mm = functools.partial(_matmul, x_ref, e=e, o0=o0, width=width, block_n=block_n, block_k=block_k)
        gate = mm(gw_ref, gs_ref) + gb_ref[e, pl.ds(o0, block_n)].astype(jnp.float32)[None, :]
        up = mm(uw_ref, us_ref) + ub_ref[e, pl.ds(o0, block_n)].astype(jnp.float32)[None, :]
        # gpt-oss SwiGLU (model.moe.swiglu): gate clamped above, up clamped both sides, gate·σ(α·gate)·(up + 1)
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        act_ref[...] = (gate * jax.nn.sigmoid(gate * alpha) * (up + 1.0)).astype(act_ref.dtype)

    @pl.when(live == 0)
    def _():
        act_ref[...] = jnp.zeros(act_ref.shape, act_ref.dtype)


def _down_kernel(meta_ref, a_ref, w_ref, s_ref, b_ref, y_ref, *, width, block_n, block_k):
    """Program (row tile i, output tile j): `y[i-th rows, j·bn:(j+1)·bn]` float32."""
    e, live = meta_ref[0], meta_ref[1]
    o0 = pl.multiple_of(pl.program_id(1) * block_n, block_n)

    @pl.when(live > 0)
    def _():
        y = _matmul(a_ref, w_ref, s_ref, e, o0, width=width, block_n=block_n, block_k=block_k)
        y_ref[...] = y + b_ref[e, pl.ds(o0, block_n)].astype(jnp.float32)[None, :]

    @pl.when(live == 0)
    def _():
        y_ref[...] = jnp.zeros(y_ref.shape, jnp.float32)


def _full(shape, index):
    """BlockSpec of a whole array (weights: the program picks its expert's rows by index), with squeezed dims where
    `index` is not None (a strided view, e.g. the gate rows of W1)."""
    block = tuple(pl.Squeezed() if i is not None else n for n, i in zip(shape, index))
    idx = tuple(0 if i is None else i for i in index)
    return pl.BlockSpec(block, lambda *_: idx)


def _weights(p: dict, name: str, e: int, out: int, width: int, parity: int | None) -> list:
    """`[(w, spec), (s, spec)]` (packed) or `[(w, spec)]` (dense) of `name` ("w1"/"w2") as kernel operands;
    parity 0/1 picks W1's gate/up rows."""
    if f"{name}_blocks" in p:
        w = p[f"{name}_blocks"].reshape(e, out, width // 2)  # [E, O, G, 16] → [E, O, G·16] (free)
        s = p[f"{name}_scales"]
    else:
        w, s = p[name], None
    if parity is None:
        ws = [(w, _full(w.shape, (None,) * 3))] + ([(s, _full(s.shape, (None,) * 3))] if s is not None else [])
    else:  # [E, 2I, ·] → [E, I, 2, ·]: row 2c + parity, a strided view
        w = w.reshape(e, out // 2, 2, w.shape[-1])
        ws = [(w, _full(w.shape, (None, None, parity, None)))]
        if s is not None:
            s = s.reshape(e, out // 2, 2, s.shape[-1])
            ws.append((s, _full(s.shape, (None, None, parity, None))))
    return ws


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "alpha", "limit", "interpret",
                                             "num_warps", "num_stages"))
def grouped_mlp(x: jax.Array, meta: jax.Array, p: dict, *, block_m: int, alpha: float, limit: float,
                block_n: int = 64, block_k: int = 64, interpret: bool = False, num_warps: int = 4,
                num_stages: int = 2) -> jax.Array:
    """Expert MLPs of expert-aligned row tiles: `y[r] = W2[e] a(W1[e] x[r] + b1[e]) + b2[e]`, e the tile's expert.

    Args:
      x: `[Mp, D]` rows (activation dtype), `Mp` a multiple of block_m; tile i (rows `[i·bm, (i+1)·bm)`) belongs to
        expert `meta[i, 0]`.
      meta: int32 `[nt, 2]`: per row tile (expert in `[0, E)`, live 0/1); a tile with live = 0 does no work and gives 0.
      p: expert parameters: `b1 [E, 2I]`, `b2 [E, D]` and either MXFP4 `w1_blocks [E, 2I, Gd, 16]`,
        `w1_scales [E, 2I, Gd]`, `w2_blocks [E, D, Gi, 16]`, `w2_scales [E, D, Gi]` (uint8), or dense
        `w1 [E, 2I, D]`, `w2 [E, D, I]`.
      block_m: rows per tile; block_n: output columns per program (caps; the largest power of two dividing the
        width is used); block_k: contraction step (cap; a multiple of 32 when packed).
      alpha, limit: SwiGLU constants; interpret: Pallas interpret mode (CPU); num_warps, num_stages: Triton.
    Returns:
      `[Mp, D]` float32; rows of dead tiles are 0, pad rows of live tiles hold their (discardable) value.
    Raises:
      ValueError if a width has no admissible block (e.g. D not a multiple of 32 with MXFP4 weights).
    """
    mp, d = x.shape
    i_size = p["b1"].shape[1] // 2
    packed = "w1_blocks" in p
    up_blocks, down_blocks = _pick_blocks(d, i_size, block_n=block_n, block_k=block_k, packed=packed)
    nt = mp // block_m
    params = None
    if not interpret:
        for bn, bk in (up_blocks, down_blocks):
            check_shapes(block_m, bn, bk, "gpu")
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    meta = meta.astype(jnp.int32)
    launch = dict(nt=nt, block_m=block_m, interpret=interpret, params=params)
    act = _up_call(x, meta, p, blocks=up_blocks, alpha=alpha, limit=limit, **launch)
    return _down_call(act, meta, p, blocks=down_blocks, **launch)


def _pick_blocks(d: int, i_size: int, *, block_n: int, block_k: int, packed: bool) -> tuple:
    """`((bn1, bk1), (bn2, bk2))`: (output, contraction) blocks of the up launch (widths I and D) and the down launch
    (widths D and I): the largest powers of two under the caps that divide the widths, the contraction a multiple of
    the MXFP4 block when packed. Raises ValueError naming the sizes when a width has none."""
    mult = MX_BLOCK if packed else 1
    bk1, bk2 = pick_block(d, block_k, mult), pick_block(i_size, block_k, mult)
    bn1, bn2 = pick_block(i_size, block_n), pick_block(d, block_n)
    if 0 in (bk1, bk2, bn1, bn2):
        raise ValueError(f"pallas MoE: no power-of-two block <= {block_k}/{block_n} (multiple of {mult}) divides "
                         f"hidden_size={d} / intermediate_size={i_size}")
    return (bn1, bk1), (bn2, bk2)


def _meta_spec() -> pl.BlockSpec:
    """BlockSpec of `meta [nt, 2]`: program (i, j) reads row tile i's (expert, live)."""
    return pl.BlockSpec((pl.Squeezed(), 2), lambda i, j: (i, 0))


def _up_call(x, meta, p, *, blocks: tuple[int, int], alpha, limit, nt, block_m, interpret, params) -> jax.Array:
    """Launch 1, gate/up + SwiGLU: `x [Mp, D]` → `act [Mp, I]` in x's dtype, over the grid (row tile, I / bn)."""
    mp, d = x.shape
    e = p["b1"].shape[0]
    i_size = p["b1"].shape[1] // 2
    packed = "w1_blocks" in p
    bn1, bk1 = blocks
    gate = _weights(p, "w1", e, 2 * i_size, d, 0)
    up = _weights(p, "w1", e, 2 * i_size, d, 1)
    b1 = p["b1"].reshape(e, i_size, 2)
    args = [meta, x] + [a for a, _ in gate + up] + [b1, b1]
    specs = ([_meta_spec(), pl.BlockSpec((block_m, d), lambda i, j: (i, 0))] + [sp for _, sp in gate + up]
             + [_full(b1.shape, (None, None, 0)), _full(b1.shape, (None, None, 1))])

    def up_kernel(*refs):
        if packed:
            meta_r, x_r, gw, gs, uw, us, gb, ub, out = refs
        else:
            (meta_r, x_r, gw, uw, gb, ub, out), gs, us = refs, None, None
        _up_kernel(meta_r, x_r, gw, gs, uw, us, gb, ub, out, width=d, block_n=bn1, block_k=bk1, alpha=alpha,
                   limit=limit)

    return pl.pallas_call(
        up_kernel, grid=(nt, i_size // bn1), in_specs=specs,
        out_specs=pl.BlockSpec((block_m, bn1), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, i_size), x.dtype), interpret=interpret, compiler_params=params,
        name="slope_moe_up")(*args)


def _down_call(act, meta, p, *, blocks: tuple[int, int], nt, block_m, interpret, params) -> jax.Array:
    """Launch 2, down: `act [Mp, I]` → `y [Mp, D]` float32, over the grid (row tile, D / bn)."""
    mp, i_size = act.shape
    e, d = p["b2"].shape
    packed = "w1_blocks" in p
    bn2, bk2 = blocks
    down = _weights(p, "w2", e, d, i_size, None)

    def down_kernel(*refs):
        if packed:
            meta_r, a_r, w, s, b, out = refs
        else:
            (meta_r, a_r, w, b, out), s = refs, None
        _down_kernel(meta_r, a_r, w, s, b, out, width=i_size, block_n=bn2, block_k=bk2)

    return pl.pallas_call(
        down_kernel, grid=(nt, d // bn2),
        in_specs=[_meta_spec(), pl.BlockSpec((block_m, i_size), lambda i, j: (i, 0))] + [s for _, s in down]
        + [_full(p["b2"].shape, (None, None))],
        out_specs=pl.BlockSpec((block_m, bn2), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, d), jnp.float32), interpret=interpret, compiler_params=params,
        name="slope_moe_down")(meta, act, *[a for a, _ in down], p["b2"])
