"""The Pallas flash-attention kernel (interpret mode on the CPU) == the pure-JAX blockwise reference, and the
ragged_dot MoE and the grouped Pallas MoE kernel (MXFP4 dequantized in the kernel) == the tile-loop MoE, all in
float32; both kernels also lower to Triton for a GPU (checked on the CPU, without running them).

Attention kernel cases (one program per KV head serving its G query heads): causal, sliding windows W−1 / W / W+1
(windows around the prompt length), fully masked rows (queries before every key, pad queries, a key block of pads
only), GQA head shapes 64/8 and 12/4 (G = 8 and 3; the GPU path's padding of G = 3 to 4), zigzag ring-step blocks with
state continuation (`state=`), halo blocks (invalid halo positions), lengths that no block divides. Compared on the
raw partial `(o, m, l)` and after the sink finalisation. MoE kernel cases: MXFP4 and dense experts, skewed routing
(one expert takes every token), pad tokens, ids of no local expert (expert parallelism), groups straddling tiles.
Then the engine end to end with attention_impl="pallas" against the single-device XLA/loop engine on a
representative subset of layouts (single device, ring 2 with EP 2 and the MoE kernel, pipeline 2 × ring 2 × Ulysses
2; more under -m slow); the whole CP and PP parity files run with the kernel via the `pallas_everywhere` plugin (see
its docstring).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import CONFIG_A, CONFIG_B, assert_prefill_close, random_prompt

from slope_jax.model import attention as attn
from slope_jax.model import moe
from slope_jax.parallel import layout
from slope_jax.parallel.config import ParallelConfig
from slope_jax.serve.engine import PrefillEngine

KERNEL_TOL = 1e-6  # float32; measured max |Δ| of the finalised output ~2e-7, of o/l relative to l ~3e-7
ENGINE_TOL = 1e-5  # as the CP/PP parity files: measured max |Δ| logits and K/V ~3e-6
MOE_TOL = 1e-6  # measured 0 (dense) to ~1e-7 (summation order of the k slots)


def _qkv(tq, tk, n, kh, d, seed):
    r = np.random.default_rng(seed)
    return (jnp.asarray(r.standard_normal((tq, n, d)), jnp.float32),
            jnp.asarray(r.standard_normal((tk, kh, d)), jnp.float32),
            jnp.asarray(r.standard_normal((tk, kh, d)), jnp.float32))


def _assert_states_equal(a: attn.AttnState, b: attn.AttnState, what: str):
    np.testing.assert_array_equal(np.isneginf(a.m), np.isneginf(b.m), err_msg=what)
    assert np.isfinite(np.asarray(b.o)).all() and np.isfinite(np.asarray(b.l)).all(), f"{what}: not finite"
    empty = np.isneginf(np.asarray(b.m))
    assert (np.asarray(b.l)[empty] == 0).all() and (np.asarray(b.o)[empty] == 0).all(), f"{what}: empty rows not 0"
    scale = np.maximum(np.asarray(a.l), 1.0)
    dm = np.abs(np.where(empty, 0, np.asarray(a.m) - np.where(empty, 0, np.asarray(b.m)))).max()
    dl = (np.abs(np.asarray(a.l) - np.asarray(b.l)) / scale).max()
    do = (np.abs(np.asarray(a.o) - np.asarray(b.o)) / scale[..., None]).max()
    assert max(dm, dl, do) < KERNEL_TOL, f"{what}: |Δm| {dm}, |Δl|/l {dl}, |Δo|/l {do}"
    sinks = jnp.linspace(-1.0, 1.0, a.m.shape[1] * a.m.shape[2])
    df = np.abs(np.asarray(attn.finalize(a, sinks) - attn.finalize(b, sinks))).max()
    assert df < KERNEL_TOL, f"{what}: finalised max |Δ| {df}"


def _both(q, k, v, qp, kp, what, **kw):
    a = attn.attend(q, k, v, qp, kp, impl="xla", **kw)
    b = attn.attend(q, k, v, qp, kp, impl="pallas", **kw)
    _assert_states_equal(a, b, what)
    return a, b


# (query heads, kv heads): GQA 64/8 and 12/4; head_dim 4 keeps interpret mode fast
@pytest.mark.parametrize("heads", [(64, 8), (12, 4)])
def test_causal_lengths_not_multiple_of_block(heads):
    n, kh = heads
    q, k, v = _qkv(45, 45, n, kh, 4, seed=n)
    p = jnp.arange(45, dtype=jnp.int32)
    _both(q, k, v, p, p, f"causal {n}/{kh}", q_tile=16, kv_tile=8)


@pytest.mark.parametrize("window", [8, 9, 10])  # W−1, W, W+1 around T = 9, and a longer T = 37 in the same test
def test_sliding_window_around_length(window):
    for t in (9, 37):
        q, k, v = _qkv(t, t, 12, 4, 4, seed=window + t)
        p = jnp.arange(t, dtype=jnp.int32)
        _both(q, k, v, p, p, f"sliding W={window} T={t}", window=window, q_tile=8, kv_tile=8)


def test_fully_masked_rows_stay_finite():
    """Queries 0..9 see no key (keys start at 20), pad queries (INVALID_POS), and a key block made only of pads."""
    q, k, v = _qkv(30, 40, 12, 4, 4, seed=3)
    qp = jnp.concatenate([jnp.arange(10), jnp.arange(25, 40), jnp.full((5,), attn.INVALID_POS)]).astype(jnp.int32)
    kp = jnp.concatenate([jnp.full((16,), attn.INVALID_POS), jnp.arange(20, 44)]).astype(jnp.int32)
    a, b = _both(q, k, v, qp, kp, "masked rows", window=12, q_tile=16, kv_tile=16)
    assert np.isneginf(np.asarray(b.m[:10])).all() and np.isneginf(np.asarray(b.m[25:])).all()


def test_zigzag_ring_step_blocks_with_state_continuation():
    """R=2, U=1 zigzag over 40 tokens: rank 0 holds chunks 0 and 3; its ring step brings rank 1's chunks 1 and 2.
    Step 0 (own diagonal), then both later blocks continue the state, as `context_parallel.full_attention` does."""
    t, ring = 40, 2
    pos = jnp.asarray(layout.layout_positions(t, ring, 1), jnp.int32).reshape(2 * ring, -1)  # chunk order r0: 0, 3
    own = jnp.concatenate([pos[0], pos[1]])  # rank 0: chunks 0 and 3 (layout order)
    other = jnp.concatenate([pos[2], pos[3]])  # rank 1: chunks 1 and 2
    q, k0, v0 = _qkv(own.shape[0], own.shape[0], 12, 4, 4, seed=11)
    _, k1, v1 = _qkv(1, other.shape[0], 12, 4, 4, seed=12)
    kw = dict(q_tile=8, kv_tile=8)
    for impl_state in ("xla", "pallas"):
        st0 = attn.attend(q, k0, v0, own, own, impl=impl_state, **kw)
        a = attn.attend(q, k1, v1, own, other, state=st0, impl="xla", **kw)
        b = attn.attend(q, k1, v1, own, other, state=st0, impl="pallas", **kw)
        _assert_states_equal(a, b, f"ring step continuing a {impl_state} state")
    # and the whole sequence at once gives the same finalised rows as the two steps merged
    full_q = jnp.concatenate([own, other])
    sinks = jnp.zeros((12,))
    st = attn.attend(q, k1, v1, own, other, state=attn.attend(q, k0, v0, own, own, impl="pallas", **kw),
                     impl="pallas", **kw)
    kk, vv = jnp.concatenate([k0, k1]), jnp.concatenate([v0, v1])
    ref = attn.attention(q, kk, vv, own, full_q, sinks, q_tile=8, kv_tile=8)
    assert np.abs(np.asarray(attn.finalize(st, sinks) - ref)).max() < KERNEL_TOL


def test_halo_blocks():
    """A sliding piece of 12 tokens at positions 30..41 with a W−1 = 8 halo, and the first piece whose halo is empty."""
    w = 9
    for start in (30, 0):
        halo = jnp.arange(start - (w - 1), start, dtype=jnp.int32)
        halo = jnp.where(halo >= 0, halo, attn.INVALID_POS)
        own = jnp.arange(start, start + 12, dtype=jnp.int32)
        q, k, v = _qkv(12, 20, 12, 4, 4, seed=start)
        _both(q, k, v, own, jnp.concatenate([halo, own]), f"halo at {start}", window=w, q_tile=8, kv_tile=16)


def test_unknown_impl_names_the_field():
    with pytest.raises(ValueError, match="attention_impl"):
        attn.resolve_impl("cuda")
    with pytest.raises(ValueError, match="moe_impl"):
        moe.resolve_impl("dense")
    assert attn.resolve_impl("auto", "cpu") == "xla" and attn.resolve_impl("auto", "gpu") == "pallas"
    assert moe.resolve_impl("auto", "cpu") == "loop" and moe.resolve_impl("auto", "cuda") == "loop"
    assert moe.resolve_impl("auto", "rocm") == "loop" and moe.resolve_impl("ragged", "gpu") == "ragged"
    assert moe.resolve_impl("pallas", "gpu") == "pallas"


def test_group_padding_of_the_gpu_path():
    """Triton needs power-of-two tensors: a G that is not one (12/4 = 3) is padded with zero query heads on GPUs.
    The padded kernel (forced here in interpret mode) gives the unpadded partial: the pad heads' rows are dropped."""
    from slope_jax.kernels import flash_attention as fa

    q, k, v = _qkv(32, 32, 12, 4, 4, seed=8)
    p = jnp.arange(32, dtype=jnp.int32)
    rng = attn._kv_tile_range(p.reshape(2, 16), p.reshape(2, 16), jnp.int32(9))
    kw = dict(block_q=16, block_k=16, interpret=True)
    a = fa.flash_partial(q, k, v, p, p, rng, jnp.int32(9), pad_group=False, **kw)
    b = fa.flash_partial(q, k, v, p, p, rng, jnp.int32(9), pad_group=True, **kw)
    for name, x, y in zip("oml", a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)  # same rows, same arithmetic


