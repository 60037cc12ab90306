"""Plan output: text tables, JSON, the PNG (matplotlib, Agg backend) and the scenario document."""

from __future__ import annotations

import os

from slope_jax.atomic import atomic_json, atomic_write

MiB, GiB = 2**20, 2**30
_LINKS = (("ulysses_all_to_all", "a2a"), ("ring_ppermute", "ring"), ("halo_ppermute", "halo"),
          ("pipeline_handoff", "pipe"), ("ep_dispatch", "EP"))


# The text table's columns (`table`), with what each holds; printed under the tables and in `--help`.
COLUMNS = (
    ("layout", "e.g. P4xR8xU1+EP8+C16 = 4 pipeline stages x ring 8 x Ulysses 1, expert-parallel degree 8 (no +EP: "
               "none), 16 sequence chunks per request (no +C: 1); the chosen layout is marked (* in the text "
               "tables, bold in the scenario document)"),
    ("TTFT ms", "predicted time to first token of one request on an idle cluster (M = 1 request in flight)"),
    ("loaded ms", "predicted time of one step with the pipeline full (M = P requests in flight, each waiting the "
                  "whole step; equals TTFT when P = 1); goodput takes the better of this and TTFT as the step"),
    ("GiB/dev", "predicted memory per device at M = 1: parameters + inputs + temporaries + KV export"),
    ("headroom", "GiB per device left of the usable memory (HBM x the profile's memory_fraction - its runtime "
                 "reserve for collective buffers and workspaces) at the larger of M = 1 and loaded; only layouts "
                 "with headroom >= 0 are listed and chosen"),
    ("a2a MB", "MB (1e6 bytes) each device sends per request over Ulysses all-to-alls"),
    ("ring MB", "... over ring-attention K/V ppermutes"),
    ("halo MB", "... over sliding-window halo ppermutes"),
    ("pipe MB", "... over pipeline stage hand-offs"),
    ("EP MB", "... over expert-parallel dispatch + combine (0 without EP)"),
    ("req/s", "goodput: the largest Poisson arrival rate at which the percentile of requests meets the SLO, "
              "queueing included (M/D/1 tail, slope_jax/plan/search.py); 0 = misses the SLO even when idle"),
    ("tok/s", "goodput in prompt tokens/s: req/s x length x percentile"),
    ("SLO", "meets / misses: TTFT <= the SLO"),
)


def column_key(width: int = 118) -> str:
    """The `COLUMNS` key as text lines of at most `width` characters (hanging indent)."""
    import textwrap

    pad = max(len(name) for name, _ in COLUMNS) + 2
    return "\n".join(textwrap.fill(text, width, initial_indent=f"  {name:<{pad}}",
                                    subsequent_indent=" " * (pad + 2)) for name, text in COLUMNS)


def table(entry: dict, hbm_bytes: float | None = None) -> str:
    """One length's table (columns: `COLUMNS`): every layout that fits memory (fastest first), then how many did
    not fit, then the chosen layout and why — or why none is. The heading states the memory budget
    (`entry["memory_budget"]` of `search.plan`; `hbm_bytes` only for entries without one)."""
    rows = sorted((r for r in entry["layouts"] if r["fits_memory"]), key=lambda r: r["ttft_ms"])
    head = (f"{'layout':<18} {'TTFT ms':>9} {'loaded ms':>10} {'GiB/dev':>8} {'headroom':>9} "
            + " ".join(f"{short + ' MB':>9}" for _, short in _LINKS) + f" {'req/s':>8} {'tok/s':>9}  SLO")
    budget = entry.get("memory_budget") or f"{(hbm_bytes or 0) / GiB:.0f} GiB per device"
    lines = [f"context {entry['length']} tokens, SLO {entry['slo_ms']:g} ms at p{entry['percentile'] * 100:g}, "
             f"{budget}", head, "-" * len(head)]
    for r in rows:
        mark = "*" if entry["chosen"] and r["layout"] == entry["chosen"]["layout"] else " "
        lines.append(f"{mark}{r['layout']:<17} {r['ttft_ms']:>9.0f} {r['loaded_step_ms']:>10.0f} "
                     f"{r['memory_bytes_per_device'] / GiB:>8.1f} {r['headroom_bytes'] / GiB:>9.1f} "
                     + " ".join(f"{r['link_bytes_per_device'][k] / 1e6:>9.0f}" for k, _ in _LINKS)
                     + f" {r['goodput_requests_per_s']:>8.3g} {r['goodput_tokens_per_s']:>9.3g}  "
                     + ("meets" if r["meets_slo"] else "misses"))
    skipped = len(entry["layouts"]) - len(rows)
    if skipped:
        lines.append(f"({skipped} layout(s) do not fit in the usable memory)")
    lines.append(("chosen: " + entry["chosen"]["layout"] + ": " if entry["chosen"] else "") + entry["reason"])
    return "\n".join(lines)


