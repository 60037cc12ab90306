"""The "loop" MoE's tile ladder (`options.moe_loop_tiles`) against one tile height: one MoE layer of the peer config,
timed in one process with the variants interleaved (round-robin, best of `--repeats`), and the bf16 expert matmul's
FLOP rate by tile height.

    python benchmarks/moe_ladder.py                                  # 608, 2048, 8192 tokens, ~4 min on 2 idle cores
    python benchmarks/moe_ladder.py --lengths=608 --variants=128:1,128,512 --repeats=11

Variants `TILE[:1]`: `moe_tile` TILE with the ladder (the engine's compute), or with `:1` one height only (every
expert's group in whole tiles of TILE rows: the engine before the ladder, and the Pallas kernel's padding). Each
row reports the best seconds, the expert-matmul rows executed for this routing (`options.moe_loop_rows` over the
measured per-expert counts) and the FLOP rate of those rows. Why: an expert's group pads to whole tiles, so one
height either wastes rows (short prompts: ~152 rows per expert padded to 256 at 600 tokens, tile 128) or runs short,
slow matmuls; the ladder runs tall tiles and pads < 8 rows. Random router and expert weights of the peer config
(configs/peer-hd64.json: D = I = 1152, 16 experts, top-4), bf16 with float32 accumulation as the step. Prints a
table and writes JSON (default benchmarks/results/moe_ladder.json).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from slope_jax import xla_env  # noqa: E402  (no JAX)

xla_env.configure(cpu_devices=1)

from absl import app, flags  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from common import best_seconds, start_load, write_result  # noqa: E402  (benchmarks/common.py)

FLAGS = flags.FLAGS
flags.DEFINE_list("lengths", ["608", "2048", "8192"], "Tokens of the MoE layer's input.")
flags.DEFINE_list("variants", ["128:1", "128", "512"], "moe_tile values; ':1' = one tile height (no ladder).")
flags.DEFINE_integer("repeats", 9, "Interleaved rounds; the best time per variant is kept.")
flags.DEFINE_list("dot_rows", ["8", "32", "128", "256", "512"], "Row counts of the expert-matmul rate table.")
flags.DEFINE_string("config", os.path.join(REPO, "configs", "peer-hd64.json"), "HF-style config.json.")
flags.DEFINE_string("out", "benchmarks/results/moe_ladder.json", "JSON output path.")


def _best_interleaved(fns: dict, args: tuple, repeats: int) -> dict[str, float]:
    import jax

    for f in fns.values():
        jax.block_until_ready(f(*args))
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def main(argv):
    del argv
    load0 = start_load()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from slope_jax.model import moe as moe_lib
    from slope_jax.model import options as options_lib
    from slope_jax.model.config import ModelConfig

    cfg = ModelConfig.from_json(FLAGS.config)
    D, I, E, k = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.experts_per_token
    rng = np.random.default_rng(0)
    p = {"router_w": jnp.asarray(rng.standard_normal((E, D)) * 0.05, jnp.bfloat16),
         "router_b": jnp.zeros((E,), jnp.bfloat16),
         "w1": jnp.asarray(rng.standard_normal((E, 2 * I, D)) * 0.02, jnp.bfloat16),
         "w2": jnp.asarray(rng.standard_normal((E, D, I)) * 0.02, jnp.bfloat16),
         "b1": jnp.zeros((E, 2 * I), jnp.bfloat16), "b2": jnp.zeros((E, D), jnp.bfloat16)}
    flop_per_row = 2 * D * 2 * I + 2 * I * D

    # bf16 expert matmul rate by rows (W1 of one expert, (out, in) as the step holds it)
    w1 = p["w1"][0]
    dot = jax.jit(lambda x, w: jnp.einsum("td,od->to", x, w, preferred_element_type=jnp.float32))
    dot_rate = {}
    for m in map(int, FLAGS.dot_rows):
        x = jnp.asarray(rng.standard_normal((m, D)), jnp.bfloat16)
        jax.block_until_ready(dot(x, w1))
        s = best_seconds(lambda: jax.block_until_ready(dot(x, w1)), 3 * FLAGS.repeats)
        dot_rate[m] = 2 * m * D * 2 * I / s
    print("bf16 expert matmul [rows, D] x [2I, D]^T: " + ", ".join(f"{m} rows {r / 1e9:.0f} GFLOP/s"
                                                                  for m, r in dot_rate.items()))

    rows_out = []
    for t in map(int, FLAGS.lengths):
        h = jnp.asarray(rng.standard_normal((t, D)), jnp.bfloat16)
        valid = jnp.ones((t,), bool)
        _, ids = moe_lib.route_valid(h, valid, p, k)
        counts = np.bincount(np.asarray(ids).reshape(-1), minlength=E)[:E]
        fns, ladders = {}, {}
        for v in FLAGS.variants:
            tile, _, one = v.partition(":")
            tile = int(tile)
            saved = options_lib.MOE_LADDER_MIN
            if one == "1":
                options_lib.MOE_LADDER_MIN = 1 << 30  # the ladder stops at its first height
            try:
                ladders[v] = options_lib.moe_loop_tiles(tile, t * k)
                f = jax.jit(lambda h, p, tile=tile: moe_lib.moe(h, valid, p, experts_per_token=k,
                                                               alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit,
                                                               tile=tile, impl="loop"))
                jax.block_until_ready(f(h, p))  # traced (and its ladder fixed) now
            finally:
                options_lib.MOE_LADDER_MIN = saved
            fns[v] = f
        best = _best_interleaved(fns, (h, p), FLAGS.repeats)
        print(f"\nT={t}: {t * k} assignments, rows per expert {counts.min()}..{counts.max()}")
        print(f"{'variant':>9} {'ladder':>18} {'rows':>7} {'ms':>8} {'GFLOP/s':>8} {'vs first':>8}")
        first = best[FLAGS.variants[0]]
        for v in FLAGS.variants:
            rows = sum(sum(options_lib.moe_loop_rows(int(c), ladders[v]).values()) for c in counts)
            rate = rows * flop_per_row / best[v]
            print(f"{v:>9} {str(ladders[v]):>18} {rows:>7} {best[v] * 1e3:>8.1f} {rate / 1e9:>8.0f} "
                  f"{best[v] / first:>8.2f}")
            rows_out.append({"tokens": t, "variant": v, "ladder": list(ladders[v]), "rows": rows,
                             "assignments": t * k, "seconds": best[v], "gflops": rate / 1e9,
                             "vs_first": best[v] / first})
    out = {"config": os.path.relpath(FLAGS.config, REPO), "repeats": FLAGS.repeats, "cpus": os.cpu_count(),
           "loadavg_end": os.getloadavg()[0], "dot_gflops_by_rows": {str(m): r / 1e9 for m, r in dot_rate.items()},
           "rows": rows_out}
    write_result(FLAGS.out, out, load_start=load0)
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
