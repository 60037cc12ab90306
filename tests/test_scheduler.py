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
    # the excess load is refused: at 2x capacity at least 40 % of the offered prompt tokens (ideally 50 %) ...
    assert sum(r["num_tokens"] for r in rej) > 0.4 * sum(r["num_tokens"] for r in edf.records)
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


def test_online_correction_seeded_by_measured_warm_up_steps():
    """Warm-up steps measured before traffic set the factor (geometric mean of measured / predicted) in place of the
    uninformed 1.0 that the first requests were predicted with; clipped like `observe`; unusable samples are
    skipped, and with none left the factor stays."""
    pred = OnlineCorrection(per_request(10.0), max_factor=8.0)
    assert pred.seed([([1], 20.0), ([1, 1], 160.0)]) == pytest.approx(4.0)  # ratios 2 and 8: geometric mean 4
    assert pred([3, 5]) == pytest.approx(80.0)  # two requests at 10 ms each, x4
    assert pred.seed([([1], 1e6)]) == 8.0  # clipped
    assert pred.seed([([], 5.0), ([1], 0.0), ([1], float("nan"))]) == 8.0  # nothing usable: unchanged
    pred.observe([1], 10.0)  # later batches correct it as before (alpha 0.2 from the seeded factor)
    assert pred.factor == pytest.approx(0.8 * 8.0 + 0.2 * 1.0)


def test_refreshed_prefix_hits_of_queued_requests_set_their_predictions():
    """A request admitted while its prefix was not cached yet (the request that exports it was queued or running)
    is re-estimated after each batch (`refresh_expected`, the head of the queue in service order, up to `limit`):
    released as the hit it will be, predicted from its new tokens, not as the cold prompt."""
    new_tokens = lambda works: sum(w[0] - w[1] if isinstance(w, tuple) else w for w in works)  # noqa: E731 (1 ms/token)
    s = Scheduler(new_tokens, batch_size=1, batch_wait_ms=0)
    for rid, n in (("doc", 600), ("turn", 1400), ("other", 900)):
        s.add(req(rid, 0.0, 60_000, n=n))
    batch, _, _ = s.take_batch(0.0, closed=True)
    assert [p.id for p in batch] == ["doc"]
    hits = {"turn": 512, "other": 256}
    assert s.refresh_expected(lambda p: hits.get(p.id, 0), limit=1) == 1  # only the head: "turn"
    s.finished(0.6)
    batch, _, _ = s.take_batch(0.6, closed=True)
    assert [p.id for p in batch] == ["turn"] and batch[0].cached_tokens == 512
    assert batch[0].predicted_compute_ms == pytest.approx(888.0) and batch[0].predicted_ttft_ms == pytest.approx(1488.0)
    assert s.refresh_expected(lambda p: 0) == 0  # "other" was never refreshed: still 0, unchanged
    s.finished(1.5)
    batch, _, _ = s.take_batch(1.5, closed=True)
    assert [p.id for p in batch] == ["other"] and batch[0].predicted_compute_ms == pytest.approx(900.0)


def test_a_request_sharing_a_prefix_with_one_ahead_is_predicted_as_its_hit():
    """The engine runs a batch's steps as separate prefills, so a prompt in a later step takes the prefix an earlier
    step's prompt left (an agent re-sending its context, duplicates sent at once). With `prefix_block`, a request
    whose leading block hashes match a request ahead of it in service order is expected to take those blocks —
    before, both were predicted cold while the second ran as a hit (another program to compile: +207 % to +339 %
    over the prediction, and an SLO request admitted at 174 ms served at 2872 ms). Not with several prompts per
    step, and not where the hashes differ (another salt, other tokens)."""
    new_tokens = lambda works: sum(w[0] - w[1] if isinstance(w, tuple) else w for w in works)  # noqa: E731
    a = ("h0", "h1", "h2")

    def run(per_step, second_hashes, block=128):
        s = Scheduler(new_tokens, batch_size=8, batch_wait_ms=0, per_step=per_step, prefix_block=block)
        first, second = req("first", 0.0, None, n=400), req("second", 0.001, None, n=420)
        first.prefix_hashes, second.prefix_hashes = a, second_hashes
        for p in (first, second):
            s.add(p)
        batch, _, _ = s.take_batch(0.002, closed=True)
        return {p.id: (p.cached_tokens, p.predicted_compute_ms) for p in batch}

    assert run(1, a + ("h3",)) == {"first": (0, 400.0), "second": (384, 36.0)}  # 3 shared blocks of 128
    assert run(1, ("h0", "h1", "other")) == {"first": (0, 400.0), "second": (256, 164.0)}
    assert run(1, ("x0", "x1", "x2")) == {"first": (0, 400.0), "second": (0, 420.0)}  # another salt: no match
    assert run(2, a + ("h3",))["second"][0] == 0  # two prompts per step: one step, no reuse between them
    assert run(1, a + ("h3",), block=0)["second"][0] == 0  # not modelled (no place keeps the KV)


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


