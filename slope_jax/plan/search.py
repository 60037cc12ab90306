"""Layout search for a TTFT SLO: enumerate the layouts of a cluster, predict each, keep those that fit memory and
meet the SLO, pick the one with the best goodput.

Goodput model (stated approximation, checked by the scheduler's Poisson simulation): requests arrive as a Poisson
stream of rate λ; the server runs steps of up to `M` requests (M = 1, or the pipeline's in-flight count), each taking
the predicted step time `s_M`; utilisation `ρ = λ·s_M/M`. Waiting time tail: `P(W > x) ≈ ρ·exp(−2(1−ρ)·x/s_M)`
(Kingman's exponential approximation for an M/D/1 queue, whose service-time squared coefficient of variation is 0).
A request meets the SLO when `W + s_M ≤ SLO`; the goodput is the largest λ with `P(W > SLO − s_M) ≤ 1 − percentile`,
maximised over the two step sizes, and also reported in prompt tokens/s.
"""

from __future__ import annotations

import math

from slope_jax.model.config import ModelConfig
from slope_jax.parallel.config import LayoutError, ParallelConfig
from slope_jax.plan.hardware import Hardware, load
from slope_jax.plan.model import Prediction, predict


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


SEQ_CHUNK_OPTIONS = (1, 4, 8, 16)  # sequence chunks considered for pipelined layouts (P > 1)


