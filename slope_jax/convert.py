r"""`python -m slope_jax.convert` (console script `slope-convert`): convert an HF / `original/` gpt-oss checkpoint
into an orbax directory for fast restarts.

  python -m slope_jax.convert --checkpoint=checkpoints/tiny-gpt-oss --out=/tmp/tiny-orbax \
      --cpu_devices=8 --pipeline=2 --ring=2 --ulysses=2

The parameters are loaded into the given layout (each device reads only its shard), kept in the layout's dtype with
MXFP4 experts packed, and saved with orbax-checkpoint (implementation: `slope_jax.checkpoints.orbax_store`).
`python -m slope_jax.launch --checkpoint=OUT` and `PrefillEngine.from_checkpoint(OUT, …)` then restore it into any
layout, each process reading only the shards its devices hold. One process converts (over all its devices).
"""

from __future__ import annotations

import sys

from absl import app, flags, logging

from slope_jax import xla_env

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "Source checkpoint: an HF directory (config.json + safetensors) or an "
                    "original/ directory.", required=True)
flags.DEFINE_string("out", None, "Output directory (created; must not already hold a converted checkpoint).",
                    required=True)
flags.DEFINE_integer("pipeline", 1, "Pipeline stages of the layout the parameters are placed in while converting "
                     "(restoring into another layout works; this only sets how the writes are split).")
flags.DEFINE_integer("ring", 1, "Ring-attention degree of the conversion layout.")
flags.DEFINE_integer("ulysses", 1, "Ulysses degree of the conversion layout.")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Stored dtype of float parameters (norms and sinks "
                  "are float32 and MXFP4 experts uint8 either way); a restore may ask for the other one.")
flags.DEFINE_integer("cpu_devices", None, "Split the CPU into this many virtual devices (testing without "
                     "accelerators; sets XLA_FLAGS=--xla_force_host_platform_device_count).")
flags.DEFINE_string("platform", None, "Force a JAX platform (cpu, cuda, rocm); default: JAX's choice.")


def main(argv) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    xla_env.configure(FLAGS.cpu_devices, FLAGS.platform)
    from slope_jax.checkpoints import orbax_store
    from slope_jax.checkpoints.hf import CheckpointError
    from slope_jax.model.config import ConfigError
    from slope_jax.parallel.config import LayoutError, ParallelConfig

    try:
        parallel = ParallelConfig(pipeline=FLAGS.pipeline, ring=FLAGS.ring, ulysses=FLAGS.ulysses)
        meta = orbax_store.convert(FLAGS.checkpoint, FLAGS.out, parallel, FLAGS.dtype)
    except (CheckpointError, ConfigError, LayoutError, OSError) as e:  # OSError: --out cannot be created or written
        print(f"slope_jax.convert: error: {e}", file=sys.stderr, flush=True)
        return 2
    logging.info("wrote %s (%.1f MiB, fingerprint %s)", FLAGS.out, meta["bytes"] / 2**20, meta["fingerprint"])
    return 0


def run():
    from slope_jax import cli

    cli.run(main, name="slope_jax.convert")  # absl's app.run, --help exiting 0, backend noise filtered


if __name__ == "__main__":
    run()
