"""Context-parallel balance and collective traffic, checked on the compiled program.

    python benchmarks/cp_traffic.py                      # gpt-oss attention shapes, 8 CPU devices
    python benchmarks/cp_traffic.py --tokens 16384 --work_tokens 2048

For each layout (pipeline, ring, ulysses) of 8 devices:
  * collective operand bytes per device, read from the compiled HLO (all-to-all, collective-permute, all-gather,
    all-reduce; ops in loops × their known trip counts) vs. the analytic formula of `slope_jax.plan.traffic`, in
    total and for sliding-window layers alone (which must move only their halo: no all-to-all, no ring);
  * attention work per device — score entries actually computed (visited tiles × tile area), reported by the
    compiled program itself through `attention.count_work` callbacks — as max/mean over devices.
Prints a table and writes JSON (default benchmarks/results/cp_traffic.json).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from absl import app, flags  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import start_load, write_result  # noqa: E402  (benchmarks/common.py)

FLAGS = flags.FLAGS
flags.DEFINE_integer("tokens", 8192, "Padded prompt length for the traffic check (compile only).")
flags.DEFINE_integer("work_tokens", 2048, "Prompt length for the measured attention-work run.")
flags.DEFINE_list("layouts", ["1x8x1", "1x4x2", "1x2x4", "1x1x8", "2x2x2", "2x4x1"],
                  "Comma-separated layouts, each pipeline x ring x ulysses.")
flags.DEFINE_enum("dtype", "float32", ["bfloat16", "float32"],
                  "Activation dtype. XLA:CPU moves bf16 collectives as float32; the formula is evaluated at the "
                  "width the backend uses, and `wire` at the model dtype.")
flags.DEFINE_integer("tile", 256, "Attention tile size.")
flags.DEFINE_string("out", "benchmarks/results/cp_traffic.json", "JSON output path.")

# gpt-oss attention: 64 query heads, 8 KV heads, head_dim 64, window 128; a narrow MoE to keep the CPU run short.
SHAPES = dict(num_hidden_layers=4, num_experts=8, experts_per_token=4, vocab_size=2048, hidden_size=512,
              intermediate_size=256, num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128)


def measure(cfg, params, layout, tokens, work_tokens, dtype, tile):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from slope_jax.model import attention
    from slope_jax.parallel.config import ParallelConfig
    from slope_jax.plan import traffic
    from slope_jax.serve.engine import PrefillEngine

    p, r, u = layout
    # experts replicated (EP = 1): this benchmark checks the attention traffic; EP traffic is benchmarks/ep_memory.py
    par = ParallelConfig(pipeline=p, ring=r, ulysses=u, expert=1)
    eng = PrefillEngine(cfg, params, par, dtype, q_tile=tile, kv_tile=tile, moe_tile=128)
    m = par.in_flight
    hlo = eng.compiled(tokens, m).as_text()
    meas = traffic.hlo_bytes_by_scope(hlo)
    width = traffic.collective_element_bytes(jnp.dtype(dtype), jax.default_backend())
    pred = traffic.analytic_bytes(cfg, par, tokens, m, eng.plan.slots_per_stage, width)
    wire_model_dtype = traffic.analytic_bytes(cfg, par, tokens, m, eng.plan.slots_per_stage,
                                              jnp.dtype(dtype).itemsize)["wire"]
    sliding_kinds = sorted({c.kind for c in traffic.hlo_collectives(hlo) if c.scope == "sliding_layer"})

    work_eng = PrefillEngine(cfg, params, par, dtype, q_tile=tile, kv_tile=tile, moe_tile=128)
    with attention.count_work({"pipeline": p, "ring": r, "ulysses": u}) as counter:
        ids = np.random.default_rng(0).integers(0, cfg.vocab_size, work_tokens)
        work_eng.prefill([ids] * m, return_kv=False)
    work = np.array([counter.work[d] for d in range(p * r * u)])
    # devices of one pipeline stage share a sequence; compare within each stage
    per_stage = work.reshape(p, r * u)
    imbalance = float((per_stage.max(1) / per_stage.mean(1)).max())
    return {"layout": {"pipeline": p, "ring": r, "ulysses": u}, "tokens": tokens, "requests_in_flight": m,
            "hlo_bytes": meas, "analytic_bytes": pred,
            "ratio_total": meas.get("total", 0) / pred["total"] if pred["total"] else 1.0,
            "sliding_hlo_bytes": meas.get("sliding_layer", 0), "sliding_analytic_bytes": pred["sliding_layer"],
            "sliding_collective_kinds": sliding_kinds, "collective_element_bytes": width,
            "wire_bytes_at_model_dtype": wire_model_dtype,
            "work_tokens": work_tokens, "attention_work_per_device": work.tolist(),
            "work_max_over_mean": imbalance}


def main(argv):
    del argv
    load0 = start_load()
    import jax
    import numpy as np

    from slope_jax.model import gpt_oss as model
    from slope_jax.model.config import FULL, SLIDING, ModelConfig

    cfg = ModelConfig(**SHAPES, layer_types=tuple(SLIDING if i % 2 == 0 else FULL for i in range(4)))
    params = jax.tree.map(np.asarray, model.init_params(cfg, jax.random.key(0), FLAGS.dtype))
    rows = [measure(cfg, params, tuple(int(x) for x in s.split("x")), FLAGS.tokens, FLAGS.work_tokens, FLAGS.dtype,
                    FLAGS.tile) for s in FLAGS.layouts]
    print(f"\ncollective operand bytes per device for one prefill step, T={FLAGS.tokens}, {FLAGS.dtype} "
          f"({rows[0]['collective_element_bytes']} bytes/element in collectives on {jax.default_backend()}); "
          f"attention work at T={FLAGS.work_tokens}; wire MiB at the model dtype")
    print(f"{'P,R,U':>7} {'HLO MiB':>9} {'formula':>9} {'ratio':>7} {'sliding HLO':>12} {'halo formula':>13} "
          f"{'sliding ops':>20} {'wire MiB':>9} {'work max/mean':>14}")
    mib = 2 ** 20
    for r in rows:
        lay = r["layout"]
        print(f"{lay['pipeline']},{lay['ring']},{lay['ulysses']:>3} {r['hlo_bytes'].get('total', 0) / mib:>9.2f} "
              f"{r['analytic_bytes']['total'] / mib:>9.2f} {r['ratio_total']:>7.4f} "
              f"{r['sliding_hlo_bytes'] / mib:>12.3f} {r['sliding_analytic_bytes'] / mib:>13.3f} "
              f"{'+'.join(r['sliding_collective_kinds']) or '-':>20} {r['wire_bytes_at_model_dtype'] / mib:>9.2f} "
              f"{r['work_max_over_mean']:>14.4f}")
    write_result(FLAGS.out, {"config": SHAPES, "dtype": FLAGS.dtype, "rows": rows}, load_start=load0, indent=2)
    print(f"\nwrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