def write_json(path: str, result: dict) -> None:
    """Per length: every layout (feasible or not, with `fits_memory`, `meets_slo`), the feasible ones, the chosen.
    Creates `path`'s directory if needed."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_json(path, result)


def caption(model: str, cluster: str, slo_ms: float, percentile: float, efficiency) -> str:
    """The figure's caption: model, cluster, SLO and the efficiency factors with their source
    (`efficiency`: a `hardware.Efficiency`)."""
    return (f"Model: {model}. Cluster: {cluster}. SLO: TTFT <= {slo_ms:g} ms at p{percentile * 100:g}. "
            f"Efficiency: matmul {efficiency.matmul:.3g}, attention {efficiency.attention:.3g} of peak - "
            f"{efficiency.source or 'no source given'}. Predicted by slope_jax.plan, not measured.")


def figure_marks(entries: list[dict], per_length: int = 4) -> dict:
    """What the plan figure draws and marks, from `search.plan` entries (no matplotlib).

    Returns `{"layouts": [names drawn as TTFT lines], "lengths": [per length: {"length", "chosen" (layout name or
    None), "marked" (the layout whose point carries the label: the chosen one, or the fastest that fits memory when
    none meets the SLO, or None), "label" (the text drawn at that length: "chosen: <layout>, <ms> ms" or "none
    meets the SLO ..."), "bars": [(layout, goodput req/s)] for the goodput panel, best first}]}`.

    Per length, the goodput panel shows the chosen layout and the other layouts that fit memory and meet the SLO
    with the highest goodput, `per_length` in all; where none meets the SLO it shows no bars, only the label. The
    TTFT panel draws every layout named in a goodput panel (so each length's chosen one) and, where none meets the
    SLO, the fastest layout that fits memory.
    """
    drawn: list[str] = []
    marks = []
    for e in entries:
        fitting = [r for r in e["layouts"] if r["fits_memory"]]
        chosen = e["chosen"]["layout"] if e["chosen"] else None
        if chosen:  # the chosen bar first (search.plan's rule makes it the highest), then the best others
            others = sorted((r for r in fitting if r["meets_slo"] and r["layout"] != chosen),
                            key=lambda r: (-r["goodput_requests_per_s"], r["ttft_ms"]))
            bars = [(r["layout"], r["goodput_requests_per_s"]) for r in [e["chosen"], *others][:per_length]]
            label = f"chosen: {chosen}, {e['chosen']['ttft_ms']:.0f} ms"
            names = [b[0] for b in bars]
        else:
            fastest = sorted(fitting, key=lambda r: r["ttft_ms"])
            bars = []
            label = (f"none meets the SLO at {e['length']} tokens"
                     + (f" (fastest: {fastest[0]['layout']}, {fastest[0]['ttft_ms']:.0f} ms)" if fastest else
                        " (no layout fits in memory)"))
            names = [r["layout"] for r in fastest[:1]]
        drawn += [n for n in names if n not in drawn]
        marks.append({"length": e["length"], "chosen": chosen, "marked": names[0] if names else None,
                      "label": label, "bars": bars})
    return {"layouts": drawn, "lengths": marks}


def write_png(path: str, entries: list[dict], slo_ms: float, title: str, caption_text: str = "",
              tp: list[dict] | None = None) -> dict:
    """Plot `search.plan` entries and write the PNG atomically at `path`; returns `figure_marks(entries)` plus
    `"texts"`, every text drawn on the figure (title, caption, labels, annotations), so callers and tests can check
    what it marks.

    Left: predicted TTFT (ms, log scale) vs context length for the layouts of `figure_marks` (a layout's line is
    broken where it does not fit memory), the SLO line, optionally `tp` (one-host tensor-parallel rows of
    `model.predict_tensor_parallel`), and per length a star on the chosen layout labelled "chosen: …" or a cross on
    the fastest one labelled "none meets the SLO …". Right: goodput (requests/s) of the best layouts per length, the
    chosen bar outlined and labelled. Colours match between the panels. `caption_text` (see `caption`) goes under
    the panels.
    """
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    marks = figure_marks(entries)
    rows = {(e["length"], r["layout"]): r for e in entries for r in e["layouts"]}
    palette = plt.get_cmap("tab10" if len(marks["layouts"]) <= 10 else "tab20")
    colour = {k: palette(i % palette.N) for i, k in enumerate(marks["layouts"])}
    cap = textwrap.fill(caption_text, 190) if caption_text else ""
    n_bars = sum(max(len(m["bars"]), 1) + 1 for m in marks["lengths"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, max(5.5, 0.26 * n_bars + 2.2)),
                                   gridspec_kw={"width_ratios": [1.15, 1]})
    pct = entries[-1]["percentile"] * 100 if entries else 90
    _draw_ttft(ax1, entries, marks, rows, colour, slo_ms, pct, tp)
    _draw_goodput(ax2, marks, colour, slo_ms, pct)
    fig.suptitle(title)
    if cap:
        fig.text(0.01, 0.01, cap, fontsize=7.5, ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.025 * (cap.count("\n") + 1) + 0.01 if cap else 0, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    marks["texts"] = [t.get_text() for t in fig.findobj(matplotlib.text.Text) if t.get_text()]
    plt.close(fig)
    return marks


def _draw_ttft(ax1, entries: list[dict], marks: dict, rows: dict, colour: dict, slo_ms: float, pct: float,
               tp: list[dict] | None) -> None:
    """The left panel: TTFT per layout, the SLO line, the TP rows, the choice (or its absence) marked per length."""
    lengths = [e["length"] for e in entries]
    for k in marks["layouts"]:
        ys = [rows[n, k]["ttft_ms"] if (n, k) in rows and rows[n, k]["fits_memory"] else float("nan")
              for n in lengths]
        ax1.plot(lengths, ys, marker="o", ms=4, color=colour[k], label=k)
    if tp:
        ax1.plot([x["length"] for x in tp], [x["ttft_ms"] for x in tp], "k--", marker="s", ms=4,
                 label=tp[0]["layout"] + " (one host, for comparison)")
    ax1.axhline(slo_ms, color="red", linestyle=":", label=f"SLO {slo_ms:g} ms (p{pct:g})")
    for j, (e, m) in enumerate(zip(entries, marks["lengths"])):
        name = m["chosen"]
        y = rows[e["length"], m["marked"]]["ttft_ms"] if m["marked"] else slo_ms
        if name is None and m["marked"]:  # a cross on the fastest (when nothing fits memory: the label alone)
            ax1.plot([e["length"]], [y], marker="X", ms=13, color="red", mec="black", zorder=5, ls="none")
        elif name:
            ax1.plot([e["length"]], [y], marker="*", ms=18, color=colour[name], mec="black", zorder=5, ls="none")
        # labels sit below their point (the y range is widened for them), pushed inwards at the ends
        ax1.annotate(m["label"].replace(" (", "\n("), (e["length"], y), xytext=(0, -16), va="top",
                     textcoords="offset points", ha="center" if 0 < j < len(entries) - 1 else
                     ("left" if j == 0 else "right"), fontsize=8, fontweight="bold",
                     color="black" if name else "red",
                     bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="black" if name else "red", alpha=0.9))
    drawn_ms = ([r["ttft_ms"] for (_, k), r in rows.items() if k in colour and r["fits_memory"]] + [slo_ms]
                + [x["ttft_ms"] for x in tp or []])
    _ttft_axes(ax1, lengths, drawn_ms)


def _ttft_axes(ax1, lengths: list[int], drawn_ms: list[float]) -> None:
    """The left panel's axes: log-scale ms in plain numbers, the lengths as ticks, legend and title."""
    import matplotlib.ticker

    ax1.set_xlabel("context length (tokens)")
    ax1.set_ylabel("predicted TTFT (ms, log scale)")
    ax1.set_yscale("log")
    # plain numbers (2000, not 2 x 10^3: the axis is in ms); minor ticks labelled at 2, 3 and 5 x 10^k only
    ax1.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax1.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(
        lambda v, _: f"{v:g}" if f"{v:e}"[0] in "235" else ""))
    ax1.set_ylim(min(drawn_ms) / 1.9, max(drawn_ms) * 1.15)
    pad = 0.08 * (max(lengths) - min(lengths) or max(lengths))
    ax1.set_xlim(min(lengths) - pad, max(lengths) + pad)
    ax1.set_xticks(lengths, [str(n) for n in lengths])
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=7, loc="lower right")
    ax1.set_title("predicted TTFT per layout (star: chosen layout; X: none meets the SLO)", fontsize=10)