# ---- batches that follow deadlines, buckets and compilation (issue 17 (4)) ------------------------------------------
def per_token_step(t, m):
    """Step model: 1 ms per padded token per prompt (a 100-token prompt, bucket 128: 128 ms; 1000 tokens: 1008 ms)."""
    return float(t * m)


def test_urgent_short_request_leaves_first_and_alone_behind_seven_long_ones():
    from slope_jax.parallel.layout import bucket_length

    pred = batch_predictor(per_token_step, bucket_length, per_step=1)
    for others_slo, bucket in [(60_000, bucket_length), (None, bucket_length), (60_000, None), (None, None)]:
        s = Scheduler(pred, batch_size=8, batch_wait_ms=5, bucket=bucket)  # the launcher's default batch size
        for i in range(7):
            s.add(req(f"long{i}", 0.0, others_slo, n=1000))
        s.add(req("urgent", 0.001, 500, n=100))
        batch, rejected, _ = s.take_batch(0.001, closed=True)
        # before: one batch of all 8 -> "rejected: predicted TTFT 7296.0 ms" (or, without SLOs on the others,
        # admitted and released inside the 8-request batch at that prediction)
        assert rejected == [] and [p.id for p in batch] == ["urgent"], (others_slo, bucket)
        assert batch[0].predicted_ttft_ms == pytest.approx(128.0, abs=1e-6)
        s.finished(0.129)
        batch, rejected, _ = s.take_batch(0.129, closed=True)
        assert rejected == [] and [p.id for p in batch] == [f"long{i}" for i in range(7)]
        # the steps run one after another: each member's own step is 1008 ms (bucket 1008), its TTFT its step's end
        assert [p.predicted_compute_ms for p in batch] == pytest.approx([1008.0] * 7, abs=1e-6)
        assert [p.predicted_ttft_ms for p in batch] == pytest.approx([129.0 + 1008.0 * k for k in range(1, 8)],
                                                                     abs=1e-6)


def test_batch_rides_only_in_free_step_slots_past_other_buckets():
    bucket = lambda n: 64 if n <= 64 else 256  # noqa: E731
    step = lambda t, m: t + 10.0 * m  # noqa: E731 - a second prompt in a step costs 10 ms, a new step t + 10 ms

    def first_batch(per_step, slo_b):
        s = Scheduler(batch_predictor(step, bucket, per_step), batch_size=8, batch_wait_ms=0, bucket=bucket,
                      per_step=per_step)
        for r in [req("a", 0.0, 100, n=60), req("b", 0.0, slo_b, n=200), req("c", 0.0, 3000, n=50),
                  req("d", 0.0, 3000, n=40)]:
            s.add(r)
        batch, rejected, _ = s.take_batch(0.0, closed=True)
        assert rejected == []
        return [p.id for p in batch]

    # 2 prompts per step: "c" fills the free slot of a's step (84 ms instead of 74 ms), "d" would need a new step
    assert first_batch(2, 2000) == ["a", "c"]
    assert first_batch(1, 2000) == ["a"]  # one prompt per step: no free slot, "b" is not overtaken
    # "b" (266 ms alone) must end by 350 ms: riding "c" (b ends at 84 + 266 = 350 ms) is allowed, by 349 ms not
    assert first_batch(2, 350) == ["a", "c"] and first_batch(2, 349) == ["a"]


