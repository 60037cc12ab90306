"""Component checks with known values (docs/model.md §2-§3, §5.1): YaRN, window, sinks, router, SwiGLU, MXFP4,
expert biases, the online-softmax merge, and blockwise attention against a dense NumPy reference."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import REPO

from slope_jax.model import attention as attn
from slope_jax.model import gpt_oss, moe, mxfp4, options, rope
from slope_jax.model.config import ModelConfig

RELEASED = ModelConfig.from_json(os.path.join(REPO, "configs", "gpt-oss-120b.json"))


# ------------------------------------------------------------------------------------------------ YaRN RoPE
def test_yarn_bounds_are_not_rounded():
    low, high = rope.yarn_correction_range(RELEASED)
    assert abs(low - 8.092779) < 1e-6 and abs(high - 17.398025) < 1e-6  # docs/model.md §2.2: 8.0928 / 17.3980
    assert RELEASED.rope_truncate is False
    assert rope.attention_scaling(RELEASED) == pytest.approx(1.3465735902799727, abs=1e-15)


def test_inv_freq_known_values():
    f = rope.inv_freq(RELEASED)
    base = 150000.0 ** (-np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(f[:9], base[:9], rtol=1e-6)  # dims 0-8 keep the original frequency
    np.testing.assert_allclose(f[18:], base[18:] / 32, rtol=1e-6)  # dims 18-31 are divided by the factor
    ramp = np.clip((np.arange(32) - 8.092779) / (17.398025 - 8.092779), 0, 1)
    np.testing.assert_allclose(f, base / 32 * ramp + base * (1 - ramp), rtol=2e-6)  # blended 9-17


def test_rope_tables_match_transformers():
    import torch
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    with open(os.path.join(REPO, "configs", "gpt-oss-120b.json")) as fh:
        hf_cfg = GptOssConfig(**json.load(fh))
    emb = GptOssRotaryEmbedding(hf_cfg)
    ours, theirs = rope.inv_freq(RELEASED), emb.inv_freq.numpy()
    # torch's float32 pow is not correctly rounded; ours is: the two differ by at most 1 ulp
    np.testing.assert_allclose(ours, theirs, rtol=np.finfo(np.float32).eps, atol=0)
    positions = np.array([0, 1, 127, 128, 4095, 4096, 100000])
    cos_ref, sin_ref = emb(torch.zeros(1, dtype=torch.float32), torch.tensor(positions)[None])
    cos, sin = (np.asarray(x) for x in rope.cos_sin(RELEASED, jnp.asarray(positions), jnp.float32))
    conc = rope.attention_scaling(RELEASED)
    # 1) against float64 math on the same float32 angles: float32 cos/sin accuracy
    angle = (positions[:, None].astype(np.float32) * ours[None, :]).astype(np.float64)
    np.testing.assert_allclose(cos, np.cos(angle) * conc, atol=1e-6, rtol=0)
    np.testing.assert_allclose(sin, np.sin(angle) * conc, atol=1e-6, rtol=0)
    # 2) against HF (which duplicates the half table): the 1-ulp frequency gap grows with the position, and the two
    #    float32 angles may round to neighbouring values (1 ulp of the angle: ~1e-3 rad at position 1e5)
    tol = conc * (positions[:, None] * np.abs(ours - theirs)[None, :] + np.spacing(angle.astype(np.float32)) + 1e-6)
    assert np.all(np.abs(cos - cos_ref[0, :, :32].numpy()) <= tol)
    assert np.all(np.abs(sin - sin_ref[0, :, :32].numpy()) <= tol)
    assert float(cos[0, 0]) == pytest.approx(1.3465735902799727, rel=1e-7)  # conc applied to cos ...
    assert float(sin[1, 0]) == pytest.approx(math.sin(1.0) * 1.3465735902799727, rel=1e-6)  # ... and to sin


def test_rope_rotation_is_half_split():
    x = jnp.arange(8, dtype=jnp.float32).reshape(1, 1, 8)  # [T=1, n=1, D=8]
    cos = jnp.zeros((1, 4))
    sin = jnp.ones((1, 4))
    out = rope.apply_rope(x, cos, sin)  # pure 90° rotation: [-x2, x1]
    np.testing.assert_array_equal(np.asarray(out)[0, 0], [-4, -5, -6, -7, 0, 1, 2, 3])



@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rope_equals_concatenated_halves_bit_for_bit(dtype):
    """apply_rope's swapped-halves form gives exactly `[x1·c − x2·s, x2·c + x1·s]` computed as two halves: the same
    IEEE operations (a + b·(−s) is a − b·s). Sizes pairwise distinct: T 37, n 5, D 22."""
    rng = np.random.default_rng(3)
    x, c, s = (jnp.asarray(rng.standard_normal(shape) * 3, dtype) for shape in ((37, 5, 22), (37, 11), (37, 11)))
    x1, x2 = x[..., :11], x[..., 11:]
    cc, ss = c[:, None, :], s[:, None, :]
    want = np.asarray(jnp.concatenate([x1 * cc - x2 * ss, x2 * cc + x1 * ss], axis=-1))
    got = np.asarray(jax.jit(rope.apply_rope)(x, c, s))
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))  # exact: tolerance 0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_qkv_stacked_matmul_equals_three_projections(dtype):
    """gpt_oss.qkv's one matmul over the stacked wq/wk/wv gives the three projections' q, k, v (N 6, K 2, H 10,
    D 14, T 9); float32 tolerance 1e-5 relative (a GEMM library may block the sums differently by width), bf16: at
    most one bf16 ulp of the result."""
    rng = np.random.default_rng(4)
    t, n, kh, hd, d = 9, 6, 2, 10, 14
    p = {name: jnp.asarray(rng.standard_normal(shape), dtype) for name, shape in
         (("wq", (n, hd, d)), ("wk", (kh, hd, d)), ("wv", (kh, hd, d)), ("bq", (n, hd)), ("bk", (kh, hd)),
          ("bv", (kh, hd)))}
    h = jnp.asarray(rng.standard_normal((t, d)), dtype)
    cos, sin = (jnp.asarray(rng.standard_normal((t, hd // 2)), dtype) for _ in range(2))
    q, k, v = gpt_oss.qkv(h, p, cos, sin)
    ref = [gpt_oss.project(h, p[w], p[b]).astype(dtype) for w, b in (("wq", "bq"), ("wk", "bk"), ("wv", "bv"))]
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
    for got, want in ((q, rope.apply_rope(ref[0], cos, sin)), (k, rope.apply_rope(ref[1], cos, sin)), (v, ref[2])):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)


# ------------------------------------------------------------------------------------------------ attention
def _attn(t, window, sinks, v, *, head_dim=4, heads=1, q_tile=32, kv_tile=32):
    q = jnp.zeros((t, heads, head_dim))
    k = jnp.zeros((t, 1, head_dim))
    pos = jnp.arange(t)
    return np.asarray(attn.attention(q, k, jnp.asarray(v, jnp.float32), pos, pos,
                                     jnp.full((heads,), sinks, jnp.float32), window=window,
                                     q_tile=q_tile, kv_tile=kv_tile))


def test_window_covers_exactly_w_keys():
    t = 130
    v = np.zeros((t, 1, 4), np.float32)
    v[:, 0, 0] = np.arange(t)  # V channel 0 = key position
    out = _attn(t, 128, -np.inf, v)[:, 0, 0]
    assert out[127] == pytest.approx(63.5) and out[128] == pytest.approx(64.5) and out[129] == pytest.approx(65.5)
    full = _attn(t, attn.NO_WINDOW, -np.inf, v)[:, 0, 0]
    assert full[129] == pytest.approx(64.5)


def test_each_query_sees_min_q_plus_1_w_keys():
    t, w = 23, 6
    v = np.eye(t, dtype=np.float32)[:, None, :]  # one-hot key identity in the value
    out = _attn(t, w, -np.inf, v, head_dim=t, q_tile=5, kv_tile=4)[:, 0, :]
    for q in range(t):
        seen = np.nonzero(out[q] > 0)[0]
        assert list(seen) == list(range(max(0, q - w + 1), q + 1)), q
        np.testing.assert_allclose(out[q, seen], 1.0 / min(q + 1, w), rtol=1e-6)


def test_sink_normalisation():
    t = 200
    ones = np.ones((t, 1, 4), np.float32)
    out = _attn(t, 128, math.log(128), ones)[:, 0, 0]
    np.testing.assert_allclose(out[127:], 0.5, rtol=1e-6)  # n = 128 visible keys, e^s = 128
    n = np.minimum(np.arange(t) + 1, 128)
    np.testing.assert_allclose(out, n / (n + 128.0), rtol=1e-6)
    # the sink is not scaled by 1/sqrt(D): head_dim 64 (scale 1/8), s = ln 4, n = 4 -> 0.5 (a scaled sink gives 0.771)
    out64 = _attn(4, attn.NO_WINDOW, math.log(4), np.ones((4, 1, 64), np.float32), head_dim=64)[3, 0, 0]
    assert out64 == pytest.approx(0.5, abs=1e-6)


def test_sink_added_once_across_merged_partials():
    """n keys split over 4 partial states (as over 4 ring steps): n/(n+e^s), not n/(n+4e^s)."""
    d, s = 4, 1.5
    q = jnp.zeros((1, 1, d))
    st = attn.empty_state(1, 1, 1, d)
    for r in range(4):
        kpos = jnp.arange(r * 8, (r + 1) * 8)
        st = attn.merge(st, attn.attend(q, jnp.zeros((8, 1, d)), jnp.ones((8, 1, d)), jnp.array([100]), kpos))
    out = float(attn.finalize(st, jnp.array([s]))[0, 0, 0])
    assert out == pytest.approx(32 / (32 + math.exp(s)), rel=1e-6)


def test_ring_merge_keeps_every_step():
    """Full layer, 1024 tokens split in 4 partials, Q = 0, sinks = −inf, V = j: the query at 1023 outputs 511.5."""
    t, d = 1024, 4
    v = jnp.broadcast_to(jnp.arange(t, dtype=jnp.float32)[:, None, None], (t, 1, d))
    q = jnp.zeros((1, 1, d))
    st = attn.empty_state(1, 1, 1, d)
    for r in range(4):
        sl = slice(r * 256, (r + 1) * 256)
        st = attn.merge(st, attn.attend(q, jnp.zeros((256, 1, d)), v[sl], jnp.array([1023]), jnp.arange(t)[sl]))
    assert float(attn.finalize(st, jnp.array([-jnp.inf]))[0, 0, 0]) == pytest.approx(511.5, rel=1e-6)


@pytest.mark.parametrize("delta", [-1000.0, -100.0, 0.0, 100.0, 1000.0, -np.inf])
def test_lse_merge_is_finite_symmetric_and_empty_is_identity(delta):
    rng = np.random.default_rng(0)
    d = 3

    def state(m):
        return attn.AttnState(jnp.asarray(rng.standard_normal((1, 1, 1, d)), jnp.float32),
                              jnp.full((1, 1, 1), m, jnp.float32), jnp.full((1, 1, 1), 2.0, jnp.float32))

    a = state(0.0)
    b = state(delta) if np.isfinite(delta) else attn.empty_state(1, 1, 1, d)
    ab, ba = attn.merge(a, b), attn.merge(b, a)
    for x, y in zip(ab, ba):
        assert np.all(np.isfinite(np.asarray(x)))
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    empty = attn.empty_state(1, 1, 1, d)
    for x, y in zip(attn.merge(a, empty), a):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    out = attn.finalize(attn.merge(empty, empty), jnp.array([-jnp.inf]))
    assert np.all(np.asarray(out) == 0)  # a row with no key and a −inf sink gives 0, not NaN


def _dense_reference(q, k, v, pos, sinks, window):
    t, n, d = q.shape
    g = n // k.shape[1]
    out = np.zeros((t, n, d), np.float64)
    for h in range(n):
        s = q[:, h].astype(np.float64) @ k[:, h // g].T.astype(np.float64) * d ** -0.5
        diff = pos[:, None] - pos[None, :]
        s = np.where((diff >= 0) & (diff < window), s, -np.inf)
        m = np.maximum(s.max(-1), sinks[h])
        p = np.exp(s - m[:, None])
        out[:, h] = (p @ v[:, h // g]) / (p.sum(-1) + np.exp(sinks[h] - m))[:, None]
    return out


@pytest.mark.parametrize("window", [5, 64, attn.NO_WINDOW])
@pytest.mark.parametrize("tiles", [(7, 5), (16, 16), (64, 64)])
@pytest.mark.parametrize("d", [10, 16])  # 16: d^-1/2 = 1/4 is exact, so the core scales q once instead of the scores
def test_blockwise_equals_dense_reference(window, tiles, d):
    rng = np.random.default_rng(window % 97)
    t, n, kh = 61, 6, 2
    q, k, v = (rng.standard_normal((t, h, d)).astype(np.float32) for h in (n, kh, kh))
    sinks = rng.standard_normal(n).astype(np.float32)
    pos = np.arange(t)
    out = attn.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos), jnp.asarray(pos),
                         jnp.asarray(sinks), window=window, q_tile=tiles[0], kv_tile=tiles[1])
    np.testing.assert_allclose(np.asarray(out), _dense_reference(q, k, v, pos, sinks, window), atol=2e-6, rtol=0)


def _whole_runs_brute_force(qp: np.ndarray, kp: np.ndarray, window: int, lo: int, hi: int) -> tuple[int, int]:
    """The run `[a, b)` of key tiles in `[lo, hi)` whose every key is real and visible to every query of the tile
    (all real), or `(hi, hi)` when there is none or they are not one run."""
    whole = [j for j in range(lo, hi) if (qp >= 0).all() and (kp[j] >= 0).all()
             and all(0 <= qi - kj < window for qi in qp for kj in kp[j])]
    if not whole or whole != list(range(whole[0], whole[-1] + 1)):
        return hi, hi
    return whole[0], whole[-1] + 1


@pytest.mark.parametrize("case", ["causal", "window", "zigzag", "padded", "prefix", "gap"])
def test_whole_key_tiles_skip_the_mask_and_change_nothing(case):
    """`_kv_tile_runs` finds, per query tile, the run of key tiles that need no mask (brute force over every
    query-key pair), and the attention through it is bit-for-bit the attention with every tile masked. Positions:
    causal; a 23-token window; zigzag (two chunks of a ring layout, as a CP device holds them); padded queries and
    keys (INVALID_POS); queries after a cached prefix; padding amid the keys (whole tiles on both sides of a tile
    that is not: no single run, so every tile is masked)."""
    rng = np.random.default_rng(3)
    bq, bk, window = 8, 6, attn.NO_WINDOW
    qpos = kpos = np.arange(50)
    if case == "window":
        window = 23
    elif case == "zigzag":
        qpos = kpos = np.concatenate([np.arange(0, 25), np.arange(75, 100)])
    elif case == "padded":
        qpos = kpos = np.concatenate([np.arange(45), np.full(5, attn.INVALID_POS)])
    elif case == "prefix":
        kpos, qpos = np.arange(70), np.arange(52, 70)
    elif case == "gap":
        kpos, qpos = np.concatenate([np.arange(22), np.full(2, attn.INVALID_POS), np.arange(22, 50)]), np.arange(30, 50)
    nq, nk = -(-len(qpos) // bq), -(-len(kpos) // bk)
    qpt = np.concatenate([qpos, np.full(nq * bq - len(qpos), attn.INVALID_POS)]).reshape(nq, bq).astype(np.int32)
    kpt = np.concatenate([kpos, np.full(nk * bk - len(kpos), attn.INVALID_POS)]).reshape(nk, bk).astype(np.int32)
    runs = np.asarray(attn._kv_tile_runs(jnp.asarray(qpt), jnp.asarray(kpt), jnp.int32(window)))
    for i, (lo, a, b, hi) in enumerate(runs):
        assert lo <= a <= b <= hi, (i, runs[i])
        assert (a, b) == _whole_runs_brute_force(qpt[i], kpt, window, lo, hi), (case, i, runs[i])
    if case == "gap":
        assert (runs[:, 1] == runs[:, 3]).all(), "whole tiles split by a padded one: every tile masked"
    else:
        assert case in ("padded", "window") or (runs[:, 2] > runs[:, 1]).any(), "some query tile skips a mask"

    n, kh, d = 6, 2, 16
    q = jnp.asarray(rng.standard_normal((len(qpos), n, d)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((len(kpos), kh, d)), jnp.float32) for _ in range(2))
    sinks = jnp.asarray(rng.standard_normal(n), jnp.float32)

    def run():
        return np.asarray(attn.attention(q, k, v, jnp.asarray(qpos), jnp.asarray(kpos), sinks, window=window,
                                         q_tile=bq, kv_tile=bk))

    fast = run()
    every_tile_masked = attn._kv_tile_runs

    def masked_runs(qpt, kpt, window):
        r = every_tile_masked(qpt, kpt, window)
        return r.at[:, 1].set(r[:, 3]).at[:, 2].set(r[:, 3])

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attn, "_kv_tile_runs", masked_runs)
        jax.clear_caches()
        slow = run()
    jax.clear_caches()
    np.testing.assert_array_equal(fast, slow)  # the same tiles in the same order: bit-for-bit


def test_attention_memory_is_linear_in_tokens():
    """Compiled temp memory of a 4096-token causal attention stays far below one [T, T] score matrix per head."""
    t, n, d, tile = 4096, 2, 16, 128
    spec = jax.ShapeDtypeStruct
    fn = jax.jit(lambda q, k, v, p, s: attn.attention(q, k, v, p, p, s, q_tile=tile, kv_tile=tile))
    compiled = fn.lower(spec((t, n, d), jnp.float32), spec((t, 1, d), jnp.float32), spec((t, 1, d), jnp.float32),
                        spec((t,), jnp.int32), spec((n,), jnp.float32)).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    square = t * t * n * 4
    assert temp < square / 8, f"temp {temp} bytes vs one score matrix {square}"


# ------------------------------------------------------------------------------------------------ router, SwiGLU, MoE
def test_router_topk_then_softmax():
    logits_target = np.array([[4, 3, 2, 1, 0, -1, -2, -3]], np.float32)
    d = 8
    w = np.eye(d, dtype=np.float32)  # h = e_i picks logit i
    weights, ids = moe.route(jnp.asarray(logits_target), jnp.asarray(w), jnp.zeros(d), 4)
    assert sorted(np.asarray(ids)[0].tolist()) == [0, 1, 2, 3]
    np.testing.assert_allclose(np.asarray(weights)[0], [0.64391, 0.23688, 0.08714, 0.03206], atol=1e-5)
    assert float(np.asarray(weights).sum()) == pytest.approx(1.0, abs=1e-6)


def test_router_exact_ties_lower_expert_wins_and_transformers_routes_alike():
    """Exact ties in the router logits: slope_jax's router picks the lower expert index (prefill, the reference
    decoder and expert parallelism all use `moe.route`); transformers' GptOss router patched by
    `kv.transformers.lowest_index_ties` (as `slope_jax.decode --engine=transformers` does) routes every token to the
    same experts in the same order with the same weights (float32, rtol 1e-6)."""
    import torch
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from slope_jax.kv.transformers import lowest_index_ties

    rng = np.random.default_rng(7)
    for e, k in ((32, 4), (6, 2), (128, 4)):
        # router weight = identity, bias 0: token t's logits are exactly levels[t] (few distinct values per row:
        # many exact ties, also across the k-th place; row 0 ties every expert)
        levels = rng.integers(0, 3, size=(64, e)).astype(np.float32)
        levels[0] = 0.0
        weights, ids = (np.asarray(x) for x in moe.route(jnp.asarray(levels), jnp.eye(e), jnp.zeros(e), k))
        for row, picked in zip(levels, ids):  # the rule: by value, then by lower index
            assert picked.tolist() == sorted(range(e), key=lambda i: (-row[i], i))[:k]
        mlp = GptOssMLP(GptOssConfig(hidden_size=e, num_local_experts=e, num_experts_per_tok=k,
                                     intermediate_size=8)).eval()
        assert lowest_index_ties(mlp) == 1
        with torch.no_grad():
            mlp.router.weight.copy_(torch.eye(e))
            mlp.router.bias.zero_()
            _, scores, idx = mlp.router(torch.from_numpy(levels))
        np.testing.assert_array_equal(idx.numpy(), ids)
        np.testing.assert_allclose(scores.numpy(), weights, rtol=1e-6)


@pytest.mark.parametrize("gate,up,expected", [(3.0, 3.0, 11.9277), (10.0, -10.0, -41.9997), (0.5, 0.0, 0.35039),
                                              (-10.0, 0.0, -4.05e-7)])
def test_swiglu_clamp_boundaries(gate, up, expected):
    out = float(moe.swiglu(jnp.array([gate, up], jnp.float32), alpha=1.702, limit=7.0)[0])
    assert out == pytest.approx(expected, rel=2e-4, abs=1e-9)


def test_swiglu_reads_interleaved_gate_up():
    h = np.empty(16, np.float32)
    h[0::2], h[1::2] = 1.0, -2.0
    out = np.asarray(moe.swiglu(jnp.asarray(h), alpha=1.702, limit=7.0))
    np.testing.assert_allclose(out, -1.0 / (1.0 + math.exp(-1.702)), rtol=1e-5)  # σ(1.702)·(−1) = −0.84580
    assert out[0] == pytest.approx(-0.84580, abs=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_swiglu_halves_equals_interleaved_bit_for_bit(dtype):
    """The loop MoE reorders W1's rows (`gate_up_halves`) and applies `swiglu_halves`: the same result as `swiglu`
    on the checkpoint's interleaved rows, bit for bit, values across the clamp (limit 7) included."""
    rng = np.random.default_rng(5)
    w1 = jnp.asarray(rng.standard_normal((2 * 12, 7)), dtype)  # [2I, D], I 12, D 7
    b1 = jnp.asarray(rng.standard_normal(2 * 12), jnp.float32)
    x = jnp.asarray(rng.standard_normal((5, 7)) * 4, dtype)
    gu = jnp.einsum("td,od->to", x, w1, preferred_element_type=jnp.float32) + b1
    gu_h = jnp.einsum("td,od->to", x, moe.gate_up_halves(w1), preferred_element_type=jnp.float32)
    gu_h = gu_h + moe.gate_up_halves(b1)
    want = np.asarray(moe.swiglu(gu, alpha=1.702, limit=7.0))
    got = np.asarray(moe.swiglu_halves(gu_h, alpha=1.702, limit=7.0))
    assert np.abs(np.asarray(gu)).max() > 7.0  # the clamp is exercised
    np.testing.assert_array_equal(got, want)  # exact: tolerance 0


