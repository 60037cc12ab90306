"""What a cache write costs: compile the small programs of eager JAX ops over S array shapes (~4 per shape) into a
compilation-cache directory that already holds M entries, with (a) no persistent cache, (b) JAX's own LRU file
cache capped at `compile_cache.MAX_BYTES` (file lock + a listing and stat of the whole directory on every write),
(c) slope_jax's `compile_cache.DirectoryCache` (atomic rename, no scan; trimmed once per process). Each case runs
in a fresh process on its own freshly filled directory.

    python benchmarks/compile_cache_writes.py                       # 100 shapes, 0 and 1500 entries, ~3 min
    python benchmarks/compile_cache_writes.py --shapes=30 --entries=0,3000

Prints a table and writes JSON (default benchmarks/measured/cpu/compile_cache_writes.json).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

from absl import app, flags

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)
from common import start_load, write_result  # noqa: E402  (benchmarks/common.py)

FLAGS = flags.FLAGS
flags.DEFINE_integer("shapes", 100, "Array shapes; each compiles ~4 small programs (eager ops).")
flags.DEFINE_list("entries", ["0", "1500"], "Entries already in the cache directory (1 KiB each).")
flags.DEFINE_string("out", "benchmarks/measured/cpu/compile_cache_writes.json", "JSON output path.")

CASES = ("off", "jax_lru_capped", "directory_cache")

# one case in a fresh process: argv = case, directory, shapes; prints the seconds
CHILD = r"""
import sys, time
import jax, jax.numpy as jnp
case, directory, shapes = sys.argv[1], sys.argv[2], int(sys.argv[3])
from slope_jax import compile_cache
if case == "off":
    compile_cache.enable("off")
elif case == "directory_cache":
    compile_cache.enable(directory)
else:  # JAX's own cache, configured as slope_jax did before DirectoryCache
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_compilation_cache_max_size", compile_cache.MAX_BYTES)
t0 = time.perf_counter()
for n in range(3, 3 + shapes):
    x = jnp.ones((n, 7))
    (jnp.exp((x * 2 + 1).sum(0))).block_until_ready()
print(time.perf_counter() - t0)
"""


def _fill(directory: str, entries: int) -> None:
    os.makedirs(directory, exist_ok=True)
    for i in range(entries):
        with open(os.path.join(directory, f"filler{i:06d}-cache"), "wb") as f:
            f.write(os.urandom(1024))
        with open(os.path.join(directory, f"filler{i:06d}-atime"), "wb") as f:
            f.write((i + 1).to_bytes(8, "little"))  # JAX's LRU reads one beside each entry


def main(argv):
    del argv
    load0 = start_load()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    rows = []
    for entries in (int(e) for e in FLAGS.entries):
        for case in CASES:
            with tempfile.TemporaryDirectory() as tmp:
                directory = os.path.join(tmp, "xla")
                _fill(directory, entries)
                out = subprocess.run([sys.executable, "-c", CHILD, case, directory, str(FLAGS.shapes)], env=env,
                                     capture_output=True, text=True, check=True)
                written = len([n for n in os.listdir(directory) if n.endswith("-cache")]) - entries
                shutil.rmtree(directory)
            rows.append(dict(case=case, entries_before=entries, shapes=FLAGS.shapes,
                             seconds=round(float(out.stdout.split()[-1]), 2), entries_written=written))
            print(f"{case:16s} entries before {entries:6d}: {rows[-1]['seconds']:7.2f} s "
                  f"({written} programs written)", flush=True)
    print(f"\n{'case':16s} {'entries':>8s} {'s':>8s} {'vs off':>8s}")
    for r in rows:
        off = next(o["seconds"] for o in rows if o["case"] == "off" and o["entries_before"] == r["entries_before"])
        r["vs_off"] = round(r["seconds"] / off, 3)
        print(f"{r['case']:16s} {r['entries_before']:8d} {r['seconds']:8.2f} {r['vs_off']:8.2f}x")
    write_result(FLAGS.out, dict(cpu_count=os.cpu_count(), rows=rows), load_start=load0)
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