def test_admission_charges_each_uncompiled_step_shape_once():
    compiled = set()
    bucket = lambda n: 64 if n <= 64 else 256  # noqa: E731
    compile_ms = lambda shape: 0.0 if shape in compiled else 5000.0  # noqa: E731
    s = Scheduler(batch_predictor(per_token_step, bucket, 1), batch_size=1, batch_wait_ms=0, bucket=bucket,
                  compile_ms=compile_ms)
    s.add(req("x", 0.0, 6000, n=50))  # 5000 ms compile + 64 ms
    s.add(req("y", 0.0, 5200, n=60))  # same shape, after x: 5128 ms, no second compile
    s.add(req("z", 0.0, 5100, n=200))  # a new shape (256, 1): 5000 + 256 ms alone, cannot make 5100 ms
    batch, rejected, _ = s.take_batch(0.0, closed=True)
    assert [p.id for p, _ in rejected] == ["z"]
    assert "predicted TTFT 5256.0 ms exceeds the allowed 5100.0 ms" in rejected[0][1]
    assert "5000.0 ms compiling step shapes not compiled yet (--precompile" in rejected[0][1]
    assert [p.id for p in batch] == ["y"] and batch[0].predicted_ttft_ms == pytest.approx(5064.0, abs=1e-6)
    compiled.add((64, 1))  # the engine compiled it: the next batch of the shape pays compute only
    s.finished(5.064)
    batch, _, _ = s.take_batch(5.064, closed=True)
    assert [p.id for p in batch] == ["x"] and batch[0].predicted_compute_ms == pytest.approx(64.0, abs=1e-6)
    # z's shape was refused for its compile: it is warmed once the engine is idle (not while a batch is in flight),
    # so a later request of that length is not refused for the same compile forever
    assert s.take_warm(5.1) == []  # x is in flight
    s.finished(5.2)
    assert s.take_warm(5.2) == [(256, 1)] and s.busy  # busy for its expected compile, until finished
    compiled.add((256, 1))
    s.finished(10.2)
    assert s.take_warm(10.2) == []  # warmed once
    s.add(req("w", 10.2, 300, n=200))
    batch, rejected, _ = s.take_batch(10.2, closed=True)
    assert [p.id for p in batch] == ["w"] and rejected == []


class _FakeEngine:
    """What BatchModel reads of a PrefillEngine: bucket(), mesh/parallel (prompts per step), compile_ms."""

    mesh = None
    parallel = None

    def __init__(self):
        self.compile_ms = {}

    @staticmethod
    def bucket(n):
        from slope_jax.parallel.layout import bucket_length

        return bucket_length(n, multiple=16)


def test_main_job_replay_rejects_what_compilation_makes_late():
    """The README main job on a loaded host: buckets 48 (two texts, 30 s SLO), 32 (one, 30 s), 608 (60 s),
    1408 (no SLO); every bucket compiles for ~45 s, compute is ~1 s. Before, every prediction was ~1.5 s and nothing
    was rejected; now the first compile is expected (the prior) and every later one is the last measured."""
    from slope_jax.serve.slo import BatchModel, compile_prior_ms

    prior = compile_prior_ms("cpu", loadavg=12.0, cpus=2)  # 8 s idle x 6 (load 12 on 2 cores)
    assert prior == pytest.approx(48_000.0, abs=1e-6)
    assert compile_prior_ms("cpu", loadavg=0.5, cpus=2) == pytest.approx(8_000.0, abs=1e-6)
    # a warm persistent compilation cache: a hit is expected, not a full compile
    assert compile_prior_ms("cpu", loadavg=12.0, cpus=2, cache_warm=True) == pytest.approx(4_800.0, abs=1e-6)
    lengths = {"gettysburg": 40, "genesis": 35, "tale": 30, "corpus-600": 600, "corpus-1400": 1400}
    slos = {"gettysburg": 30_000, "genesis": 30_000, "tale": 30_000, "corpus-600": 60_000, "corpus-1400": None}

    def run(prior_ms, compile_s):
        engine = _FakeEngine()
        model = BatchModel(engine, lambda t, m: 1.0 * t, prior_ms)
        s = Scheduler(model, batch_size=8, batch_wait_ms=5, bucket=engine.bucket, compile_ms=model.compile_ms)
        for rid, n in lengths.items():
            s.add(req(rid, 0.0, slos[rid], n=n))
        now, served, rejected = 0.0, {}, {}
        while s.pending:
            batch, rej, _ = s.take_batch(now, closed=True)
            rejected.update({p.id: reason for p, reason in rej})
            if batch:  # the engine compiles each new shape (compile_s), then computes
                for shape in {(engine.bucket(p.num_tokens), 1) for p in batch} - set(engine.compile_ms):
                    engine.compile_ms[shape] = compile_s * 1e3
                    now += compile_s
                now += model([p.num_tokens for p in batch]) / 1e3
                served.update({p.id: (now - p.arrival_s) * 1e3 for p in batch})
                s.finished(now)
        return served, rejected

    served, rejected = run(prior, 45.0)  # a load-aware prior: what a compile makes late is refused on arrival,
    assert sorted(rejected) == ["genesis", "gettysburg", "tale"]  # what can make it (60 s) is served in time
    assert all("exceeds the allowed" in r and "ran longer" not in r for r in rejected.values())
    assert sorted(served) == ["corpus-1400", "corpus-600"] and served["corpus-600"] <= 60_000
    served, rejected = run(8_000.0, 45.0)  # an idle-machine prior: the first batch is served late, and once its
    assert sorted(served) == ["corpus-1400", "genesis", "gettysburg"]  # compile is measured the rest is dropped
    assert served["gettysburg"] > 30_000 and sorted(rejected) == ["corpus-600", "tale"]
    assert all("work ahead ran longer than predicted" in r for r in rejected.values())


