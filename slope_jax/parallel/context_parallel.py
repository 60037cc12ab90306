"""Context-parallel attention cores (inside `shard_map` over `(ring, ulysses)`): exact sink attention on a sequence
split in the zigzag layout of `slope_jax.layout`.

Full-attention layers — Ulysses × ring (docs/design.md §2.4):
  1. all-to-all over `ulysses`: `[2, Pz, N, H]` → `[2, C, N/U, H]` (sequence shards → head shards); with GQA the KV
     heads are split when U ≤ K, or replicated first when U > K so that the rank holding query head h holds KV head
     h // G. Each rank uses the sinks of its own query heads.
  2. ring over `ring`: step 0 is the causal diagonal on the rank's own chunks; at step k ≥ 1 the rank holds the KV
     (and positions) of rank s = (r − k) mod R and computes exactly two fully visible chunk × chunk blocks, chosen by
     index (static shapes, equal work on every rank, no `lax.cond`): for s < r both query chunks see KV chunk s; for
     s > r query chunk 2R−1−r sees both KV chunks. The next `ppermute` is issued before the current block's compute.
     Partial results merge in float32 `(o, m, l)`; the sink enters once, at the end.
  3. inverse all-to-all back to `[2, Pz, N, H]`.
Sliding-window layers — halo (docs/design.md §2.5): each piece gets the K/V (and positions) of the W−1 tokens before it,
then attends locally over exactly those W−1 + Pz keys. No all-to-all and no ring. Two ways, chosen per bucket
(`halo_by_gather`) so that the collectives per sliding layer never grow as the prompt shrinks:
  * Pz ≥ W−1 (long buckets): one hop of `collectives.piece_pass` (2 ppermutes, 3 when U > 1) brings the tail of the
    preceding piece; traffic W−1 tokens per piece.
  * Pz < W−1 (short buckets, e.g. a 5-token prompt on R=2 × U=4 with W=128): passing pieces would take ⌈(W−1)/Pz⌉
    hops (up to ~250 ppermutes per layer); instead one all-gather over `(ring, ulysses)` brings the whole sequence
    (T = 2RU·Pz < 2RU·(W−1) tokens, small by construction) and each piece slices its W−1 predecessors from it.
    1 collective per sliding layer; positions likewise come from one all-gather per step.
Both give each piece the same keys in the same order, so the results are identical.
Earlier sequence chunks (sequence-pipelined prefill) — `prefix_attention`: the local queries go once round the R·U
devices and fold in the K/V each device stored for earlier chunks; the resulting state enters `full_attention` /
`sliding_attention` as `prefix` and is merged before the sink.

Shapes per device: `Pz` piece, `C = U·Pz` chunk, `N` query heads, `K` KV heads, `H` head_dim.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from slope_jax.model import attention as attn_lib
from slope_jax.model.options import StepOptions
from slope_jax.parallel import collectives


class CPPositions(NamedTuple):
    """Global positions a device needs, exchanged once per step (positions are the same for every layer, tick and
    request of a bucket; only K/V travel per layer).

    local `[2Pz]` (own tokens, layout order); chunks `[2, C]` (the ring rank's two chunks after the Ulysses
    all-to-all); ring `[R, 2, C]` (every ring rank's chunks: the positions that travel with ring block s);
    halo `[2, W−1]` (the tokens before each piece; INVALID_POS where there is none).
    """

    local: jax.Array
    chunks: jax.Array
    ring: jax.Array
    halo: jax.Array


def halo_by_gather(pz: int, window: int) -> bool:
    """True when sliding layers take their halo from one all-gather of the whole sequence (pieces shorter than the
    halo, Pz < W−1) rather than from one `piece_pass` hop (module docstring)."""
    return 0 < pz < window - 1


def _window_keys(seq: jax.Array, piece: jax.Array, pz: int, halo: int, fill) -> jax.Array:
    """From the whole sequence `seq` `[T, …]` (natural order), the `[2, W−1 + Pz, …]` keys of this device's two pieces
    (`piece`: their global indices): the W−1 tokens before each piece (`fill` before token 0), then the piece."""
    padded = jnp.concatenate([jnp.full((halo, *seq.shape[1:]), fill, seq.dtype), seq])
    return jnp.stack([jax.lax.dynamic_slice_in_dim(padded, piece[j] * pz, halo + pz) for j in range(2)])


def exchange_positions(pos: jax.Array, *, ring: int, ulysses: int, window: int) -> CPPositions:
    """Gather the positions of the chunks (all-gather over `ulysses`, then `ring`) and of the halos (one
    `piece_pass` hop, or one all-gather of the sequence when `halo_by_gather`). `pos`: int32 `[2Pz]` local
    positions in layout order."""
    pz = pos.shape[0] // 2
    pp = pos.reshape(2, pz)
    chunks = jax.lax.all_gather(pp, "ulysses", axis=1, tiled=True) if ulysses > 1 else pp  # [2, C]
    ring_pos = jax.lax.all_gather(chunks, "ring") if ring > 1 else chunks[None]  # [R, 2, C]
    halo = max(window - 1, 0)
    parts = []
    if halo and halo_by_gather(pz, window):
        seq = collectives.gather_sequence(pp, ring, ulysses)  # [T]
        halo_pos = _window_keys(seq, _piece_index(ring, ulysses), pz, halo, attn_lib.INVALID_POS)[:, :halo]
        return CPPositions(pos, chunks, ring_pos, halo_pos)
    if halo:
        piece = _piece_index(ring, ulysses)
        buf = pp[:, pz - min(pz, halo):]
        for hop in range(1, -(-halo // pz) + 1):
            buf = collectives.piece_pass(buf, ring, ulysses)
            parts.insert(0, jnp.where((piece - hop >= 0)[:, None], buf, attn_lib.INVALID_POS))  # no such piece
    halo_pos = jnp.concatenate(parts, axis=1)[:, -halo:] if halo else jnp.zeros((2, 0), jnp.int32)
    return CPPositions(pos, chunks, ring_pos, halo_pos)


def _piece_index(ring: int, ulysses: int) -> jax.Array:
    """Global zigzag piece index of this device's two slots: `[r·U + u, (2R−1−r)·U + u]`."""
    r = jax.lax.axis_index("ring")
    u = jax.lax.axis_index("ulysses")
    return jnp.stack([r * ulysses + u, (2 * ring - 1 - r) * ulysses + u])


def _local_sinks(sinks: jax.Array, ulysses: int) -> jax.Array:
    """The sinks `[N/U]` of this Ulysses rank's query heads."""
    n_local = sinks.shape[0] // ulysses
    u = jax.lax.axis_index("ulysses")
    return jax.lax.dynamic_slice_in_dim(sinks, u * n_local, n_local)


def _select(pred, a, b):
    return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def full_attention(q: jax.Array, k: jax.Array, v: jax.Array, pos: CPPositions, sinks: jax.Array, *, ring: int,
                   ulysses: int, options: StepOptions, prefix: attn_lib.AttnState | None = None) -> jax.Array:
    """Causal sink attention over the whole (context-parallel) sequence.

    Args:
      q: `[2Pz, N, H]` local queries (post-RoPE) in layout order; k, v: `[2Pz, K, H]`; pos: from
        `exchange_positions`; sinks: `[N]` float32 (all heads).
      prefix: optional partial state of the same local queries over keys outside this sequence (earlier sequence
        chunks, `prefix_attention`; o `[2Pz, N, H]`, m, l `[2Pz, N]`): moved to head shards with the same Ulysses
        all-to-all and merged before the sink enters.
      options: resolved step options: the tiles and local attention core of every block (`attention.attend`).
    Returns:
      `[2Pz, N, H]` attention output in q's dtype, layout order.
    """
    two_pz, n, h = q.shape
    kh = k.shape[1]
    pz = two_pz // 2
    R, U = ring, ulysses
    if U > kh:  # replicate KV heads: replica j of head i sits at index i·(U/K) + j; rank u gets head u // (U/K)
        k = jnp.repeat(k, U // kh, axis=1)
        v = jnp.repeat(v, U // kh, axis=1)
    qc = q.reshape(2, pz, n, h)
    kvc = jnp.stack([k, v]).reshape(2, 2, pz, k.shape[1], h)  # [kv, slot, Pz, K', H]
    if U > 1:
        # [2, C, N/U, H] and [2, 2, C, K'/U, H]; one after the other on XLA:CPU (`collectives.sequenced_map`)
        qc, kvc = collectives.sequenced_map(collectives.ulysses_seq_to_heads, (qc, kvc))
        sinks = _local_sinks(sinks, U)
    posc = pos.chunks
    attend = functools.partial(attn_lib.attend, q_tile=options.q_tile, kv_tile=options.kv_tile,
                               impl=options.attention_impl, upcast=options.upcast_matmul)
    st0, st1 = _zigzag_ring(qc, kvc, posc, pos.ring, attend, R)
    if prefix is not None:
        st0, st1 = _merge_prefix((st0, st1), prefix, U)
    out = jnp.stack([attn_lib.finalize(st0, sinks), attn_lib.finalize(st1, sinks)]).astype(q.dtype)  # [2, C, N/U, H]
    if U > 1:
        out = collectives.ulysses_heads_to_seq(out)
    return out.reshape(two_pz, n, h)


def _zigzag_ring(qc, kvc, posc, ring_pos, attend, R: int):
    """The zigzag ring of `full_attention` on head shards: qc `[2, C, N', H]` (this rank's chunks r and 2R−1−r), kvc
    `[kv, 2, C, K', H]`, posc `[2, C]`, ring_pos: the positions that travel with each rank's block. Step 0 attends to
    the own chunks (causal diagonal); then R − 1 ring steps, the next `ring_pass` issued before each step's compute.
    Returns the two chunks' AttnStates (no sink yet)."""
    q0, q1 = qc[0], qc[1]
    p0, p1 = posc[0], posc[1]

    with jax.named_scope("ring_step0"):
        nxt = collectives.ring_pass(kvc, R) if R > 1 else None
        st0 = attend(q0, kvc[0, 0], kvc[1, 0], p0, p0)  # chunk r, causal diagonal
        k01 = jnp.concatenate([kvc[0, 0], kvc[0, 1]])
        v01 = jnp.concatenate([kvc[1, 0], kvc[1, 1]])
        st1 = attend(q1, k01, v01, p1, jnp.concatenate([p0, p1]))  # chunk 2R−1−r: all of chunk r + own diagonal

    r = jax.lax.axis_index("ring")

    def ring_step(step, kv_blk, st0, st1):
        s = (r - step) % R
        pos_blk = ring_pos[s]  # the positions that travel with rank s's block
        before = s < r
        # block A: (s < r: q chunk r | else: q chunk 2R−1−r) × KV chunk s
        st_a = attend(jnp.where(before, q0, q1), kv_blk[0, 0], kv_blk[1, 0], jnp.where(before, p0, p1), pos_blk[0],
                      state=_select(before, st0, st1))
        # block B: q chunk 2R−1−r × (s < r: KV chunk s | else: KV chunk 2R−1−s), continuing A when both hit q1
        st_b = attend(q1, jnp.where(before, kv_blk[0, 0], kv_blk[0, 1]), jnp.where(before, kv_blk[1, 0], kv_blk[1, 1]),
                      p1, jnp.where(before, pos_blk[0], pos_blk[1]), state=_select(before, st1, st_a))
        return _select(before, st_a, st0), st_b

    if R > 2:  # steps 1 … R−2 (a loop of no steps would still be traced and lowered)
        def body(step, carry):
            cur, st0, st1 = carry
            with jax.named_scope("ring_step"):
                nxt = collectives.ring_pass(cur, R)  # issued before this step's compute
                st0, st1 = ring_step(step, cur, st0, st1)
            return nxt, st0, st1

        nxt, st0, st1 = jax.lax.fori_loop(1, R - 1, body, (nxt, st0, st1))
    if R > 1:
        with jax.named_scope("ring_step_last"):
            st0, st1 = ring_step(R - 1, nxt, st0, st1)

    return st0, st1


def sliding_attention(q: jax.Array, k: jax.Array, v: jax.Array, pos: CPPositions, sinks: jax.Array, *, ring: int,
                      ulysses: int, window: int, options: StepOptions,
                      prefix: attn_lib.AttnState | None = None) -> jax.Array:
    """Sliding-window sink attention with a halo exchange: each piece sees the W−1 tokens before it.

    Args: as `full_attention` (`prefix` merged per piece, no all-to-all; `options`), plus `window` (keys per query,
    itself included).
    Returns: `[2Pz, N, H]` in q's dtype, layout order.
    """
    two_pz, n, h = q.shape
    pz = two_pz // 2
    halo = window - 1
    kv = jnp.stack([k, v], axis=1).reshape(2, pz, 2, k.shape[1], h)  # [slot, Pz, kv, K, H]
    pp = pos.local.reshape(2, pz)
    keys, kpos = kv, pp
    if halo > 0 and halo_by_gather(pz, window):
        with jax.named_scope("halo"):
            seq = collectives.gather_sequence(kv, ring, ulysses)  # [T, kv, K, H]
            keys = _window_keys(seq, _piece_index(ring, ulysses), pz, halo, 0)
            kpos = jnp.concatenate([pos.halo, pp], axis=1)
    elif halo > 0:
        with jax.named_scope("halo"):
            buf = kv[:, pz - min(pz, halo):]
            parts = []
            for _ in range(-(-halo // pz)):  # hop h brings piece g−h's tail (or whole piece) to piece g
                buf = collectives.piece_pass(buf, ring, ulysses)
                parts.insert(0, buf)
            keys = jnp.concatenate(parts + [kv], axis=1)[:, -(halo + pz):]
            kpos = jnp.concatenate([pos.halo, pp], axis=1)
    outs = []
    for slot in range(2):
        st = attn_lib.attend(q[slot * pz:(slot + 1) * pz], keys[slot, :, 0], keys[slot, :, 1], pp[slot], kpos[slot],
                             window=window, q_tile=options.q_tile, kv_tile=options.kv_tile,
                             impl=options.attention_impl, upcast=options.upcast_matmul)
        if prefix is not None:
            pre = jax.tree.map(lambda a: a[slot * pz:(slot + 1) * pz], prefix)
            st = attn_lib.merge(st, _grouped(pre, st.o.shape[1]))
        outs.append(attn_lib.finalize(st, sinks))
    return jnp.concatenate(outs).astype(q.dtype)


def _grouped(flat: attn_lib.AttnState, kv_heads: int) -> attn_lib.AttnState:
    """A head-flat state (o `[T, N, H]`, m, l `[T, N]`; head h = k·G + g) → `attend`'s grouping `[T, K, G, …]`."""
    t, n = flat.m.shape
    g = n // kv_heads
    return attn_lib.AttnState(flat.o.reshape(t, kv_heads, g, -1), flat.m.reshape(t, kv_heads, g),
                              flat.l.reshape(t, kv_heads, g))


def _merge_prefix(states, prefix: attn_lib.AttnState, ulysses: int):
    """Merge a head-flat prefix state of the local queries (`[2Pz, N, …]`) into the ring's two chunk states
    (`[C, K', G', …]`, head shards): the same all-to-all `[2, Pz, N, …] → [2, C, N/U, …]` as the queries."""
    def to_heads(a):
        a = a.reshape(2, a.shape[0] // 2, *a.shape[1:])
        if a.ndim == 3:  # m, l: give the all-to-all a trailing axis
            a = a[..., None]
            return (collectives.ulysses_seq_to_heads(a) if ulysses > 1 else a)[..., 0]
        return collectives.ulysses_seq_to_heads(a) if ulysses > 1 else a

    pre = attn_lib.AttnState(*collectives.sequenced_map(to_heads, tuple(prefix)))
    kv_heads = states[0].o.shape[1]
    return tuple(attn_lib.merge(st, _grouped(attn_lib.AttnState(pre.o[j], pre.m[j], pre.l[j]), kv_heads))
                 for j, st in enumerate(states))


def prefix_attention(q: jax.Array, q_pos: jax.Array, k: jax.Array, v: jax.Array, k_pos: jax.Array, *, ring: int,
                     ulysses: int, options: StepOptions,
                     window: int | jax.Array = attn_lib.NO_WINDOW) -> attn_lib.AttnState:
    """Partial attention (no sink) of the local queries over keys that stay where they are: the K/V of earlier
    sequence chunks that this stage stored, spread over the R·U devices of its `(ring, ulysses)` group
    (sequence-pipelined prefill, `parallel.pipeline`).

    The queries travel, not the keys: (q, positions, state) go once round the R·U devices (`ppermute` d → d+1 over
    `(ring, ulysses)`); each device folds its own stored keys into the visiting state, and after R·U passes every
    state is home. Masks come from positions, so stored rows that hold no key yet (`k_pos < 0`), causality and the
    sliding window make it exact for every layer kind. Traffic per device and layer: (R·U−1)·|q| + R·U·|state|
    (|state| = 2Pz·N·(H+2) float32), independent of the prefix length; work: the visible (query, key) pairs, equal on
    every device when each holds the same number of earlier-chunk rows.

    Args:
      q: `[2Pz, N, H]` local queries (post-RoPE); q_pos: int32 `[2Pz]`; k, v: `[S, K, H]` this device's stored keys;
      k_pos: int32 `[S]` their global positions (negative = no key); window: as `attention.attend`; options: as
      `full_attention`.
    Returns:
      Head-flat AttnState of the local queries: o `[2Pz, N, H]`, m, l `[2Pz, N]` float32 (merge it with
      `full_attention(prefix=…)` / `sliding_attention(prefix=…)`; the sink enters there, once).
    """
    t, n, h = q.shape
    group = ring * ulysses
    # full layers: every cached key is visible, so tiles as large as options.prefix_kv_tile (widened for few local
    # queries: `StepOptions.prefix_kv_tile_for`); a sliding layer sees
    # at most W − 1 of them, which one or two kv_tile tiles cover
    full = isinstance(window, int) and window == attn_lib.NO_WINDOW
    attend = functools.partial(attn_lib.attend, window=window, q_tile=options.prefix_q_tile,
                               kv_tile=options.prefix_kv_tile_for(t) if full else options.kv_tile,
                               impl=options.attention_impl, upcast=options.upcast_matmul)

    def flat(st):
        return attn_lib.AttnState(st.o.reshape(t, n, h), st.m.reshape(t, n), st.l.reshape(t, n))

    st = attend(q, k, v, q_pos, k_pos)
    if group == 1:
        return flat(st)
    axes = ("ring", "ulysses")
    perm = [(d, (d + 1) % group) for d in range(group)]

    def step(_, carry):
        qv, pv, sv = carry
        qv, pv, sv = collectives.ppermute_packed((qv, pv, sv), axes, perm)  # one collective per hop on XLA:CPU
        return qv, pv, attend(qv, k, v, pv, k_pos, state=sv)

    with jax.named_scope("prefix_ring"):
        # Unrolled (R·U − 1 static steps), not a `fori_loop`: on XLA:CPU (jaxlib 0.10.2) a collective-permute of
        # the loop carry inside a known-trip-count loop nested in the tick scan of `seq_pipeline` intermittently read
        # a peer's buffer while it was being rewritten or after it was freed — wrong logits (0.1–1.3 off), NaN, or a
        # segfault inside InProcessCommunicator::CollectivePermute, depending on what the allocator handed out
        # (issue 17; `tests/repro_prefix_ring_race.py`). Unrolled, every hop is its own collective on its own
        # buffers; the HLO grows by R·U − 1 small attention calls per layer, the work and traffic do not change.
        carry = (q, q_pos, st)
        for hop in range(1, group):
            carry = step(hop, carry)
        st = carry[2]
        st = collectives.ppermute_packed(st, axes, perm)  # home
    return flat(st)
