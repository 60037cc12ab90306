"""Plan output: text tables, JSON, the PNG (matplotlib, Agg backend) and the scenario document."""

from __future__ import annotations

import os

from slope_jax.atomic import atomic_json, atomic_write

MiB, GiB = 2**20, 2**30
_LINKS = (("ulysses_all_to_all", "a2a"), ("ring_ppermute", "ring"), ("halo_ppermute", "halo"),
          ("pipeline_handoff", "pipe"), ("ep_dispatch", "EP"))


def table(entry: dict, hbm_bytes: float) -> str:
    """One length's table: every layout that fits memory (fastest first), then how many did not fit."""
    rows = sorted((r for r in entry["layouts"] if r["fits_memory"]), key=lambda r: r["ttft_ms"])
    head = (f"{'layout':<18} {'TTFT ms':>9} {'loaded ms':>10} {'GiB/dev':>8} "
            + " ".join(f"{short + ' MB':>9}" for _, short in _LINKS) + f" {'req/s':>8} {'tok/s':>9}  SLO")
    lines = [f"context {entry['length']} tokens, SLO {entry['slo_ms']:g} ms at p{entry['percentile'] * 100:g}, "
             f"{hbm_bytes / GiB:.0f} GiB per device", head, "-" * len(head)]
    for r in rows:
        mark = "*" if entry["chosen"] and r["layout"] == entry["chosen"]["layout"] else " "
        lines.append(f"{mark}{r['layout']:<17} {r['ttft_ms']:>9.0f} {r['loaded_step_ms']:>10.0f} "
                     f"{r['memory_bytes_per_device'] / GiB:>8.1f} "
                     + " ".join(f"{r['link_bytes_per_device'][k] / 1e6:>9.0f}" for k, _ in _LINKS)
                     + f" {r['goodput_requests_per_s']:>8.3g} {r['goodput_tokens_per_s']:>9.3g}  "
                     + ("meets" if r["meets_slo"] else "misses"))
    skipped = len(entry["layouts"]) - len(rows)
    if skipped:
        lines.append(f"({skipped} layout(s) do not fit in memory)")
    lines.append(("chosen: " + entry["chosen"]["layout"] + ": " if entry["chosen"] else "") + entry["reason"])
    return "\n".join(lines)


def write_json(path: str, result: dict) -> None:
    """Per length: every layout (feasible or not, with `fits_memory`, `meets_slo`), the feasible ones, the chosen."""
    atomic_json(path, result)


def write_png(path: str, entries: list[dict], slo_ms: float, title: str, tp: list[dict] | None = None) -> None:
    """Predicted TTFT vs context length per layout (with the SLO line) and goodput per layout and length.
    Only layouts that fit memory at every length are drawn (up to the 10 fastest)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [e["length"] for e in entries]
    by_layout: dict[str, list[dict]] = {}
    for e in entries:
        for r in e["layouts"]:
            by_layout.setdefault(r["layout"], []).append(r)
    keep = [k for k, v in by_layout.items() if len(v) == len(entries) and all(r["fits_memory"] for r in v)]
    keep = sorted(keep, key=lambda k: by_layout[k][-1]["ttft_ms"])[:10]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for k in keep:
        ax1.plot(lengths, [r["ttft_ms"] / 1e3 for r in by_layout[k]], marker="o", label=k)
    if tp:
        ax1.plot([x["length"] for x in tp], [x["ttft_ms"] / 1e3 for x in tp], "k--", marker="s",
                 label=tp[0]["layout"] + " (one host)")
    ax1.axhline(slo_ms / 1e3, color="red", linestyle=":", label=f"SLO {slo_ms:g} ms")
    ax1.set_xlabel("context length (tokens)")
    ax1.set_ylabel("predicted TTFT (s)")
    ax1.set_yscale("log")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=7)
    ax1.set_title("predicted TTFT per layout")
    height = 0.8 / len(entries)
    for j, e in enumerate(entries):
        rate = {r["layout"]: r["goodput_requests_per_s"] for r in e["layouts"]}
        ax2.barh([i + j * height for i in range(len(keep))], [rate[k] for k in keep], height=height,
                 label=f"{e['length']} tokens")
    ax2.set_yticks([i + 0.4 - height / 2 for i in range(len(keep))], keep)
    ax2.invert_yaxis()
    ax2.set_xlabel(f"goodput (requests/s meeting {slo_ms:g} ms at p{entries[-1]['percentile'] * 100:g}; 0 = misses)")
    ax2.set_title("goodput per layout")
    ax2.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
