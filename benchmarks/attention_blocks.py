"""Block-size sweep of the Pallas flash-attention kernel on one device (GPU): which (block_q, block_k, num_warps,
num_stages) runs a gpt-oss full-attention layer fastest.

    PYTHONPATH=. python3 benchmarks/attention_blocks.py --out /tmp/attention_blocks.json

Times `kernels.flash_attention.flash_partial` alone (bf16 q/k/v `[T, 64, 64]` / `[T, 8, 64]`, causal, the KV block
ranges that `attention.attend` would pass), best of `--repeats` after one warm-up; reports ms and the achieved
TFLOP/s over the visible pairs (`4·N·H` FLOPs per pair, `slope_jax.plan.flops.visible_pairs`). Each configuration in
its own try/except (a configuration Triton rejects, e.g. for shared memory, is recorded and skipped).
"""

from __future__ import annotations

import itertools
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import best_jax_seconds, start_load, write_result  # noqa: E402  (benchmarks/common.py)

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "benchmarks/results/attention_blocks.json", "JSON output path.")
flags.DEFINE_list("lengths", ["8192", "32768"], "Sequence lengths.")
flags.DEFINE_integer("repeats", 5, "Timed runs per configuration (best reported).")
flags.DEFINE_list("blocks", ["64x32", "64x64", "128x32", "128x64", "128x128"], "block_q x block_k pairs.")
flags.DEFINE_list("warps", ["4", "8"], "Triton num_warps values.")
flags.DEFINE_list("stages", ["2", "3"], "Triton num_stages values.")


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp

    from slope_jax.kernels import flash_attention as fa
    from slope_jax.model import attention as attn
    from slope_jax.plan import flops

    load0 = start_load()
    n, kh, d = 64, 8, 64
    rows = []
    for t in (int(x) for x in FLAGS.lengths):
        ks = jax.random.split(jax.random.key(t), 3)
        q = jax.random.normal(ks[0], (t, n, d), jnp.bfloat16)
        k = jax.random.normal(ks[1], (t, kh, d), jnp.bfloat16)
        v = jax.random.normal(ks[2], (t, kh, d), jnp.bfloat16)
        pos = jnp.arange(t, dtype=jnp.int32)
        window = jnp.int32(attn.NO_WINDOW)
        pair_flops = 4 * n * d * flops.visible_pairs(t, None)
        for blk, warps, stages in itertools.product(FLAGS.blocks, FLAGS.warps, FLAGS.stages):
            bq, bk = (int(x) for x in blk.split("x"))
            row = {"tokens": t, "block_q": bq, "block_k": bk, "num_warps": int(warps), "num_stages": int(stages)}
            try:
                rng = attn._kv_tile_range(pos.reshape(-1, bq), pos.reshape(-1, bk), window)
                f = jax.jit(lambda q, k, v, rng, bq=bq, bk=bk, w=int(warps), s=int(stages): fa.flash_partial(
                    q, k, v, pos, pos, rng, window, block_q=bq, block_k=bk, num_warps=w, num_stages=s))
                best = best_jax_seconds(f, (q, k, v, rng), FLAGS.repeats)
                row.update(ms=best * 1e3, tflops=pair_flops / best / 1e12)
                print(f"T={t} {bq}x{bk} warps={warps} stages={stages}: {best * 1e3:.2f} ms, "
                      f"{pair_flops / best / 1e12:.0f} TFLOP/s", flush=True)
            except Exception as e:  # noqa: BLE001 - record and continue
                row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
                print(f"T={t} {bq}x{bk} warps={warps} stages={stages}: ERROR {type(e).__name__}", flush=True)
            rows.append(row)
    doc = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "heads": [n, kh], "head_dim": d,
           "rows": rows}
    write_result(FLAGS.out, doc, load_start=load0)
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
