"""Where single-device prefill time goes: per-layer parts timed apart, each with its FLOP rate against the matmul peak
measured in the same run.

    python benchmarks/breakdown.py                                  # peer config (configs/peer-hd64.json), 2K and 8K
    python benchmarks/breakdown.py --lengths=2048,8192,32768 --dtype=float32
    python benchmarks/breakdown.py --config=configs/gpt-oss-20b.json --layers=2 --moe_tile=256

Parts (one layer's parameters, random, of `--config`; each part its own jitted program on one device, best of
`--repeats`, inputs already on the device):
  projections   RMSNorm + q/k/v (+ bias, RoPE) + output projection
  attn_full     the attention core (`attention.attention`, the step's tiles and implementation) with no window
  attn_sliding  the same with the config's window
  moe           RMSNorm + router + grouped experts (`moe.moe`, the step's tile and implementation)
  embed         the token gather; unembed: final norm + the last token's logits
  rest          the whole compiled step (`PrefillEngine`, same options) minus the sum of the parts (L layers):
                residual adds, the layer scan, KV outputs, logits to the host
FLOPs are the work each part executes (`plan.flops.per_device`: visited attention tiles, MoE rows incl. tile padding);
`% peak` divides the part's FLOP/s by the same-run `jnp.dot` peak of the step's dtype (bf16: bf16 inputs with
float32 accumulation, as the step's einsums; f32). Prints a table and writes JSON (default
benchmarks/results/breakdown.json). Takes ~2 min on 2 idle cores at 2K+8K for the peer config.
"""

from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from slope_jax import xla_env  # noqa: E402  (no JAX)

xla_env.configure(cpu_devices=1)  # virtual CPU devices as the launcher sets them

from absl import app, flags  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from common import best_jax_seconds, matmul_peaks, start_load, write_result  # noqa: E402  (benchmarks/common.py)

FLAGS = flags.FLAGS
flags.DEFINE_list("lengths", ["2048", "8192"], "Prompt lengths (tokens); add 32768 for the long point.")
flags.DEFINE_string("config", os.path.join(REPO, "configs", "peer-hd64.json"), "HF-style config.json.")
flags.DEFINE_integer("layers", None, "Keep the first N layers (sliding/full alternating).")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Activation/weight dtype.")
flags.DEFINE_integer("repeats", 3, "Timed runs per part (best kept).")
flags.DEFINE_integer("peak_n", 2048, "Square size of the matmul-peak jnp.dot.")
flags.DEFINE_integer("q_tile", None, "Override StepOptions.q_tile.")
flags.DEFINE_integer("kv_tile", None, "Override StepOptions.kv_tile.")
flags.DEFINE_integer("moe_tile", None, "Override StepOptions.moe_tile.")
flags.DEFINE_bool("step", True, "Also time the whole compiled step (for `rest`).")
flags.DEFINE_string("out", "benchmarks/results/breakdown.json", "JSON output path.")


def model_config():
    from slope_jax.model.config import FULL, SLIDING, ModelConfig

    cfg = ModelConfig.from_json(FLAGS.config)
    if FLAGS.layers is not None:
        cfg = dataclasses.replace(cfg, num_hidden_layers=FLAGS.layers, layer_types=tuple(
            SLIDING if i % 2 == 0 else FULL for i in range(FLAGS.layers)))
    return dataclasses.replace(cfg, expert_format="dense")