def _moe_params(e, d, i, rng, zero_weights=False):
    w1 = np.zeros((e, 2 * i, d), np.float32) if zero_weights else rng.standard_normal((e, 2 * i, d)).astype(np.float32)
    w2 = np.zeros((e, d, i), np.float32) if zero_weights else rng.standard_normal((e, d, i)).astype(np.float32)
    return {"router_w": jnp.asarray(rng.standard_normal((e, d)), jnp.float32), "router_b": jnp.zeros(e),
            "w1": jnp.asarray(w1), "w2": jnp.asarray(w2 * 0.1),
            "b1": jnp.asarray(rng.standard_normal((e, 2 * i)), jnp.float32),
            "b2": jnp.asarray(rng.standard_normal((e, d)), jnp.float32)}


def test_expert_bias_weighted_once():
    rng = np.random.default_rng(1)
    e, d, i, t, k = 5, 6, 4, 9, 3
    p = _moe_params(e, d, i, rng, zero_weights=True)
    h = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    valid = jnp.ones(t, bool)
    p["b2"] = jnp.ones((e, d))
    out = moe.moe(h, valid, p, experts_per_token=k, alpha=1.702, limit=7.0, tile=2)
    np.testing.assert_allclose(np.asarray(out), 1.0, rtol=1e-6)  # Σ_k w_k · 1 = 1 per channel
    p["b2"] = jnp.broadcast_to(jnp.arange(e, dtype=jnp.float32)[:, None], (e, d))
    out = np.asarray(moe.moe(h, valid, p, experts_per_token=k, alpha=1.702, limit=7.0, tile=2))
    w, ids = (np.asarray(x) for x in moe.route(h, p["router_w"], p["router_b"], k))
    np.testing.assert_allclose(out[:, 0], (w * ids).sum(-1), rtol=1e-6)


