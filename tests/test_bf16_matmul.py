"""`StepOptions.bf16_matmul`: bf16 matmuls with their operands widened to float32 (CPUs without bf16 dots).

The widened path must compute what the bf16 path computes (exact bf16 × bf16 products, float32 sums, the same
roundings to bf16 between matmuls), so each piece is checked three ways: its compiled program really runs float32
dots (and keeps bf16 ones where the rule says so), it agrees with the native bf16 path to float32 summation order,
and both agree with a float32 reference on the same bf16-rounded inputs within bf16 rounding. Then the whole
single-device prefill, cold and from a cached prefix, and the "auto" rule per CPU.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import CONFIG_A, CONFIG_B, TILES, random_prompt

from slope_jax import cpuinfo
from slope_jax.model import attention as attn
from slope_jax.model import gpt_oss, moe, mxfp4
from slope_jax.model import options as options_lib
from slope_jax.model.options import StepOptions

# float32 outputs of the two bf16 paths: they differ only by float32 summation order, which can move a bf16 rounding
# between matmuls (K/V, probabilities, activations) by one bf16 ulp (2^-8 relative) in a few elements
SAME_PATH_TOL = 2e-2
# either bf16 path against float32 on the same bf16-rounded inputs (probabilities / activations rounded only in bf16)
REF_TOL = 5e-2


def _dot_operand_types(fn, *args) -> list[str]:
    """The element types of every dot_general's operands in `fn`'s lowered program (StableHLO text)."""
    text = jax.jit(fn).lower(*args).as_text()
    return re.findall(r"stablehlo\.dot_general.*?:\s*\(tensor<[^>]*?x?(bf16|f32)>", text)


def _bf16(x) -> jax.Array:
    return jnp.asarray(x, jnp.bfloat16)


@pytest.mark.parametrize("queries,widened", [(150, True), (40, False)])
def test_attention_core_widens_tall_query_tiles_only(queries, widened):
    """16 heads over 4 KV heads, head_dim 12, 150 / 40 queries over 37 earlier keys and themselves, window 29; query
    tile 128: the 150-query call widens (a 128-row tile), the 40-query one keeps bf16 dots (UPCAST_MIN_QUERY_TILE)."""
    r = np.random.default_rng(queries)
    n, kh, d, off = 16, 4, 12, 37
    q = _bf16(r.standard_normal((queries, n, d)))
    k, v = (_bf16(r.standard_normal((off + queries, kh, d))) for _ in range(2))
    qp = jnp.arange(queries, dtype=jnp.int32) + off
    kp = jnp.arange(off + queries, dtype=jnp.int32)
    sinks = jnp.linspace(-1.0, 2.0, n)

    def run(q, k, v, upcast):
        return attn.attention(q, k, v, qp, kp, sinks, window=29, q_tile=128, kv_tile=32, upcast=upcast)

    types = _dot_operand_types(lambda q, k, v: run(q, k, v, True), q, k, v)
    assert types and all(t == ("f32" if widened else "bf16") for t in types), types
    assert set(_dot_operand_types(lambda q, k, v: run(q, k, v, False), q, k, v)) == {"bf16"}
    native, wide = np.asarray(run(q, k, v, False)), np.asarray(run(q, k, v, True))
    ref = np.asarray(run(*(x.astype(jnp.float32) for x in (q, k, v)), False))  # float32 probabilities
    assert np.abs(native - wide).max() < SAME_PATH_TOL, np.abs(native - wide).max()
    assert np.abs(wide - ref).max() < REF_TOL, np.abs(wide - ref).max()


def test_moe_loop_widens_the_dequantized_experts():
    """CONFIG_B's expert shapes (5 experts, top-3, hidden 96, intermediate 64), MXFP4 weights, 41 tokens: the loop
    dequantizes to float32 and widens its rows; float32 reference: the same MoE on float32 rows and weights."""
    cfg = CONFIG_B
    r = np.random.default_rng(7)
    e, dm, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    w1, w2 = (0.05 * r.standard_normal(s).astype(np.float32) for s in ((e, 2 * i, dm), (e, dm, i)))
    (b1, s1), (b2, s2) = mxfp4.encode_numpy(w1), mxfp4.encode_numpy(w2)
    p = {"router_w": _bf16(r.standard_normal((e, dm))), "router_b": _bf16(r.standard_normal(e)),
         "b1": _bf16(0.1 * r.standard_normal((e, 2 * i))), "b2": _bf16(0.1 * r.standard_normal((e, dm))),
         "w1_blocks": jnp.asarray(b1), "w1_scales": jnp.asarray(s1), "w2_blocks": jnp.asarray(b2),
         "w2_scales": jnp.asarray(s2)}
    h = _bf16(r.standard_normal((41, dm)))
    valid = jnp.arange(41) < 39  # two pad tokens

    def run(h, upcast):
        return moe.moe(h, valid, p, experts_per_token=cfg.experts_per_token, alpha=cfg.swiglu_alpha,
                       limit=cfg.swiglu_limit, tile=16, impl="loop", upcast=upcast)

    expert_dots = _dot_operand_types(lambda h: run(h, True), h)[1:]  # [0] is the router (native everywhere)
    assert expert_dots and set(expert_dots) == {"f32"}, expert_dots
    native, wide, ref = np.asarray(run(h, False)), np.asarray(run(h, True)), np.asarray(run(h.astype(jnp.float32),
                                                                                             False))
    assert np.abs(native - wide).max() < SAME_PATH_TOL, np.abs(native - wide).max()
    assert np.abs(wide - ref).max() < REF_TOL, np.abs(wide - ref).max()
    assert not wide[39:].any(), "pad tokens do no expert work"


@pytest.mark.parametrize("cfg", [CONFIG_A, CONFIG_B], ids=["A", "B"])
def test_forward_widened_equals_native_cold_and_from_a_prefix(cfg):
    """bf16 single-device prefill (161 tokens: crosses the window and a 128-query tile), cold and the last 29 tokens
    from a cached prefix of 132: the widened step against the native one, and both against the float32 forward of
    the same (bf16-valued) parameters."""
    params = gpt_oss.init_params(cfg, jax.random.key(2), dtype="bfloat16")
    params32 = jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a, params)
    n, off = 161, 132
    tokens = jnp.asarray(random_prompt(cfg, n, seed=5))
    tiles = dict(TILES, q_tile=128, prefix_q_tile=128)
    native, wide = (StepOptions(**tiles, bf16_matmul=m) for m in ("native", "float32"))
    outs = {}
    for name, prm, opts in (("native", params, native), ("wide", params, wide), ("ref", params32, native)):
        logits, k, v = gpt_oss.forward(prm, cfg, tokens, jnp.int32(n), opts)
        pre = gpt_oss.CachedPrefix(jnp.int32(off), k[:, :off], v[:, :off], jnp.arange(off, dtype=jnp.int32))
        hit, _, _ = gpt_oss.forward(prm, cfg, tokens[off:], jnp.int32(n - off), opts, prefix=pre)
        outs[name] = (np.asarray(logits), np.asarray(k, np.float32), np.asarray(hit))
    for j, what in enumerate(("logits", "K", "hit logits")):
        # bf16 rounding compounds over the layers (K of the last layer: ~0.2-0.5 max |Δ| from float32 on both paths):
        # the widened step may not stray further from float32 than the native one (+25 %, float32 summation order)
        err_wide, err_native = (np.abs(outs[m][j] - outs["ref"][j]).max() for m in ("wide", "native"))
        assert err_wide <= 1.25 * err_native + 1e-3, (what, err_wide, err_native)
        # and the two bf16 paths stay closer to each other than half of that: a one-ulp flip of an early layer's
        # rounding (a bf16 GEMM library sums in another order than XLA's float32 one: AMX/AVX512_BF16 kernels) grows
        # through the later layers (CONFIG_B's 9th-layer K: 0.066 apart, 0.21 from float32, on an AMX Xeon)
        same_path = max(SAME_PATH_TOL, 0.5 * err_native)
        assert np.abs(outs["native"][j] - outs["wide"][j]).max() < same_path, (what, same_path)
    assert int(outs["wide"][0].argmax()) == int(outs["native"][0].argmax()) == int(outs["wide"][2].argmax())


def test_auto_follows_the_cpu(monkeypatch):
    for has, expected in ((False, "float32"), (True, "native"), (None, "native")):
        monkeypatch.setattr(cpuinfo, "has_bf16_dot", lambda has=has: has)
        assert StepOptions().resolve("cpu").bf16_matmul == expected, has
        assert StepOptions().resolve("cuda").bf16_matmul == "native"
    assert StepOptions(bf16_matmul="float32").resolve("rocm").upcast_matmul
    assert not StepOptions(bf16_matmul="native").resolve("cpu").upcast_matmul
    with pytest.raises(ValueError, match="bf16_matmul='fast'"):
        StepOptions(bf16_matmul="fast")
    with pytest.raises(ValueError, match="bf16_matmul"):
        StepOptions(attention_impl="xla", moe_impl="loop", ep_dispatch="all_to_all").require_resolved()
    assert options_lib.FIELD_HELP["bf16_matmul"] and "bf16_matmul" in StepOptions().to_dict()


def test_cpuinfo_flags_and_the_machine_fingerprint():
    from slope_jax.plan import machine

    name, flags = cpuinfo.cpu()
    assert isinstance(name, str) and set(flags) <= set(cpuinfo.FLAGS)
    fp = machine.fingerprint()
    assert fp["bf16_matmul"] == options_lib.resolve_bf16_matmul("auto", "cpu")
    assert fp["flags"] == flags


def test_processes_take_process_0s_choice(monkeypatch):
    """An "auto" choice resolves per host CPU; a multi-process engine compiles process 0's choice on every process
    (`serve.agreement.agreed_options`, applied where the engine resolves its options)."""
    from slope_jax.serve import agreement

    mine = StepOptions(bf16_matmul="native").resolve("cpu")
    assert agreement.agreed_options(mine) == mine  # one process: as given
    monkeypatch.setattr(agreement.jax, "process_count", lambda: 2)
    sent = []

    def process0_answer(values):
        sent.append(values.tolist())
        return np.asarray([options_lib.BF16_MATMULS.index("float32")], np.int32)  # process 0 resolved "float32"

    monkeypatch.setattr(agreement, "process0_answer", process0_answer)
    agreed = agreement.agreed_options(mine)
    assert sent == [[options_lib.BF16_MATMULS.index("native")]]
    assert agreed.bf16_matmul == "float32" and agreed.upcast_matmul
    assert agreed == mine.__class__(**{**mine.to_dict(), "bf16_matmul": "float32"})