def part_functions(cfg, options):
    """name → (jitted fn, builder of its arguments from (layer params, t, activations))."""
    import jax
    import jax.numpy as jnp

    from slope_jax.model import attention as attn_lib
    from slope_jax.model import gpt_oss as model_lib
    from slope_jax.model import rope

    def projections(x, p, cos, sin):
        h = model_lib.rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
        q, k, v = model_lib.qkv(h, p, cos, sin)
        o = model_lib.project(q, p["wo"], p["bo"])
        return o.astype(x.dtype), k, v

    def core(window):
        def f(q, k, v, sinks):
            pos = jnp.arange(q.shape[0], dtype=jnp.int32)
            return attn_lib.attention(q, k, v, pos, pos, sinks, window=window, q_tile=options.q_tile,
                                      kv_tile=options.kv_tile, impl=options.attention_impl).astype(q.dtype)
        return f

    def moe(x, p):
        h = model_lib.rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
        valid = jnp.ones(x.shape[0], bool)
        return model_lib.local_moe(cfg, options)(h, valid, p).astype(x.dtype)

    def embed(table, tokens):
        return table[tokens]

    def unembed(x, norm, table):
        return model_lib.unembed(x[-1], norm, table, cfg)

    del rope
    return {"projections": jax.jit(projections), "attn_full": jax.jit(core(attn_lib.NO_WINDOW)),
            "attn_sliding": jax.jit(core(cfg.sliding_window)), "moe": jax.jit(moe), "embed": jax.jit(embed),
            "unembed": jax.jit(unembed)}


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np

    from slope_jax.model import gpt_oss as model_lib
    from slope_jax.model import rope
    from slope_jax.model.options import StepOptions
    from slope_jax.plan import flops
    from slope_jax.serve.engine import PrefillEngine

    cfg = model_config()
    fields = {k: getattr(FLAGS, k) for k in ("q_tile", "kv_tile", "moe_tile") if getattr(FLAGS, k) is not None}
    options = StepOptions(**fields).resolve()
    dtype = jnp.dtype(FLAGS.dtype)
    load0 = start_load()
    peaks = matmul_peaks(FLAGS.peak_n, repeats=FLAGS.repeats)  # float32, and bfloat16 accumulating in float32
    peak = peaks[FLAGS.dtype]
    params = model_lib.init_params(cfg, jax.random.key(0), dtype)
    p0 = jax.tree.map(lambda a: a[0], params["layers"])
    fns = part_functions(cfg, options)
    engine = PrefillEngine(cfg, params, dtype=FLAGS.dtype, options=options) if FLAGS.step else None
    L = cfg.num_hidden_layers
    n_sliding = sum(cfg.is_sliding(i) for i in range(L))
    rows = []
    for t in (int(x) for x in FLAGS.lengths):
        rng = np.random.default_rng(t)
        x = jnp.asarray(rng.standard_normal((t, cfg.hidden_size), np.float32) * 0.5, dtype)
        cos, sin = rope.cos_sin(cfg, jnp.arange(t, dtype=jnp.int32), dtype)
        q = jnp.asarray(rng.standard_normal((t, cfg.num_attention_heads, cfg.head_dim), np.float32), dtype)
        k = jnp.asarray(rng.standard_normal((t, cfg.num_key_value_heads, cfg.head_dim), np.float32), dtype)
        v = jnp.asarray(rng.standard_normal((t, cfg.num_key_value_heads, cfg.head_dim), np.float32), dtype)
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, t), jnp.int32)
        args = {"projections": (x, p0, cos, sin), "attn_full": (q, k, v, p0["sinks"]),
                "attn_sliding": (q, k, v, p0["sinks"]), "moe": (x, p0), "embed": (params["embed"], tokens),
                "unembed": (x, params["final_norm"], params["unembed"])}
        secs = {name: best_jax_seconds(fns[name], args[name], FLAGS.repeats) for name in fns}
        ex = flops.per_device(cfg, 1, 1, 1, t, tiles=options)
        D, N, K, H, E = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         cfg.num_experts)
        cls = ex["classes"]
        work = {"projections": t * (2 * D * (N + 2 * K) * H + 2 * N * H * D),
                "attn_full": cls["step0"][0] / max(L - n_sliding, 1),
                "attn_sliding": cls["sliding"][0] / max(n_sliding, 1),
                "moe": ex["moe"] / L + 2.0 * t * D * E, "embed": 0.0, "unembed": 2.0 * D * cfg.vocab_size}
        per_layer_count = {"projections": L, "attn_full": L - n_sliding, "attn_sliding": n_sliding, "moe": L,
                           "embed": 1, "unembed": 1}
        step_s = None
        if engine is not None:
            prompt = np.asarray(tokens)
            engine.precompile([t])
            step_s = min(engine.prefill([prompt], return_kv=False)[0].compute_ms / 1e3
                         for _ in range(FLAGS.repeats))
        parts = {}
        total_parts = 0.0
        for name in fns:
            s = secs[name] * per_layer_count[name]
            total_parts += s
            parts[name] = {"seconds_each": secs[name], "count": per_layer_count[name], "seconds": s,
                           "gflop_each": work[name] / 1e9, "gflops": work[name] / secs[name] / 1e9,
                           "fraction_of_peak": work[name] / secs[name] / peak}
        if step_s is not None:
            parts["rest"] = {"seconds": step_s - total_parts, "count": 1}
        rows.append({"tokens": t, "step_s": step_s, "parts_s": total_parts, "parts": parts,
                     "model_gflop": flops.prefill(cfg, t)["total"] / 1e9, "executed_gflop": ex["total"] / 1e9})
        _print_rows(rows[-1:], peak)
    result = {"config": cfg.to_dict(), "dtype": FLAGS.dtype, "options": options.to_dict(),
              "matmul_peak_gflops": {k: v / 1e9 for k, v in peaks.items()}, "peak_n": FLAGS.peak_n,
              "loadavg": os.getloadavg(), "cpus": os.cpu_count(), "jax": jax.__version__, "rows": rows}
    print(f"matmul peak ({FLAGS.peak_n}^3): " + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in peaks.items())
          + f"; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    write_result(FLAGS.out, result, load_start=load0)
    print(f"wrote {FLAGS.out}")


def _print_rows(rows, peak):
    for r in rows:
        step = f"{r['step_s']:.3f} s" if r["step_s"] is not None else "-"
        print(f"\nT={r['tokens']}: step {step}, parts {r['parts_s']:.3f} s, executed {r['executed_gflop']:.1f} GFLOP")
        print(f"{'part':>13} {'x':>3} {'ms each':>9} {'s total':>8} {'share':>6} {'GFLOP/s':>8} {'% peak':>7}")
        whole = r["step_s"] or r["parts_s"]
        for name, p in r["parts"].items():
            rate = f"{p['gflops']:>8.1f} {p['fraction_of_peak']:>7.1%}" if p.get("gflop_each") else f"{'-':>8} {'-':>7}"
            each = f"{p['seconds_each'] * 1e3:>9.1f}" if "seconds_each" in p else f"{'-':>9}"
            print(f"{name:>13} {p['count']:>3} {each} {p['seconds']:>8.3f} {p['seconds'] / whole:>6.1%} {rate}")
    del peak


if __name__ == "__main__":
    app.run(main)