def test_compile_estimate_follows_the_latest_measured_compile():
    from slope_jax.serve.slo import BatchModel

    engine = _FakeEngine()
    model = BatchModel(engine, lambda t, m: float(t), compile_prior_ms=9000.0)
    assert model.compile_ms((32, 1)) == 9000.0  # nothing compiled yet: the prior
    engine.compile_ms[(32, 1)] = 41_000.0  # a cold compile
    assert model.compile_ms((32, 1)) == 0.0 and model.compile_ms((768, 1)) == 41_000.0
    engine.compile_ms[(48, 1)] = 900.0  # a persistent-cache hit compiles fast: the estimate drops with it
    assert model.compile_ms((768, 1)) == 900.0 and model([40, 600]) == pytest.approx(48.0 + 608.0, abs=1e-9)


def test_each_member_is_predicted_at_the_end_of_its_own_step():
    """The engine runs a batch's steps one after another (`steps.group_steps`: by bucket, `per_step` prompts each)
    and a request's first token is ready when its step ends: a member's predicted TTFT is the end of its own step
    (the steps before it, then its step's compute and the compile of its shape where the batch first runs it), not
    the batch's end (which every member was given before: the first members' predictions were the whole batch's
    time, and the part spent on earlier steps read as compute rather than waiting). The simulator times members the
    same way."""
    bucket = lambda n: 64 if n <= 64 else 256  # noqa: E731
    step = lambda t, m: t + 10.0 * m  # noqa: E731
    compiled = set()
    s = Scheduler(batch_predictor(step, bucket, per_step=2), batch_size=8, batch_wait_ms=0, bucket=bucket,
                  per_step=2, compile_ms=lambda shape: 0.0 if shape in compiled else 500.0)
    for i, n in enumerate([10, 20, 30]):  # one bucket (64): a step of 2 prompts, then a step of 1
        s.add(req(f"r{i}", 0.0, None, n=n))
    batch, rejected, _ = s.take_batch(0.002, closed=True)
    assert rejected == [] and len(batch) == 3
    got = {p.id: (p.predicted_ttft_ms, p.predicted_compute_ms, p.predicted_compile_ms) for p in batch}
    # (64 x 2: r0, r1) 84 ms + its compile 500; (64 x 1: r2) 74 ms + its compile 500 (another shape)
    assert got["r0"] == got["r1"] == pytest.approx((2.0 + 584.0, 584.0, 500.0))
    assert got["r2"] == pytest.approx((2.0 + 584.0 + 574.0, 574.0, 500.0))
    assert [p.predicted_share for p in batch] == pytest.approx([584.0 / 1158.0] * 2 + [1.0])
    compiled.add((64, 2))  # a later batch of the compiled shape pays no compile in its step
    for i, n in enumerate([10, 20]):
        s.add(req(f"q{i}", 1.0, None, n=n))
    s.finished(1.0)
    batch, _, _ = s.take_batch(1.0, closed=True)
    assert [p.predicted_ttft_ms for p in batch] == pytest.approx([84.0] * 2)
    assert [p.predicted_compile_ms for p in batch] == [0.0, 0.0]

    from slope_jax.serve.simulate import TraceRequest, simulate
    trace = [TraceRequest(f"s{i}", 0.0, n, None) for i, n in enumerate([10, 20, 30])]
    run = simulate(trace, batch_predictor(step, bucket, per_step=1), batch_size=8, batch_wait_ms=0, bucket=bucket)
    assert [r["ttft_ms"] for r in run.records] == pytest.approx([74.0, 148.0, 222.0])
    assert [r["predicted_ttft_ms"] for r in run.records] == pytest.approx([74.0, 148.0, 222.0])
