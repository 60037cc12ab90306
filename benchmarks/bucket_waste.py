"""Work spent on padding: a prompt of L tokens runs in its length bucket T = `layout.bucket_length(L)`; how much more
work is that than compiling the step at exactly L? (issue 21, "padding": ≤ 1.07× for every L ≥ 256.)

    python benchmarks/bucket_waste.py                                  # every L in 256..20000, ~10-20 min
    python benchmarks/bucket_waste.py --hi=4096 --tiles=256x256x128 --compile_lengths=257

Three parts, written to one JSON (default benchmarks/measured/cpu/bucket_waste.json):
  * model: for every L in [lo, hi], each config and each tile set, executed FLOPs of one device
    (`plan.flops.per_device`, the engine's single-device path: projections, blockwise attention over visited tiles,
    MoE tiles of the real tokens, head) at T over the same at exactly L; the worst ratio and where.
  * rows: for each mesh multiple M = 2·ring·ulysses·seq_chunks, the worst padded-row ratio T/L and its square (the
    bound on any work that grows at most with the square of the rows), and from which L on (T/L)² ≤ 1.07 holds.
  * compiled: compile-only (no run) on one device for a few lengths just above bucket boundaries, the XLA FLOPs of
    the bucket's program over the exact-length program's (`plan.verify.padding_work`: HLO dots × trip counts, and
    XLA's own cost_analysis).
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import start_load, write_result  # noqa: E402  (benchmarks/common.py)

FLAGS = flags.FLAGS
flags.DEFINE_list("configs", ["gpt-oss-20b", "gpt-oss-120b", "tiny", "tiny-hd64"], "Configs (configs/<name>.json).")
flags.DEFINE_list("tiles", ["256x256x512", "64x64x128", "16x16x16"],
                  "Tile sets q_tile x kv_tile x moe_tile: the engine's defaults (XLA attention), the Pallas GPU "
                  "blocks, small tiles (attention closest to the exact square).")
flags.DEFINE_integer("lo", 256, "Shortest prompt checked.")
flags.DEFINE_integer("hi", 20000, "Longest prompt checked.")
flags.DEFINE_list("multiples", ["1", "2", "4", "8", "16", "32", "64", "128", "6", "24", "48"],
                  "Mesh multiples 2·R·U·C for the row bound.")
flags.DEFINE_list("compile_lengths", ["257", "513", "1025", "2049"], "Lengths compiled (bucket vs exact).")
flags.DEFINE_string("compile_config", "tiny", "Config of the compiled check.")
flags.DEFINE_string("compile_tiles", "16x16x16", "Tiles of the compiled check.")
flags.DEFINE_float("bound", 1.07, "The target ratio.")
flags.DEFINE_string("out", "benchmarks/measured/cpu/bucket_waste.json", "JSON output path.")


def _tiles(spec: str):
    from slope_jax.plan import flops

    q, k, m = (int(x) for x in spec.split("x"))
    return flops.Tiles(q_tile=q, kv_tile=k, moe_tile=m)


def model_sweep(cfg, tiles, lo: int, hi: int) -> dict:
    """Worst per_device(bucket) / per_device(exact) over every L in [lo, hi]; also whether the exact-length work
    is non-decreasing in L (then each bucket's worst case is its shortest length)."""
    from slope_jax.parallel import layout
    from slope_jax.plan import flops

    buckets: set[int] = set()
    worst, prev, monotone = (0.0, 0), 0.0, True
    for n in range(lo, hi + 1):
        t = layout.bucket_length(n)
        buckets.add(t)
        # the bucket's program at n real tokens: MoE runs the real tokens only (pads are routed to no expert)
        padded = flops.per_device(cfg, 1, 1, 1, t, n, 1, tiles)["total"] if t != n else None
        exact = flops.per_device(cfg, 1, 1, 1, n, n, 1, tiles)["total"]
        monotone &= exact >= prev
        prev = exact
        ratio = (padded / exact) if padded is not None else 1.0
        worst = max(worst, (ratio, n))
    return {"worst_ratio": worst[0], "worst_length": worst[1], "worst_bucket": layout.bucket_length(worst[1]),
            "exact_work_non_decreasing": bool(monotone), "buckets": len(buckets)}


def row_sweep(multiple: int, lo: int, hi: int, bound: float) -> dict:
    from slope_jax.parallel import layout

    worst, holds_from = (0.0, 0), lo
    for n in range(lo, hi + 1):
        r = layout.bucket_length(n, multiple) / n
        worst = max(worst, (r, n))
        if r * r > bound:
            holds_from = n + 1
    return {"multiple": multiple, "worst_row_ratio": worst[0], "worst_length": worst[1],
            "worst_row_ratio_squared": worst[0] ** 2, "square_within_bound_from": holds_from,
            "programs": len({layout.bucket_length(n, multiple) for n in range(lo, hi + 1)})}


def compiled_check(name: str, tiles, lengths: list[int]) -> list[dict]:
    import jax

    from slope_jax.checkpoints import writer
    from slope_jax.model.config import ModelConfig
    from slope_jax.parallel.config import ParallelConfig
    from slope_jax.plan import verify
    from slope_jax.serve.engine import PrefillEngine

    jax.config.update("jax_default_matmul_precision", "highest")
    cfg = ModelConfig.from_json(f"configs/{name}.json")
    eng = PrefillEngine(cfg, writer.random_params(cfg, 0), ParallelConfig(), "float32", q_tile=tiles.q_tile,
                        kv_tile=tiles.kv_tile, moe_tile=tiles.moe_tile)
    rows = []
    for n in lengths:
        t0 = time.perf_counter()
        row = verify.padding_work(eng, n)
        row.update(config=name, tiles=tiles.to_dict(), seconds=time.perf_counter() - t0)
        rows.append(row)
        print(f"compiled {name} L={n} T={row['bucket']}: XLA FLOPs ratio {row['xla_ratio']:.4f}, "
              f"cost_analysis ratio {row['cost_analysis_ratio']:.4f}", flush=True)
        eng._compiled.clear()
    return rows


def main(argv):
    del argv
    from slope_jax.model.config import ModelConfig
    from slope_jax.parallel import layout

    load0 = start_load()
    out = {"lo": FLAGS.lo, "hi": FLAGS.hi, "bound": FLAGS.bound, "fine_from": layout.FINE_FROM,
           "buckets_per_octave": layout.BUCKETS_PER_OCTAVE, "model": [], "rows": [], "compiled": []}
    for m in (int(x) for x in FLAGS.multiples):
        r = row_sweep(m, FLAGS.lo, FLAGS.hi, FLAGS.bound)
        out["rows"].append(r)
        print(f"rows M={m:>3}: worst T/L {r['worst_row_ratio']:.4f} at L={r['worst_length']} "
              f"(squared {r['worst_row_ratio_squared']:.4f}); (T/L)^2 <= {FLAGS.bound} from "
              f"L={r['square_within_bound_from']}; {r['programs']} programs in [{FLAGS.lo}, {FLAGS.hi}]", flush=True)
    for name in FLAGS.configs:
        cfg = ModelConfig.from_json(f"configs/{name}.json")
        for spec in FLAGS.tiles:
            t0 = time.perf_counter()
            r = model_sweep(cfg, _tiles(spec), FLAGS.lo, FLAGS.hi)
            r.update(config=name, tiles=spec, seconds=time.perf_counter() - t0)
            out["model"].append(r)
            print(f"model {name:<13} tiles {spec:<12} worst {r['worst_ratio']:.4f} at L={r['worst_length']} "
                  f"(T={r['worst_bucket']}), exact work non-decreasing: {r['exact_work_non_decreasing']} "
                  f"[{r['seconds']:.0f} s]", flush=True)
            write_result(FLAGS.out, out, load_start=load0)
    if FLAGS.compile_lengths:
        out["compiled"] = compiled_check(FLAGS.compile_config, _tiles(FLAGS.compile_tiles),
                                         [int(x) for x in FLAGS.compile_lengths])
    worst = max([r["worst_ratio"] for r in out["model"]] + [r["xla_ratio"] for r in out["compiled"]]
                + [r["cost_analysis_ratio"] for r in out["compiled"]], default=0.0)
    out["worst_ratio"] = worst
    out["within_bound"] = worst <= FLAGS.bound
    print(f"worst ratio over everything checked: {worst:.4f} (bound {FLAGS.bound})")
    write_result(FLAGS.out, out, load_start=load0)
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
