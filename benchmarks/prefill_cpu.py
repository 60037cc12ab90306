"""Single-device prefill throughput and MFU on the CPU, with the checkpoint loader's peak host memory.

    python benchmarks/prefill_cpu.py                       # mid-size config, T in {512, 2048}
    python benchmarks/prefill_cpu.py --lengths 512 --dtype bfloat16
    python benchmarks/prefill_cpu.py --checkpoint /tmp/gpt-oss-20b-2l     # a cut written by make_checkpoint.py

Steps, all in one run so that ratios are comparable:
  1. a float32 matmul peak (XLA `jnp.dot` and NumPy, 2048³, best of several) on this machine;
  2. a random checkpoint of the mid-size config in the released layout (MXFP4 experts), loaded by the real loader in a
     child process whose peak RSS is read back (host memory while loading, vs. the checkpoint size);
  3. prefill of one T-token prompt per length: compile once, then the best of `--repeats` timed runs;
     tokens/s, achieved FLOP/s (analytic model FLOPs, `slope_jax.flops`) and MFU = achieved / XLA matmul peak.
Prints a table and writes JSON (default benchmarks/results/prefill_cpu.json).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import (best_seconds, matmul_peak, numpy_matmul_peak, start_load,  # noqa: E402  (benchmarks/common.py)
                    write_result)

FLAGS = flags.FLAGS
flags.DEFINE_list("lengths", ["512", "2048"], "Prompt lengths to time.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights/activations dtype (on CPUs without bf16 "
                  "dot instructions the bf16 step runs its matmuls on float32 operands: StepOptions.bf16_matmul).")
flags.DEFINE_integer("repeats", 3, "Timed runs per length (best is reported).")
flags.DEFINE_string("out", "benchmarks/results/prefill_cpu.json", "JSON output path.")
flags.DEFINE_string("checkpoint", None, "Benchmark this checkpoint (e.g. a gpt-oss-20b cut written by "
                    "checkpoints/make_checkpoint.py) instead of a generated mid-size one.")
flags.DEFINE_string("load_only", None, "Internal: load this checkpoint and exit (peak-RSS child).")

# A mid-size gpt-oss: real head_dim/window/YaRN, 1/3 of the real width, 16 experts.
MID = dict(num_hidden_layers=4, num_experts=16, experts_per_token=4, vocab_size=32768, hidden_size=1024,
           intermediate_size=1024, num_attention_heads=16, num_key_value_heads=4, head_dim=64, sliding_window=128)


def mid_config():
    from slope_jax.model.config import FULL, SLIDING, ModelConfig

    return ModelConfig(**MID, layer_types=tuple(SLIDING if i % 2 == 0 else FULL for i in range(4)))


def _proc_status(key: str) -> int:
    """A memory field of /proc/self/status in bytes (Linux)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


class _PeakSampler:
    """Polls a /proc/self/status field every 5 ms in a thread (the kernel keeps no peak of anonymous memory)."""

    def __init__(self, key: str):
        import threading

        self.key, self.peak, self._stop = key, _proc_status(key), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _proc_status(self.key))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _proc_status(self.key))


