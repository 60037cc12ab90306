"""SLO-aware scheduler (EDF, admission, bounded batch wait), SLO metrics, and the Poisson-trace simulation.

Pure Python with synthetic service times and an explicit clock: every time below is exact, so the asserts are exact
(float comparisons use a 1e-9 s / 1e-6 ms tolerance for rounding only).
"""

import math

import numpy as np
import pytest

from slope_jax.serve.scheduler import OnlineCorrection, Pending, Scheduler, batch_predictor, slo_stats
from slope_jax.serve.simulate import TraceRequest, capacity_rps, noisy, poisson_trace, simulate


def per_request(ms_per_request: float, ms_per_token: float = 0.0):
    """Service model: the batch costs the sum over its prompts (the engine runs one step per bucket group)."""
    return lambda lengths: sum(ms_per_request + ms_per_token * n for n in lengths)


def req(rid, arrival, slo_ms=None, n=100):
    return Pending(rid, rid, n, arrival, None if slo_ms is None else arrival + slo_ms / 1e3)


def drain(sched, now):
    """Release every queued batch at `now`, finishing each at once; the ids in service order."""
    order = []
    while sched.pending:
        batch, rejected, _ = sched.take_batch(now, closed=True)
        assert not rejected
        order += [p.id for p in batch]
        sched.finished(now)
    return order


def test_edf_order_no_slo_last_fcfs_among_equals():
    s = Scheduler(per_request(1.0), batch_size=1, batch_wait_ms=0)
    for r in [req("none1", 0.0), req("d3", 0.001, 3000), req("d1", 0.002, 1000), req("none2", 0.003),
              req("d2a", 0.004, 1996), req("d2b", 0.005, 1995)]:  # d2a and d2b share the deadline 2.0 s
        s.add(r)
    assert drain(s, 0.01) == ["d1", "d2a", "d2b", "d3", "none1", "none2"]

    f = Scheduler(per_request(1.0), batch_size=2, batch_wait_ms=0, order="fcfs")
    for r in [req("a", 0.0), req("b", 0.001, 3000), req("c", 0.002, 1000)]:
        f.add(r)
    assert drain(f, 0.01) == ["a", "b", "c"]


def test_rejection_names_predicted_and_allowed_ms_at_once():
    s = Scheduler(per_request(100.0), batch_size=1, batch_wait_ms=0)
    s.add(req("first", 0.0, 150))
    s.add(req("second", 0.0, 150))  # behind "first": 100 ms queue + 100 ms compute = 200 ms > 150 ms
    batch, rejected, _ = s.take_batch(0.0)
    assert [p.id for p in batch] == ["first"] and batch[0].predicted_ttft_ms == pytest.approx(100.0, abs=1e-6)
    assert len(rejected) == 1 and rejected[0][0].id == "second"
    assert "predicted TTFT 200.0 ms exceeds the allowed 150.0 ms" in rejected[0][1]

    # A prompt whose compute alone exceeds its SLO is rejected even with an idle engine.
    s.finished(0.1)
    s.add(req("huge", 0.2, 50))
    batch, rejected, _ = s.take_batch(0.2)
    assert batch == [] and "predicted TTFT 100.0 ms exceeds the allowed 50.0 ms" in rejected[0][1]


def test_rejected_while_busy_gets_its_record_at_once_counting_work_in_flight():
    s = Scheduler(per_request(100.0), batch_size=1, batch_wait_ms=0)
    s.add(req("running", 0.0, 1000))
    batch, _, _ = s.take_batch(0.0)  # in flight, predicted to end at 0.1 s
    assert s.busy and [p.id for p in batch] == ["running"]
    s.add(req("fits", 0.04, 170))  # starts at 0.1, ends at 0.2: TTFT 160 ms <= 170 ms
    s.add(req("late", 0.05, 120))  # deadline 0.17 s, first in EDF order; ends at 0.2 s: 150 ms > 120 ms
    batch, rejected, wait_s = s.take_batch(0.05)
    assert batch == [] and wait_s is None  # nothing is released while a batch is in flight...
    assert [p.id for p, _ in rejected] == ["late"]  # ...but the doomed request is answered now, not after it
    assert "predicted TTFT 150.0 ms exceeds the allowed 120.0 ms" in rejected[0][1]
    s.finished(0.1)
    batch, rejected, _ = s.take_batch(0.1)
    assert [p.id for p in batch] == ["fits"] and not rejected


