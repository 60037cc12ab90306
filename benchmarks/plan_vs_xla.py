"""The cost model vs what XLA compiles, on the CPU mesh (8 virtual devices): FLOPs per device, collective bytes per
device, argument + temp memory per device (docs/design.md §6; issue 9 "must show").

    python benchmarks/plan_vs_xla.py                         # tiny + mid configs, 7 layouts, lengths 1..8192
    python benchmarks/plan_vs_xla.py --configs=tiny --lengths=1,300 --layouts=1x1x1,2x2x2

Per (config, layout, length): compile the engine's step for the length's bucket (no run) and compare
`slope_jax.plan` against the compiled program (`slope_jax.plan.verify.compare`: HLO dot FLOPs × known trip counts,
dynamic loops × the model's trip counts; HLO collective operand bytes; `memory_analysis()`), then the attention
tile ranges against the program's own count for one short prompt per layout. Targets: FLOPs and bytes within 5 %,
memory within 15 %. Prints a table and writes JSON (default benchmarks/results/plan_vs_xla.json).
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from absl import app, flags  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import start_load, write_result  # noqa: E402  (benchmarks/common.py)

FLAGS = flags.FLAGS
MID = dict(num_hidden_layers=4, num_experts=16, experts_per_token=4, vocab_size=32768, hidden_size=1024,
           intermediate_size=1024, num_attention_heads=16, num_key_value_heads=4, head_dim=64, sliding_window=128)
flags.DEFINE_list("configs", ["tiny", "mid"], "tiny = configs/tiny.json; mid = the mid-size gpt-oss of "
                  "benchmarks/prefill_cpu.py (real head_dim/window, 1/3 of the width, 16 experts).")
flags.DEFINE_list("layouts", ["1x1x1", "1x8x1", "1x2x4", "1x4x2", "2x2x2", "2x4x1", "4x1x2"],
                  "Layouts pipeline x ring x ulysses (1x1x1 = one device).")
flags.DEFINE_list("lengths", ["1", "300", "2048", "8192"], "Prompt lengths (padded to the engine's buckets).")
flags.DEFINE_bool("work_check", True, "Also check attention tile ranges against the program's own count.")
flags.DEFINE_string("out", "benchmarks/results/plan_vs_xla.json", "JSON output path.")


def main(argv):
    del argv
    load0 = start_load()
    import jax

    from slope_jax.checkpoints import writer
    from slope_jax.model.config import FULL, SLIDING, ModelConfig
    from slope_jax.parallel.config import ParallelConfig
    from slope_jax.plan import verify
    from slope_jax.serve.engine import PrefillEngine

    cfgs = {"tiny": lambda: ModelConfig.from_json("configs/tiny.json"),
            "mid": lambda: ModelConfig(**MID, layer_types=(SLIDING, FULL) * 2)}
    rows = []
    print(f"{'config':<6} {'layout':<7} {'tokens':>6} {'bucket':>6} {'FLOPs model/XLA':>16} {'bytes model/XLA':>16} "
          f"{'mem model/XLA':>14} {'model GFLOP':>12} {'XLA MiB arg+temp':>17}")
    for name in FLAGS.configs:
        cfg = cfgs[name]()
        host = writer.random_params(cfg, 0)  # bf16 + MXFP4 as released; cast to float32 by the engine
        for spec in FLAGS.layouts:
            p, r, u = (int(x) for x in spec.split("x"))
            par = ParallelConfig(pipeline=p, ring=r, ulysses=u)
            eng = PrefillEngine(cfg, host, par, "float32", devices=jax.devices()[:par.num_devices])
            for n in (int(x) for x in FLAGS.lengths):
                t0 = time.perf_counter()
                row = verify.compare(eng, n)
                row.update(config=name, compile_s=time.perf_counter() - t0)
                rows.append(row)
                print(f"{name:<6} {spec:<7} {n:>6} {row['bucket']:>6} {row['flops_ratio']:>16.4f} "
                      f"{row['bytes_ratio']:>16.4f} {row['memory_ratio']:>14.3f} {row['model_flops'] / 1e9:>12.2f} "
                      f"{(row['xla_argument_bytes'] + row['xla_temp_bytes']) / 2**20:>17.1f}", flush=True)
                eng._compiled.clear()
            if FLAGS.work_check and par.num_devices > 1:
                measured, modelled = verify.attention_work(eng, 100)
                rows.append({"config": name, "layout": spec, "check": "attention_work", "tokens": 100,
                             "measured_entries": measured, "model_entries": modelled})
                print(f"{name:<6} {spec:<7} attention score entries at 100 tokens: program {measured:.0f}, "
                      f"model {modelled:.0f}")
    checked = [r for r in rows if "flops_ratio" in r]
    summary = {k: {"max_abs_error": max(abs(r[k] - 1) for r in checked), "target": tgt}
               for k, tgt in (("flops_ratio", 0.05), ("bytes_ratio", 0.05), ("memory_ratio", 0.15))}
    for k, v in summary.items():
        print(f"{k}: worst |ratio - 1| = {v['max_abs_error']:.4f} (target {v['target']})")
    write_result(FLAGS.out, {"rows": rows, "summary": summary, "jax": jax.__version__}, load_start=load0)
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
