"""Sequence-pipelined prefill: the predicted TTFT table and the measured schedule and memory.

    python benchmarks/seq_pipeline.py [--tokens=1024] [--chunks=1,4,8]

Part 1 (cost model, `slope_jax.plan.seq_chunks`, no JAX): predicted TTFT of one gpt-oss-120b request of
--model_tokens tokens on P = --model_pipeline stages for C ∈ --model_chunks, at an ASSUMED --peak_tflops ×
--efficiency per device (stated inputs, not a measurement); context-parallel communication not modelled.
Part 2 (measured on 8 CPU devices, compile only): for a gpt-oss-20b-proportioned small model (24 layers, bf16 +
MXFP4) on (P, R, U) = (--pipeline, --ring, --ulysses) and one --tokens request, the compiled step's tick-loop trip
count (HLO `known_trip_count`) and `compiled.memory_analysis()` per device — temp bytes (activations, attention
states, the embedded prompt) and output bytes (the K/V of the stage's layers, identical with and without chunks) —
for each C in --chunks.
Prints tables and writes JSON (default benchmarks/results/seq_pipeline.json).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from absl import app, flags  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import start_load, write_result  # noqa: E402  (benchmarks/common.py)

FLAGS = flags.FLAGS
flags.DEFINE_integer("model_tokens", 100_000, "Prompt length for the cost-model table.")
flags.DEFINE_integer("model_pipeline", 4, "Pipeline stages for the cost-model table.")
flags.DEFINE_list("model_chunks", ["1", "4", "8", "16"], "seq_chunks values for the cost-model table.")
flags.DEFINE_float("peak_tflops", 989.0, "Assumed dense bf16 peak per device, TFLOP/s (H100/H200 SXM data sheet).")
flags.DEFINE_float("efficiency", 0.5, "Assumed fraction of peak achieved (an assumption, not a measurement).")
flags.DEFINE_integer("tokens", 1024, "Bucket length of the measured compiled step.")
flags.DEFINE_integer("pipeline", 2, "Measured layout: pipeline stages.")
flags.DEFINE_integer("ring", 2, "Measured layout: ring degree.")
flags.DEFINE_integer("ulysses", 2, "Measured layout: Ulysses degree.")
flags.DEFINE_list("chunks", ["1", "4", "8"], "seq_chunks values to compile.")
flags.DEFINE_string("out", "benchmarks/results/seq_pipeline.json", "JSON output path.")

SMALL = dict(num_hidden_layers=24, num_experts=32, experts_per_token=4, vocab_size=8192, hidden_size=256,
             intermediate_size=256, num_attention_heads=16, num_key_value_heads=8, head_dim=32, sliding_window=128)


def model_table() -> list[dict]:
    from slope_jax.model.config import ModelConfig
    from slope_jax.plan import seq_chunks

    cfg = ModelConfig.from_json(os.path.join(os.path.dirname(__file__), "..", "configs", "gpt-oss-120b.json"))
    return seq_chunks.table(cfg, FLAGS.model_tokens, pipeline=FLAGS.model_pipeline,
                            chunk_options=[int(c) for c in FLAGS.model_chunks],
                            flops_per_s=FLAGS.peak_tflops * 1e12 * FLAGS.efficiency)


def measured() -> list[dict]:
    from slope_jax.checkpoints import writer as checkpoint_writer
    from slope_jax.model.config import FULL, SLIDING, ModelConfig
    from slope_jax.parallel.config import ParallelConfig
    from slope_jax.plan import traffic
    from slope_jax.serve.engine import PrefillEngine

    cfg = ModelConfig(**SMALL, layer_types=tuple(SLIDING if i % 2 == 0 else FULL for i in range(24)))
    host = checkpoint_writer.random_params(cfg, 0)
    rows = []
    for c in [int(x) for x in FLAGS.chunks]:
        par = ParallelConfig(pipeline=FLAGS.pipeline, ring=FLAGS.ring, ulysses=FLAGS.ulysses, seq_chunks=c,
                             microbatches=1)
        eng = PrefillEngine(cfg, host, par, "bfloat16", q_tile=128, kv_tile=128, moe_tile=64)
        compiled = eng.compiled(FLAGS.tokens, 1)
        mem = compiled.memory_analysis()
        rows.append({"chunks": c, "ticks": traffic.schedule_ticks(compiled.as_text()),
                     "expected_ticks": c + FLAGS.pipeline - 1,
                     "temp_bytes": int(mem.temp_size_in_bytes), "output_bytes": int(mem.output_size_in_bytes),
                     "argument_bytes": int(mem.argument_size_in_bytes)})
        del eng, compiled
    return rows


def main(argv):
    del argv
    load0 = start_load()
    table = model_table()
    print(f"\npredicted TTFT, gpt-oss-120b, {FLAGS.model_tokens} tokens, P={FLAGS.model_pipeline}, R=U=1, assumed "
          f"{FLAGS.peak_tflops:.0f} TFLOP/s x {FLAGS.efficiency:.2f} per device (assumption, not measured)")
    print(f"{'C':>3} {'ticks':>6} {'TTFT s':>8} {'ideal s':>8} {'fill s':>7} {'imbal. s':>9} {'vs C=1':>7}")
    for r in table:
        print(f"{r['chunks']:>3} {r['ticks']:>6} {r['ttft_s']:>8.3f} {r['ideal_s']:>8.3f} {r['fill_s']:>7.3f} "
              f"{r['imbalance_s']:>9.3f} {r['speedup']:>6.2f}x")
    rows = measured()
    import jax

    mib = 2 ** 20
    print(f"\nmeasured on {jax.device_count()} {jax.default_backend()} devices (compile only): 24-layer "
          f"gpt-oss-shaped model, T={FLAGS.tokens}, (P,R,U)=({FLAGS.pipeline},{FLAGS.ring},{FLAGS.ulysses}), "
          "per device")
    print(f"{'C':>3} {'ticks':>6} {'C+P-1':>6} {'temp MiB':>9} {'KV out MiB':>11} {'args MiB':>9}")
    for r in rows:
        print(f"{r['chunks']:>3} {r['ticks']:>6} {r['expected_ticks']:>6} {r['temp_bytes'] / mib:>9.2f} "
              f"{r['output_bytes'] / mib:>11.2f} {r['argument_bytes'] / mib:>9.2f}")
    write_result(FLAGS.out, {"assumed": {"peak_tflops": FLAGS.peak_tflops, "efficiency": FLAGS.efficiency},
                             "model_table": table, "measured": rows}, load_start=load0)
    print(f"\nwrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
