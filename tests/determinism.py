"""Determinism harness: the same batch through one layout in fresh processes with different allocator states must give
the same bits (logits and every layer's K/V), whatever else lives in the process (issue 17).

A read of memory the step never wrote (a pad row, a bubble tick, a not-yet-written chunk slot) or a race between the
virtual devices' collectives is hidden by lucky zeros in a quiet process; these states change what memory the
allocator hands out, so such a fault shows as different bits (or NaN) between runs:

  torch     import torch and transformers first (their start-up allocations and thread pools);
  arrays    allocate NaN-filled numpy and JAX arrays of ~0.4 GB and free them before the engine starts (with
            `MALLOC_MMAP_THRESHOLD_` raised: they go back to the heap, so freed memory the step reads holds NaN);
  perturb   glibc `MALLOC_PERTURB_` (every malloc'd block is filled with one byte pattern and freed blocks with
            another), with `MALLOC_MMAP_THRESHOLD_` raised so that large buffers come from the reused heap too.

Each child runs the batch `reps` times in its own process and prints one JSON line: a SHA-256 per request of its
logits and K/V bytes, per rep. `run_matrix` starts the children together (one process per allocator state) and
returns their digests; `tests/test_determinism.py` asserts they are all equal.

    PYTHONPATH=$PWD python tests/determinism.py --layout 2,4,1 --chunks 4 --state perturb   # one child, prints JSON
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

# REPO and SHIPPED as in tests/support.py, not imported from it: a child imports nothing (numpy included) before
# `_prepare` has set up its allocator state
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(REPO, "checkpoints", "tiny-gpt-oss")
STATES = ("torch", "arrays", "perturb")
# glibc: blocks up to 32 MiB come from the heap (not fresh zeroed mmap pages), so freed and reused memory is what
# the next buffer sees; MALLOC_PERTURB_=n fills allocations with ~n and freed blocks with n
PERTURB_ENV = {"MALLOC_PERTURB_": "90", "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}


@dataclasses.dataclass(frozen=True)
class Case:
    """One layout of the harness: mesh (P, R, U), seq_chunks, expert degree (None = the default rule), attention
    implementation, and the prompt lengths of the batch (token ids from a fixed seed)."""

    name: str
    layout: tuple[int, int, int]
    lengths: tuple[int, ...]
    chunks: int = 1
    expert: int | None = None
    attention_impl: str = "xla"

    def args(self) -> list[str]:
        out = ["--layout", ",".join(map(str, self.layout)), "--chunks", str(self.chunks),
               "--lengths", ",".join(map(str, self.lengths)), "--attention_impl", self.attention_impl]
        return out + (["--expert", str(self.expert)] if self.expert is not None else [])


def _prepare(state: str) -> None:
    """Bring this fresh process into an allocator state before JAX computes anything."""
    if state == "torch":
        import torch  # noqa: F401
        import transformers  # noqa: F401
    elif state == "arrays":
        import jax.numpy as jnp
        import numpy as np

        host = [np.full(1 << 21, np.nan) for _ in range(16)]  # 16 × 16 MiB, below the mmap threshold
        dev = [jnp.full((1 << 21,), jnp.nan) + i for i in range(16)]  # 16 × 8 MiB
        for a in dev:
            a.block_until_ready()
        del host, dev


def child(argv: list[str]) -> dict:
    """Run one batch `--reps` times in this process (after `--state`); returns the digests."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", required=True)
    ap.add_argument("--chunks", type=int, default=1)
    ap.add_argument("--expert", type=int, default=None)
    ap.add_argument("--lengths", required=True)
    ap.add_argument("--attention_impl", default="xla")
    ap.add_argument("--state", choices=STATES, required=True)
    ap.add_argument("--reps", type=int, default=1)
    a = ap.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    _prepare(a.state)  # before jax is imported here, so torch's start-up comes first
    import hashlib

    import jax
    import numpy as np

    jax.config.update("jax_default_matmul_precision", "highest")
    from slope_jax.parallel.config import ParallelConfig
    from slope_jax.serve.engine import PrefillEngine

    p, r, u = (int(x) for x in a.layout.split(","))
    par = ParallelConfig(pipeline=p, ring=r, ulysses=u, seq_chunks=a.chunks, expert=a.expert)
    eng = PrefillEngine.from_checkpoint(SHIPPED, par, dtype="float32", progress=False,
                                        devices=jax.devices()[:p * r * u], attention_impl=a.attention_impl)
    lengths = [int(x) for x in a.lengths.split(",")]
    rng = np.random.default_rng(17)
    prompts = [rng.integers(0, eng.cfg.vocab_size, n) for n in lengths]
    reps = []
    for _ in range(a.reps):
        digests = []
        # prefix reuse off: every rep runs the cold step (a later rep would otherwise reuse the first one's KV, a
        # different computation; the prefix-hit path has its own parity tests, tests/test_prefix_reuse.py)
        for res in eng.prefill(prompts, return_kv=True, prefix_reuse=False):
            h = hashlib.sha256(np.ascontiguousarray(res.logits).tobytes())
            for layer in sorted(res.kv):
                h.update(np.ascontiguousarray(res.kv[layer].k).tobytes())
                h.update(np.ascontiguousarray(res.kv[layer].v).tobytes())
            digests.append({"n": res.num_tokens, "sha256": h.hexdigest(),
                            "finite": bool(np.isfinite(res.logits).all())})
        reps.append(digests)
    return {"state": a.state, "pid": os.getpid(), "reps": reps}