def _reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux `clear_refs` = 5), so the peak covers only what follows."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def load_in_child(path: str) -> dict[str, float]:
    """Load `path` in a fresh process; return its load time and peak RSS during the load (bytes)."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, os.path.abspath(__file__), f"--load_only={path}", f"--dtype={FLAGS.dtype}"],
                         check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    child = json.loads(out.stdout.strip().splitlines()[-1])
    peak = child["peak_rss_bytes"]
    # On the CPU backend the loaded parameters themselves live in host memory. RSS also counts the memory-mapped
    # checkpoint pages (file-backed, reclaimable); anonymous memory beyond the params is the loader's own transient.
    return {"load_s": child["load_s"], "child_wall_s": wall, "peak_rss_bytes": peak,
            "rss_before_load_bytes": child["rss_before_bytes"], "params_bytes": child["params_bytes"],
            "peak_anon_growth_bytes": child["peak_anon_bytes"] - child["anon_before_bytes"],
            "transient_anon_bytes": child["peak_anon_bytes"] - child["anon_before_bytes"] - child["params_bytes"]}


def main(argv):
    del argv
    if FLAGS.load_only:
        import jax

        import slope_jax

        _reset_peak_rss()
        rss0, anon0 = _proc_status("VmRSS"), _proc_status("RssAnon")
        sampler = _PeakSampler("RssAnon")
        t0 = time.perf_counter()
        _, params = slope_jax.load_checkpoint(FLAGS.load_only, FLAGS.dtype, progress=False)
        jax.block_until_ready(params)
        load_s = time.perf_counter() - t0
        nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
        print(json.dumps({"load_s": load_s, "rss_before_bytes": rss0, "params_bytes": nbytes,
                          "peak_rss_bytes": _proc_status("VmHWM"), "anon_before_bytes": anon0,
                          "peak_anon_bytes": sampler.stop()}))
        return

    import jax
    import numpy as np

    from slope_jax.checkpoints import writer as checkpoint_writer
    from slope_jax.plan import flops
    from slope_jax.serve.engine import PrefillEngine

    load0 = start_load()
    peak = {"xla_f32_flops": matmul_peak(2048, "float32", 5), "numpy_f32_flops": numpy_matmul_peak(2048, 5)}
    with tempfile.TemporaryDirectory() as tmp:
        if FLAGS.checkpoint:
            ckpt = FLAGS.checkpoint
        else:
            ckpt = os.path.join(tmp, "mid")
            cfg = mid_config()
            checkpoint_writer.write_hf(ckpt, cfg, checkpoint_writer.random_params(cfg, 0), num_shards=2)
        size = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt) if f.endswith(".safetensors"))
        load = load_in_child(ckpt)
        engine = PrefillEngine.from_checkpoint(ckpt, dtype=FLAGS.dtype, progress=False)
        cfg = engine.cfg

    rows = []
    for t in (int(x) for x in FLAGS.lengths):
        ids = np.random.default_rng(t).integers(0, cfg.vocab_size, t)
        t0 = time.perf_counter()
        engine.prefill([ids], return_kv=False)
        first = time.perf_counter() - t0
        best = best_seconds(lambda: engine.prefill([ids], return_kv=False), FLAGS.repeats)
        f = flops.prefill(cfg, t)
        achieved = f["total"] / best
        rows.append({"tokens": t, "bucket": engine.bucket(t), "seconds": best, "first_call_s": first,
                     "tokens_per_s": t / best, "model_gflop": f["total"] / 1e9,
                     "attention_gflop": f["attention"] / 1e9, "achieved_gflops": achieved / 1e9,
                     "mfu_vs_xla_peak": achieved / peak["xla_f32_flops"],
                     "mfu_vs_numpy_peak": achieved / peak["numpy_f32_flops"]})

    result = {"config": cfg.to_dict(), "checkpoint": FLAGS.checkpoint or "generated mid-size", "dtype": FLAGS.dtype,
              "jax": jax.__version__, "backend": jax.default_backend(),
              "devices": jax.device_count(), "cpu_count": os.cpu_count(),
              "matmul_peak_gflops": {k: v / 1e9 for k, v in peak.items()},
              "checkpoint_bytes": size, "load": load, "prefill": rows}
    print(f"\nmatmul peak (float32, 2048^3): XLA {peak['xla_f32_flops'] / 1e9:.1f} GFLOP/s, "
          f"NumPy {peak['numpy_f32_flops'] / 1e9:.1f} GFLOP/s")
    print(f"checkpoint {size / 2**20:.1f} MiB, loaded in {load['load_s']:.2f} s; loader process: peak RSS "
          f"{load['peak_rss_bytes'] / 2**20:.0f} MiB ({load['rss_before_load_bytes'] / 2**20:.0f} MiB before loading), "
          f"anonymous memory +{load['peak_anon_growth_bytes'] / 2**20:.0f} MiB at peak = "
          f"{load['params_bytes'] / 2**20:.0f} MiB loaded params (host = device on CPU) + "
          f"{load['transient_anon_bytes'] / 2**20:.0f} MiB loader transient")
    print(f"\n{'T':>6} {'bucket':>6} {'time s':>8} {'tok/s':>9} {'GFLOP':>8} {'GFLOP/s':>8} {'MFU':>6}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['bucket']:>6} {r['seconds']:>8.3f} {r['tokens_per_s']:>9.1f} "
              f"{r['model_gflop']:>8.1f} {r['achieved_gflops']:>8.1f} {r['mfu_vs_xla_peak']:>6.1%}")
    write_result(FLAGS.out, result, load_start=load0, indent=2)
    print(f"\nwrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