def test_moe_loop_ladder_pads_less_than_its_second_height():
    assert options.moe_loop_tiles(128, 2432) == (128, 32, 8)
    assert options.moe_loop_tiles(128, 20) == (20,)  # clipped to T·k, too short to step down
    assert options.moe_loop_tiles(512, 10**6) == (512, 128, 32)  # at most MOE_LADDER_HEIGHTS heights
    for tile in (8, 40, 128, 100):
        ladder = options.moe_loop_tiles(tile, 10**6)
        for count in range(0, 700):
            rows = options.moe_loop_rows(count, ladder)
            assert all(r % h == 0 for h, r in rows.items())
            pad = sum(rows.values()) - count
            assert 0 <= pad < (ladder[1] if len(ladder) > 1 else ladder[0])
            # what a height leaves to the shorter ones: never so many rows that one more tile of it would pad
            # fewer than the next height's rows
            for j in range(len(ladder) - 1):
                shorter = sum(rows[h] for h in ladder[j + 1:])
                assert shorter == 0 or shorter - pad <= ladder[j] - ladder[j + 1]
    # one height (the Pallas kernel's padding): whole tiles of it
    assert options.moe_loop_rows(152, (128,)) == {128: 256}
    assert options.moe_loop_rows(152, (128, 32, 8)) == {128: 128, 32: 0, 8: 24}
    assert options.moe_loop_rows(490, (512, 128, 32)) == {512: 512, 128: 0, 32: 0}  # 22 pad rows < 128
    assert options.moe_loop_rows(384, (512, 128, 32)) == {512: 0, 128: 384, 32: 0}  # 128 pad rows: not < 128
    assert options.moe_loop_rows(120, (128, 32, 8)) == {128: 128, 32: 0, 8: 0}
    assert options.moe_loop_rows(0, (512, 128, 32)) == {512: 0, 128: 0, 32: 0}
    with pytest.raises(ValueError, match="moe_tile=0"):
        options.moe_loop_tiles(0, 10)


