"""Blockwise (flash-style) causal attention with GQA, an optional sliding window and learned sinks.

Notable:
- Masks come from **global token positions**, never from local indices: key j is visible to query i iff
  `0 <= pos_k[j] <= pos_q[i]` and, on sliding layers, `pos_q[i] − pos_k[j] < window` (docs/model.md §2.3: a window of W
  covers W keys, the query itself included). Keys with a negative position (`INVALID_POS`) do not exist (tile
  padding, a halo before token 0).
- The running state is `(o, m, l)` in float32 — un-normalised output, running max, running sum — updated per KV tile
  with the online softmax (Milakov & Gimelshein 2018; Dao et al. 2022). Fully masked tiles and rows give zeros, never
  NaN, and merging with an empty state returns the other state unchanged.
- The sink logit enters **once**, in `finalize`: `out = o·e^(m−m') / (l·e^(m−m') + e^(S−m'))`, `m' = max(m, S)`
  (docs/model.md §2.3). It is not scaled by 1/√D.
- Memory is `O(Tq_tile · Tk_tile)` per head: tiles that the positions prove fully masked are skipped by a
  dynamic KV-tile range per query tile, so sliding layers cost `O(T·W)` and causal layers ~half the square.

Shapes: `T` tokens, `N` query heads, `K` KV heads, `G = N/K`, `D` head_dim.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import threading
from collections import defaultdict
from typing import NamedTuple

import jax
import jax.numpy as jnp

from slope_jax.model import matmul
from slope_jax.model import options as options_lib
from slope_jax.model import stack

INVALID_POS = -(2**30)  # position of a key slot that holds no token
NO_WINDOW = 2**30  # "window" of a full-attention layer


class AttnState(NamedTuple):
    """Online-softmax partial result for `Tq` queries, float32.

    o: `[Tq, K, G, D]` un-normalised `Σ_j e^(s_j − m)·v_j`; m: `[Tq, K, G]` running max (−inf if no key yet);
    l: `[Tq, K, G]` running `Σ_j e^(s_j − m)`.
    """

    o: jax.Array
    m: jax.Array
    l: jax.Array


class WorkCounter:
    """Measured attention work per device: score entries computed (visited tiles × tile area), accumulated by
    `jax.debug.callback`s that `attend` emits when it is traced inside `count_work()` (benchmarks and tests only;
    the production program carries no callback)."""

    def __init__(self, axes: dict[str, int]):
        self.axes = dict(axes)  # mesh axis name -> size, major to minor
        self.work: dict[int, float] = defaultdict(float)
        self._lock = threading.Lock()  # callbacks of one program run on several runtime threads at once

    def _device_index(self):
        idx = jnp.int32(0)
        for name, size in self.axes.items():
            idx = idx * size + jax.lax.axis_index(name)
        return idx

    def _record(self, device, work):
        with self._lock:  # `+=` on a dict item is a read-modify-write: unlocked, concurrent callbacks lose counts
            self.work[int(device)] += float(work)

    def emit(self, work: jax.Array) -> None:
        jax.debug.callback(self._record, self._device_index(), work)


_COUNTER: contextvars.ContextVar[WorkCounter | None] = contextvars.ContextVar("attention_work", default=None)


@contextlib.contextmanager
def count_work(axes: dict[str, int] | None = None):
    """Trace programs inside this context to make them report attention work per device (see WorkCounter)."""
    counter = WorkCounter(axes or {})
    token = _COUNTER.set(counter)
    try:
        yield counter
    finally:
        _COUNTER.reset(token)


def empty_state(tq: int, kv_heads: int, group: int, head_dim: int) -> AttnState:
    """The state of a query that has seen no key: o = 0, m = −inf, l = 0."""
    return AttnState(jnp.zeros((tq, kv_heads, group, head_dim), jnp.float32),
                     jnp.full((tq, kv_heads, group), -jnp.inf, jnp.float32),
                     jnp.zeros((tq, kv_heads, group), jnp.float32))


def _safe(m: jax.Array) -> jax.Array:
    return jnp.where(jnp.isneginf(m), 0.0, m)


def merge(a: AttnState, b: AttnState) -> AttnState:
    """Merge two partial states over disjoint key sets (stable log-sum-exp update).

    Finite for any gap between `a.m` and `b.m` (exponents are taken against the larger one); an empty state
    (m = −inf, l = 0) is an identity element, exactly.
    """
    m = jnp.maximum(a.m, b.m)
    ms = _safe(m)
    sa, sb = jnp.exp(a.m - ms), jnp.exp(b.m - ms)
    return AttnState(a.o * sa[..., None] + b.o * sb[..., None], m, a.l * sa + b.l * sb)


def finalize(state: AttnState, sinks: jax.Array) -> jax.Array:
    """Normalise with the attention sinks (added once per row).

    Args:
      state: partial state over all keys of each query.
      sinks: `[N]` float32 sink logits, head h = k·G + g.
    Returns:
      `[Tq, N, D]` float32 attention output; rows without any visible key give 0 (and never NaN, also for −inf sinks).
    """
    tq, kh, g, d = state.o.shape
    s = sinks.astype(jnp.float32).reshape(kh, g)[None]
    m = jnp.maximum(state.m, s)
    ms = _safe(m)
    scale = jnp.exp(state.m - ms)
    denom = state.l * scale + jnp.exp(s - ms)
    denom = jnp.where(denom == 0, 1.0, denom)
    return (state.o * (scale / denom)[..., None]).reshape(tq, kh * g, d)


def _tile_update(st: AttnState, q, k, v, qp, kp, window, scale, p_dtype, mask=True) -> AttnState:
    """One (query tile × key tile) online-softmax step in the head-major tile layout of `attend`'s XLA core.

    q `[K, G·bq, D]` (rows g-major: row g·bq + i is query i of head k·G + g), k `[K, D, bk]` (keys transposed), v
    `[K, bk, D]`, qp `[bq]`, kp `[bk]`; st holds o `[K, G·bq, D]`, m and l `[K, G·bq]`. Both matmuls are plain
    batched GEMMs over the K KV heads (batch axis leading, no transposes inside the loop): XLA:CPU hands them to its
    bf16/f32 GEMM library as they are. p_dtype: the dtype the probabilities are rounded to before the PV matmul (the
    activation dtype; `matmul.through`: k, v widened to float32 by `bf16_matmul` still see bf16 probabilities).
    scale: multiplies the scores (1.0: none, q came pre-scaled). mask: apply the causal / window / padding mask;
    False for a tile whose every key every query sees (`_kv_tile_runs`), where the select would change nothing.
    """
    kh, rows, _ = q.shape
    bq = qp.shape[0]
    s = jnp.einsum("kmd,kdc->kmc", q, k, preferred_element_type=jnp.float32)
    if scale != 1.0:
        s = s * scale
    if mask:
        diff = qp[:, None] - kp[None, :]
        visible = (kp[None, :] >= 0) & (diff >= 0) & (diff < window)  # [bq, bk]
        s = jnp.where(jnp.tile(visible, (rows // bq, 1))[None], s, -jnp.inf)
    m_new = jnp.maximum(st.m, s.max(axis=-1))
    ms = _safe(m_new)
    p = jnp.exp(s - ms[..., None])
    alpha = jnp.exp(st.m - ms)
    pv = jnp.einsum("kmc,kcd->kmd", matmul.through(p, p_dtype, v.dtype != p_dtype), v,
                    preferred_element_type=jnp.float32)
    del kh
    return AttnState(st.o * alpha[..., None] + pv, m_new, st.l * alpha + p.sum(axis=-1))


def _pad_to(x: jax.Array, n: int, value) -> jax.Array:
    pad = n - x.shape[0]
    if pad == 0:
        return x
    widths = [(0, pad)] + [(0, 0)] * (x.ndim - 1)
    return jnp.pad(x, widths, constant_values=value)


ATTENTION_IMPLS = options_lib.ATTENTION_IMPLS
# H200 sweep of the one-head-per-program kernel (benchmarks/attention_blocks.py): 64x64, 4 warps, 2 stages best at
# 8K, within 1% at 32K. The kernel now packs the G query heads of a KV head into one program (block_q·G score rows);
# 128 rows is the FlashAttention-2/3 Hopper tile height, to be re-swept on a device (benchmarks/device_check.sh).
PALLAS_MAX_BLOCK_Q = 64
PALLAS_MAX_BLOCK_K = 64
PALLAS_MAX_ROWS = 128


def resolve_impl(impl: str, platform: str | None = None) -> str:
    """`attention_impl` → the concrete core (`options.resolve_attention`: "auto" is "pallas" on GPUs, "xla"
    elsewhere; platform default: JAX's default backend). Raises ValueError naming the field for an unknown value."""
    return options_lib.resolve_attention(impl, platform or jax.default_backend())


def _real_bounds(pt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per tile of padded positions `pt [n, b]`: the least and greatest real position (INVALID_POS entries ignored;
    an all-padding tile gives `(2^31 − 1, −2^31)`)."""
    real = pt >= 0
    return jnp.where(real, pt, 2**31 - 1).min(axis=1), jnp.where(real, pt, -(2**31)).max(axis=1)


def _first_last(mask: jax.Array, fallback: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row of bool `mask [n, m]`: the first True column and one past the last; `(fallback, fallback)` for a row
    without any."""
    m = mask.shape[1]
    some = mask.any(axis=1)
    return (jnp.where(some, jnp.argmax(mask, axis=1), fallback),
            jnp.where(some, m - jnp.argmax(mask[:, ::-1], axis=1), fallback))


def _kv_tile_range(qpt: jax.Array, kpt: jax.Array, window: jax.Array) -> jax.Array:
    """int32 `[nq, 2]`: the contiguous range `[lo, hi)` of key tiles each query tile must visit.

    qpt `[nq, bq]`, kpt `[nk, bk]` padded positions. Tile j may hold a visible key iff it holds some key that is
    <= the latest query and within the window of the earliest query; tiles outside the first..last such tile are
    fully masked and skipped (an empty range when none is needed).
    """
    (k_lo, k_hi), (q_lo, q_hi) = _real_bounds(kpt), _real_bounds(qpt)
    needed = (kpt >= 0).any(axis=1)[None] & (k_lo[None] <= q_hi[:, None]) & (k_hi[None] > q_lo[:, None] - window)
    return jnp.stack(_first_last(needed, 0), axis=1).astype(jnp.int32)


def _kv_tile_runs(qpt: jax.Array, kpt: jax.Array, window: jax.Array) -> jax.Array:
    """int32 `[nq, 4]` `(lo, a, b, hi)`: each query tile visits key tiles `[lo, hi)` (`_kv_tile_range`), of which
    `[a, b)` are whole: every key of them is real and visible to every (real) query of the tile, so their scores
    need no mask (a whole tile is a needed one, so the run lies inside `[lo, hi)`). `a = b = hi` when the tile has no
    such run, or when its whole tiles are not one contiguous run (then every tile is masked). Causal prefill: the
    tiles left of the diagonal are whole."""
    rng = _kv_tile_range(qpt, kpt, window)
    lo, hi = rng[:, 0], rng[:, 1]
    (k_lo, k_hi), (q_lo, q_hi) = _real_bounds(kpt), _real_bounds(qpt)
    whole = ((kpt >= 0).all(axis=1)[None] & (qpt >= 0).all(axis=1)[:, None] & (k_hi[None] <= q_lo[:, None])
             & (q_hi[:, None] - k_lo[None] < window))
    a, b = _first_last(whole, hi)
    one_run = whole.sum(axis=1) == b - a  # every tile of [a, b) whole (an empty row: 0 == 0, a = b = hi)
    a, b = jnp.where(one_run, a, hi), jnp.where(one_run, b, hi)
    return jnp.stack([lo, a, b, hi], axis=1).astype(jnp.int32)


def _attend_pallas(q, k, v, q_pos, k_pos, window, state, q_tile, kv_tile) -> AttnState:
    """`attend` through the fused Pallas kernel (Triton on GPU, interpret mode on CPU); same contract."""
    from slope_jax.kernels import flash_attention as fa

    tq, n, d = q.shape
    tk, kh, _ = k.shape
    platform = jax.default_backend()
    # blocks: the tiles capped for the GPU's registers (block_q·G score rows per program), and never longer than the
    # (power-of-two rounded) lengths
    gp = fa.pow2_at_least(n // kh)
    bq = min(q_tile, PALLAS_MAX_BLOCK_Q, max(1, PALLAS_MAX_ROWS // gp), fa.pow2_at_least(max(tq, 16)))
    bk = min(kv_tile, PALLAS_MAX_BLOCK_K, fa.pow2_at_least(max(tk, 16)))
    fa.check_shapes(bq, bk, d, platform, group=gp)
    nq, nk = -(-tq // bq), -(-tk // bk)
    qp = _pad_to(q_pos.astype(jnp.int32), nq * bq, INVALID_POS)
    kp = _pad_to(k_pos.astype(jnp.int32), nk * bk, INVALID_POS)
    kv_range = _kv_tile_range(qp.reshape(nq, bq), kp.reshape(nk, bk), window)
    o, m, l = fa.flash_partial(_pad_to(q, nq * bq, 0), _pad_to(k, nk * bk, 0), _pad_to(v, nk * bk, 0).astype(k.dtype),
                               qp, kp, kv_range, window, block_q=bq, block_k=bk, interpret=platform == "cpu")
    counter = _COUNTER.get()
    if counter is not None:
        counter.emit((kv_range[:, 1] - kv_range[:, 0]).sum() * (bq * bk))
    g = n // kh
    part = AttnState(o[:tq].reshape(tq, kh, g, d), m[:tq].reshape(tq, kh, g), l[:tq].reshape(tq, kh, g))
    return part if state is None else merge(state, part)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array, *,
           window: int | jax.Array = NO_WINDOW, state: AttnState | None = None,
           q_tile: int = 256, kv_tile: int = 256, impl: str = "xla", contiguous: bool = False,
           windows: tuple[int, ...] | None = None, upcast: bool = False) -> AttnState:
    """Accumulate attention of `q` over the keys `k, v` into an online-softmax state (no sinks yet).

    Args:
      q: `[Tq, N, D]` (any float dtype; logits are float32). N must be a multiple of K.
      k, v: `[Tk, K, D]` post-RoPE keys and values.
      q_pos: int32 `[Tq]` global positions of the queries.
      k_pos: int32 `[Tk]` global positions of the keys; negative = no key.
      window: keys visible to a query, itself included (static int or traced scalar); NO_WINDOW for full layers.
      state: partial state to continue (e.g. from earlier ring steps); default empty.
      q_tile, kv_tile: tile sizes (clipped to the lengths; the Pallas kernel also caps them at
        PALLAS_MAX_BLOCK_Q / PALLAS_MAX_BLOCK_K, and q_tile·G at PALLAS_MAX_ROWS score rows per program).
      impl: "xla" (this module's `lax.map` × `fori_loop` over tiles: the reference), "pallas" (the fused kernel of
        `slope_jax.kernels.flash_attention`; its partial is merged into `state`), "cudnn" (`attend_sdpa`: the
        fused attention of `jax.nn.dot_product_attention` for `contiguous` calls with a static window, "pallas" on
        GPUs and "xla" elsewhere for the others); "auto" is resolved before (`options.StepOptions.resolve`) and raises
        ValueError here.
      contiguous: the caller guarantees that the keys are the queries' own tokens in order at consecutive positions
        (`k_pos = q_pos = q_pos[0] + arange(Tq)`), so index-based causal and window masks equal the position masks.
      windows: the static values a traced `window` can take (e.g. the model's layer windows); "cudnn" needs a static
        window and switches over these.
      upcast: the "xla" core's bf16 q, k, v widened to float32 for its matmuls (`StepOptions.upcast_matmul`,
        `model.matmul`) when its query tile holds at least `options.UPCAST_MIN_QUERY_TILE` queries; the fused
        kernels ignore it.
    Returns:
      Updated AttnState for the `Tq` queries (`state`, or the empty state, when there is no key: Tk = 0). Scale
      `D^-0.5` is applied to q·k (docs/model.md §2.3).
    """
    if impl not in ("xla", "pallas", "cudnn"):
        raise ValueError(f"attention_impl={impl!r}: the step runs a concrete core, 'xla', 'pallas' or 'cudnn' "
                         "(resolve 'auto' with StepOptions.resolve)")
    if k.shape[0] == 0:  # no keys (a window of 1 over a cached prefix reads none of it): nothing to accumulate
        return state if state is not None else empty_state(q.shape[0], k.shape[1], q.shape[1] // k.shape[1],
                                                           q.shape[2])
    if impl == "cudnn":
        gpu = jax.default_backend() in options_lib.GPU_PLATFORMS
        choices = (int(window),) if isinstance(window, int) else windows
        usable = not gpu or (sdpa_supported(q.dtype, q.shape[-1]) and not on_rocm())
        if contiguous and choices and usable and _COUNTER.get() is None:
            part = attend_sdpa(q, k, v, window, windows=choices, implementation="cudnn" if gpu else "xla")
            return part if state is None else merge(state, part)
        impl = "pallas" if gpu else "xla"
    window = jnp.asarray(window, jnp.int32)
    if impl == "pallas":
        return _attend_pallas(q, k, v, q_pos, k_pos, window, state, q_tile, kv_tile)
    if _COUNTER.get() is not None:  # jit's trace cache does not see count_work's context variable: a trace made
        # outside it (no callback) would be reused inside it, so counted programs trace the core inline
        return _attend_xla(q, k, v, q_pos, k_pos, window, state, q_tile=q_tile, kv_tile=kv_tile, upcast=upcast)
    return _attend_xla_call(q, k, v, q_pos, k_pos, window, state, q_tile=q_tile, kv_tile=kv_tile, upcast=upcast)


def _attend_xla(q, k, v, q_pos, k_pos, window, state: AttnState | None, *, q_tile: int, kv_tile: int,
                upcast: bool = False) -> AttnState:
    """`attend`'s XLA core (`lax.map` over query tiles × `fori_loop` over the key tiles they need); same contract,
    `window` an int32 scalar. The empty state is made here, not passed in: as a call argument XLA copies it (+12.5
    MiB of temporaries for the tiny config's 8192-token step)."""
    tq, n, d = q.shape
    tk, kh, _ = k.shape
    g = n // kh
    if state is None:
        state = empty_state(tq, kh, g, d)
    bq, bk = min(q_tile, tq), min(kv_tile, tk)
    nq, nk = -(-tq // bq), -(-tk // bk)
    scale = d ** -0.5
    if math.log2(scale).is_integer():  # exact in any float dtype: scale the queries once, not every score
        q, scale = q * jnp.asarray(scale, q.dtype), 1.0

    p_dtype = v.dtype  # the probabilities' rounding before the PV matmul, also when v is widened
    upcast = upcast and bq >= options_lib.UPCAST_MIN_QUERY_TILE
    q, k, v = (matmul.widen(x, upcast) for x in (q, k, v))  # fused into the tile copies below
    # head-major tiles: queries [nq, K, G·bq, D] (g-major rows), keys [nk, K, D, bk], values [nk, K, bk, D]
    qt = _pad_to(q, nq * bq, 0).reshape(nq, bq, kh, g, d).transpose(0, 2, 3, 1, 4).reshape(nq, kh, g * bq, d)
    qpt = _pad_to(q_pos.astype(jnp.int32), nq * bq, INVALID_POS).reshape(nq, bq)
    kt = _pad_to(k, nk * bk, 0).reshape(nk, bk, kh, d).transpose(0, 2, 3, 1)
    vt = _pad_to(v, nk * bk, 0).reshape(nk, bk, kh, d).transpose(0, 2, 1, 3)
    kpt = _pad_to(k_pos.astype(jnp.int32), nk * bk, INVALID_POS).reshape(nk, bk)
    st = AttnState(*(_pad_to(x, nq * bq, 0).reshape(nq, bq, *x.shape[1:]) for x in state))
    st = st._replace(m=jnp.where(jnp.arange(nq * bq).reshape(nq, bq)[..., None, None] < tq, st.m, -jnp.inf))
    # state to the tile layout: o [nq, K, G·bq, D], m, l [nq, K, G·bq]
    st = AttnState(st.o.transpose(0, 2, 3, 1, 4).reshape(nq, kh, g * bq, d),
                   *(x.transpose(0, 2, 3, 1).reshape(nq, kh, g * bq) for x in (st.m, st.l)))
    kv_range = _kv_tile_runs(qpt, kpt, window)

    def per_q_tile(args):
        qi, qp, s0, rng = args
        qi = stack.unbits(qi, q.dtype)

        def body(mask):
            return lambda j, s: _tile_update(s, qi, stack.take(kt, j), stack.take(vt, j), qp, stack.take(kpt, j),
                                             window, scale, p_dtype, mask=mask)

        # the key tiles in order (the online softmax's summation order): masked ones before and after the run of
        # tiles every query of this tile sees whole, which skips the mask
        # (named scopes: `plan.hlo.matmul_flops` counts one run's dots per pass — the three run the same dots)
        with jax.named_scope(options_lib.MASKED_RUN_SCOPE):
            s0 = jax.lax.fori_loop(rng[0], rng[1], body(True), s0)
        with jax.named_scope(options_lib.WHOLE_RUN_SCOPE):
            s0 = jax.lax.fori_loop(rng[1], rng[2], body(False), s0)
        with jax.named_scope(options_lib.MASKED_RUN_SCOPE):
            return jax.lax.fori_loop(rng[2], rng[3], body(True), s0)

    out = jax.lax.map(per_q_tile, (stack.bits(qt), qpt, st, kv_range))  # bf16 tiles as bits (`model.stack`)
    counter = _COUNTER.get()
    if counter is not None:
        counter.emit((kv_range[:, 3] - kv_range[:, 0]).sum() * (bq * bk))
    o = out.o.reshape(nq, kh, g, bq, d).transpose(0, 3, 1, 2, 4).reshape(nq * bq, kh, g, d)[:tq]
    m, l = (x.reshape(nq, kh, g, bq).transpose(0, 3, 1, 2).reshape(nq * bq, kh, g)[:tq] for x in (out.m, out.l))
    return AttnState(o, m, l)


# The core as one traced call: the blocks of a layer (zigzag ring steps, sliding-window slots) that share shapes share
# one trace and one lowered function (XLA inlines it again), so a step traces and lowers in less time — the part of
# getting a program that a compilation-cache hit still pays.
_attend_xla_call = jax.jit(_attend_xla, static_argnames=("q_tile", "kv_tile", "upcast"))


def attention(q, k, v, q_pos, k_pos, sinks, *, window=NO_WINDOW, q_tile=256, kv_tile=256, impl="xla",
              contiguous=False, windows=None, upcast=False) -> jax.Array:
    """Complete sink attention: `finalize(attend(...), sinks)` → `[Tq, N, D]` float32."""
    return finalize(attend(q, k, v, q_pos, k_pos, window=window, q_tile=q_tile, kv_tile=kv_tile, impl=impl,
                           contiguous=contiguous, windows=windows, upcast=upcast), sinks)


# --- the fused attention of jax.nn.dot_product_attention (cuDNN on NVIDIA GPUs) -------------------------------------

SDPA_DTYPES = ("bfloat16", "float16")  # cuDNN's fused attention takes half precision only
SDPA_PRIVATE_STATS = True  # take cuDNN's float32 stats from JAX's cuDNN binding (False: the public call only)
SDPA_ENTRY: dict[str, str] = {}  # implementation → the entry point last traced ("cudnn_private" / "public"): benchmarks


def on_rocm() -> bool:
    """Whether JAX's GPU backend is ROCm (its client's platform_version names ROCm/HIP; CUDA otherwise): cuDNN's
    attention exists on NVIDIA GPUs only, and ROCm reports its platform as "gpu" too."""
    try:
        version = str(getattr(jax.devices()[0].client, "platform_version", "")).lower()
    except Exception:  # noqa: BLE001 - no backend detail: assume CUDA (the cuDNN call then names its own error)
        return False
    return "rocm" in version or "hip" in version


def sdpa_supported(dtype, head_dim: int) -> bool:
    """Whether cuDNN's fused attention takes these inputs: bf16/fp16, head_dim a multiple of 8 up to 256 (cuDNN
    frontend's SDPA support surface); other inputs take the "pallas" core."""
    return jnp.dtype(dtype).name in SDPA_DTYPES and head_dim % 8 == 0 and head_dim <= 256


def _sdpa_call(q, k, v, window: int, implementation: str) -> tuple[jax.Array, jax.Array]:
    """Causal (and, if `window` < Tq, sliding-window) attention of `q [T, N, D]` over `k, v [T, K, D]` without sinks
    → `(out [T, N, D] in q's dtype, lse [T, N] float32)`, `lse` the natural-log log-sum-exp of each row's scaled
    logits. cuDNN: JAX's cuDNN binding is called directly for its float32 softmax statistics (the public
    `jax.nn.dot_product_attention` rounds them to the output dtype, which would put a bf16 error into every sink
    weight); where that private entry point differs (another jax), the public one is used."""
    t, _, d = q.shape
    scale = d ** -0.5
    sliding = window if window < t else None
    if implementation == "cudnn" and SDPA_PRIVATE_STATS:
        try:
            from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa

            out, lse = cudnn_fa.dot_product_attention(
                q[None], k[None], v[None], scale=scale, mask_type=cudnn_fa.MaskType.CAUSAL,
                sliding_window_length=sliding, return_residual=True)
            SDPA_ENTRY[implementation] = "cudnn_private"
            return out[0], lse[0].T.astype(jnp.float32)  # stats come as [B, N, T]
        except (ImportError, AttributeError, TypeError):
            pass
    SDPA_ENTRY[implementation] = "public"
    out, lse = jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=True, local_window_size=None if sliding is None else (sliding - 1, 0),
        implementation=implementation, return_residual=True)
    return out, lse.astype(jnp.float32)


def switch_window(window: jax.Array, windows: tuple[int, ...], fn):
    """`fn(w)` for the static w of `windows` equal to the traced `window` (one `lax.switch` branch per choice; no
    switch for a single choice): how a layer scan, whose window is traced, reaches code that needs it static."""
    if len(windows) == 1:
        return fn(windows[0])
    idx = jnp.argmax(jnp.asarray(windows, jnp.int32) == jnp.asarray(window, jnp.int32))
    return jax.lax.switch(idx, [lambda w=w: fn(w) for w in windows])


def attend_sdpa(q: jax.Array, k: jax.Array, v: jax.Array, window: int | jax.Array, *, windows: tuple[int, ...],
                implementation: str = "cudnn") -> AttnState:
    """`attend` of contiguous tokens (`contiguous=True`) through `jax.nn.dot_product_attention`'s fused core.

    The fused call returns the normalised output `out` and the log-sum-exp `lse` of each row; as an online-softmax
    state that is `(o, m, l) = (out, lse, 1)`: `Σ_j e^(s_j − lse)·v_j = out` and `Σ_j e^(s_j − lse) = 1` (Milakov &
    Gimelshein 2018), so `merge` and the sink of `finalize` consume it unchanged. Every query sees at least itself,
    so no row is empty.

    Args:
      q: `[T, N, D]` bf16/fp16 on cuDNN (any float with implementation="xla"); k, v: `[T, K, D]`, the same tokens.
      window: keys visible to a query, itself included: a static int, or a traced scalar taking one of `windows`
        (then one fused call per choice under `lax.switch`).
      windows: the static choices of a traced `window`.
      implementation: "cudnn" (NVIDIA GPUs) or "xla" (JAX's reference of the same call: the whole `[N, T, T]`
        score matrix; tests only).
    Returns:
      AttnState for the T queries (float32). Raises ValueError if a traced window has no `windows`.
    """
    tq, n, d = q.shape
    kh = k.shape[1]

    def call(w):
        out, lse = _sdpa_call(q, k, v.astype(q.dtype), int(w), implementation)
        return out.astype(jnp.float32), lse

    if isinstance(window, int):
        out, lse = call(window)
    elif not windows:
        raise ValueError("attend_sdpa: a traced window needs its static choices (windows=...)")
    else:
        out, lse = switch_window(window, windows, call)
    g = n // kh
    return AttnState(out.reshape(tq, kh, g, d), lse.reshape(tq, kh, g), jnp.ones((tq, kh, g), jnp.float32))
