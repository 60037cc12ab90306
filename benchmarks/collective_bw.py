"""Bandwidth of the collectives the engine uses, on all local devices of one host: all_to_all (Ulysses), a ring
ppermute (ring attention), all_gather and psum, each inside `jax.shard_map` over a 1-D mesh of every local device.

    PYTHONPATH=. python3 benchmarks/collective_bw.py --out /tmp/collective_bw.json                     # GPUs
    PYTHONPATH=. python3 benchmarks/collective_bw.py --smoke --cpu_devices=8 --out /tmp/collective_bw.json  # CPU

Each device holds S bytes of float32 (`--sizes_mib`, the per-device message size) shaped `[n, S/(4n)]` (n = devices).
A measurement times `--calls` back-to-back dispatches of the jitted collective, blocked at the end (async dispatch
hides the per-call launch cost), divides by `--calls`, and keeps the best of `--repeats` such measurements, after
one untimed call (compilation, communicator set-up). Bandwidths in GB/s (1e9 bytes/s) per device, t = that time:

    op           what each device does                                algbw            busbw
    all_to_all   sends S·(n−1)/n, keeps S/n (Ulysses' head/seq swap)  S / t            S·(n−1)/n / t
    ppermute     sends S to its ring successor, receives S            S / t            S / t
    all_gather   gathers n·S (its own S included)                     n·S / t          n·S·(n−1)/n / t
    psum         all-reduces S                                        S / t            S·2(n−1)/n / t

algbw follows nccl-tests (PERFORMANCE.md: size / time, size = the bytes of one rank's result buffer) and busbw its
correction to the bytes each device must move over its links, comparable with the link's bandwidth whatever n is.
With one device the collectives are copies or no-ops: the run is recorded with `single_device: true`.
Writes `benchmarks/common.write_result` JSON: {backend, device, device_count, sizes_bytes, results: {op: [{bytes,
seconds, algbw_GBps, busbw_GBps}]}, failures: {op/size: error}}; a failed size is recorded and the run goes on.
Exit status 0 unless nothing was measured.
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import seconds, start_load, write_result  # noqa: E402  (benchmarks/common.py)

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "benchmarks/results/collective_bw.json", "JSON output path.")
flags.DEFINE_list("sizes_mib", None, "Per-device message sizes in MiB (default 1,16,64; smoke 0.0625,0.25).")
flags.DEFINE_list("ops", ["all_to_all", "ppermute", "all_gather", "psum"], "Collectives to time.")
flags.DEFINE_integer("repeats", 5, "Measurements per op and size (the best is reported; smoke 2).")
flags.DEFINE_integer("calls", 10, "Back-to-back calls per measurement (smoke 2).")
flags.DEFINE_integer("cpu_devices", 0, "Split the host CPU into this many virtual devices (dry runs); 0: the "
                     "backend's own devices.")
flags.DEFINE_float("budget_s", 240.0, "Sizes that would start after this many seconds are skipped.")
flags.DEFINE_bool("smoke", False, "Tiny sizes, few repeats: checks the script, not the links.")

AXIS = "devices"
# busbw / algbw per op (nccl-tests PERFORMANCE.md), n = devices
BUS_FACTOR = {"all_to_all": lambda n: (n - 1) / n, "ppermute": lambda n: 1.0,
              "all_gather": lambda n: (n - 1) / n, "psum": lambda n: 2 * (n - 1) / n}


def collective(op: str, n: int):
    """The per-device body of `op` over mesh axis AXIS: `[n, m]` float32 in; out `[n, m]` (all_gather `[n·n, m]`)."""
    import jax

    if op == "all_to_all":  # Ulysses: split rows over the devices, concatenate the received rows
        return lambda x: jax.lax.all_to_all(x, AXIS, split_axis=0, concat_axis=0, tiled=True)
    if op == "ppermute":  # ring attention: each device sends its block to its successor
        perm = [(i, (i + 1) % n) for i in range(n)]
        return lambda x: jax.lax.ppermute(x, AXIS, perm)
    if op == "all_gather":
        return lambda x: jax.lax.all_gather(x, AXIS, axis=0, tiled=True)
    if op == "psum":
        return lambda x: jax.lax.psum(x, AXIS)
    raise ValueError(f"unknown op {op!r} (known: {', '.join(BUS_FACTOR)})")


def measure(op: str, size_bytes: int, mesh, repeats: int, calls: int) -> dict:
    """Time `op` with `size_bytes` per device (rounded down to whole `[n, m]` float32 rows). Returns {bytes, seconds,
    algbw_GBps, busbw_GBps}."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = mesh.devices.size
    m = max(1, size_bytes // (4 * n))
    s = 4 * n * m  # the bytes each device really holds
    x = jax.device_put(jnp.arange(n * n * m, dtype=jnp.float32).reshape(n * n, m), NamedSharding(mesh, P(AXIS)))
    f = jax.jit(jax.shard_map(collective(op, n), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    jax.block_until_ready(f(x))

    def run():
        outs = [f(x) for _ in range(calls)]
        jax.block_until_ready(outs)

    t = min(seconds(run) for _ in range(max(1, repeats))) / calls
    alg = (n * s if op == "all_gather" else s) / t
    return {"bytes": s, "seconds": t, "algbw_GBps": alg / 1e9, "busbw_GBps": alg * BUS_FACTOR[op](n) / 1e9}


def main(argv):
    del argv
    load0 = start_load()
    if FLAGS.cpu_devices:
        from slope_jax import xla_env

        xla_env.configure(cpu_devices=FLAGS.cpu_devices, platform="cpu")
    import jax
    import numpy as np
    from jax.sharding import Mesh

    smoke = FLAGS.smoke
    sizes = [float(s) for s in (FLAGS.sizes_mib or (["0.0625", "0.25"] if smoke else ["1", "16", "64"]))]
    repeats, calls = (2, 2) if smoke else (FLAGS.repeats, FLAGS.calls)
    devices = jax.local_devices()
    mesh = Mesh(np.array(devices), (AXIS,))
    doc = {"backend": jax.default_backend(), "device": devices[0].device_kind, "device_count": len(devices),
           "single_device": len(devices) == 1, "smoke": smoke, "repeats": repeats, "calls": calls,
           "sizes_bytes": [int(s * 2**20) for s in sizes], "results": {op: [] for op in FLAGS.ops},
           "failures": {}, "skipped": []}
    t0 = time.perf_counter()
    for op in FLAGS.ops:
        for s in sizes:
            key = f"{op}/{s:g}MiB"
            if time.perf_counter() - t0 > FLAGS.budget_s:
                doc["skipped"].append(key)
                continue
            try:
                row = measure(op, int(s * 2**20), mesh, repeats, calls)
            except Exception as e:  # noqa: BLE001 - record and go on with the next size
                doc["failures"][key] = f"{type(e).__name__}: {str(e)[:2000]}"
                print(f"{key:<24} FAILED {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                      flush=True)
                continue
            doc["results"][op].append(row)
            print(f"{key:<24} {row['seconds'] * 1e6:10.1f} us  algbw {row['algbw_GBps']:8.2f} GB/s  "
                  f"busbw {row['busbw_GBps']:8.2f} GB/s", flush=True)
            write_result(FLAGS.out, doc, load_start=load0)
    doc["elapsed_s"] = round(time.perf_counter() - t0, 1)
    write_result(FLAGS.out, doc, load_start=load0)
    measured = sum(len(v) for v in doc["results"].values())
    print(f"{measured} measurements on {len(devices)} {doc['device']} devices; wrote {FLAGS.out}", flush=True)
    sys.exit(0 if measured else 1)


if __name__ == "__main__":
    app.run(main)
