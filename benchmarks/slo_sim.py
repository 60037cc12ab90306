"""SLO-aware scheduling under a Poisson trace: EDF + admission vs FCFS, simulated and replayed on the real CPU engine.

    python benchmarks/slo_sim.py                       # simulation: offered load 0.2x .. 2x of predicted capacity
    python benchmarks/slo_sim.py --replay              # + the real engine (tiny checkpoint, 1 CPU device), < 2 min
    python benchmarks/slo_sim.py --replay --devices 8  # same on 8 virtual CPU devices (ring 2 x Ulysses 4)

Service model (printed in the output and the JSON as `service_model`): `slope_jax.plan.predict(cfg, parallel,
bucket, hardware="cpu")["ttft_ms"]` per prompt, summed over a batch, if that cost model is importable; otherwise a
measured fit: the real engine's median-of-5 compute time per bucket of the length mix on this machine (the engine
runs one step per prompt here, so a batch costs the sum over its prompts).

Simulation (`slope_jax.serve.simulate`, discrete-event, seeded): per offered load, one Poisson trace with the mixed
lengths through (a) EDF + admission (`slo_policy=reject`) and (b) FCFS without admission, with the service time =
the model × log-normal noise (`--noise_cv`). The predicted goodput is the largest offered load at which the
noise-free model with EDF + admission still attains >= 90 % (on a trace with another seed). Checks printed at the end:
  * for every load <= the predicted goodput: EDF + admission attainment >= 90 %;
  * above it: EDF + admission rejects the excess before the deadline (mostly on arrival) and serves late <= 5 %;
    FCFS on the same trace is shown next to it.
Replay (`--replay`): the same loop in real time on the engine (`PrefillEngine` on `--checkpoint`), a worker thread
running each batch while the scheduler admits/rejects new arrivals; the rate is scaled to the predicted capacity;
the model is corrected online by measured batch compute (`OnlineCorrection`: this machine is shared, its speed
drifts by 2x).
Writes JSON (default benchmarks/results/slo_sim.json).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import start_load, write_result  # noqa: E402  (benchmarks/common.py)

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", "checkpoints/tiny-gpt-oss", "Checkpoint of the engine (measured fit and replay).")
flags.DEFINE_enum("devices", "1", ["1", "8"], "Engine on 1 CPU device, or 8 virtual CPU devices as ring 2 x Ulysses 4.")
flags.DEFINE_enum("service_model", "auto", ["auto", "plan", "measured"],
                  "Cost model of the scheduler and the simulation: `plan` = slope_jax.plan.predict (hardware 'cpu'), "
                  "`measured` = a per-bucket fit measured on the engine here, `auto` = plan if importable, else "
                  "measured.")
flags.DEFINE_list("lengths", ["32", "100", "250"], "Prompt lengths of the mix (drawn uniformly).")
flags.DEFINE_float("ttft_slo_ms", None, "TTFT SLO of every request (default: 5 x the predicted compute of the "
                   "longest prompt of the mix).")
flags.DEFINE_integer("batch_size", 4, "Requests per batch.")
flags.DEFINE_float("batch_wait_ms", 5.0, "Bounded batch wait.")
flags.DEFINE_list("loads", ["0.2", "0.4", "0.6", "0.8", "0.9", "1.0", "1.2", "1.5", "2.0"],
                  "Offered loads, as multiples of the predicted capacity.")
flags.DEFINE_float("duration_s", 300.0, "Simulated trace duration per load (virtual seconds).")
flags.DEFINE_float("noise_cv", 0.1, "Coefficient of variation of the simulated service time around the model.")
flags.DEFINE_integer("seed", 0, "Trace seed.")
flags.DEFINE_bool("replay", False, "Also replay scaled-down traces on the real engine in real time.")
flags.DEFINE_list("replay_loads", ["0.5", "2.0"], "Offered loads (x predicted capacity) of the real-engine replay.")
flags.DEFINE_float("replay_s", 15.0, "Trace duration per replay run (wall seconds; 2 policies per load).")
flags.DEFINE_string("out", "benchmarks/results/slo_sim.json", "JSON output path.")

POLICIES = [("edf", "reject"), ("fcfs", "none")]


def make_engine():
    from slope_jax.parallel.config import ParallelConfig
    from slope_jax.serve.engine import PrefillEngine

    par = ParallelConfig() if FLAGS.devices == "1" else ParallelConfig(ring=2, ulysses=4)
    return PrefillEngine.from_checkpoint(FLAGS.checkpoint, par, "float32", progress=False), par


def measured_fit(engine, lengths, repeats=5):
    """Median of `repeats` wall times (ms) of one single-prompt prefill per bucket, after compiling it (the median,
    not the best: the scheduler needs the typical service time on this shared machine, not its floor)."""
    import numpy as np

    rng = np.random.default_rng(0)
    table = {}
    for n in lengths:
        b = engine.bucket(n)
        if b in table:
            continue
        prompt = rng.integers(0, engine.cfg.vocab_size, n)
        engine.prefill([prompt], return_kv=False, top_k=1)  # compile
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.prefill([prompt], return_kv=False, top_k=1)
            times.append((time.perf_counter() - t0) * 1e3)
        table[b] = sorted(times)[len(times) // 2]
    return table


def service_model(lengths):
    """(predict_ms over a batch, description, engine or None, per-bucket table in ms). One prompt per engine step
    (pipeline 1), so a batch costs the sum over its prompts."""
    from slope_jax.serve.scheduler import batch_predictor

    predict = None
    if FLAGS.service_model != "measured":
        try:
            from slope_jax.plan import predict  # the cost model of issue 9 item 1, once merged
        except ImportError:
            if FLAGS.service_model == "plan":
                raise
    if predict is not None:
        from slope_jax.model.config import ModelConfig
        from slope_jax.parallel import layout
        from slope_jax.parallel.config import ParallelConfig

        with open(os.path.join(FLAGS.checkpoint, "config.json")) as f:
            cfg = ModelConfig.from_hf_dict(json.load(f))
        par = ParallelConfig() if FLAGS.devices == "1" else ParallelConfig(ring=2, ulysses=4)

        def bucket(n):
            return layout.bucket_length(n, multiple=par.token_multiple)

        table = {bucket(n): float(predict(cfg, par, bucket(n), "cpu")["ttft_ms"]) for n in lengths}
        desc = "slope_jax.plan.predict(cfg, parallel, bucket, hardware='cpu')['ttft_ms'] per prompt, summed"
        return batch_predictor(lambda t, m: m * table[t], bucket), desc, None, table
    engine, _ = make_engine()
    table = measured_fit(engine, lengths)
    why = "chosen" if FLAGS.service_model == "measured" else "slope_jax.plan.predict not importable"
    desc = (f"measured fit ({why}): median-of-5 engine compute per bucket on this "
            f"CPU ({FLAGS.devices} device(s)), summed over the batch")
    return batch_predictor(lambda t, m: m * table[t], engine.bucket), desc, engine, table


def sweep(predict_ms, lengths, slo_ms, cap):
    from slope_jax.serve import simulate as sim

    def run(load, order, policy, seed, cv):
        trace = sim.poisson_trace(load * cap, FLAGS.duration_s, lengths, slo_ms=slo_ms, seed=seed)
        service = sim.noisy(predict_ms, cv, seed + 1) if cv > 0 else predict_ms
        return sim.simulate(trace, predict_ms, service_ms=service, batch_size=FLAGS.batch_size,
                            batch_wait_ms=FLAGS.batch_wait_ms, order=order, slo_policy=policy)

    # Predicted goodput: noise-free model, EDF + admission, another seed, loads in steps of 0.05x.
    goodput_load = 0.0
    for k in range(4, 41):
        load = k * 0.05
        if run(load, "edf", "reject", FLAGS.seed + 1000, 0.0).stats.attainment < 0.9:
            break
        goodput_load = load
    rows = []
    for load in [float(x) for x in FLAGS.loads]:
        row = {"load": load, "offered_rps": load * cap}
        for order, policy in POLICIES:
            r = run(load, order, policy, FLAGS.seed, FLAGS.noise_cv)
            rej = [x for x in r.records if x.get("rejected")]
            row[f"{order}_{policy}"] = dict(
                stats_row(r.stats), rejected_on_arrival=sum(not x["dropped"] for x in rej),
                rejected_before_deadline=sum(x["rejected_after_ms"] < x["ttft_slo_ms"] for x in rej))
        rows.append(row)
    return goodput_load, rows


def stats_row(st):
    return {"requests": st.requests, "attainment": st.attainment, "goodput_tokens_per_s": st.goodput_tokens_per_s,
            "goodput_rps": st.goodput_requests_per_s, "p50_ms": st.ttft_p50_ms, "p90_ms": st.ttft_p90_ms,
            "p99_ms": st.ttft_p99_ms, "served": st.served, "late": st.late, "rejected": st.rejected,
            "wall_s": st.wall_s}


def replay(engine, predict_ms, lengths, slo_ms, cap, load, order, policy, seed):
    """Real-time replay of a Poisson trace on the engine; returns (records, SLOStats)."""
    import numpy as np

    from slope_jax.serve.scheduler import OnlineCorrection, Pending, Scheduler, slo_stats
    from slope_jax.serve.simulate import poisson_trace

    trace = poisson_trace(load * cap, FLAGS.replay_s, lengths, slo_ms=slo_ms, seed=seed)
    rng = np.random.default_rng(seed)
    prompts = {r.id: rng.integers(0, engine.cfg.vocab_size, r.num_tokens) for r in trace}
    predict_ms = OnlineCorrection(predict_ms)
    sched = Scheduler(predict_ms, batch_size=FLAGS.batch_size, batch_wait_ms=FLAGS.batch_wait_ms, order=order,
                      slo_policy=policy)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    records, i, fut, batch_in_flight, compute = [], 0, None, [], []
    t0 = time.perf_counter()
    while True:
        now = time.perf_counter()
        while i < len(trace) and t0 + trace[i].arrival_s <= now:  # stamped at its (scheduled) arrival time
            r = trace[i]
            arr = t0 + r.arrival_s
            sched.add(Pending(r, r.id, r.num_tokens, arr, arr + slo_ms / 1e3))
            i += 1
        if fut is not None and fut.done():
            results = fut.result()
            for p, res in zip(batch_in_flight, results):
                records.append({"id": p.id, "num_tokens": p.num_tokens, "ttft_ms": res.ttft_ms,
                                "ttft_slo_ms": slo_ms, "predicted_ttft_ms": p.predicted_ttft_ms})
            # one engine step per prompt here: the batch's compute is the sum of its steps
            measured = sum(r.compute_ms for r in results)
            compute.append((measured, batch_in_flight[0].predicted_compute_ms))
            predict_ms.observe([p.num_tokens for p in batch_in_flight], measured)
            fut, batch_in_flight = None, []
            sched.finished(now)
        batch, rejected, wait_s = sched.take_batch(now, closed=i == len(trace))
        for p, reason in rejected:
            records.append({"id": p.id, "num_tokens": p.num_tokens, "ttft_slo_ms": slo_ms, "error": reason,
                            "rejected": True, "rejected_after_ms": (now - p.arrival_s) * 1e3, "dropped": p.dropped})
        if batch:
            batch_in_flight = batch
            fut = pool.submit(engine.prefill, [prompts[p.id] for p in batch], return_kv=False, top_k=1,
                              arrival_times=[p.arrival_s for p in batch])
            continue
        if i == len(trace) and fut is None and not sched.pending:
            break
        timeout = min(t0 + trace[i].arrival_s - now if i < len(trace) else 1.0, 1.0 if wait_s is None else wait_s)
        if fut is not None:
            concurrent.futures.wait([fut], timeout=max(timeout, 0.0))
        else:
            time.sleep(max(timeout, 0.0))
    pool.shutdown()
    wall = time.perf_counter() - t0
    return records, slo_stats(records, wall), compute


def _median(xs):
    return sorted(xs)[len(xs) // 2] if xs else None


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def main(argv):
    del argv
    load0 = start_load()
    if FLAGS.devices == "8":
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
    from slope_jax.serve import simulate as sim

    lengths = [int(x) for x in FLAGS.lengths]
    predict_ms, desc, engine, table = service_model(lengths)
    slo_ms = FLAGS.ttft_slo_ms or 5.0 * max(predict_ms([n]) for n in lengths)
    cap = sim.capacity_rps(predict_ms, lengths, FLAGS.batch_size)
    print(f"service model: {desc}")
    print("  predicted compute per bucket (ms): " + ", ".join(f"T={b}: {ms:.1f}" for b, ms in sorted(table.items())))
    print(f"length mix {lengths} (uniform); TTFT SLO {slo_ms:.1f} ms; batch_size {FLAGS.batch_size}, batch_wait "
          f"{FLAGS.batch_wait_ms} ms; predicted capacity {cap:.2f} req/s; noise cv {FLAGS.noise_cv}; "
          f"{FLAGS.duration_s:.0f} s per simulated trace")
    goodput_load, rows = sweep(predict_ms, lengths, slo_ms, cap)
    print(f"predicted goodput (noise-free model, EDF + admission, >= 90 % attainment): {goodput_load:.2f}x capacity "
          f"= {goodput_load * cap:.2f} req/s\n")
    hdr = f"{'load':>5} {'req/s':>7} | {'policy':<12} {'attain':>7} {'goodput tok/s':>13} {'p50':>8} {'p90':>8} " \
          f"{'p99':>8} {'served':>6} {'late':>5} {'reject':>6} {'(on arr.)':>9}"
    print(hdr)
    print("-" * len(hdr))
    checks = []
    for row in rows:
        for order, policy in POLICIES:
            s = row[f"{order}_{policy}"]
            print(f"{row['load']:>5.2f} {row['offered_rps']:>7.2f} | {order + '+' + policy:<12} "
                  f"{100 * s['attainment']:6.1f}% {s['goodput_tokens_per_s']:>13.0f} {fmt(s['p50_ms'], '8.1f')} "
                  f"{fmt(s['p90_ms'], '8.1f')} {fmt(s['p99_ms'], '8.1f')} {s['served']:>6} {s['late']:>5} "
                  f"{s['rejected']:>6} {s['rejected_on_arrival']:>9}")
        e = row["edf_reject"]
        if row["load"] <= goodput_load + 1e-9:
            checks.append((f"load {row['load']:.2f}x <= predicted goodput: EDF+admission attainment "
                           f"{100 * e['attainment']:.1f}% >= 90%", e["attainment"] >= 0.9))
        else:
            ok = (e["rejected"] > 0 and e["rejected_before_deadline"] == e["rejected"]
                  and e["late"] <= 0.05 * e["served"])
            checks.append((f"load {row['load']:.2f}x > predicted goodput: EDF+admission rejects {e['rejected']} early "
                           f"({e['rejected_on_arrival']} on arrival, all before their deadline: "
                           f"{e['rejected_before_deadline'] == e['rejected']}), late {e['late']}/{e['served']} "
                           f"served; FCFS attainment {100 * row['fcfs_none']['attainment']:.1f}%", ok))
    print()
    for text, ok in checks:
        print(("PASS " if ok else "FAIL ") + text)
    result = {"service_model": desc, "predicted_compute_ms_per_bucket": {str(k): v for k, v in table.items()},
              "lengths": lengths, "ttft_slo_ms": slo_ms, "batch_size": FLAGS.batch_size,
              "batch_wait_ms": FLAGS.batch_wait_ms, "capacity_rps": cap, "noise_cv": FLAGS.noise_cv,
              "duration_s": FLAGS.duration_s, "seed": FLAGS.seed, "predicted_goodput_load": goodput_load,
              "predicted_goodput_rps": goodput_load * cap, "sweep": rows,
              "checks": [{"check": t, "pass": ok} for t, ok in checks]}
    if FLAGS.replay:
        if engine is None:
            engine, _ = make_engine()
            measured = measured_fit(engine, lengths)
            print("measured per bucket (ms): " + ", ".join(f"T={b}: {ms:.1f}" for b, ms in sorted(measured.items())))
        print(f"\nreplay on the real engine ({FLAGS.devices} CPU device(s)), {FLAGS.replay_s:.0f} s per run:")
        print(f"{'load':>5} {'req/s':>7} | {'policy':<12} summary")
        result["replay"], replay_checks = [], []
        for load in [float(x) for x in FLAGS.replay_loads]:
            for order, policy in POLICIES:
                recs, st, compute = replay(engine, predict_ms, lengths, slo_ms, cap, load, order, policy,
                                           FLAGS.seed + 7)
                med = _median([c / p for c, p in compute])
                rej = [r for r in recs if r.get("rejected")]
                on_arrival = [r["rejected_after_ms"] for r in rej if not r["dropped"]]
                print(f"{load:>5.2f} {load * cap:>7.2f} | {order + '+' + policy:<12} {st.summary_line()}; "
                      f"rejected on arrival {len(on_arrival)} (median {fmt(_median(on_arrival), '.1f')} ms after "
                      f"it), dropped later {len(rej) - len(on_arrival)}; all rejections before the deadline: "
                      f"{all(r['rejected_after_ms'] < slo_ms for r in rej)}; measured/predicted batch compute "
                      f"median {fmt(med, '.2f')}")
                if order == "edf":
                    if load <= goodput_load + 1e-9:
                        replay_checks.append((f"replay {load:.2f}x <= predicted goodput: EDF+admission attainment "
                                              f"{100 * st.attainment:.1f}% >= 90%", st.attainment >= 0.9))
                    else:
                        replay_checks.append((
                            f"replay {load:.2f}x > predicted goodput: EDF+admission rejects {len(rej)} before their "
                            f"deadline ({len(on_arrival)} on arrival), late {st.late}/{st.served} served",
                            len(rej) > 0 and all(r["rejected_after_ms"] < slo_ms for r in rej)
                            and st.late <= 0.05 * max(st.served, 1)))
                result["replay"].append({"load": load, "offered_rps": load * cap, "order": order, "policy": policy,
                                         **stats_row(st), "measured_over_predicted_compute_median": med,
                                         "rejected_on_arrival": len(on_arrival),
                                         "rejected_on_arrival_median_ms_after": _median(on_arrival),
                                         "dropped_after_admission": len(rej) - len(on_arrival)})
        print()
        for text, ok in replay_checks:
            print(("PASS " if ok else "FAIL ") + text)
        result["replay_checks"] = [{"check": t, "pass": ok} for t, ok in replay_checks]
    write_result(FLAGS.out, result, load_start=load0)
    print(f"\nwrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