# ---------------------------------------------------------------------------------------------------------------
# MoE: ragged_dot and the grouped Pallas kernel vs the tile loop
def _moe_params(cfg, fmt, skew, seed=5):
    e, d, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    r = np.random.default_rng(seed)
    p = {"router_w": r.standard_normal((e, d)) * 0.2, "router_b": r.standard_normal(e) * 0.1,
         "b1": r.standard_normal((e, 2 * i)) * 0.05, "b2": r.standard_normal((e, d)) * 0.05}
    if fmt == "mxfp4":  # random E2M1 codes, scale bytes 2^-9..2^-6
        p.update(w1_blocks=r.integers(0, 256, (e, 2 * i, d // 32, 16)),
                 w1_scales=r.integers(118, 122, (e, 2 * i, d // 32)),
                 w2_blocks=r.integers(0, 256, (e, d, i // 32, 16)), w2_scales=r.integers(118, 122, (e, d, i // 32)))
    else:
        p.update(w1=r.standard_normal((e, 2 * i, d)) * 0.05, w2=r.standard_normal((e, d, i)) * 0.05)
    p = {k: jnp.asarray(v, jnp.uint8 if k.endswith(("blocks", "scales")) else jnp.float32) for k, v in p.items()}
    if skew:  # every token's top-1 is expert 3 (and top-2 expert 1): one group holds all T rows
        p["router_w"] = jnp.zeros_like(p["router_w"])
        p["router_b"] = jnp.zeros_like(p["router_b"]).at[3].set(5.0).at[1].set(2.0)
    return p


def _moe_both(cfg, p, impl, t=53, n_valid=47, tile=8):
    h = jax.random.normal(jax.random.key(2), (t, cfg.hidden_size), jnp.float32)
    valid = jnp.arange(t) < n_valid
    kw = dict(experts_per_token=cfg.experts_per_token, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit, tile=tile)
    a = jax.jit(lambda h: moe.moe(h, valid, p, impl="loop", **kw))(h)
    b = jax.jit(lambda h: moe.moe(h, valid, p, impl=impl, **kw))(h)
    assert float(jnp.abs(a[:n_valid]).max()) > 1e-3  # not trivially zero
    assert float(jnp.abs(b[n_valid:]).max()) == 0.0  # pad tokens do no expert work
    return float(jnp.abs(a - b)[:n_valid].max())


def test_kernel_mxfp4_decode_is_bit_identical():
    """The kernel's tile decoder (arithmetic E2M1, no table) == `mxfp4.decode` bit for bit, for every byte (both
    nibbles) under every scale byte 0..255 (0: flushed to 0; 255: 0 and ±inf), in float32 (both end in the same cast
    to the activation dtype); and the pitfall check: byte 0x72 with scale 129 decodes to [4.0, 24.0] at (2j, 2j+1)."""
    from slope_jax.kernels import grouped_moe
    from slope_jax.model import mxfp4

    codes = jnp.tile(jnp.arange(256, dtype=jnp.int32).astype(jnp.uint8).reshape(1, 16, 16), (256, 1, 1))
    scales = jnp.tile(jnp.arange(256, dtype=jnp.int32).astype(jnp.uint8)[:, None], (1, 16))  # row r: scale byte r
    got, want = jax.jit(lambda c, s: (grouped_moe.decode_tile(c.reshape(256, 256), s, jnp.float32),
                                      mxfp4.decode(c, s, jnp.float32)))(codes, scales)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.asarray(got)[129, 2 * 0x72: 2 * 0x72 + 2].tolist() == [4.0, 24.0]


@pytest.mark.parametrize("fmt", ["mxfp4", "dense"])
@pytest.mark.parametrize("skew", [False, True])
def test_ragged_moe_equals_loop(fmt, skew):
    err = _moe_both(CONFIG_A, _moe_params(CONFIG_A, fmt, skew), "ragged")
    assert err < MOE_TOL, f"{fmt} skew={skew}: max |Δ| {err}"


def test_pallas_moe_equals_loop_with_foreign_experts():
    """The grouped kernel on CONFIG_B's MXFP4 experts (D = 96 = 3 blocks of 32: the contraction crosses weight tiles)
    through `experts` with ids out of range (pads, and under expert parallelism another device's experts: -1, E, E+2)
    and a 53-token batch whose groups (~21 rows) straddle the 16-row tiles: == the tile loop."""
    cfg = CONFIG_B
    p = _moe_params(cfg, "mxfp4", skew=False, seed=9)
    t, k, e = 53, cfg.experts_per_token, cfg.num_experts
    r = np.random.default_rng(4)
    h = jax.random.normal(jax.random.key(3), (t, cfg.hidden_size), jnp.float32)
    ids = jnp.asarray(r.integers(-1, e + 3, (t, k)), jnp.int32)  # ~1/3 of the assignments on no local expert
    w = jax.nn.softmax(jnp.asarray(r.standard_normal((t, k)), jnp.float32), axis=-1)
    kw = dict(alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit, tile=16)
    a = jax.jit(lambda h: moe.experts(h, w, ids, p, impl="loop", **kw))(h)
    b = jax.jit(lambda h: moe.experts(h, w, ids, p, impl="pallas", **kw))(h)
    err = float(jnp.abs(a - b).max())
    assert err < MOE_TOL, f"max |Δ| {err}"
    none_local = np.asarray(((ids < 0) | (ids >= e)).all(axis=1))
    assert none_local.any() and float(jnp.abs(b[none_local]).max()) == 0.0  # tokens with no local expert: 0
    assert float(jnp.abs(a).max()) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("name", ["A", "B"])
@pytest.mark.parametrize("fmt", ["mxfp4", "dense"])
@pytest.mark.parametrize("skew", [False, True])
@pytest.mark.parametrize("tile", [8, 16])
def test_pallas_moe_equals_loop_matrix(name, fmt, skew, tile):
    cfg = {"A": CONFIG_A, "B": CONFIG_B}[name]
    err = _moe_both(cfg, _moe_params(cfg, fmt, skew), "pallas", tile=tile)
    assert err < MOE_TOL, f"{name} {fmt} skew={skew} tile={tile}: max |Δ| {err}"


def test_kernels_lower_to_triton_and_moe_work_is_bounded():
    """Both kernels lower to Triton for a CUDA GPU (run on the CPU: the Pallas→Triton lowering rules, e.g. the
    power-of-two rule, are applied at lowering time, so an unsupported op or shape fails here, not on the device),
    at gpt-oss-20b's widths (2880 = 45·64) and heads (64/8), and for G = 3 (padded to 4). And the grouped MoE's grid
    holds at most T·k + E·(tile−1) rows (dropless, O(T·k + tile padding))."""
    from slope_jax.kernels import flash_attention as fa
    from slope_jax.kernels import grouped_moe

    sds = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    for n, kh, bq in ((64, 8, 16), (12, 4, 32)):
        q, kv, pos, rng = sds((128, n, 64), bf16), sds((128, kh, 64), bf16), sds((128,), jnp.int32), \
            sds((128 // bq, 2), jnp.int32)
        f = functools.partial(fa.flash_partial, block_q=bq, block_k=64, interpret=False)
        text = jax.jit(lambda q, k, v, p, r, f=f: f(q, k, v, p, p, r, jnp.int32(128))).trace(
            q, kv, kv, pos, rng).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("xla.gpu.triton") == 1, (n, kh)
    e, d, i = 32, 2880, 2880
    p = {"b1": sds((e, 2 * i), bf16), "b2": sds((e, d), bf16), "w1_blocks": sds((e, 2 * i, d // 32, 16), jnp.uint8),
         "w1_scales": sds((e, 2 * i, d // 32), jnp.uint8), "w2_blocks": sds((e, d, i // 32, 16), jnp.uint8),
         "w2_scales": sds((e, d, i // 32), jnp.uint8)}
    f = functools.partial(grouped_moe.grouped_mlp, block_m=128, alpha=1.702, limit=7.0, interpret=False)
    text = jax.jit(f).trace(sds((128 * 40, d), bf16), sds((40, 2), jnp.int32), p).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 2  # up (gate, up, SwiGLU) and down
    # grid rows of the MoE kernel for T tokens: the static worst case, never T·E
    cfg, t, tile = CONFIG_A, 53, 8
    pm = _moe_params(cfg, "mxfp4", skew=False)
    jaxpr = jax.make_jaxpr(lambda h: moe.moe(h, jnp.ones((t,), bool), pm, experts_per_token=cfg.experts_per_token,
                                             alpha=1.702, limit=7.0, tile=tile, impl="pallas"))(
        jnp.zeros((t, cfg.hidden_size), jnp.float32))
    grids = [eq.params["grid_mapping"].grid for eq in _eqns(jaxpr.jaxpr) if eq.primitive.name == "pallas_call"]
    assert len(grids) == 2
    bound = t * cfg.experts_per_token + cfg.num_experts * (tile - 1)
    assert all(g[0] * tile <= bound for g in grids), (grids, bound)


def _eqns(jaxpr):
    for eq in jaxpr.eqns:
        yield eq
        for v in eq.params.values():
            if hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                yield from _eqns(v.jaxpr)
            elif hasattr(v, "eqns"):
                yield from _eqns(v)


# ---------------------------------------------------------------------------------------------------------------
# Engine end to end with the kernel: a representative subset (the full files run via the plugin)
ENGINE_TILES = dict(q_tile=32, kv_tile=24, moe_tile=16)


@pytest.fixture(scope="module")
def xla_reference(checkpoints):
    out = {}
    for name, cfg in (("A", CONFIG_A), ("B", CONFIG_B)):
        ref = PrefillEngine.from_checkpoint(checkpoints[name]["mxfp4"], dtype="float32", progress=False,
                                            attention_impl="xla", moe_impl="loop", **ENGINE_TILES)
        prompts = [random_prompt(cfg, 3 * cfg.sliding_window + 4, seed=1)]  # > W (short ones: the plugin run)
        out[name] = (ref, prompts, ref.prefill(prompts))
    return out


# ("A", (1, 2, 1)): ring 2 with expert parallelism 2 (6 experts, 3 per device): the grouped MoE kernel on a device's
# slice of the experts, fed the other device's tokens too
ENGINE_CASES = [("A", (1, 1, 1), "ragged"), ("A", (1, 2, 1), "pallas"), ("B", (2, 2, 2), "ragged")]
ENGINE_CASES_SLOW = [("A", (1, 2, 2), "loop"), ("A", (1, 1, 2), "pallas"), ("B", (1, 1, 1), "pallas"),
                     ("B", (2, 2, 2), "pallas")]


@pytest.mark.parametrize("name,layout,moe_impl", ENGINE_CASES + [pytest.param(*c, marks=pytest.mark.slow)
                                                                 for c in ENGINE_CASES_SLOW])
def test_engine_with_pallas_equals_xla(name, layout, moe_impl, checkpoints, xla_reference):
    ref, prompts, expected = xla_reference[name]
    p, r, u = layout
    eng = PrefillEngine.from_checkpoint(checkpoints[name]["mxfp4"], ParallelConfig(pipeline=p, ring=r, ulysses=u),
                                        dtype="float32", progress=False, devices=jax.devices()[:p * r * u],
                                        attention_impl="pallas", moe_impl=moe_impl, **ENGINE_TILES)
    assert eng.impls == {"attention_impl": "pallas", "moe_impl": moe_impl}
    if name == "A" and layout in ((1, 2, 1), (1, 1, 2)):
        assert eng.parallel.expert_degree(eng.cfg) == 2
    assert_prefill_close(expected, eng.prefill(prompts), ENGINE_TOL)
