"""Discrete-event simulation of the request loop: a Poisson trace through `Scheduler` and a service-time model.

    trace = poisson_trace(rate_per_s=20, duration_s=60, lengths=[256, 1024, 4096], slo_ms=1000, seed=0)
    run = simulate(trace, predict_ms, service_ms=noisy(predict_ms, cv=0.1, seed=1), batch_size=4, batch_wait_ms=5)
    run.stats.attainment, run.stats.goodput_tokens_per_s, run.stats.ttft_p99_ms

The simulated loop is the one a launcher runs with a reader thread: every arrival is offered to the scheduler at its
arrival time (so admission rejects at once, even while a batch is in flight), a released batch occupies the engine
for `service_ms(lengths)` ms, and all its members get their first token when it ends. Virtual clock: no sleeping,
deterministic for a seed. Pure Python + numpy; no JAX.

Queueing facts used to read the results: with Poisson arrivals (rate λ) and mean service time S per request the
utilisation is ρ = λ·S; capacity = 1/S requests/s (`capacity_rps`, for full batches). Without admission, as ρ → 1
the mean wait grows as ρ/(1−ρ) (Pollaczek–Khinchine) and past ρ = 1 without bound, so every request eventually
misses a fixed TTFT SLO; with admission the excess is rejected on arrival and the served ones keep their SLO.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import numpy as np

from slope_jax.serve.scheduler import Pending, Scheduler, SLOStats, slo_stats

PredictMs = Callable[[list[int]], float]


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: arrival_s (seconds from the trace start), num_tokens, ttft_slo_ms (or None)."""

    id: str
    arrival_s: float
    num_tokens: int
    ttft_slo_ms: float | None


@dataclasses.dataclass
class SimRun:
    """Result of `simulate`: one record per request (the launcher's result-record keys), wall_s, and SLOStats."""

    records: list[dict]
    wall_s: float
    stats: SLOStats


def poisson_trace(rate_per_s: float, duration_s: float, lengths: Sequence[int], *, slo_ms, seed: int,
                  weights: Sequence[float] | None = None) -> list[TraceRequest]:
    """Poisson arrivals (exponential inter-arrival times, mean 1/rate) over [0, duration_s) with lengths drawn
    i.i.d. from `lengths` (probabilities `weights`, default uniform).

    slo_ms: a TTFT SLO in ms for every request, a callable num_tokens -> ms, or None.
    Raises ValueError for a non-positive rate or duration, or empty lengths.
    """
    if not (rate_per_s > 0 and duration_s > 0):
        raise ValueError(f"rate_per_s={rate_per_s}, duration_s={duration_s}: both must be > 0")
    if len(lengths) == 0:
        raise ValueError("lengths: need at least one prompt length")
    rng = np.random.default_rng(seed)
    p = None if weights is None else np.asarray(weights, np.float64) / np.sum(weights)
    out, t = [], 0.0
    while True:
        t += rng.exponential(1.0 / rate_per_s)
        if t >= duration_s:
            return out
        n = int(rng.choice(np.asarray(lengths), p=p))
        slo = slo_ms(n) if callable(slo_ms) else slo_ms
        out.append(TraceRequest(f"r{len(out)}", t, n, None if slo is None else float(slo)))


def noisy(predict_ms: PredictMs, cv: float, seed: int) -> PredictMs:
    """A service-time model: predict_ms times a log-normal factor with mean 1 and coefficient of variation `cv`."""
    rng = np.random.default_rng(seed)
    sigma = math.sqrt(math.log1p(cv * cv))

    def service_ms(lengths: list[int]) -> float:
        return float(predict_ms(lengths)) * float(rng.lognormal(-sigma * sigma / 2, sigma))

    return service_ms