def test_prefix_key_tile_widens_for_short_query_tiles():
    o = options.StepOptions()  # prefix tiles 512 x 256
    assert [o.prefix_kv_tile_for(n) for n in (1, 16, 64, 65, 128, 512, 4096)] == [1024, 1024, 1024, 256, 256,
                                                                                    256, 256]
    o = options.StepOptions(prefix_q_tile=16, prefix_kv_tile=24)
    assert (o.prefix_kv_tile_for(2), o.prefix_kv_tile_for(3), o.prefix_kv_tile_for(40)) == (96, 24, 24)


@pytest.mark.parametrize("t,tile", [(23, 4), (97, 40)])  # ladders (4,) and (40, 10): ~42 rows per expert at 97
def test_grouped_moe_equals_per_token_loop(t, tile):
    rng = np.random.default_rng(2)
    e, d, i, k = 7, 8, 6, 3
    assert len(options.moe_loop_tiles(tile, t * k)) == (1 if tile == 4 else 2)
    p = _moe_params(e, d, i, rng)
    h = rng.standard_normal((t, d)).astype(np.float32)
    out = np.asarray(moe.moe(jnp.asarray(h), jnp.ones(t, bool), p, experts_per_token=k, alpha=1.702, limit=7.0,
                             tile=tile))
    w, ids = (np.asarray(x) for x in moe.route(jnp.asarray(h), p["router_w"], p["router_b"], k))
    if tile == 40:  # the ladder's paths are all taken: whole tiles, a padded tall tile, the short tiles
        ladder = options.moe_loop_tiles(tile, t * k)
        runs = [options.moe_loop_rows(int(c), ladder) for c in np.bincount(ids.ravel(), minlength=e)]
        assert any(r[40] > c for r, c in zip(runs, np.bincount(ids.ravel(), minlength=e)))
        assert any(r[10] for r in runs) and any(r[40] for r in runs)
    ref = np.zeros((t, d))
    pn = {key: np.asarray(val, np.float64) for key, val in p.items()}
    for tok in range(t):
        for j in range(k):
            ex = ids[tok, j]
            gu = pn["w1"][ex] @ h[tok] + pn["b1"][ex]
            gate, up = np.minimum(gu[0::2], 7.0), np.clip(gu[1::2], -7.0, 7.0)
            a = gate / (1 + np.exp(-1.702 * gate)) * (up + 1)
            ref[tok] += w[tok, j] * (pn["w2"][ex] @ a + pn["b2"][ex])
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0)


