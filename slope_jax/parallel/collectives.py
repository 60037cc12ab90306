"""The collectives of the parallel prefill, one small named function each. Call them inside `jax.shard_map` over the
mesh `(pipeline, ring, ulysses)`.

Shape notation (scaling-book style): a sharded dimension carries its mesh axis. `Pz` = tokens of one zigzag piece,
`C = U·Pz` = tokens of one chunk, `n` = heads, `H` = head_dim, slot axis `2` = the device's two zigzag pieces.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from slope_jax.model import stack
from slope_jax.parallel.config import AXES, CP_AXES


def ulysses_seq_to_heads(x: jax.Array) -> jax.Array:
    """`[…, 2, Pz_{ring,ulysses}, n, H] → […, 2, C_{ring}, n/U_{ulysses}, H]` (all-to-all over `ulysses`).

    Each rank sends head slice j of both pieces to rank j and concatenates what it receives along the token axis in
    rank order, so slot 0 becomes the whole chunk r and slot 1 the whole chunk 2R−1−r, in natural order.
    Bytes sent per device: (U−1)/U of the operand.
    """
    return jax.lax.all_to_all(x, "ulysses", split_axis=x.ndim - 2, concat_axis=x.ndim - 3, tiled=True)


def ulysses_heads_to_seq(x: jax.Array) -> jax.Array:
    """`[…, 2, C_{ring}, n/U_{ulysses}, H] → […, 2, Pz_{ring,ulysses}, n, H]`: inverse of `ulysses_seq_to_heads`."""
    return jax.lax.all_to_all(x, "ulysses", split_axis=x.ndim - 3, concat_axis=x.ndim - 2, tiled=True)


def _serialize_collectives() -> bool:
    """Whether this program's collectives must run one at a time (XLA:CPU). jaxlib 0.10.2 lowers every collective
    with channel id 1, and XLA:CPU keys a collective's rendezvous by (run, devices, kind, channel id): two collectives
    of one kind over the same devices that its thunk executor starts concurrently (no data dependency between them)
    meet in one rendezvous — 8 participants where 4 were expected, `Check failed: id < num_threads`, or a 40 s
    termination timeout, either way the process aborts (outside-in probe: a prefix hit on ring ≥ 4 aborted 3 of 3
    times; before it, the same fault showed as wrong logits, issue 17). GPU and TPU collectives do not rendezvous this
    way."""
    return jax.default_backend() == "cpu"


def after(x, dep):
    """`x`, made to depend on `dep` (an optimization barrier): the collective that consumes it starts only after the
    one that produced `dep`. Values unchanged."""
    return jax.lax.optimization_barrier((x, dep))[0]


def sequenced_map(fn, tree):
    """`jax.tree.map(fn, tree)` for a collective `fn`, the leaves' collectives one after the other on XLA:CPU (each
    leaf's operand made to depend on the previous leaf's result, `after`; `_serialize_collectives`). Elsewhere the
    plain map: independent collectives may overlap."""
    if not _serialize_collectives():
        return jax.tree.map(fn, tree)
    leaves, treedef = jax.tree.flatten(tree)
    out = []
    for a in leaves:
        out.append(fn(after(a, out[-1]) if out else a))
    return jax.tree.unflatten(treedef, out)


def ppermute_packed(tree, axes, perm):
    """`jax.lax.ppermute` of every leaf of `tree` over `axes` with `perm`, as one collective on XLA:CPU: the leaves'
    bytes are concatenated into one uint8 vector, sent, and split back (`_serialize_collectives`: separate
    ppermutes with the same pairs may run concurrently there and abort the process). Elsewhere one ppermute per leaf.
    Layout unchanged; values bit-exact."""
    leaves, treedef = jax.tree.flatten(tree)
    if len(leaves) <= 1 or not _serialize_collectives():
        return jax.tree.map(lambda a: jax.lax.ppermute(a, axes, perm), tree)
    parts = [jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(-1) for a in leaves]
    got = jax.lax.ppermute(jnp.concatenate(parts), axes, perm)
    out, start = [], 0
    for a, part in zip(leaves, parts):
        piece = got[start:start + part.size]
        start += part.size
        width = jnp.dtype(a.dtype).itemsize
        out.append(jax.lax.bitcast_convert_type(piece.reshape(*a.shape, width) if width > 1 else piece.reshape(a.shape),
                                                a.dtype))
    return jax.tree.unflatten(treedef, out)


def ring_pass(x, ring: int):
    """Send a pytree of blocks one step round the ring: rank r → r+1 (mod R). After k calls, rank r holds the blocks
    that started on rank (r−k) mod R. Layout unchanged: `[…]_{ring} → […]_{ring}` (contents rotate). One collective
    on XLA:CPU (`ppermute_packed`)."""
    perm = [(i, (i + 1) % ring) for i in range(ring)]
    return ppermute_packed(x, "ring", perm)


def pipeline_pass(x: jax.Array, pipeline: int) -> jax.Array:
    """Stage p → p+1 (the last stage sends nothing; stage 0 receives zeros). `[…]_{pipeline}` contents shift."""
    if pipeline == 1:
        return jnp.zeros_like(x)
    return jax.lax.ppermute(x, "pipeline", [(i, i + 1) for i in range(pipeline - 1)])


def piece_predecessor_perms(ring: int, ulysses: int):
    """Source→destination pairs (linear device index r·U + u over `(ring, ulysses)`) that bring each zigzag piece the
    data of the piece just before it in the sequence:

      A: slot 0 → slot 0 (chunks 0…R−1),  B: slot 1 → slot 1 (chunks R…2R−1),
      C: slot 0 → slot 1 at the fold, piece (R−1, U−1) → piece (R, 0), both on ring rank R−1.

    Returns (A, B, C, c_local) where c_local is True when C stays on one device (U = 1).
    """
    U = ulysses

    def lin(r, u):
        return r * U + u

    a, b = [], []
    for r in range(ring):
        for u in range(U):
            if u > 0:
                a.append((lin(r, u - 1), lin(r, u)))
                b.append((lin(r, u - 1), lin(r, u)))
            else:
                if r > 0:
                    a.append((lin(r - 1, U - 1), lin(r, 0)))
                if r < ring - 1:
                    b.append((lin(r + 1, U - 1), lin(r, 0)))
    src, dst = lin(ring - 1, U - 1), lin(ring - 1, 0)
    return a, b, [(src, dst)], src == dst


def piece_pass(x: jax.Array, ring: int, ulysses: int) -> jax.Array:
    """Give each of a device's two zigzag pieces the data of the preceding piece of the sequence.

    `x`: `[2, …]` per device (slot 0 = piece of chunk r, slot 1 = piece of chunk 2R−1−r). Returns `[2, …]` where slot j
    holds the predecessor's slot data (zeros for the very first piece of the sequence). Three `ppermute`s over
    `(ring, ulysses)` (A, B and the single fold pair C, see `piece_predecessor_perms`; one after the other on
    XLA:CPU); used for sliding-window halos.
    """
    axes = ("ring", "ulysses")
    perm_a, perm_b, perm_c, c_local = piece_predecessor_perms(ring, ulysses)
    serial = _serialize_collectives()  # the three in a fixed order on XLA:CPU (`_serialize_collectives`)
    recv0 = jax.lax.ppermute(x[0], axes, perm_a) if perm_a else jnp.zeros_like(x[0])
    recv1 = jax.lax.ppermute(after(x[1], recv0) if serial else x[1], axes, perm_b) if perm_b else jnp.zeros_like(x[1])
    fold = x[0] if c_local else jax.lax.ppermute(after(x[0], recv1) if serial else x[0], axes, perm_c)
    r = jax.lax.axis_index("ring")
    u = jax.lax.axis_index("ulysses")
    at_fold = (r == ring - 1) & (u == 0)
    recv1 = jnp.where(at_fold, fold, recv1)
    return jnp.stack([recv0, recv1])


def natural_piece_order(ring: int, ulysses: int) -> list[int]:
    """For each zigzag piece g = chunk·U + u of the sequence (natural order), its row d·2 + slot in the `[R·U, 2, …]`
    result of an all-gather over `(ring, ulysses)` (device d = r·U + u holds chunks r and 2R−1−r in slots 0, 1)."""
    rows = []
    for chunk in range(2 * ring):
        r, slot = (chunk, 0) if chunk < ring else (2 * ring - 1 - chunk, 1)
        rows += [(r * ulysses + u) * 2 + slot for u in range(ulysses)]
    return rows


def gather_sequence(x: jax.Array, ring: int, ulysses: int) -> jax.Array:
    """`[2, Pz_{ring,ulysses}, …] → [2R·U·Pz, …]` replicated over `(ring, ulysses)`: the whole sequence in natural
    token order — one all-gather over `(ring, ulysses)`, then a static reorder of the 2RU pieces
    (`natural_piece_order`). Bytes sent per device: the operand to each of the RU−1 other devices. Used for the
    sliding-window halo of short buckets, where the whole sequence is smaller than RU halos."""
    if ring * ulysses == 1:
        return x.reshape(-1, *x.shape[2:])
    g = jax.lax.all_gather(x, ("ring", "ulysses"), axis=0, tiled=False)  # [RU, 2, Pz, …], device d = r·U + u
    g = g.reshape(2 * ring * ulysses, *x.shape[1:])[jnp.asarray(natural_piece_order(ring, ulysses))]
    return g.reshape(-1, *x.shape[2:])


def vocab_shard_index(axes=AXES) -> jax.Array:
    """This device's block of a dimension split over `axes` (linear index, major to minor, as a PartitionSpec entry
    `axes` places blocks)."""
    idx = jnp.int32(0)
    for name in axes:
        idx = idx * jax.lax.axis_size(name) + jax.lax.axis_index(name)
    return idx


def vocab_parallel_embed(table: jax.Array, ids: jax.Array, pipeline: int, cp: int) -> jax.Array:
    """Embedding lookup with the table's vocabulary rows split over every device (`(pipeline, ring, ulysses)`).

    `table`: `[V'/(P·R·U), D]` (this device's rows, block `vocab_shard_index()`), `ids`: int32 `[M, T_loc]` sharded
    over `(ring, ulysses)` (cp = R·U devices) along tokens, replicated over `pipeline` → `[M, T_loc, D]`, the same on
    every stage. Per request: all-gather the ids of the stage `[T]`, take the rows this device holds (zeros
    elsewhere), reduce-scatter over `(ring, ulysses)` back to the local tokens, psum over `pipeline`. Exact: exactly
    one device contributes a non-zero row per token. Transient per device: one request's `[T, D]`; operand bytes per
    request: 4·T_loc (ids) + T·D·b (reduce-scatter) + T_loc·D·b (psum), each only where its group has > 1 device.
    """
    if pipeline * cp == 1:
        return stack.gather_rows(table, ids.reshape(-1)).reshape(*ids.shape, table.shape[1])
    rows = table.shape[0]
    base = vocab_shard_index() * rows

    def one(ids_loc):
        # [T] in token-shard order r·U + u
        ids_all = jax.lax.all_gather(ids_loc, CP_AXES, axis=0, tiled=True) if cp > 1 else ids_loc
        local = ids_all - base
        mine = (local >= 0) & (local < rows)
        x = jnp.where(mine[:, None], stack.gather_rows(table, jnp.clip(local, 0, rows - 1)), 0)
        if cp > 1:
            x = jax.lax.psum_scatter(x, CP_AXES, scatter_dimension=0, tiled=True)  # [T_loc, D]
        return jax.lax.psum(x, "pipeline") if pipeline > 1 else x

    return jax.lax.map(one, ids)


def vocab_parallel_gather(logits: jax.Array, num_shards: int) -> jax.Array:
    """`[…, V'/S] → […, V']`: all-gather of per-device vocabulary slices along the last axis, over every device
    (block order `vocab_shard_index`)."""
    if num_shards == 1:
        return logits
    return jax.lax.all_gather(logits, AXES, axis=logits.ndim - 1, tiled=True)


def expert_dispatch(x, axes=("ring", "ulysses")):
    """Expert-parallel dispatch: every device of a stage gets every token of the stage.

    A pytree of `[T_loc_{axes}, …]` → `[T_stage, …]` (all-gather over `axes`, tiled, in the linear device order
    r·U + u of the token sharding). Operand bytes per device: the local block; wire bytes: (EP−1)× the local block.
    One leaf after the other on XLA:CPU (`sequenced_map`).
    """
    return sequenced_map(lambda a: jax.lax.all_gather(a, axes, axis=0, tiled=True), x)


def expert_combine(y: jax.Array, axes=("ring", "ulysses")) -> jax.Array:
    """Expert-parallel combine: `[T_stage, D]` partial sums (this device's experts) → `[T_loc_{axes}, D]` totals.

    Reduce-scatter (`psum_scatter` over `axes`, tiled along tokens): device r·U + u receives the sum over all devices
    of its own token block, the inverse layout change of `expert_dispatch`. Operand bytes per device: all of `y`;
    wire bytes: (EP−1)/EP of `y`.
    """
    return jax.lax.psum_scatter(y, axes, scatter_dimension=0, tiled=True)


def expert_exchange(x, axes=("ring", "ulysses")):
    """Expert-parallel all-to-all: a pytree of `[EP, c, …]` send buffers (row block j for device j) →
    `[EP, c, …]` receive buffers (row block i from device i), device index linear over `axes` (r·U + u). Used both
    ways: tokens out to their experts' owners, partial outputs back. Operand bytes per device: the whole buffer;
    wire bytes: (EP−1)/EP of it (block j = self stays). One leaf after the other on XLA:CPU (`sequenced_map`)."""
    return sequenced_map(lambda a: jax.lax.all_to_all(a, axes, split_axis=0, concat_axis=0, tiled=True), x)