def run_matrix(case: Case, states=STATES, reps: int = 1, timeout: float = 900, first_alone: bool = False
               ) -> list[dict]:
    """Run `case` once per allocator state, each in its own fresh process (started together: XLA compiles on one
    thread, so they overlap on a multi-core machine); returns their results in `states` order. Raises RuntimeError
    with the child's stderr tail if a child fails (a crash counts as a determinism failure).

    The children use the persistent compilation cache the caller's environment names (`SLOPE_JAX_COMPILE_CACHE`), as
    production processes do. `first_alone`: the first state's child runs to completion before the others start, so
    that they load its compiled program from the cache instead of compiling it again side by side — the same
    executable then runs in every allocator state (the faults this harness catches are run-time reads and races)."""
    if first_alone and len(states) > 1:
        return (run_matrix(case, states[:1], reps, timeout)
                + _run_together(case, states[1:], reps, timeout, index0=1))
    return _run_together(case, states, reps, timeout)


def _run_together(case: Case, states, reps: int, timeout: float, index0: int = 0) -> list[dict]:
    procs = []
    for i, state in enumerate(states, start=index0):
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the cache is SLOPE_JAX_COMPILE_CACHE's (inherited)
        if state == "perturb":
            env.update(PERTURB_ENV, MALLOC_PERTURB_=str(90 + 16 * i))
        elif state == "arrays":
            env["MALLOC_MMAP_THRESHOLD_"] = PERTURB_ENV["MALLOC_MMAP_THRESHOLD_"]
        cmd = [sys.executable, os.path.abspath(__file__), *case.args(), "--state", state, "--reps", str(reps)]
        procs.append((state, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True)))
    out = []
    for state, proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        if proc.returncode != 0:
            for _, other in procs:  # leave no child behind
                if other.poll() is None:
                    other.kill()
                    other.communicate()
            raise RuntimeError(f"{case.name} [{state}]: child exited with {proc.returncode}:\n{stderr[-3000:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def mismatches(results: list[dict]) -> list[str]:
    """Every (process, rep, request) whose digest differs from the first process's first rep, or whose logits are not
    finite; empty when all bits agree."""
    first = results[0]["reps"][0]
    bad = []
    for res in results:
        for j, rep in enumerate(res["reps"]):
            for want, got in zip(first, rep):
                if got["sha256"] != want["sha256"] or not got["finite"]:
                    bad.append(f"{res['state']} rep {j}: request of {got['n']} tokens "
                               f"{'differs' if got['sha256'] != want['sha256'] else 'is not finite'}")
    return bad


if __name__ == "__main__":
    print(json.dumps(child(sys.argv[1:])))
