"""Per-device parameter memory and the pipeline schedule, for pipeline ∈ {1, 2, 4, 8} on 8 devices.

    python benchmarks/pp_memory.py

Part 1 (measured, 8 CPU devices, a gpt-oss-20b-proportioned small model, 24 layers): for each P the engine is built
with ring·ulysses = 8/P; per-device parameter bytes are read from the sharded arrays (`addressable_shards`) and from
`compiled.memory_analysis()` (argument bytes of the prefill step, minus its token inputs), and compared with
total/P. The schedule's ticks for M requests are read from the compiled tick loop's trip count (M + P − 1).
Part 2 (declared shapes, no allocation): per-device parameter bytes of gpt-oss-20b and -120b (bf16 + MXFP4).
Prints tables and writes JSON (default benchmarks/results/pp_memory.json).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from absl import app, flags  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import start_load, write_result  # noqa: E402  (benchmarks/common.py)

FLAGS = flags.FLAGS
flags.DEFINE_list("pipelines", ["1", "2", "4", "8"], "Pipeline degrees to measure.")
flags.DEFINE_integer("tokens", 256, "Bucket length of the compiled step.")
flags.DEFINE_string("out", "benchmarks/results/pp_memory.json", "JSON output path.")

SMALL = dict(num_hidden_layers=24, num_experts=32, experts_per_token=4, vocab_size=8192, hidden_size=256,
             intermediate_size=256, num_attention_heads=16, num_key_value_heads=8, head_dim=32, sliding_window=128)


def _device_bytes(params, device) -> int:
    import jax

    return sum(s.data.nbytes for leaf in jax.tree.leaves(params) for s in leaf.addressable_shards
               if s.device == device)


def measured(p: int, cfg, host_params, tokens: int):
    import jax
    import numpy as np

    from slope_jax.parallel.config import ParallelConfig
    from slope_jax.plan import traffic
    from slope_jax.serve.engine import PrefillEngine

    # experts replicated (EP = 1) so that the ratio isolates the pipeline split (EP: benchmarks/ep_memory.py)
    par = ParallelConfig(pipeline=p, ulysses=8 // p, microbatches=max(p, 1), expert=1)
    eng = PrefillEngine(cfg, host_params, par, "bfloat16", q_tile=128, kv_tile=128, moe_tile=64)
    total = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(eng.params))
    per_dev = [_device_bytes(eng.params, d) for d in eng.mesh.devices.reshape(-1)]
    rows = []
    for m in sorted({1, p, 2 * p}):
        compiled = eng.compiled(tokens, m)
        mem = compiled.memory_analysis()
        token_inputs = (m * tokens + tokens + m) * 4 // (8 // p)  # tokens, positions, num_tokens (per device)
        rows.append({"requests": m, "ticks": traffic.schedule_ticks(compiled.as_text()), "expected_ticks": m + p - 1,
                     "bubble": (p - 1) / (m + p - 1),
                     "memory_analysis_argument_bytes": int(mem.argument_size_in_bytes),
                     "memory_analysis_param_bytes": int(mem.argument_size_in_bytes) - token_inputs,
                     "memory_analysis_temp_bytes": int(mem.temp_size_in_bytes),
                     "memory_analysis_output_bytes": int(mem.output_size_in_bytes)})
    stored = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(host_params))
    return {"pipeline": p, "ring": 1, "ulysses": 8 // p, "stored_param_bytes": stored,
            "sharded_total_bytes": total, "per_device_bytes_max": max(per_dev), "per_device_bytes_min": min(per_dev),
            "ideal_bytes": stored / p, "ratio_to_ideal": max(per_dev) / (stored / p),
            "memory_analysis_ratio_to_ideal": rows[0]["memory_analysis_param_bytes"] / (stored / p),
            "empty_slots": eng.plan.empty_slots, "stack_per_stage": eng.plan.stack_per_stage, "schedule": rows}


def declared(name: str, pipelines) -> list[dict]:
    import numpy as np

    from slope_jax.model import gpt_oss as model
    from slope_jax.model.config import ModelConfig
    from slope_jax.parallel import sharding, stages
    from slope_jax.parallel.config import ParallelConfig
    from slope_jax.plan import memory

    cfg = ModelConfig.from_json(os.path.join(os.path.dirname(__file__), "..", "configs", f"{name}.json"))
    out = []
    for p in pipelines:
        plan = stages.plan_stages(cfg, p)
        par = ParallelConfig(pipeline=p, expert=1)
        specs = sharding.stacked_param_specs(cfg, par, "bfloat16")
        per_dev = 0
        total = 0
        for spec in _leaves(specs):
            nbytes = int(np.prod(spec.shape)) * spec.dtype.itemsize
            per_dev += nbytes // stages.shards(spec.axes, cfg, par)
        for spec in _leaves(model.param_specs(cfg, "bfloat16")):
            total += int(np.prod(spec.shape)) * spec.dtype.itemsize
        model_bytes = memory.param_bytes(cfg, 2, p)["total"]  # the planner's count (slope_jax.plan.memory)
        out.append({"model": name, "pipeline": p, "per_device_bytes": per_dev, "total_bytes": total,
                    "ratio_to_ideal": per_dev / (total / p), "empty_slots": plan.empty_slots,
                    "cost_model_bytes": model_bytes, "cost_model_ratio": model_bytes / per_dev})
    return out


def _leaves(tree):
    for v in tree.values():
        if isinstance(v, dict):
            yield from _leaves(v)
        else:
            yield v


def main(argv):
    del argv
    load0 = start_load()
    import jax
    import numpy as np

    from slope_jax.checkpoints import writer as checkpoint_writer
    from slope_jax.model.config import FULL, SLIDING, ModelConfig

    cfg = ModelConfig(**SMALL, layer_types=tuple(SLIDING if i % 2 == 0 else FULL for i in range(24)))
    host = checkpoint_writer.random_params(cfg, 0)  # bf16 + MXFP4, as released
    pipelines = [int(x) for x in FLAGS.pipelines]
    rows = [measured(p, cfg, host, FLAGS.tokens) for p in pipelines]
    mib = 2 ** 20
    print(f"\nmeasured on {jax.device_count()} {jax.default_backend()} devices: 24-layer gpt-oss-shaped model, "
          f"{rows[0]['stored_param_bytes'] / mib:.1f} MiB of parameters (bf16 + MXFP4)")
    print(f"{'P':>3} {'R*U':>4} {'per-device MiB':>15} {'total/P MiB':>12} {'ratio':>7} {'mem_analysis':>13} "
          f"{'ratio':>7} {'empty slots':>12}")
    for r in rows:
        print(f"{r['pipeline']:>3} {r['ulysses']:>4} {r['per_device_bytes_max'] / mib:>15.2f} "
              f"{r['ideal_bytes'] / mib:>12.2f} {r['ratio_to_ideal']:>7.3f} "
              f"{r['schedule'][0]['memory_analysis_param_bytes'] / mib:>13.2f} "
              f"{r['memory_analysis_ratio_to_ideal']:>7.3f} {r['empty_slots']:>12}")
    print("\nGPipe schedule (compiled tick-loop trip count): M requests on P stages")
    print(f"{'P':>3} {'M':>3} {'ticks':>6} {'M+P-1':>6} {'bubble':>7}")
    for r in rows:
        for s in r["schedule"]:
            print(f"{r['pipeline']:>3} {s['requests']:>3} {s['ticks']:>6} {s['expected_ticks']:>6} {s['bubble']:>7.1%}")
    decl = declared("gpt-oss-20b", [1, 2, 4, 8]) + declared("gpt-oss-120b", [1, 2, 4, 8])
    print("\ndeclared parameter bytes per device (bf16 + MXFP4 experts), no activations or KV")
    print(f"{'model':>14} {'P':>3} {'GiB/device':>11} {'total/P GiB':>12} {'ratio':>7} {'empty slots':>12} "
          f"{'cost model/declared':>20}")
    for d in decl:
        print(f"{d['model']:>14} {d['pipeline']:>3} {d['per_device_bytes'] / 2**30:>11.2f} "
              f"{d['total_bytes'] / d['pipeline'] / 2**30:>12.2f} {d['ratio_to_ideal']:>7.3f} {d['empty_slots']:>12} "
              f"{d['cost_model_ratio']:>20.4f}")
    write_result(FLAGS.out, {"config": SMALL, "measured": rows, "declared": decl}, load_start=load0, indent=2)
    print(f"\nwrote {FLAGS.out}")
    del np


if __name__ == "__main__":
    app.run(main)
