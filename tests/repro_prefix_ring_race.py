"""Reproducer (issue 17): the XLA:CPU race that made the sequence-pipelined step nondeterministic, and its workaround.

`context_parallel.prefix_attention` passes the queries (and positions and online-softmax state) round the R·U devices
of a stage. Written as a `jax.lax.fori_loop` whose body ppermutes its carry, nested in the chunked step's tick scan,
jaxlib 0.10.2's CPU runtime intermittently copied from a peer's buffer while it was being rewritten or after it was
freed: logits 0.1–1.3 off, NaN, or a segfault in `xla::cpu::InProcessCommunicator::CollectivePermute` (memcpy,
inside `WhileThunk::ExecuteAsyncForLoop`). Valid JAX cannot segfault, so this is an XLA:CPU fault; it needs the
allocator to hand freed heap memory back (glibc `MALLOC_MMAP_THRESHOLD_` raised, `MALLOC_PERTURB_` marks it), or
the lucky layout a torch import produced. The library now unrolls that loop (every hop its own collective on its own
buffers). A smaller shard_map-only program (fori_loop of ppermutes inside a scan) did not reproduce it in 300 runs,
so this script drives the real step.

    PYTHONPATH=$PWD python tests/repro_prefix_ring_race.py            # both variants, 3 fresh processes each

Each child builds the (2,4,1) × seq_chunks=4 engine on checkpoints/tiny-gpt-oss (float32), runs one 500-token prompt
`--reps` times and counts runs whose logits differ from the first run's bits (or are not finite); the parent prints
per variant the mismatching runs and crashed children. Measured (2 loaded CPU cores): fori_loop 22 of 30 runs
wrong in one process, a segfault with experts replicated; unrolled 0 of 30 (and 0 of 30 replicated).
"""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _prefix_attention_fori(q, q_pos, k, v, k_pos, *, ring, ulysses, options, window=2**30):
    """`context_parallel.prefix_attention` as it was: the ring as a fori_loop over the carry."""
    import functools

    import jax

    from slope_jax.model import attention as attn_lib

    t, n, h = q.shape
    group = ring * ulysses
    attend = functools.partial(attn_lib.attend, window=window, q_tile=options.q_tile, kv_tile=options.kv_tile,
                               impl=options.attention_impl)
    st = attend(q, k, v, q_pos, k_pos)
    axes = ("ring", "ulysses")
    perm = [(d, (d + 1) % group) for d in range(group)]

    def step(_, carry):
        qv, pv, sv = jax.tree.map(lambda a: jax.lax.ppermute(a, axes, perm), carry)
        return qv, pv, attend(qv, k, v, pv, k_pos, state=sv)

    _, _, st = jax.lax.fori_loop(1, group, step, (q, q_pos, st))
    st = jax.tree.map(lambda a: jax.lax.ppermute(a, axes, perm), st)
    return attn_lib.AttnState(st.o.reshape(t, n, h), st.m.reshape(t, n), st.l.reshape(t, n))


def child(variant: str, reps: int) -> None:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np

    jax.config.update("jax_default_matmul_precision", "highest")
    from slope_jax.parallel import context_parallel
    from slope_jax.parallel.config import ParallelConfig
    from slope_jax.serve.engine import PrefillEngine

    if variant == "fori":
        context_parallel.prefix_attention = _prefix_attention_fori
    par = ParallelConfig(pipeline=2, ring=4, ulysses=1, seq_chunks=4)
    eng = PrefillEngine.from_checkpoint(os.path.join(REPO, "checkpoints", "tiny-gpt-oss"), par, dtype="float32",
                                        progress=False)
    prompt = np.random.default_rng(0).integers(0, eng.cfg.vocab_size, 500)
    first = None
    bad = 0
    for _ in range(reps):
        (res,) = eng.prefill([prompt], return_kv=False)
        first = res.logits if first is None else first
        bad += (not np.array_equal(res.logits, first)) or (not np.isfinite(res.logits).all())
    print(f"RESULT {bad}")


def main(reps: int = 10, processes: int = 3) -> None:
    env = {**os.environ, "PYTHONPATH": REPO, "MALLOC_PERTURB_": "90", "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}
    for variant in ("fori", "unrolled"):
        bad, crashed = 0, 0
        for _ in range(processes):
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", variant, str(reps)], env=env,
                                  capture_output=True, text=True)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                crashed += 1
            else:
                bad += int(lines[-1].split()[1])
        print(f"{variant:9s}: {bad} of {reps * (processes - crashed)} runs differ from their process's first run; "
              f"{crashed} of {processes} processes crashed")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]))
    else:
        main()