def enumerate_layouts(cfg: ModelConfig, num_devices: int, devices_per_host: int, *, with_expert: bool = True,
                      seq_chunk_options=SEQ_CHUNK_OPTIONS) -> list[ParallelConfig]:
    """Every valid `(pipeline, ring, ulysses[, expert][, seq_chunks])` using all `num_devices`: the rules of
    `ParallelConfig.validate`, Ulysses inside a host (`ulysses` divides `devices_per_host`), EP degree 1 or R·U
    (when it divides E), and for P > 1 each of `seq_chunk_options` (sequence-pipelined prefill)."""
    out = []
    for p in _divisors(num_devices):
        for u in _divisors(num_devices // p):
            r = num_devices // (p * u)
            if devices_per_host % u:
                continue
            try:
                ParallelConfig(pipeline=p, ring=r, ulysses=u, expert=1).validate(cfg, num_devices)
            except LayoutError:
                continue
            experts = [1] + ([r * u] if with_expert and r * u > 1 and cfg.num_experts % (r * u) == 0 else [])
            for ep in experts:
                for c in (seq_chunk_options if p > 1 else (1,)):
                    out.append(ParallelConfig(pipeline=p, ring=r, ulysses=u, expert=ep, seq_chunks=c))
    return out


def max_rate(step_s: float, batch: int, slo_s: float, percentile: float) -> float:
    """Largest Poisson arrival rate (requests/s) at which `percentile` of requests meet `slo_s` (module docstring)."""
    slack = slo_s - step_s
    if step_s <= 0 or slack < 0:
        return 0.0
    miss = 1.0 - percentile

    def tail(rho):
        return rho * math.exp(-2 * (1 - rho) * slack / step_s)

    lo, hi = 0.0, 1.0 - 1e-9
    if tail(hi) <= miss:
        return hi * batch / step_s
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tail(mid) <= miss else (lo, mid)
    return lo * batch / step_s


def evaluate(cfg: ModelConfig, parallel: ParallelConfig, length: int, hardware: Hardware, *, slo_ms: float,
             percentile: float, devices_per_host: int, **kw) -> dict:
    """Prediction at M = 1 (idle TTFT) and at the pipeline's in-flight count, plus goodput; a JSON-ready dict."""
    one = predict(cfg, parallel, length, hardware, batch=1, devices_per_host=devices_per_host, **kw)
    rows = [one]
    if parallel.pipeline > 1:
        rows.append(predict(cfg, parallel, length, hardware, batch=parallel.in_flight,
                            devices_per_host=devices_per_host, **kw))
    rates = [max_rate(p.step_ms / 1e3, p.batch, slo_ms / 1e3, percentile) for p in rows]
    best = max(range(len(rows)), key=lambda i: rates[i])
    loaded = rows[-1]
    d = one.to_dict()
    d.update(goodput_requests_per_s=rates[best], goodput_tokens_per_s=rates[best] * length * percentile,
             goodput_batch=rows[best].batch, loaded_step_ms=loaded.step_ms, loaded_batch=loaded.batch,
             loaded_memory_bytes_per_device=loaded.memory_bytes_per_device,
             meets_slo=one.ttft_ms <= slo_ms, fits_memory=loaded.fits_memory and one.fits_memory,
             headroom_bytes=min(one.headroom_bytes, loaded.headroom_bytes))
    return d


def _gib(x: float) -> str:
    return f"{x / 2**30:.1f} GiB"


def _headroom(row: dict) -> str:
    """A row's memory and headroom, for reasons: "33.3 GiB per device, headroom 21.3 GiB of the 54.6 GiB usable"
    (memory: the larger of M = 1 and loaded)."""
    used = row["memory_limit_bytes"] - row["headroom_bytes"]
    return (f"{_gib(used)} per device, headroom {_gib(row['headroom_bytes'])} of the "
            f"{_gib(row['memory_limit_bytes'])} usable")


def plan(cfg: ModelConfig, hardware: str | Hardware, num_devices: int, devices_per_host: int, lengths, *,
         slo_ms: float, percentile: float = 0.9, layouts=None, with_expert: bool = True, **kw) -> list[dict]:
    """Per length: every layout's evaluation, the feasible ones, the chosen one and the reason (or why none).

    layouts: the candidates (default `enumerate_layouts`, with EP layouts unless `with_expert` is False); `kw` goes
    to `predict` (dtype, tiles, bucket, memory_limit_bytes). A layout fits when its memory at M = 1 and loaded is
    within the usable capacity (`Hardware.usable_bytes`: HBM × memory_fraction − runtime reserve, unless
    memory_limit_bytes is given); every row carries `headroom_bytes` (capacity − the larger of the two), and only a
    layout that fits is chosen. Raises LayoutError for a length above the model's `max_position_embeddings` (the
    engine refuses such a prompt, so no layout serves it).
    """
    too_long = [n for n in lengths if n > cfg.max_position_embeddings]
    if too_long:
        raise LayoutError(f"lengths {', '.join(map(str, too_long))}: above the model's max_position_embeddings="
                          f"{cfg.max_position_embeddings} (the longest prompt it serves)")
    hw = load(hardware)
    layouts = layouts or enumerate_layouts(cfg, num_devices, devices_per_host, with_expert=with_expert)
    out = []
    for n in lengths:
        rows = [evaluate(cfg, par, n, hw, slo_ms=slo_ms, percentile=percentile, devices_per_host=devices_per_host,
                         **kw) for par in layouts]
        fitting = [r for r in rows if r["fits_memory"]]
        feasible = [r for r in fitting if r["meets_slo"]]
        chosen = max(feasible, key=lambda r: (r["goodput_requests_per_s"], -r["ttft_ms"])) if feasible else None
        out.append({"length": n, "slo_ms": slo_ms, "percentile": percentile, "layouts": rows,
                    "feasible": [r["layout"] for r in feasible], "fitting": [r["layout"] for r in fitting],
                    "chosen": chosen, "reason": _reason(n, rows, fitting, feasible, chosen, slo_ms, percentile),
                    "memory_limit_bytes": rows[0]["memory_limit_bytes"] if rows else hw.usable_bytes,
                    "memory_budget": hw.memory_budget() if kw.get("memory_limit_bytes") is None else
                    f"{_gib(kw['memory_limit_bytes'])} per device (memory_limit_bytes)"})
    return out


def _reason(n: int, rows: list[dict], fitting: list[dict], feasible: list[dict], chosen: dict | None, slo_ms: float,
            percentile: float) -> str:
    """Why `chosen` (the feasible layout with the highest goodput), or why none is: the fastest that fits memory
    and how far it misses the SLO, or the smallest layout's memory against the usable capacity."""
    if chosen:
        return (f"meets {slo_ms:g} ms at p{percentile * 100:g} with the highest goodput "
                f"({chosen['goodput_requests_per_s']:.3g} req/s; predicted TTFT {chosen['ttft_ms']:.0f} ms; "
                f"{_headroom(chosen)}) among {len(feasible)} feasible of {len(rows)} layouts ({len(fitting)} fit "
                "memory)")
    if fitting:
        best = min(fitting, key=lambda r: r["ttft_ms"])
        return (f"no layout meets {slo_ms:g} ms at {n} tokens on this cluster; best is {best['layout']} at "
                f"{best['ttft_ms']:.0f} ms ({best['ttft_ms'] / slo_ms:.2f}x the SLO; {_headroom(best)})")
    least = min(rows, key=lambda r: r["memory_limit_bytes"] - r["headroom_bytes"]) if rows else None
    return (f"no layout fits in memory at {n} tokens on this cluster" + (
        f"; the smallest needs {_gib(least['memory_limit_bytes'] - least['headroom_bytes'])} per device "
        f"({least['layout']}) vs {_gib(least['memory_limit_bytes'])} usable" if least else ""))


def choose_layout(cfg: ModelConfig, hardware: str | Hardware, num_devices: int, devices_per_host: int, lengths,
                  ttft_slo_ms: float, percentile: float = 0.9, **kw) -> tuple[ParallelConfig, str, list[dict]]:
    """The layout for a length mix (for `--layout=auto`): the feasible layout with the best goodput at the longest
    length, i.e. the one whose SLO is hardest to meet; if none meets the SLO, the fastest that fits memory.

    `kw` goes to `plan` (e.g. `with_expert=False` where the engine has no expert parallelism, `memory_limit_bytes`,
    `dtype`). Returns `(ParallelConfig, reason, table)` with `table` the per-length `plan` output.
    Raises LayoutError when no layout fits in memory.
    """
    lengths = sorted(int(x) for x in lengths)
    table = plan(cfg, hardware, num_devices, devices_per_host, lengths, slo_ms=ttft_slo_ms, percentile=percentile,
                 **kw)
    hardest = table[-1]
    row = hardest["chosen"]
    if row is None:
        fitting = [r for r in hardest["layouts"] if r["fits_memory"]]
        if not fitting:
            raise LayoutError(hardest["reason"])
        row = min(fitting, key=lambda r: r["ttft_ms"])
    par = ParallelConfig.from_row(row)
    return par, f"{row['layout']} at {lengths[-1]} tokens: {hardest['reason']}", table


__all__ = ["Prediction", "choose_layout", "enumerate_layouts", "evaluate", "max_rate", "plan"]
