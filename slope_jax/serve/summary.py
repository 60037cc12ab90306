"""The launcher's end-of-run summary (process 0, stderr): one row per result record, and count lines computed from
the same records the results file holds, so every count can be checked against it with `jq`/`grep`.

    id                        tokens  cached   first   TTFT ms    queue (compile)  compute   export  status
    corpus-600                   600       0     412   45012.3  44500.1  44390.2    512.2     21.0  ok, SLO missed
    invalid-token                                                                                    failed:
        line 6 (invalid-token): prompt 0: token id 5000 at index 2 is outside the vocabulary [0, 1024)
    6 records: 4 ok (1 SLO met, 2 late), 1 rejected, 1 failed; 2110 prompt tokens (0 from the prefix cache) in ...
    SLO attainment 20.0% (1/5); goodput ... served 4, late 2, rejected 1, failed 1; wall 95.1 s

An error is never cut: it goes on its own lines under its row, wrapped at `width` columns. The two count lines
are not wrapped (one line each, for grep). Count words mean one record
flag each: ok = no "error"; late = "late": true (served after its ttft_slo_ms); rejected = "rejected": true (refused
by admission); cancelled = "cancelled": true (the HTTP client disconnected before the prefill started: nothing
computed, not in SLO attainment; shown only when there are some); failed = every other error; SLO met =
"slo_met": true. Pure Python; no JAX.
"""

from __future__ import annotations

import textwrap
from typing import Sequence

from slope_jax.serve.scheduler import slo_stats

MAX_ROWS = 40  # rows shown; the count lines always cover every record
_HEAD = (f"{'id':<24} {'tokens':>7} {'cached':>7} {'first':>7} {'TTFT ms':>9} {'queue':>8} {'(compile)':>9} "
         f"{'compute':>8} {'export':>8}  status")


def _status(r: dict) -> str:
    if "error" in r:
        return "rejected:" if r.get("rejected") else "cancelled:" if r.get("cancelled") else "failed:"
    if r.get("slo_met") is None:
        return "ok"
    return "ok, SLO met" if r["slo_met"] else "ok, SLO missed (late)"


def _row(r: dict) -> str:
    if "error" in r:
        name = r.get("id") or f"(line {r.get('line')})"
        return f"{name:<24} {'':>7} {'':>7} {'':>7} {'':>9} {'':>8} {'':>9} {'':>8} {'':>8}  {_status(r)}"
    return (f"{r['id']:<24} {r['num_tokens']:>7} {r.get('cached_tokens', 0):>7} {r['first_token']:>7} "
            f"{r['ttft_ms']:>9.1f} {r['queue_ms']:>8.1f} {r['compile_ms']:>9.1f} {r['compute_ms']:>8.1f} "
            f"{r['export_ms']:>8.1f}  {_status(r)}")


def count_line(records: Sequence[dict], wall_s: float) -> str:
    """'N records: a ok (b SLO met, c late), d rejected, e failed; ...' over every record (flags as in the module
    docstring)."""
    ok = [r for r in records if "error" not in r]
    rejected = sum(1 for r in records if "error" in r and r.get("rejected"))
    cancelled = sum(1 for r in records if "error" in r and r.get("cancelled"))
    met = sum(1 for r in ok if r.get("slo_met") is True)
    late = sum(1 for r in records if r.get("late") is True)
    toks = sum(r["num_tokens"] for r in ok)
    cached = sum(r.get("cached_tokens", 0) for r in ok)
    return (f"{len(records)} records: {len(ok)} ok ({met} SLO met, {late} late), {rejected} rejected, "
            + (f"{cancelled} cancelled, " if cancelled else "")
            + f"{len(records) - len(ok) - rejected - cancelled} failed; {toks} prompt tokens ({cached} from the "
            f"prefix cache) in "
            f"{wall_s:.1f} s "
            f"({toks / max(wall_s, 1e-9):.0f} tokens/s including compilation)")


def format_summary(records: Sequence[dict], wall_s: float, width: int = 120) -> str:
    """The summary text (no trailing newline). records: the result records in the order written; wall_s: the run's
    wall time in seconds (> 0); width: wrap column for errors and count lines (>= 40)."""
    width = max(40, int(width))
    lines = [_HEAD]
    for r in records[:MAX_ROWS]:
        lines.append(_row(r))
        if "error" in r:  # whole, on its own lines
            lines += textwrap.wrap(str(r["error"]), width, initial_indent="    ", subsequent_indent="    ",
                                   break_on_hyphens=False) or ["    (no message)"]
    if len(records) > MAX_ROWS:
        lines.append(f"... {len(records) - MAX_ROWS} more records (in the results file)")
    lines += [count_line(records, wall_s), slo_stats(records, wall_s).summary_line()]
    return "\n".join(lines)