def test_admission_keeps_promises_to_admitted_requests():
    s = Scheduler(per_request(100.0), batch_size=1, batch_wait_ms=0)
    s.add(req("running", 0.0, 1000))
    s.take_batch(0.0)
    s.add(req("admitted", 0.01, 195))  # deadline 0.205 s; ends at 0.2 s
    assert s.take_batch(0.01)[1] == []
    # An earlier deadline (0.202 s) that would fit itself but push "admitted" to 0.3 s is refused, and says why.
    s.add(req("pushy", 0.02, 182))
    _, rejected, _ = s.take_batch(0.02)
    assert [p.id for p, _ in rejected] == ["pushy"]
    assert "predicted TTFT 180.0 ms is within the allowed 182.0 ms" in rejected[0][1]
    assert "would make 1 admitted request(s) miss" in rejected[0][1]


def test_bounded_batch_wait_never_holds_a_request_for_a_later_one():
    s = Scheduler(per_request(10.0), batch_size=8, batch_wait_ms=5, default_slo_ms=10_000)
    s.add(req("a", 0.0))
    batch, rejected, wait_s = s.take_batch(0.0)
    assert batch == [] and rejected == [] and wait_s == pytest.approx(0.005, abs=1e-9)
    batch, _, _ = s.take_batch(0.005)
    assert [p.id for p in batch] == ["a"]
    s.finished(0.015)
    s.add(req("b", 20.0))  # 20 s later: waits its own 5 ms, not for a full batch
    assert s.take_batch(20.0)[0] == []
    assert [p.id for p in s.take_batch(20.005)[0]] == ["b"]

    # Same through the simulated loop: TTFT = batch wait + compute; the last request of a closed stream (no more
    # arrivals) does not wait at all.
    trace = [TraceRequest(rid, t, 100, 10_000.0) for rid, t in [("first", 1.0), ("later", 21.0), ("last", 41.0)]]
    run = simulate(trace, per_request(10.0), batch_size=8, batch_wait_ms=5)
    assert [r["ttft_ms"] for r in run.records] == pytest.approx([15.0, 15.0, 10.0], abs=1e-6)


def test_release_early_when_waiting_would_miss_a_deadline():
    s = Scheduler(per_request(100.0), batch_size=4, batch_wait_ms=50)
    s.add(req("tight", 0.0, 103))  # slack 3 ms < the 50 ms batch wait
    batch, _, wait_s = s.take_batch(0.0)
    assert batch == [] and wait_s == pytest.approx(0.003, abs=1e-9)
    assert [p.id for p in s.take_batch(0.003)[0]] == ["tight"]
    s.finished(0.103)
    s.add(req("x", 1.0))
    assert [p.id for p in s.take_batch(1.0, closed=True)[0]] == ["x"]  # closed stream: no waiting


def test_serve_late_flags_and_serves_behind_on_time_requests():
    s = Scheduler(per_request(100.0), batch_size=1, batch_wait_ms=0, slo_policy="serve_late")
    s.add(req("first", 0.0, 150))
    s.add(req("doomed", 0.0, 150))
    s.add(req("on_time", 0.001, 1000))
    batch, rejected, _ = s.take_batch(0.001)
    assert rejected == [] and [p.id for p in batch] == ["first"]
    s.finished(0.1)
    b2 = s.take_batch(0.1)[0]
    s.finished(0.2)
    b3 = s.take_batch(0.2)[0]
    assert [p.id for p in b2] == ["on_time"] and not b2[0].late
    assert [p.id for p in b3] == ["doomed"] and b3[0].late


def test_scheduler_argument_errors_name_the_field():
    for kwargs, word in [(dict(order="lifo"), "order"), (dict(slo_policy="drop"), "slo_policy"),
                         (dict(batch_size=0), "batch_size"), (dict(batch_wait_ms=-1), "batch_wait_ms"),
                         (dict(default_slo_ms=math.inf), "default_slo_ms")]:
        args = dict(batch_size=1, batch_wait_ms=0) | kwargs
        with pytest.raises(ValueError, match=word):
            Scheduler(per_request(1.0), **args)