# ------------------------------------------------------------------------------------------------ MXFP4
LUT = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]  # docs/model.md §3.3


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mxfp4_all_bytes_all_scales(dtype):
    """Every byte 0..255 in every block position, for scale bytes 2..255: bit-exact with LUT (overflow to
    ±inf at the top included). Scale bytes 0 and 1 give float32 subnormals, which XLA on CPU flushes to zero."""
    scales = np.arange(2, 256, dtype=np.uint8)
    # [O=16, G=len(scales), 16 bytes]: row o holds bytes 16o..16o+15 in every block, block g has scale byte scales[g]
    blocks = np.tile(np.arange(256, dtype=np.uint8).reshape(16, 1, 16), (1, scales.size, 1))
    sc = np.broadcast_to(scales, (16, scales.size)).copy()
    out = np.asarray(mxfp4.decode(jnp.asarray(blocks), jnp.asarray(sc), dtype)).astype(np.float32)
    expected = np.empty((16, scales.size * 32))
    for o in range(16):
        for g, s in enumerate(scales):
            for j in range(16):
                b = int(blocks[o, g, j])
                expected[o, 32 * g + 2 * j] = LUT[b & 0xF] * 2.0 ** (int(s) - 127)
                expected[o, 32 * g + 2 * j + 1] = LUT[b >> 4] * 2.0 ** (int(s) - 127)
    with np.errstate(over="ignore"):
        expected = expected.astype(np.float32)
        np.testing.assert_array_equal(mxfp4.decode_numpy(blocks, sc), expected)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(np.signbit(out), np.signbit(expected))  # −0.0 stays −0.0


def test_mxfp4_nibble_order_known_value():
    blocks = np.zeros((1, 1, 16), np.uint8)
    blocks[0, 0, 0] = 0x72
    out = np.asarray(mxfp4.decode(jnp.asarray(blocks), jnp.full((1, 1), 129, jnp.uint8), jnp.float32))
    assert out[0, 0] == 4.0 and out[0, 1] == 24.0  # low nibble first: (2j, 2j+1) = (4.0, 24.0)


def test_mxfp4_encode_round_trip():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 5, 4, 16), dtype=np.uint8)
    scales = rng.integers(110, 130, (3, 5, 4), dtype=np.uint8)
    w = mxfp4.decode_numpy(blocks, scales)
    np.testing.assert_array_equal(mxfp4.decode_numpy(*mxfp4.encode_numpy(w)), w)
