"""Balance and collective traffic of the compiled parallel step (small case of benchmarks/cp_traffic.py)."""

import dataclasses

import jax
import numpy as np
import pytest
from support import CONFIG_A

from slope_jax.model import attention
from slope_jax.model import gpt_oss as model
from slope_jax.parallel import context_parallel
from slope_jax.parallel.config import ParallelConfig
from slope_jax.plan import traffic
from slope_jax.serve.engine import PrefillEngine


@pytest.fixture(scope="module")
def params():
    return jax.tree.map(np.asarray, model.init_params(CONFIG_A, jax.random.key(0), "float32"))


@pytest.mark.parametrize("layout,tokens", [((1, 4, 2), 256), ((2, 2, 2), 64), ((1, 1, 8), 128), ((1, 8, 1), 48)])
def test_hlo_collective_bytes_match_formula(layout, tokens, params):
    p, r, u = layout
    par = ParallelConfig(pipeline=p, ring=r, ulysses=u)
    eng = PrefillEngine(CONFIG_A, params, par, "float32", q_tile=32, kv_tile=32, moe_tile=32)
    hlo = eng.compiled(tokens, par.in_flight).as_text()
    meas = traffic.hlo_bytes_by_scope(hlo)
    pred = traffic.analytic_bytes(CONFIG_A, par, tokens, par.in_flight, eng.plan.slots_per_stage, 4)
    assert abs(meas["total"] - pred["total"]) <= 0.02 * pred["total"], (meas, pred)  # measured: exact
    # sliding-window layers move only their halo: ppermutes (one hop), or one all-gather when pieces are shorter
    # than the halo; no all-to-all, no ring
    sliding = [c for c in traffic.hlo_collectives(hlo) if c.scope == "sliding_layer"]
    gathered = context_parallel.halo_by_gather(tokens // (2 * r * u), CONFIG_A.sliding_window)
    assert {c.kind for c in sliding} == {"all-gather" if gathered else "collective-permute"}
    assert abs(meas["sliding_layer"] - pred["sliding_layer"]) <= 0.02 * pred["sliding_layer"]
    assert meas.get("full_layer", 0) == pytest.approx(pred["full_layer"], rel=0.02)


def _sliding_collectives_per_layer(eng, tokens):
    """Collective ops (each execution counted) per sliding layer, and in the whole step, of bucket `tokens`."""
    cols = traffic.hlo_collectives(eng.compiled(tokens, 1).as_text())
    layers = sum(eng.cfg.is_sliding(i) for i in range(eng.cfg.num_hidden_layers))
    sliding = sum(c.executions for c in cols if c.scope == "sliding_layer")
    return sliding / layers, sum(c.executions for c in cols)


def test_short_prompt_halo_collectives_do_not_grow(params):
    """A 5-token prompt on ring 2 × Ulysses 4 with W = 17 (pieces of 1 token; passing pieces would take 16 hops × 3
    ppermutes per sliding layer) needs no more collectives per sliding layer than a long bucket (one hop)."""
    cfg = dataclasses.replace(CONFIG_A, sliding_window=17, num_hidden_layers=2, layer_types=CONFIG_A.layer_types[:2])
    two_layers = {**params, "layers": jax.tree.map(lambda a: a[:2], params["layers"])}  # half the compile time
    eng = PrefillEngine(cfg, two_layers, ParallelConfig(ring=2, ulysses=4), "float32", q_tile=64, kv_tile=64,
                        moe_tile=64)
    short_t, long_t = eng.bucket(5), 16 * 16  # pieces of 1 and 16 = W−1 tokens
    assert short_t // 16 < cfg.sliding_window - 1 <= long_t // 16
    short, short_all = _sliding_collectives_per_layer(eng, short_t)
    long, long_all = _sliding_collectives_per_layer(eng, long_t)
    print(f"collectives per sliding layer: short {short}, long {long}; per step: {short_all}, {long_all}")
    assert short <= long, (short, long)  # measured: 1 all-gather vs 3 collective-permutes
    assert short_all <= long_all, (short_all, long_all)  # whole step too (positions included); measured 14 vs 20


@pytest.mark.parametrize("ring,ulysses", [(2, 4), pytest.param(4, 2, marks=pytest.mark.slow), (8, 1)])
def test_attention_work_is_balanced(ring, ulysses, params):
    """Score entries computed per device (reported by the compiled program), T = 16·ring + a ragged tail."""
    eng = PrefillEngine(CONFIG_A, params, ParallelConfig(ring=ring, ulysses=ulysses), "float32",
                        q_tile=16, kv_tile=16, moe_tile=32)
    with attention.count_work({"pipeline": 1, "ring": ring, "ulysses": ulysses}) as counter:
        eng.prefill([np.arange(16 * ring + 5) % CONFIG_A.vocab_size], return_kv=False)
    work = np.array([counter.work[d] for d in range(ring * ulysses)])
    assert work.min() > 0
    assert work.max() / work.mean() <= 1.10, work


def test_hlo_parser_counts_trip_counts():
    hlo = """HloModule m
%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %a = f32[4]{0} collective-permute(%x), channel_id=1, source_target_pairs={{0,1}}, metadata={op_name="x/full_layer/y"}
}
%inner (p: f32[2]) -> f32[2] {
  %g = f32[8]{0} all-gather(%y), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}
}
ENTRY %main (x: f32[4]) -> f32[4] {
  %w = (s32[], f32[4]) while(%t), condition=%c, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %call = f32[2] call(%z), to_apply=%inner
}
"""
    cols = traffic.hlo_collectives(hlo)
    by_kind = {c.kind: c for c in cols}
    assert by_kind["collective-permute"].total == 16 * 5 and by_kind["collective-permute"].scope == "full_layer"
    assert by_kind["all-gather"].total == 8  # operand = output / group size
