"""attention_impl="cudnn": the fused attention of `jax.nn.dot_product_attention` as an online-softmax state.

On the CPU the same call runs JAX's XLA implementation of `jax.nn.dot_product_attention` (the cuDNN one needs an
NVIDIA GPU: benchmarks/kernel_parity.py checks it there), so these tests check everything around the fused call
in float32: the `(out, lse, 1)` state against the blockwise reference (`attend`, impl="xla") raw and after the
sink finalisation, merged after a prefix's state, the `lax.switch` over a traced layer window, windows around the
prompt length, GQA 64/8 and 12/4, lengths no tile divides; then the single-device prefill (`gpt_oss.forward`)
end to end, cold and from a cached prefix, against impl="xla", and the fallback of non-contiguous calls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import CONFIG_A, CONFIG_B

from slope_jax.model import attention as attn
from slope_jax.model import gpt_oss
from slope_jax.model.options import StepOptions, resolve_attention

TOL = 2e-6  # float32: measured max |Δ| of the finalised output ~3e-7 (softmax over the whole row vs online)
PREFILL_TOL = 1e-5  # float32 logits / K / V of the 4- and 9-layer test models; measured ~1e-6


def _qkv(t, n, kh, d, seed):
    r = np.random.default_rng(seed)
    return tuple(jnp.asarray(r.standard_normal((t, h, d)), jnp.float32) for h in (n, kh, kh))


def _finalised(st, sinks):
    return np.asarray(attn.finalize(st, sinks))


@pytest.mark.parametrize("heads,t,window", [((64, 8), 37, 36), ((64, 8), 37, 37), ((12, 4), 53, 9),
                                            ((12, 4), 53, attn.NO_WINDOW)])
def test_sdpa_state_equals_blockwise_reference(heads, t, window):
    n, kh = heads
    q, k, v = _qkv(t, n, kh, 8, seed=t + n)
    pos = jnp.arange(t, dtype=jnp.int32) + 5  # positions need not start at 0
    ref = attn.attend(q, k, v, pos, pos, window=window, q_tile=16, kv_tile=8, impl="xla")
    got = attn.attend_sdpa(q, k, v, window, windows=(window,), implementation="xla")
    sinks = jnp.linspace(-2.0, 3.0, n)
    err = np.abs(_finalised(ref, sinks) - _finalised(got, sinks)).max()
    assert err < TOL, f"{heads} T={t} W={window}: finalised max |Δ| {err}"
    # the state itself: o/l and m+log(l) (the row's log-sum-exp) agree, whatever the split between m and l
    lse_ref = np.asarray(ref.m + jnp.log(ref.l))
    assert np.abs(lse_ref - np.asarray(got.m)).max() < TOL, "log-sum-exp"
    o_ref = np.asarray(ref.o / ref.l[..., None])
    assert np.abs(o_ref - np.asarray(got.o)).max() < TOL, "normalised output"


def test_traced_window_switches_and_merges_after_a_prefix_state():
    n, kh, d, off, t, w = 12, 4, 8, 19, 23, 6
    q, k, v = _qkv(t, n, kh, d, seed=3)
    kp_, vp_ = _qkv(off, kh, kh, d, seed=4)[1:]
    pos = jnp.arange(t, dtype=jnp.int32) + off
    ppos = jnp.arange(off, dtype=jnp.int32)
    sinks = jnp.linspace(-1.0, 1.0, n)
    for window in (w, attn.NO_WINDOW):
        @jax.jit
        def both(window_arr, q=q, k=k, v=v):
            st0 = attn.attend(q, kp_, vp_, pos, ppos, window=window_arr, q_tile=8, kv_tile=8, impl="xla")
            ref = attn.attend(q, k, v, pos, pos, window=window_arr, state=st0, q_tile=8, kv_tile=8, impl="xla")
            got = attn.attend(q, k, v, pos, pos, window=window_arr, state=st0, impl="cudnn", contiguous=True,
                              windows=(w, attn.NO_WINDOW))
            return attn.finalize(ref, sinks), attn.finalize(got, sinks)

        ref, got = both(jnp.int32(window))
        err = np.abs(np.asarray(ref) - np.asarray(got)).max()
        assert err < TOL, f"W={window}: max |Δ| {err}"


def test_non_contiguous_calls_fall_back_and_bad_fields_are_named():
    q, k, v = _qkv(20, 8, 2, 8, seed=9)
    qp = jnp.arange(20, dtype=jnp.int32)
    kp = jnp.where(qp % 3 == 0, attn.INVALID_POS, qp)  # holes: index masks would be wrong, the fallback is exact
    ref = attn.attend(q, k, v, qp, kp, impl="xla", q_tile=8, kv_tile=8)
    got = attn.attend(q, k, v, qp, kp, impl="cudnn", q_tile=8, kv_tile=8)  # contiguous not claimed
    np.testing.assert_array_equal(np.asarray(ref.o), np.asarray(got.o))
    with pytest.raises(ValueError, match="windows"):
        attn.attend_sdpa(q, k, v, jnp.int32(4), windows=None, implementation="xla")
    with pytest.raises(ValueError, match="NVIDIA"):
        resolve_attention("cudnn", "rocm")
    assert resolve_attention("cudnn", "cuda") == "cudnn"
    assert attn.sdpa_supported(jnp.bfloat16, 64) and not attn.sdpa_supported(jnp.float32, 64)
    assert not attn.sdpa_supported(jnp.bfloat16, 12)


@pytest.mark.parametrize("cfg", [CONFIG_A, CONFIG_B], ids=["A", "B"])
def test_forward_cold_and_from_a_prefix_equals_xla(cfg):
    params = gpt_oss.init_params(cfg, jax.random.key(1), dtype="float32")
    t = 3 * cfg.sliding_window + 5  # crosses the window; 4 pad rows below
    n = t - 4
    tokens = jax.random.randint(jax.random.key(2), (t,), 0, cfg.vocab_size, jnp.int32)
    xla = StepOptions(attention_impl="xla", moe_impl="loop", q_tile=8, kv_tile=8, moe_tile=8)
    fused = StepOptions(attention_impl="cudnn", moe_impl="loop", q_tile=8, kv_tile=8, moe_tile=8)
    ref = gpt_oss.forward(params, cfg, tokens, jnp.int32(n), xla)
    got = gpt_oss.forward(params, cfg, tokens, jnp.int32(n), fused)
    for a, b, what in zip(ref, got, ("logits", "k", "v")):
        err = np.abs(np.asarray(a)[..., :n, :, :] - np.asarray(b)[..., :n, :, :]).max() if what != "logits" else \
            np.abs(np.asarray(a) - np.asarray(b)).max()
        assert err < PREFILL_TOL, f"cold {what}: max |Δ| {err}"
    # a hit that splits inside the sliding window: the suffix's own block through the fused core, the cached keys
    # through the fallback core, one state
    off = cfg.sliding_window + 3
    prefix = gpt_oss.CachedPrefix(offset=jnp.int32(off), k=ref[1][:, :off], v=ref[2][:, :off],
                                  positions=jnp.arange(off, dtype=jnp.int32))
    suffix = jnp.concatenate([tokens[off:], jnp.zeros((off,), jnp.int32)])
    hit = gpt_oss.forward(params, cfg, suffix, jnp.int32(n - off), fused, prefix=prefix)
    err = np.abs(np.asarray(hit[0]) - np.asarray(ref[0])).max()
    assert err < PREFILL_TOL, f"prefix hit logits: max |Δ| {err}"
