"""benchmarks/slo_peer.py without engines: the trace generator (lengths, SLOs, Poisson arrivals, determinism) and the
attainment / goodput / goals arithmetic on hand-made outcomes."""

import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import slo_peer  # noqa: E402


def test_trace_lengths_slos_and_determinism():
    trace = slo_peer.make_trace(2000, seed=3, min_tokens=256, max_tokens=8192, median=900, sigma=1.0,
                                floor_ms=2000, ms_per_token=3.0)
    n = np.array([r["tokens"] for r in trace])
    assert n.min() == 256 and n.max() == 8192  # clipped at both ends (the tail reaches the cap)
    assert abs(np.median(n) - 900) < 90
    assert n.mean() > 1.3 * np.median(n)  # long-tailed: the mean well above the median
    assert 0.01 < (n > 4096).mean() < 0.1
    assert [r["index"] for r in trace] == list(range(2000))
    for r in trace[:50]:
        assert r["slo_ms"] == max(2000.0, 3.0 * r["tokens"])
    assert trace == slo_peer.make_trace(2000, seed=3, min_tokens=256, max_tokens=8192, median=900, sigma=1.0,
                                        floor_ms=2000, ms_per_token=3.0)
    assert trace != slo_peer.make_trace(2000, seed=4)


def test_poisson_arrivals_scale_with_rate():
    trace = slo_peer.make_trace(4001, seed=0)
    t1 = np.array(slo_peer.arrivals(trace, 1.0))
    t4 = np.array(slo_peer.arrivals(trace, 4.0))
    assert t1[0] == 0.0 and np.all(np.diff(t1) > 0)
    np.testing.assert_allclose(t4, t1 / 4.0)
    gaps = np.diff(t4)
    assert abs(gaps.mean() - 0.25) < 0.02  # mean gap 1/rate
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.08  # exponential: coefficient of variation 1
    with pytest.raises(ValueError):
        slo_peer.arrivals(trace, 0.0)


def test_prompts_distinct_per_request_and_rate():
    a, b, c = (slo_peer.prompt(i, 300, k, 32768) for i, k in ((0, 0), (1, 0), (0, 1)))
    assert len(a) == 300 and min(a) >= 16 and max(a) < 32768 - 16
    assert a[:8] != b[:8] and a[:8] != c[:8]
    assert a == slo_peer.prompt(0, 300, 0, 32768)


def _trace():
    # arrivals at 0, 1, 3 s at rate 1: span 3 s; SLOs 2000, 2000, 3000 ms
    return [{"index": 0, "tokens": 256, "slo_ms": 2000.0, "offset": 0.0},
            {"index": 1, "tokens": 600, "slo_ms": 2000.0, "offset": 1.0},
            {"index": 2, "tokens": 1000, "slo_ms": 3000.0, "offset": 3.0}]


def test_score_counts_rejections_and_late_as_misses():
    out = [{"status": "ok", "ttft_ms": 1999.0}, {"status": "rejected", "ttft_ms": None},
           {"status": "ok", "ttft_ms": 3000.5}]
    s = slo_peer.score(out, _trace(), rate=2.0)  # span 1.5 s
    assert s["met"] == 1 and s["attainment"] == pytest.approx(1 / 3)
    assert s["span_s"] == 1.5
    assert s["goodput_tokens_per_s"] == pytest.approx(256 / 1.5)
    assert s["offered_tokens_per_s"] == pytest.approx(1856 / 1.5)
    assert (s["served"], s["late"], s["rejected"], s["failed"]) == (2, 1, 1, 0)
    assert s["ttft_p50_ms"] == 1999.0 and s["ttft_p90_ms"] == 3000.5
    out = [{"status": "ok", "ttft_ms": 100.0}, {"status": "timeout", "ttft_ms": None},
           {"status": "ok", "ttft_ms": 3000.0}]  # exactly at the SLO: met
    s = slo_peer.score(out, _trace(), rate=1.0)
    assert s["met"] == 2 and s["goodput_tokens_per_s"] == pytest.approx(1256 / 3.0) and s["failed"] == 1
    with pytest.raises(ValueError):
        slo_peer.score(out[:2], _trace(), 1.0)


def test_goals_pick_first_rate_below_90_percent():
    def st(att, good):
        return {"attainment": att, "goodput_tokens_per_s": good}

    table = [{"rate": 0.2, "vllm": st(1.0, 300), "slope_jax": st(1.0, 300)},
             {"rate": 0.4, "vllm": st(0.85, 400), "slope_jax": st(0.95, 640)},
             {"rate": 0.6, "vllm": st(0.5, 300), "slope_jax": st(0.9, 900)}]
    g = slo_peer.goals(table)
    assert g["attainment_at_least_vllm_every_rate"] is True
    assert g["rate_vllm_below_90"] == 0.4 and g["goodput_ratio_there"] == pytest.approx(1.6)
    assert g["goodput_at_least_1.5x"] is True
    assert g["goodput_ratio_ceiling_there"] is None  # no offered load in these rows
    assert g["goodput_ratio_by_rate"] == {"0.2": 1.0, "0.4": pytest.approx(1.6), "0.6": 3.0}
    table[1]["vllm"]["offered_tokens_per_s"] = 500.0
    assert slo_peer.goals(table)["goodput_ratio_ceiling_there"] == pytest.approx(1.25)
    table[1]["slope_jax"] = st(0.8, 500)
    g = slo_peer.goals(table)
    assert g["attainment_at_least_vllm_every_rate"] is False and g["goodput_at_least_1.5x"] is False
    g = slo_peer.goals(table[:1])
    assert g["rate_vllm_below_90"] is None and g["goodput_at_least_1.5x"] is None
    table[1]["vllm"] = st(0.0, 0.0)
    assert math.isinf(slo_peer.goals(table)["goodput_ratio_there"])
    assert math.isinf(slo_peer.goals(table)["goodput_ratio_by_rate"]["0.4"])