def capacity_rps(predict_ms: PredictMs, lengths: Sequence[int], batch_size: int, *,
                 weights: Sequence[float] | None = None, samples: int = 2000, seed: int = 0) -> float:
    """Predicted capacity in requests/s: batch_size / E[predict_ms(batch)] over random full batches of the mix."""
    rng = np.random.default_rng(seed)
    p = None if weights is None else np.asarray(weights, np.float64) / np.sum(weights)
    draws = rng.choice(np.asarray(lengths), size=(samples, batch_size), p=p)
    mean_ms = float(np.mean([predict_ms([int(x) for x in row]) for row in draws]))
    return batch_size * 1e3 / mean_ms


def simulate(trace: Sequence[TraceRequest], predict_ms: PredictMs, *, service_ms: PredictMs | None = None,
             batch_size: int, batch_wait_ms: float, order: str = "edf", slo_policy: str = "reject",
             bucket: Callable[[int], int] | None = None, per_step: int = 1) -> SimRun:
    """Replay `trace` through a `Scheduler(predict_ms, ...)` with batches taking `service_ms` (default: exactly the
    prediction); `bucket` and `per_step` shape batches as `Scheduler`'s arguments do. Returns one record per request,
    in trace order:
      served: id, num_tokens, ttft_ms, ttft_slo_ms, predicted_ttft_ms, slo_met, late (true when it missed its SLO);
      rejected: id, num_tokens, ttft_slo_ms, error (the reason), rejected=True, rejected_after_ms (arrival → record),
        dropped (rejected after admission: work ahead overran its prediction).
    wall_s runs from 0 to the last record (the queue is drained after the last arrival).
    """
    service_ms = service_ms or predict_ms
    sched = Scheduler(predict_ms, batch_size=batch_size, batch_wait_ms=batch_wait_ms, order=order,
                      slo_policy=slo_policy, bucket=bucket, per_step=per_step)
    trace = sorted(trace, key=lambda r: r.arrival_s)
    records: dict[str, dict] = {}
    i, now, wait_s = 0, 0.0, None
    in_flight: list[Pending] = []
    busy_start = busy_end = math.inf
    while True:
        while i < len(trace) and trace[i].arrival_s <= now:
            r = trace[i]
            sched.add(Pending(r, r.id, r.num_tokens, r.arrival_s,
                              None if r.ttft_slo_ms is None else r.arrival_s + r.ttft_slo_ms / 1e3))
            i += 1
        if in_flight and busy_end <= now:
            for p in in_flight:
                # its first token: when its step of the batch ends (the steps run one after another)
                done = busy_start + (busy_end - busy_start) * p.predicted_share
                rec = {"id": p.id, "num_tokens": p.num_tokens, "ttft_ms": (done - p.arrival_s) * 1e3,
                       "ttft_slo_ms": p.request.ttft_slo_ms, "predicted_ttft_ms": p.predicted_ttft_ms}
                if p.request.ttft_slo_ms is not None:
                    rec["slo_met"] = rec["ttft_ms"] <= p.request.ttft_slo_ms
                    if not rec["slo_met"]:
                        rec["late"] = True
                records[p.id] = rec
            in_flight, busy_end = [], math.inf
            sched.finished(now)
        batch, rejected, wait_s = sched.take_batch(now, closed=i == len(trace))
        for p, reason in rejected:
            records[p.id] = {"id": p.id, "num_tokens": p.num_tokens, "ttft_slo_ms": p.request.ttft_slo_ms,
                             "error": reason, "rejected": True, "slo_met": False,
                             "rejected_after_ms": (now - p.arrival_s) * 1e3, "dropped": p.dropped}
        if batch:
            in_flight, busy_start = batch, now
            busy_end = now + float(service_ms([p.num_tokens for p in batch])) / 1e3
        nxt = min(trace[i].arrival_s if i < len(trace) else math.inf, busy_end,
                  now + wait_s if wait_s is not None else math.inf)
        if nxt == math.inf:
            break
        now = max(now, nxt)
    assert len(records) == len(trace), "every request must get exactly one record"
    out = [records[r.id] for r in trace]
    wall = max([now] + [r.arrival_s for r in trace]) or 1e-9
    return SimRun(out, wall, slo_stats(out, wall))
