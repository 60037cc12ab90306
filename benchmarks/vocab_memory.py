r"""Vocabulary-parallel embedding and logits on a gpt-oss-20b-dims cut: per-device vocabulary bytes, peak host
memory, and logits vs one device.

    /usr/bin/time -v python benchmarks/vocab_memory.py [--layout=1x2x4] [--expert=8] [--tokens=4096]

The model: configs/gpt-oss-20b.json cut to 2 layers (real dimensions: V = 201088, D = 2880, 32 experts; random
weights, `checkpoints.writer.random_params`), bf16, on 8 virtual CPU devices. Reports, per device, the bytes of the
embedding and unembedding tables from the compiled step's own input shardings (`compiled.input_shardings`) against
total/(P·R·U), the process's peak RSS, and the largest |Δlogit| of the parallel step vs the single-device path
(run second, after the parallel engine is freed). Needs ~14 GB of host memory (measured peak RSS in the output).
Writes JSON to --out.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import sys

from absl import app, flags
from common import start_load, write_result  # benchmarks/common.py (stdlib only: no JAX yet)

FLAGS = flags.FLAGS
flags.DEFINE_string("layout", "1x2x4", "pipeline x ring x ulysses (8 devices in all).")
flags.DEFINE_integer("expert", 8, "Expert-parallel degree (ring*ulysses or 1).")
flags.DEFINE_integer("tokens", 4096, "Prompt length.")
flags.DEFINE_integer("layers", 2, "Layers of the cut.")
flags.DEFINE_string("out", "benchmarks/results/vocab_memory.json", "JSON output path.")

# bf16 parallel vs bf16 single device: different summation orders (ring merge, reduce-scatter, psums) in bf16
# activations; the same bound as tests/test_engine.py's bf16 check (0.03 × the largest |logit|)
BF16_REL_TOL = 0.03


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def main(argv):
    del argv
    load0 = start_load()
    p, r, u = (int(x) for x in FLAGS.layout.split("x"))
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={p * r * u}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import jax
    import numpy as np

    from slope_jax.checkpoints import writer
    from slope_jax.model.config import ModelConfig
    from slope_jax.parallel import stages
    from slope_jax.parallel.config import ParallelConfig
    from slope_jax.serve.engine import PrefillEngine

    here = os.path.dirname(os.path.abspath(__file__))
    full = ModelConfig.from_json(os.path.join(here, "..", "configs", "gpt-oss-20b.json"))
    cfg = dataclasses.replace(full, num_hidden_layers=FLAGS.layers, layer_types=full.layer_types[:FLAGS.layers])
    host = writer.random_params(cfg, 0)
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, FLAGS.tokens).astype(np.int32)
    par = ParallelConfig(pipeline=p, ring=r, ulysses=u, expert=FLAGS.expert)
    options = dict(q_tile=256, kv_tile=256, moe_tile=128)

    eng = PrefillEngine(cfg, host, par, "bfloat16", **options)
    compiled = eng.compiled(eng.bucket(FLAGS.tokens), 1)
    shardings = compiled.input_shardings[0][0]
    vocab = {}
    for name in ("embed", "unembed"):
        arr = eng.params[name]
        shard = shardings[name].shard_shape(arr.shape)
        vocab[name] = {"total_bytes": int(arr.nbytes), "per_device_bytes": int(np.prod(shard)) * arr.dtype.itemsize,
                       "placed_bytes": sorted({int(s.data.nbytes) for s in arr.addressable_shards})}
    (par_res,) = eng.prefill([prompt], return_kv=False)
    rss_parallel = _peak_rss_gib()
    del eng, compiled
    ref = PrefillEngine(cfg, host, ParallelConfig(), "bfloat16", devices=jax.devices()[:1], **options)
    (ref_res,) = ref.prefill([prompt], return_kv=False)
    diff = float(np.abs(par_res.logits - ref_res.logits).max())
    scale = float(np.abs(ref_res.logits).max())
    shards = stages.vocab_shards(par)
    doc = {"layout": {"pipeline": p, "ring": r, "ulysses": u, "expert": par.expert_degree(cfg)},
           "tokens": FLAGS.tokens, "layers": FLAGS.layers, "vocab_shards": shards, "vocab": vocab,
           "per_device_equals_total_over_PRU": all(
               v["per_device_bytes"] * shards == v["total_bytes"] for v in vocab.values()),
           "max_abs_logit_diff": diff, "max_abs_logit": scale, "tolerance": BF16_REL_TOL * scale,
           "corr": float(np.corrcoef(par_res.logits, ref_res.logits)[0, 1]),
           "same_first_token": par_res.first_token == ref_res.first_token,
           "peak_rss_gib_after_parallel": rss_parallel, "peak_rss_gib": _peak_rss_gib()}
    print(json.dumps(doc, indent=1))
    write_result(FLAGS.out, doc, load_start=load0)
    ok = doc["per_device_equals_total_over_PRU"] and diff <= doc["tolerance"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    app.run(main)
