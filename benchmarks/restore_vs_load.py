"""Fast restart: orbax restore (`python -m slope_jax.convert` output) vs loading the HF MXFP4 checkpoint.

    python benchmarks/restore_vs_load.py --make --cleanup     # writes the 20b-shaped 2-layer cut first (~3.1 GB)

Each measurement runs in its own child process (8 virtual CPU devices): the wall time of the load/restore call
(until every array is ready, JAX start-up excluded), the child's peak resident memory (`ru_maxrss`), CPU time and
page faults. The HF load and the orbax restore at --layout alternate for --rounds rounds (medians compared), each
child starting from the page-cache state --cache asks for. The first child of each path, and the restore into
--restore_layout, hash every parameter canonically (per layer, in natural layer order, vocabulary rows cut to V), so
the HF load and the restores are compared bit for bit by digest. Prints a table and writes JSON.

The "copy floor" child copies the checkpoint's bytes once, in one thread, into fresh aligned host blocks: the least
work any loader does to produce the parameters in new host memory.

Measured (2-core Firecracker VM, bf16, gpt-oss-20b dims cut to 2 layers, 3.05 GiB; 9.8 GiB of device arrays at
(2,2,2) held in 3.05 GiB of host blocks, replicas shared; JSON in benchmarks/measured/cpu/), medians of 5 rounds:
  --cache=warm  HF load 7.36 s, orbax restore 7.61 s (0.97x), copy floor 3.68 s; peak RSS 0.68x
  --cache=cold  HF load 7.76 s, orbax restore 5.03 s (1.54x), copy floor 9.79 s; peak RSS 0.63x
  (an earlier cold run of the same code, 30 min before: HF 9.52 s, orbax 2.88 s, 3.31x — this VM's memory and
  disk vary that much between runs, hence alternating rounds)
Warm, both paths are bound by the kernel zeroing the fresh host memory that becomes the parameters (perf: 51-59 %
of CPU samples in clear_page_erms in both) and copy the bytes twice (source -> reader buffer -> block); the HF load
is 2.0x the one-thread copy floor, so a 3x faster restore would have to beat a single memcpy into fresh memory by
1.5x. Cold, the restore's concurrent TensorStore reads beat the HF path's one-thread mmap faults.
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
from common import start_load, write_result  # noqa: E402  (benchmarks/common.py)

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
flags.DEFINE_integer("rounds", 3, "Rounds of (HF load, orbax restore) at --layout, alternating; medians are compared.")
flags.DEFINE_enum("cache", "warm", ["cold", "warm", "asis"],
                  "Page cache before each timed child: cold = dropped (root: writes /proc/sys/vm/drop_caches), "
                  "warm = dropped, then the files that child reads are read once (both paths start from the same "
                  "state), asis = untouched.")
flags.DEFINE_enum("child", None, ["convert", "hf", "orbax", "floor"], "Internal: run one measurement and print JSON.")
flags.DEFINE_bool("digests", True, "Internal: the child hashes every parameter.")


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


def _floor() -> dict:
    """The copy floor of any loader on this machine: the checkpoint's bytes (page cache as --cache leaves it) copied
    once, by one thread, into fresh 64-byte-aligned host blocks of at most 512 MiB (what both loaders must at least
    do to produce the parameters in new host memory). No JAX, no parsing."""
    import glob
    import mmap

    import numpy as np

    from slope_jax.checkpoints.host import aligned_zeros

    t0 = time.perf_counter()
    blocks, step = [], 512 << 20
    for f in sorted(glob.glob(os.path.join(FLAGS.checkpoint, "*.safetensors"))):
        with open(f, "rb") as fh:
            m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        src = np.frombuffer(m, np.uint8)
        for a in range(0, src.size, step):
            block = aligned_zeros((min(src.size, a + step) - a,), np.uint8)
            block[:] = src[a:a + block.size]
            blocks.append(block)
    seconds = time.perf_counter() - t0
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"seconds": seconds, "peak_rss_mib": _rss_mib(), "cpu_user_s": ru.ru_utime, "cpu_sys_s": ru.ru_stime,
            "minor_faults": ru.ru_minflt, "bytes": sum(b.nbytes for b in blocks)}


def _child(kind: str, layout: list[str]) -> dict:
    if kind == "floor":
        return _floor()
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as Ps

    from slope_jax.checkpoints import digest, hf, orbax_store
    from slope_jax.parallel import stages
    from slope_jax.parallel.config import ParallelConfig

    par = ParallelConfig(*(int(x) for x in layout))
    orbax_dir = FLAGS.orbax_dir or FLAGS.checkpoint.rstrip("/") + "-orbax"
    reads = digest.ReadDigests()  # the loaders' own full-content digest (every byte hashed as read): its cost
    t0 = time.perf_counter()
    if kind == "orbax":
        cfg, params, pl = orbax_store.restore(orbax_dir, par, FLAGS.dtype, reads=reads)
    elif kind == "hf":
        ck = hf.open_checkpoint(FLAGS.checkpoint)
        cfg = ck.config
        pl = orbax_store.placement(cfg, par, FLAGS.dtype)
        shardings = jax.tree.map(lambda s: NamedSharding(pl.mesh, s), orbax_store._unflatten(pl.pspecs),
                                 is_leaf=lambda x: isinstance(x, Ps))
        params = hf.load_params(ck, FLAGS.dtype, shardings=shardings, stack_layers=pl.plan.flat,
                                vocab_rows=stages.vocab_rows(cfg, par), progress=False, reads=reads)
    else:
        if os.path.exists(orbax_dir):
            shutil.rmtree(orbax_dir)
        meta = orbax_store.convert(FLAGS.checkpoint, orbax_dir, par, FLAGS.dtype, progress=False)
        return {"seconds": time.perf_counter() - t0, "peak_rss_mib": _rss_mib(), "bytes": meta["bytes"]}
    jax.block_until_ready(params)
    seconds = time.perf_counter() - t0
    ru = resource.getrusage(resource.RUSAGE_SELF)
    out = {"seconds": seconds, "peak_rss_mib": _rss_mib(), "cpu_user_s": ru.ru_utime, "cpu_sys_s": ru.ru_stime,
           "minor_faults": ru.ru_minflt, "read_digest_seconds": reads.seconds, "read_digest_bytes": reads.nbytes,
           "read_digest_share": reads.seconds / seconds,
           "device_bytes": sum(s.data.nbytes for a in jax.tree.leaves(params) for s in a.addressable_shards),
           "host_buffers_bytes": sum({s.data.unsafe_buffer_pointer(): s.data.nbytes for a in jax.tree.leaves(params)
                                      for s in a.addressable_shards}.values())}
    if FLAGS.digests:
        out["digests"] = _digests(params, pl, cfg)
    return out


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _prepare_cache(paths: list[str]) -> None:
    if FLAGS.cache == "asis":
        return
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError as e:
        raise SystemExit(f"--cache={FLAGS.cache} drops the page cache and needs root ({e}); use --cache=asis") from e
    if FLAGS.cache == "warm":
        for root in paths:
            for d, _, files in os.walk(root):
                for name in files:
                    with open(os.path.join(d, name), "rb") as f:
                        while f.read(64 << 20):
                            pass


def _run_child(kind: str, layout: list[str], digests: bool = True) -> dict:
    orbax_dir = FLAGS.orbax_dir or FLAGS.checkpoint.rstrip("/") + "-orbax"
    if kind != "convert":
        _prepare_cache([orbax_dir if kind == "orbax" else FLAGS.checkpoint])  # floor reads what hf reads
    cmd = [sys.executable, os.path.abspath(__file__), f"--child={kind}", f"--layout={','.join(layout)}",
           f"--checkpoint={FLAGS.checkpoint}", f"--dtype={FLAGS.dtype}", f"--digests={digests}"]
    if FLAGS.orbax_dir:
        cmd.append(f"--orbax_dir={FLAGS.orbax_dir}")
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO})
    if r.returncode:
        raise SystemExit(f"child {kind} {layout} failed:\n{r.stderr[-4000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["process_seconds"] = time.perf_counter() - t0
    print(f"  {kind:7s} layout {','.join(layout):6s}: {out['seconds']:7.2f} s, peak RSS {out['peak_rss_mib']:8.0f} MiB"
          + (f", cpu user {out['cpu_user_s']:.1f} s sys {out['cpu_sys_s']:.1f} s, minor faults {out['minor_faults']}"
             if "cpu_sys_s" in out else "")
          + (f", weight digest {out['read_digest_seconds']:.2f} s = {100 * out['read_digest_share']:.1f} % of the "
             f"load ({out['read_digest_bytes'] / 2**30:.2f} GiB hashed)" if "read_digest_share" in out else ""),
          flush=True)
    return out


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


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
    load0 = start_load()
    runs: dict[str, list[dict]] = {"hf": [], "orbax": [], "floor": []}
    try:
        conv = _run_child("convert", FLAGS.layout)
        for r in range(FLAGS.rounds):  # alternate, so drift of the machine hits both paths alike
            for kind in ("hf", "orbax", "floor"):
                runs[kind].append(_run_child(kind, FLAGS.layout, digests=r == 0))
        other = _run_child("orbax", FLAGS.restore_layout)
    finally:
        if FLAGS.cleanup:
            shutil.rmtree(orbax_dir, ignore_errors=True)
            shutil.rmtree(FLAGS.checkpoint, ignore_errors=True)
    hf_load, same = runs["hf"][0], runs["orbax"][0]
    equal_same = same["digests"] == hf_load["digests"]
    equal_other = other["digests"] == hf_load["digests"]
    med = {k: _median([x["seconds"] for x in v]) for k, v in runs.items()}
    best = {k: min(x["seconds"] for x in v) for k, v in runs.items()}
    rss = {k: _median([x["peak_rss_mib"] for x in v]) for k, v in runs.items()}
    print(f"\n{FLAGS.rounds} rounds, page cache {FLAGS.cache}")
    print(f"{'path':15s} {'layout':8s} {'median s':>9s} {'best s':>8s} {'peak RSS MiB':>13s} {'speed-up':>9s} "
          f"{'RSS ratio':>10s} {'bitwise = HF':>13s}")
    for label, kind in (("HF MXFP4 load", "hf"), ("orbax restore", "orbax"), ("copy floor", "floor")):
        equal = str(runs[kind][0]["digests"] == hf_load["digests"]) if "digests" in runs[kind][0] else "-"
        print(f"{label:15s} {','.join(FLAGS.layout):8s} {med[kind]:9.2f} {best[kind]:8.2f} {rss[kind]:13.0f} "
              f"{med['hf'] / med[kind]:8.2f}x {rss[kind] / rss['hf']:10.2f} {equal:>13s}")
    print(f"{'orbax restore':15s} {','.join(FLAGS.restore_layout):8s} {other['seconds']:9.2f} {'-':>8s} "
          f"{other['peak_rss_mib']:13.0f} {'-':>9s} {'-':>10s} {str(equal_other):>13s}")
    print(f"speed-up of medians {med['hf'] / med['orbax']:.2f}x, of best runs {best['hf'] / best['orbax']:.2f}x; "
          f"convert ({','.join(FLAGS.layout)}): {conv['seconds']:.1f} s, {conv['bytes'] / 2**30:.2f} GiB stored")
    result = {"checkpoint": FLAGS.checkpoint, "layers": FLAGS.layers, "dtype": FLAGS.dtype, "cache": FLAGS.cache,
              "rounds": FLAGS.rounds, "layout": FLAGS.layout, "restore_layout": FLAGS.restore_layout,
              "convert": conv, "hf_load_runs": runs["hf"], "orbax_restore_runs": runs["orbax"],
              "copy_floor_runs": runs["floor"],
              "orbax_restore_other_layout": other,
              "median_seconds": med, "best_seconds": best, "median_peak_rss_mib": rss,
              "speedup_median": med["hf"] / med["orbax"], "speedup_best": best["hf"] / best["orbax"],
              "rss_ratio": rss["orbax"] / rss["hf"],
              "bitwise_equal_same_layout": equal_same, "bitwise_equal_other_layout": equal_other}
    write_result(FLAGS.out, result, load_start=load0)
    print(f"wrote {FLAGS.out}")
    if not (equal_same and equal_other):
        raise SystemExit("restored parameters differ from the HF load")


if __name__ == "__main__":
    app.run(main)
