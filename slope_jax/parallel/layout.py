"""Token layout for context parallelism: padding to a bucket, zigzag chunks over ring ranks, pieces over Ulysses.

A padded length T (a multiple of 2·R·U) is cut into 2R chunks of C = T/(2R) tokens; ring rank r holds chunks r and
2R−1−r (zigzag: every rank gets one early and one late chunk, so causal work is balanced — Liu et al. 2023 ring
attention; the zigzag order of ring-flash-attention). Each chunk is split into U pieces of Pz = C/U tokens; device
(r, u) holds piece u of both of its chunks:

    device (r, u) local tokens = [piece(r, u) ; piece(2R−1−r, u)],   piece(c, u) = tokens [c·C + u·Pz, … + Pz)

Global arrays are stored in *layout order*: device d = r·U + u owns rows [d·2Pz, (d+1)·2Pz). `layout_positions`
gives the global position held at every layout row; `to_layout` / `to_natural` permute between the two orders.
Pad tokens sit at positions ≥ num_tokens, after every real token, so causality alone hides them.
"""

from __future__ import annotations

import numpy as np


def piece_size(t: int, ring: int, ulysses: int) -> int:
    """Pz = T / (2·R·U). Raises ValueError when T is not a multiple of 2·R·U."""
    if t % (2 * ring * ulysses):
        raise ValueError(f"padded length {t} is not a multiple of 2*ring*ulysses = {2 * ring * ulysses}")
    return t // (2 * ring * ulysses)


def layout_positions(t: int, ring: int, ulysses: int) -> np.ndarray:
    """int32 `[T]`: global token position stored at each layout row (device-major, see module docstring)."""
    pz = piece_size(t, ring, ulysses)
    c = pz * ulysses
    rows = []
    for r in range(ring):
        for u in range(ulysses):
            for chunk in (r, 2 * ring - 1 - r):
                rows.append(chunk * c + u * pz + np.arange(pz))
    return np.concatenate(rows).astype(np.int32)


def to_layout(x: np.ndarray, ring: int, ulysses: int, axis: int = 0) -> np.ndarray:
    """Permute natural token order → layout order along `axis` (length T)."""
    return np.take(x, layout_positions(x.shape[axis], ring, ulysses), axis=axis)


def to_natural(x: np.ndarray, ring: int, ulysses: int, axis: int = 0) -> np.ndarray:
    """Permute layout order → natural token order along `axis` (inverse of `to_layout`)."""
    inv = np.argsort(layout_positions(x.shape[axis], ring, ulysses))
    return np.take(x, inv, axis=axis)


# Length buckets. Below FINE_FROM tokens: {2^k, 3·2^(k−1)} (at most 1.5× padding, 2 programs per octave; short
# prompts cost little either way). From FINE_FROM on: multiples of 2^(e−5) inside the octave [2^e, 2^(e+1)), i.e.
# m·2^(e−5) with m in [32, 64) — BUCKETS_PER_OCTAVE programs per octave and at most 1/32 padded rows. 1/32 (not 1/16)
# because causal attention grows with the square of the rows: (1 + 1/32)² = 1.0635 ≤ 1.07, so the compiled work
# (per-row projections and MoE, sliding windows, full causal attention alike) of a padded bucket stays within 7 % of
# the work at the exact length for any model config. See `bucket_length` for the mesh multiple.
FINE_FROM = 256
BUCKETS_PER_OCTAVE = 32


def bucket_length(n: int, multiple: int = 1, minimum: int = 16) -> int:
    """The compiled length T for an n-token prompt (THE bucket rule: engine, scheduler and planner all call this).

    target = max(n, minimum). Below FINE_FROM: the smallest of {2^k, 3·2^(k−1)} ≥ target, rounded up to a multiple
    of `multiple` (at most 1.5× padding). From FINE_FROM on, with 2^e ≤ target < 2^(e+1) and g = 2^e /
    BUCKETS_PER_OCTAVE: T = target rounded up to a multiple of step = multiple·max(1, ⌊g / multiple⌋) (the largest
    multiple of `multiple` that is ≤ g, or `multiple` itself when it exceeds g).

    Waste bound: T − n < step, so (T − n)/n < max(g, multiple)/n ≤ 1/32 for every n ≥ max(FINE_FROM,
    32·multiple) (n ≥ 2^e = 32·g). Between FINE_FROM and 32·multiple, g < multiple, so the step is `multiple` and
    T = ⌈n/multiple⌉·multiple, the least length the layout admits at all: no rows beyond the mesh's own rounding.
    Programs per octave: 32 when `multiple` divides g (it does for powers of two, 2·ring·ulysses·seq_chunks, once
    n ≥ 32·multiple), at most 64 otherwise. Non-decreasing in n.
    Raises ValueError for n < 1 or multiple < 1.
    """
    if n < 1:
        raise ValueError(f"prompt length {n} must be >= 1")
    if multiple < 1:
        raise ValueError(f"bucket multiple {multiple} must be >= 1")
    target = max(n, minimum)
    if target >= FINE_FROM:
        g = (1 << (target.bit_length() - 1)) // BUCKETS_PER_OCTAVE
        step = multiple * max(1, g // multiple)
        return -(-target // step) * step
    b = 1
    while True:
        for cand in (b, 3 * b // 2 if b >= 2 else b):
            if cand >= target:
                return -(-cand // multiple) * multiple
        b *= 2


def chunked_layout_positions(t: int, ring: int, ulysses: int, chunks: int) -> np.ndarray:
    """int32 `[T]`: the layout of sequence-pipelined prefill (`parallel.pipeline`).

    T is cut into `chunks` sequence chunks of Tc = T/chunks tokens; the zigzag layout is applied inside each chunk;
    rows stay device-major (device d owns rows [d·chunks·2Pz, (d+1)·chunks·2Pz), Pz = Tc/(2·R·U)), chunk-major inside
    a device: row d·chunks·2Pz + i·2Pz + j holds position i·Tc + layout_positions(Tc)[d·2Pz + j].
    `chunks = 1` gives `layout_positions`. Raises ValueError when T is not a multiple of 2·R·U·chunks.
    """
    if t % (2 * ring * ulysses * chunks):
        raise ValueError(f"padded length {t} is not a multiple of 2*ring*ulysses*seq_chunks = "
                         f"{2 * ring * ulysses * chunks}")
    tc = t // chunks
    base = layout_positions(tc, ring, ulysses).reshape(ring * ulysses, 1, -1)  # [devices, 1, 2Pz]
    offsets = (np.arange(chunks) * tc).reshape(1, chunks, 1)
    return (base + offsets).reshape(-1).astype(np.int32)
