"""Before/after check of single-device CPU prefill throughput: `benchmarks/prefill_cpu.py` of a base revision and of
this tree, run alternately in one session, so that a slower machine moment hits both sides alike.

    python benchmarks/prefill_cpu_ab.py --base=73a076c --rounds=2          # lengths 512, 2048 (mid-size config)

The base revision is checked out into a temporary git worktree (removed afterwards); each side runs its own
`prefill_cpu.py` in a child process with its own tree first on PYTHONPATH. Per side and length the best tokens/s
over the rounds is kept, next to the MFU (against the XLA float32 matmul peak that each child measures in the same
run), which factors out machine-speed drift between children. Prints a table (head / base ratios) and writes JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("base", "73a076c", "Base git revision (the 'before' side).")
flags.DEFINE_integer("rounds", 2, "Alternating rounds (each runs base, then head).")
flags.DEFINE_list("lengths", ["512", "2048"], "Prompt lengths.")
flags.DEFINE_integer("repeats", 3, "Timed runs per length inside each child (best is kept).")
flags.DEFINE_string("out", "benchmarks/results/prefill_cpu_ab.json", "JSON output path.")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from common import start_load, write_result  # noqa: E402  (benchmarks/common.py)


def _run_side(tree: str, out: str) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, os.path.join(tree, "benchmarks", "prefill_cpu.py"), f"--lengths={','.join(FLAGS.lengths)}",
           f"--repeats={FLAGS.repeats}", f"--out={out}"]
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def main(argv):
    del argv
    load0 = start_load()
    base_commit = subprocess.run(["git", "-C", REPO, "rev-parse", FLAGS.base], capture_output=True, text=True,
                                 check=True).stdout.strip()
    runs: dict[str, list[dict]] = {"base": [], "head": []}
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = os.path.join(tmp, "base")
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", base_tree, FLAGS.base], check=True,
                       capture_output=True)
        try:
            for r in range(FLAGS.rounds):
                for side, tree in (("base", base_tree), ("head", REPO)):
                    res = _run_side(tree, os.path.join(tmp, f"{side}-{r}.json"))
                    runs[side].append(res)
                    print(f"round {r} {side}: " + ", ".join(
                        f"T={x['tokens']} {x['tokens_per_s']:.0f} tok/s MFU {x['mfu_vs_xla_peak']:.1%}"
                        for x in res["prefill"]), flush=True)
        finally:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", base_tree], capture_output=True)
    table = []
    for t in (int(x) for x in FLAGS.lengths):
        row = {"tokens": t}
        for side in ("base", "head"):
            rows = [x for res in runs[side] for x in res["prefill"] if x["tokens"] == t]
            row[f"{side}_tokens_per_s"] = max(x["tokens_per_s"] for x in rows)
            row[f"{side}_mfu"] = max(x["mfu_vs_xla_peak"] for x in rows)
        row["tokens_per_s_ratio"] = row["head_tokens_per_s"] / row["base_tokens_per_s"]
        row["mfu_ratio"] = row["head_mfu"] / row["base_mfu"]
        table.append(row)
    print(f"\nbase {FLAGS.base} vs head, best of {FLAGS.rounds} rounds x {FLAGS.repeats} repeats")
    print(f"{'T':>6} {'base tok/s':>11} {'head tok/s':>11} {'ratio':>6} {'base MFU':>9} {'head MFU':>9} {'ratio':>6}")
    for r in table:
        print(f"{r['tokens']:>6} {r['base_tokens_per_s']:>11.1f} {r['head_tokens_per_s']:>11.1f} "
              f"{r['tokens_per_s_ratio']:>6.3f} {r['base_mfu']:>9.1%} {r['head_mfu']:>9.1%} {r['mfu_ratio']:>6.3f}")
    write_result(FLAGS.out, {"base": FLAGS.base, "base_commit": base_commit, "rounds": FLAGS.rounds, "table": table,
                             "runs": runs}, load_start=load0, indent=2)
    print(f"\nwrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
