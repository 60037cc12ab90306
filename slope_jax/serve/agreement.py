"""Agreement between the processes of a multi-process run, at the engine's level (the start-up fingerprint check
is `serve.distributed.preflight`): the same prefill inputs on every process, one run nonce, process 0's choice of
the step options that "auto" resolves per host (`agreed_options`), barriers before a step's first collective. Each
is a no-op (or the local value) in a single-process run.
"""

from __future__ import annotations

import hashlib

import jax
import numpy as np

from slope_jax import kv as kvfmt
from slope_jax.serve.requests import RequestError


def inputs_digest(prompts, ids, *options) -> bytes:
    """SHA-256 of a prefill call's prompts (as int64 token ids, or their repr when not numeric), ids and options."""
    h = hashlib.sha256(repr((None if ids is None else [str(x) for x in ids], options)).encode())
    for p in prompts:
        try:
            h.update(b"|" + np.ascontiguousarray(np.asarray(p, dtype=np.int64)).tobytes())
        except Exception:  # noqa: BLE001 - an invalid prompt still hashes; validation reports it afterwards
            h.update(b"|" + repr(p).encode())
    return h.digest()


def check_same_on_all_processes(prompts, ids, *options) -> None:
    """All-gather a digest of the call's inputs; raise RequestError on every process if any process differs."""
    from jax.experimental import multihost_utils

    mine = np.frombuffer(inputs_digest(prompts, ids, *options), np.uint8)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), -1)
    groups: dict[bytes, list[int]] = {}
    for pid, d in enumerate(every):
        groups.setdefault(d.tobytes(), []).append(pid)
    if len(groups) > 1:
        desc = "; ".join(f"process(es) {pids} passed inputs {key[:4].hex()}" for key, pids in groups.items())
        raise RequestError(f"prefill: the processes passed different prompts, ids or options ({desc}); under several "
                           "processes every process must call prefill with the same arguments")


def process0_answer(values: np.ndarray) -> np.ndarray:
    """Process 0's `values`, on every process (the local ones in a single-process run)."""
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(values))


def agreed_options(options):
    """`options` (resolved `StepOptions`) with process 0's `bf16_matmul`: "auto" resolves per host CPU
    (`options.resolve_bf16_matmul`), and every process must compile the same step; the numbers are the same either
    way (float32 summation order aside), only the speed on a host of another CPU kind differs. Single process: as
    given."""
    if jax.process_count() == 1:
        return options
    import dataclasses

    from slope_jax.model.options import BF16_MATMULS

    mine = np.asarray([BF16_MATMULS.index(options.bf16_matmul)], np.int32)
    return dataclasses.replace(options, bf16_matmul=BF16_MATMULS[int(process0_answer(mine)[0])])


def agreed_run_nonce() -> str:
    """A fresh run nonce, the same on every process (process 0's, broadcast once at engine start)."""
    nonce = kvfmt.new_run_nonce()
    if jax.process_count() > 1:
        raw = np.frombuffer(bytes.fromhex(nonce), np.uint8)
        nonce = bytes(np.asarray(process0_answer(raw), np.uint8)).hex()
    return nonce


def meet_peers(name: str, timeout_s: float = 3600.0) -> None:
    """Wait until every process reaches the barrier `name` (JAX's coordination service, not a device collective,
    so it waits as long as a compile may take; `timeout_s` bounds it)."""
    from jax._src import distributed  # the client JAX's own multi-process set-up made

    client = distributed.global_state.client
    if client is not None:
        client.wait_at_barrier(name, timeout_in_ms=int(timeout_s * 1e3))
