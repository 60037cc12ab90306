"""Fast restart: orbax restore (`python -m slope_jax.convert` output) vs loading the HF MXFP4 checkpoint.

    python benchmarks/restore_vs_load.py --make --cleanup     # writes the 20b-shaped 2-layer cut first (~3.1 GB)

Each measurement runs in its own child process (8 virtual CPU devices): the wall time of the load/restore call
(until every array is ready, JAX start-up excluded) and the child's peak resident memory (`ru_maxrss`). Every child
also hashes every parameter canonically (per layer, in natural layer order, vocabulary rows cut to V), so the HF load
and the restores — in the same layout and in a different one — are compared bit for bit by digest.
Steps: convert at --layout; HF load at --layout; orbax restore at --layout; orbax restore at --restore_layout.
Prints a table and writes JSON (default benchmarks/results/restore_vs_load.json).

Measured (2-core shared CPU box, load average ~25 during the run, bf16, gpt-oss-20b dims cut to 2 layers, 3.05 GiB):
HF load at (2,2,2) 148.4 s / peak RSS 16.9 GiB; orbax restore at (2,2,2) 85.6 s / 13.8 GiB (1.73x faster, 0.82x
RSS); orbax restore at (1,1,1) 41.7 s / 4.5 GiB; all bitwise equal to the HF load. On CPU every replica of a shard
is its own host buffer (4 per shard at (2,2,2): 12.2 GiB of "device" arrays), which dominates both paths.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from absl import app, flags  # noqa: E402

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", os.path.join(REPO, "checkpoints", "gpt-oss-20b-2l"), "HF MXFP4 checkpoint.")
flags.DEFINE_string("orbax_dir", None, "Converted directory (default: <checkpoint>-orbax).")
flags.DEFINE_bool("make", False, "Write --checkpoint first if missing (gpt-oss-20b config cut to --layers).")
flags.DEFINE_integer("layers", 2, "Layers of the cut written by --make.")
flags.DEFINE_list("layout", ["2", "2", "2"], "pipeline,ring,ulysses of the load and of the first restore.")
flags.DEFINE_list("restore_layout", ["1", "1", "1"], "pipeline,ring,ulysses of the second restore.")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Float parameter dtype.")
flags.DEFINE_bool("cleanup", False, "Delete the checkpoint and the converted directory afterwards.")
flags.DEFINE_string("out", os.path.join(REPO, "benchmarks", "results", "restore_vs_load.json"), "JSON output.")
flags.DEFINE_enum("child", None, ["convert", "hf", "orbax"], "Internal: run one measurement and print JSON.")


def _digests(params, pl, cfg) -> dict[str, str]:
    """sha256 per parameter of its canonical bytes: per-layer parameters layer by layer in natural order (padding
    entries skipped), vocabulary rows cut to V. Reassembled from addressable shards (one layer at a time)."""
    import hashlib

    import numpy as np

    from slope_jax.checkpoints.orbax_store import _flatten

    out = {}
    for name, arr in _flatten(params).items():
        spec = pl.specs[name]
        h = hashlib.sha256()
        per_layer = spec.axes[0] == "layers"
        order = sorted((g, r) for r, g in enumerate(pl.plan.flat) if g >= 0) if per_layer else [(None, None)]
        for _, r in order:
            shape = spec.shape[1:] if per_layer else spec.shape
            buf = np.zeros(shape, spec.dtype)
            for s in arr.addressable_shards:
                idx = s.index
                if per_layer:
                    lo, hi, _ = idx[0].indices(spec.shape[0])
                    if not lo <= r < hi:
                        continue
                    buf[idx[1:]] = np.asarray(s.data)[r - lo]
                else:
                    buf[idx] = np.asarray(s.data)
            if not per_layer and "vocab" in spec.axes:
                buf = buf[:cfg.vocab_size]
            h.update(np.ascontiguousarray(buf).view(np.uint8).tobytes())
        out[name] = h.hexdigest()[:16]
    return out


def _child(kind: str, layout: list[str]) -> dict:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as Ps

    from slope_jax.checkpoints import hf, orbax_store
    from slope_jax.parallel import pipeline as pipe_lib
    from slope_jax.parallel.config import ParallelConfig

    par = ParallelConfig(*(int(x) for x in layout))
    orbax_dir = FLAGS.orbax_dir or FLAGS.checkpoint.rstrip("/") + "-orbax"
    t0 = time.perf_counter()
    if kind == "orbax":
        cfg, params, pl = orbax_store.restore(orbax_dir, par, FLAGS.dtype)
    elif kind == "hf":
        ck = hf.open_checkpoint(FLAGS.checkpoint)
        cfg = ck.config
        pl = orbax_store.placement(cfg, par, FLAGS.dtype)
        shardings = jax.tree.map(lambda s: NamedSharding(pl.mesh, s), orbax_store._unflatten(pl.pspecs),
                                 is_leaf=lambda x: isinstance(x, Ps))
        params = hf.load_params(ck, FLAGS.dtype, shardings=shardings, stack_layers=pl.plan.flat,
                                vocab_rows=pipe_lib.vocab_rows(cfg, par.pipeline), progress=False)
    else:
        if os.path.exists(orbax_dir):
            shutil.rmtree(orbax_dir)
        meta = orbax_store.convert(FLAGS.checkpoint, orbax_dir, par, FLAGS.dtype, progress=False)
        return {"seconds": time.perf_counter() - t0, "peak_rss_mib": _rss_mib(), "bytes": meta["bytes"]}
    jax.block_until_ready(params)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "peak_rss_mib": _rss_mib(), "digests": _digests(params, pl, cfg),
            "device_bytes": sum(s.data.nbytes for a in jax.tree.leaves(params) for s in a.addressable_shards)}


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _run_child(kind: str, layout: list[str]) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), f"--child={kind}", f"--layout={','.join(layout)}",
           f"--checkpoint={FLAGS.checkpoint}", f"--dtype={FLAGS.dtype}"]
    if FLAGS.orbax_dir:
        cmd.append(f"--orbax_dir={FLAGS.orbax_dir}")
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO})
    if r.returncode:
        raise SystemExit(f"child {kind} {layout} failed:\n{r.stderr[-4000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["process_seconds"] = time.perf_counter() - t0
    print(f"  {kind:7s} layout {','.join(layout):6s}: {out['seconds']:7.2f} s, peak RSS {out['peak_rss_mib']:8.0f} MiB",
          flush=True)
    return out


def main(argv):
    del argv
    if FLAGS.child:
        print(json.dumps(_child(FLAGS.child, FLAGS.layout)))
        return
    if not os.path.exists(FLAGS.checkpoint):
        if not FLAGS.make:
            raise SystemExit(f"{FLAGS.checkpoint} does not exist (pass --make to write it)")
        subprocess.run([sys.executable, os.path.join(REPO, "checkpoints", "make_checkpoint.py"),
                        "--config", os.path.join(REPO, "configs", "gpt-oss-20b.json"), f"--layers={FLAGS.layers}",
                        f"--out={FLAGS.checkpoint}", "--num_shards=3"], check=True)
    orbax_dir = FLAGS.orbax_dir or FLAGS.checkpoint.rstrip("/") + "-orbax"
    try:
        conv = _run_child("convert", FLAGS.layout)
        hf_load = _run_child("hf", FLAGS.layout)
        same = _run_child("orbax", FLAGS.layout)
        other = _run_child("orbax", FLAGS.restore_layout)
    finally:
        if FLAGS.cleanup:
            shutil.rmtree(orbax_dir, ignore_errors=True)
            shutil.rmtree(FLAGS.checkpoint, ignore_errors=True)
    equal_same = same["digests"] == hf_load["digests"]
    equal_other = other["digests"] == hf_load["digests"]
    rows = [("HF MXFP4 load", FLAGS.layout, hf_load), ("orbax restore", FLAGS.layout, same),
            ("orbax restore", FLAGS.restore_layout, other)]
    print(f"\n{'path':15s} {'layout':8s} {'load s':>8s} {'peak RSS MiB':>13s} {'speed-up':>9s} {'RSS ratio':>10s} "
          f"{'bitwise = HF':>13s}")
    for label, lay, r in rows:  # ratios only against the HF load in the same layout (replicas cost time and RSS)
        same_layout = lay == FLAGS.layout
        speed = f"{hf_load['seconds'] / r['seconds']:8.2f}x" if same_layout else f"{'-':>9s}"
        rss = f"{r['peak_rss_mib'] / hf_load['peak_rss_mib']:10.2f}" if same_layout else f"{'-':>10s}"
        print(f"{label:15s} {','.join(lay):8s} {r['seconds']:8.2f} {r['peak_rss_mib']:13.0f} {speed} {rss} "
              f"{str(r['digests'] == hf_load['digests']):>13s}")
    print(f"convert ({','.join(FLAGS.layout)}): {conv['seconds']:.1f} s, {conv['bytes'] / 2**30:.2f} GiB stored, "
          f"peak RSS {conv['peak_rss_mib']:.0f} MiB")
    result = {"checkpoint": FLAGS.checkpoint, "layers": FLAGS.layers, "dtype": FLAGS.dtype,
              "layout": FLAGS.layout, "restore_layout": FLAGS.restore_layout, "convert": conv,
              "hf_load": hf_load, "orbax_restore": same, "orbax_restore_other_layout": other,
              "speedup": hf_load["seconds"] / same["seconds"],
              "rss_ratio": same["peak_rss_mib"] / hf_load["peak_rss_mib"],
              "bitwise_equal_same_layout": equal_same, "bitwise_equal_other_layout": equal_other}
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
    with open(FLAGS.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {FLAGS.out}")
    if not (equal_same and equal_other):
        raise SystemExit("restored parameters differ from the HF load")


if __name__ == "__main__":
    app.run(main)