def test_slo_stats_hand_computed():
    records = [
        {"id": "a", "num_tokens": 100, "ttft_ms": 50.0, "ttft_slo_ms": 100.0},  # met
        {"id": "b", "num_tokens": 200, "ttft_ms": 150.0, "ttft_slo_ms": 100.0},  # late
        {"id": "c", "num_tokens": 300, "ttft_ms": 10.0},  # no SLO: counts in goodput, not in attainment
        {"id": "d", "num_tokens": 400, "ttft_slo_ms": 100.0, "error": "rejected: ...", "rejected": True},
        {"id": "e", "error": "bad line"},  # failed, no SLO
    ]
    st = slo_stats(records, wall_s=2.0)
    assert (st.requests, st.served, st.rejected, st.failed, st.with_slo, st.met, st.late) == (5, 3, 1, 1, 3, 1, 1)
    assert st.attainment == pytest.approx(1 / 3, abs=1e-12)
    assert st.goodput_tokens_per_s == pytest.approx((100 + 300) / 2.0, abs=1e-9)
    assert st.goodput_requests_per_s == pytest.approx(1.0, abs=1e-12)
    assert st.throughput_tokens_per_s == pytest.approx(300.0, abs=1e-9)
    # numpy linear percentiles of [10, 50, 150]: p50 = 50, p90 = 50 + 0.8*100 = 130, p99 = 50 + 0.98*100 = 148
    assert (st.ttft_p50_ms, st.ttft_p90_ms, st.ttft_p99_ms) == pytest.approx((50.0, 130.0, 148.0), abs=1e-9)
    line = st.summary_line()
    assert "SLO attainment 33.3% (1/3)" in line and "goodput 200 tokens/s" in line and "rejected 1" in line
    assert slo_stats([], 1.0).attainment is None and slo_stats([], 1.0).ttft_p50_ms is None


def test_simulation_attainment_below_capacity_and_early_rejection_above():
    predict = per_request(5.0, 0.05)  # 11.4 ms .. 107 ms per prompt over the mix below
    lengths, batch_size = [128, 512, 1024, 2048], 4
    cap = capacity_rps(predict, lengths, batch_size)
    assert cap == pytest.approx(1e3 / np.mean([5.0 + 0.05 * n for n in lengths]), rel=0.03)  # sampling error

    def run(load, order, policy):
        trace = poisson_trace(load * cap, 60.0, lengths, slo_ms=1000, seed=3)
        return simulate(trace, predict, service_ms=noisy(predict, 0.1, seed=4), batch_size=batch_size,
                        batch_wait_ms=5, order=order, slo_policy=policy)

    low = run(0.5, "edf", "reject").stats
    assert low.attainment >= 0.9 and low.rejected == 0
    edf, fcfs = run(2.0, "edf", "reject"), run(2.0, "fcfs", "none")
    rej = [r for r in edf.records if r.get("rejected")]
    assert len(rej) > 0.3 * len(edf.records)  # the excess load is refused ...
    assert all(r["rejected_after_ms"] < r["ttft_slo_ms"] for r in rej)  # ... before its deadline, never a timeout,
    assert all(r["rejected_after_ms"] == 0.0 for r in rej if not r["dropped"])  # refused on arrival, or
    assert np.mean([r["dropped"] for r in rej]) <= 0.2  # dropped later as the noise made work ahead overrun (12 %)
    assert edf.stats.late <= 0.05 * edf.stats.served  # what is served keeps its SLO
    assert edf.stats.goodput_tokens_per_s > 0.8 * np.mean(lengths) * cap  # and the engine stays busy with good work
    assert fcfs.stats.attainment < 0.1 and fcfs.stats.rejected == 0  # FCFS without admission: everyone times out


def test_online_correction_tracks_measured_speed():
    base = per_request(10.0)
    pred = OnlineCorrection(base, alpha=0.5, max_factor=4.0)
    assert pred([1, 2]) == 20.0
    pred.observe([1, 2], 40.0)  # measured 2x the base model: factor 0.5 * 1 + 0.5 * 2 = 1.5
    assert pred.factor == pytest.approx(1.5, abs=1e-12) and pred([7]) == pytest.approx(15.0, abs=1e-12)
    for _ in range(50):
        pred.observe([1], 1000.0)  # 100x: clipped at max_factor
    assert pred.factor == 4.0
    pred.observe([], 0.0)  # an empty batch teaches nothing
    assert pred.factor == 4.0


def test_scheduler_and_simulation_import_without_jax():
    import subprocess
    import sys

    code = ("import sys; sys.modules['jax'] = None\n"  # any `import jax` now raises ImportError
            "import slope_jax.serve.scheduler, slope_jax.serve.simulate")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_batch_predictor_groups_by_bucket_like_the_engine():
    calls = []

    def step_ms(t, m):
        calls.append((t, m))
        return t + 1000.0 * m  # distinct per (t, m), so any misgrouping changes the sum

    bucket = lambda n: 64 if n <= 64 else 256  # noqa: E731
    pred = batch_predictor(step_ms, bucket, per_step=2)
    # bucket 64: 3 prompts -> steps of 2 and 1; bucket 256: 1 prompt -> a step of 1
    assert pred([10, 300, 64, 1]) == (64 + 2000) + (64 + 1000) + (256 + 1000)
    assert pred([1, 2, 3, 400]) == (64 + 2000) + (64 + 1000) + (256 + 1000) and len(calls) == 3  # memoised
    with pytest.raises(ValueError, match="per_step"):
        batch_predictor(step_ms, bucket, per_step=0)
