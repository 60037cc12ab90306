"""The Pallas flash-attention kernel (interpret mode on the CPU) == the pure-JAX blockwise reference, and the
ragged_dot MoE == the tile-loop MoE, both in float32.

Kernel cases: causal, sliding windows W−1 / W / W+1 (windows around the prompt length), fully masked rows (queries
before every key, pad queries, a key block of pads only), GQA head shapes 64/8 and 12/4, zigzag ring-step blocks with
state continuation (`state=`), halo blocks (invalid halo positions), lengths that no block divides. Compared on the
raw partial `(o, m, l)` and after the sink finalisation. Then the engine end to end with attention_impl="pallas" on
a representative subset of layouts (single device, ring 2 × Ulysses 2, pipeline 2 × ring 2 × Ulysses 2); the whole CP
and PP parity files run with the kernel via the `pallas_everywhere` plugin (see its docstring).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CONFIG_A, CONFIG_B, assert_prefill_close, random_prompt

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
    assert moe.resolve_impl("auto", "cpu") == "loop" and moe.resolve_impl("auto", "gpu") == "loop"  # measured


# ---------------------------------------------------------------------------------------------------------------
# MoE: ragged_dot vs tile loop
@pytest.mark.parametrize("fmt", ["mxfp4", "dense"])
@pytest.mark.parametrize("skew", [False, True])
def test_ragged_moe_equals_loop(fmt, skew):
    cfg = CONFIG_A
    e, d, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    r = np.random.default_rng(5)
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
    t = 53
    h = jax.random.normal(jax.random.key(2), (t, cfg.hidden_size), jnp.float32)
    valid = jnp.arange(t) < 47
    kw = dict(experts_per_token=cfg.experts_per_token, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit, tile=8)
    a = jax.jit(lambda h: moe.moe(h, valid, p, impl="loop", **kw))(h)
    b = jax.jit(lambda h: moe.moe(h, valid, p, impl="ragged", **kw))(h)
    err = float(jnp.abs(a - b)[:47].max())
    assert err < MOE_TOL, f"{fmt} skew={skew}: max |Δ| {err}"
    assert float(jnp.abs(a[:47]).max()) > 1e-3  # not trivially zero


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


@pytest.mark.parametrize("name,layout,moe_impl", [("A", (1, 1, 1), "ragged"), ("A", (1, 2, 2), "loop"),
                                                  ("B", (2, 2, 2), "ragged")])
def test_engine_with_pallas_equals_xla(name, layout, moe_impl, checkpoints, xla_reference):
    ref, prompts, expected = xla_reference[name]
    p, r, u = layout
    eng = PrefillEngine.from_checkpoint(checkpoints[name]["mxfp4"], ParallelConfig(pipeline=p, ring=r, ulysses=u),
                                        dtype="float32", progress=False, devices=jax.devices()[:p * r * u],
                                        attention_impl="pallas", moe_impl=moe_impl, **ENGINE_TILES)
    assert eng.impls == {"attention_impl": "pallas", "moe_impl": moe_impl}
    assert_prefill_close(expected, eng.prefill(prompts), ENGINE_TOL)