def _draw_goodput(ax2, marks: dict, colour: dict, slo_ms: float, pct: float) -> None:
    """The right panel: goodput of the best layouts per length, grouped by length, the chosen bar outlined."""
    y, ticks, labels = 0, [], []
    for m in marks["lengths"]:
        ax2.text(0, y, f"{m['length']} tokens", fontsize=9, fontweight="bold", va="center")
        y += 1
        if not m["bars"]:
            ax2.text(0, y, m["label"], fontsize=8, color="red", fontweight="bold", va="center")
            y += 1
        for k, rate in m["bars"]:
            chosen = k == m["chosen"]
            ax2.barh(y, rate, height=0.8, color=colour[k], edgecolor="black" if chosen else "none",
                     linewidth=2 if chosen else 0)
            if chosen:
                ax2.text(rate, y, "  chosen", va="center", fontsize=8, fontweight="bold")
            ticks.append(y)
            labels.append(k)
            y += 1
    ax2.set_yticks(ticks, labels, fontsize=8)
    ax2.set_ylim(y - 0.5, -0.7)
    ax2.set_xlim(0, 1.25 * max([r for m in marks["lengths"] for _, r in m["bars"]] or [1.0]))
    ax2.set_xlabel(f"goodput (requests/s with TTFT <= {slo_ms:g} ms at p{pct:g}, queueing included)")
    ax2.set_title("goodput of the best layouts per length", fontsize=10)
    ax2.grid(True, axis="x", alpha=0.3)
