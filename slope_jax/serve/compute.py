"""The launcher's compute loop, run by every process: process 0's front (`serve.front.Front`) takes the next batch
from the scheduler, `Broadcast` sends it to all processes, all run it (`prefill_isolated`: in the engine steps of
`steps.group_steps`, a failing step retried one request at a time), and process 0 writes the records.

Nothing here reads absl flags: the export options come in as arguments. No JAX or numpy at import.
"""

from __future__ import annotations

import dataclasses
import json
import time
import traceback

from absl import logging

from slope_jax.serve.steps import group_steps


class Broadcast:
    """Process 0 → all processes: one JSON value per call (a batch, or None to stop), as its byte length and then
    fixed-size chunks, so that the collectives are two compiled programs however large the value (one per padded
    size before: the first batch of each new size class compiled another broadcast, ~0.1 s of its TTFT)."""

    CHUNK = 1 << 16  # bytes per broadcast chunk

    def __init__(self, multi: bool):
        self.multi = multi

    def __call__(self, value):
        if not self.multi:
            return value
        import jax
        import numpy as np
        from jax.experimental import multihost_utils

        data = json.dumps(value).encode() if jax.process_index() == 0 else b""
        n = int(multihost_utils.broadcast_one_to_all(np.array([len(data)], np.int64))[0])
        out = bytearray()
        for start in range(0, n, self.CHUNK):
            buf = np.zeros(self.CHUNK, np.uint8)
            part = data[start:start + self.CHUNK]
            buf[:len(part)] = np.frombuffer(part, np.uint8)
            out += np.asarray(multihost_utils.broadcast_one_to_all(buf))[:min(self.CHUNK, n - start)].tobytes()
        return json.loads(out.decode())

    def warm(self) -> None:
        """Every process: compile the broadcast's programs and `any_process`'s all-gather before the first batch,
        whose TTFT would otherwise include them."""
        if self.multi:
            self({"warm": "x" * 8})
            any_process(False)


def any_process(flag: bool) -> bool:
    """True on every process if `flag` is True on any (one small all-gather; identity for one process)."""
    import jax

    if jax.process_count() == 1:
        return flag
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.asarray(multihost_utils.process_allgather(np.array([int(flag)], np.int32))).any())


def _failure_text(err: BaseException) -> str:
    return f"prefill failed: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"


@dataclasses.dataclass(frozen=True)
class BatchItem:
    """One request of a batch, as every process runs it: its id, token ids (int32 `[n]`), arrival
    (`time.perf_counter()` on process 0; None elsewhere), `cache_salt` (None: none) and `early`: process 0 will ask
    for its rows before the export (an HTTP request answered over NIXL, `serve.http.HttpIntake.wants_early`), so
    under several processes every process helps bring them to process 0 (`PrefillEngine.prefill`'s `rows_for`)."""

    id: str
    tokens: object
    arrival: float | None = None
    cache_salt: str | None = None
    early: bool = False

    def to_wire(self) -> list:
        """The JSON-able form `Broadcast` sends (the arrival stays on process 0)."""
        return [self.id, [int(t) for t in self.tokens], self.cache_salt, self.early]

    @classmethod
    def from_wire(cls, wire: list, arrival: float | None = None) -> BatchItem:
        import numpy as np

        return cls(wire[0], np.asarray(wire[1], np.int32), arrival, wire[2], bool(wire[3]))


@dataclasses.dataclass(frozen=True)
class WarmUp:
    """What process 0's intake returns instead of a batch when the engine is idle and admission refused requests for
    the compile time of step shapes not compiled yet (`Scheduler.take_warm`): those shapes, as engine keys
    `(t, m)` / `(t, m, prefix_rows)` (`slo.engine_key`), for every process to compile (`warm_up`)."""

    keys: list


def warm_up(engine, keys: list, front=None) -> None:
    """Every process: compile these step shapes (`PrefillEngine.compiled`; a failure is logged, never fatal: no
    request waits on it); process 0 (`front`) then tells the scheduler the engine is free."""
    if front is not None:
        shapes = ", ".join(f"T={k[0]} x {k[1]}" + (f" after {k[2]} cached rows" if len(k) > 2 else "") for k in keys)
        logging.info("warming %d step shape(s) admission refused requests for while they were not compiled: %s "
                     "(later requests of these lengths, and later runs through the compilation cache, skip that "
                     "compile)", len(keys), shapes)
    for key in keys:
        try:
            engine.compiled(*key)
        except Exception:  # noqa: BLE001 - e.g. a bucket too large for device memory: its requests will say so
            logging.warning("warming step shape %s failed: %s", key, traceback.format_exc(limit=2))
    if front is not None:
        front.predict_ms.record_compiled()  # the next run reads the step index: a load, not a full compile
        front.scheduler.finished(time.perf_counter())


TIMED_REPEAT_UNDER_MS = 1000.0  # `timed_runs` runs a step again only when its first run took less than this
TIMED_BUDGET_MS = 30_000.0  # `timed_runs` starts no further step once its runs took this long in all


def timed_runs(engine, lengths, broadcast: Broadcast, budget_ms: float = TIMED_BUDGET_MS) -> list:
    """Every process (the steps are collective; `broadcast` shares process 0's times, so every process makes the
    same choices): run steps of these lengths' buckets on `engine` — one prompt, and on a mesh also
    `parallel.in_flight` prompts in one step (token ids `0, 1, …` modulo the vocabulary; prefix reuse off, nothing
    exported or kept) — and return `[(length, prompts, ms)]`, the wall time of each step's last run: one length per
    bucket, shortest first, until the runs took `budget_ms` in all. A step whose first run took under
    `TIMED_REPEAT_UNDER_MS` runs twice and reports the second: the first pays what a program's first execution costs
    once (its buffers, the runtime's first dispatch; ~50 ms more per bucket of the tiny checkpoint on 8 CPU
    devices), which no later request pays and which would overstate a short step; on a longer one that cost is a
    few percent, and a second run would double the warm-up. The launcher runs its `--precompile` lengths through
    this before traffic and seeds the scheduler's cost model with the times (`slo.BatchModel.seed`). Raises what
    `PrefillEngine.prefill` raises."""
    import numpy as np

    buckets: dict = {}
    for n in sorted(int(x) for x in lengths):
        buckets.setdefault(engine.bucket(n), n)
    per_step = [1] if engine.mesh is None else sorted({1, engine.parallel.in_flight})
    out, spent = [], 0.0
    for n, m in ((n, m) for n in buckets.values() for m in per_step):
        if spent >= budget_ms:
            break
        ids = np.arange(n, dtype=np.int64) % engine.cfg.vocab_size
        for _ in range(2):
            t0 = time.perf_counter()
            engine.prefill([ids] * m, prefix_reuse=False, return_kv=False)
            ms = float(broadcast((time.perf_counter() - t0) * 1e3))
            spent += ms
            if ms >= TIMED_REPEAT_UNDER_MS:
                break
        out.append((n, m, ms))
    return out


def prefill_isolated(engine, items: list[BatchItem], *, kv_store=None, kv_full: bool | None = None,
                     top_k: int = 5, on_computed=None) -> list:
    """Run a batch so that a failure is attributed to the request that causes it: items go in the engine steps of
    `steps.group_steps` (one length bucket, at most `parallel.in_flight` prompts each, as the engine groups them); a
    step that fails (on any process) is retried one request at a time, and only a request that fails alone gets an
    error. `kv_store` (`kv.store.KVStore` or None): where the exports go and whether they may replace earlier ones.
    `on_computed`: the engine's callback after each step, before its exports (`PrefillEngine.prefill`).
    Returns a PrefillResult or an error string per item, in order."""
    from slope_jax.serve.requests import RequestError

    export = ({} if kv_store is None else {"kv_dir": kv_store.kv_dir, "overwrite": kv_store.overwrite})

    def attempt(idx):
        err = out = None
        part = [items[i] for i in idx]
        arrivals = [x.arrival for x in part]
        try:
            out = engine.prefill([x.tokens for x in part], ids=[x.id for x in part],
                                 arrival_times=None if None in arrivals else arrivals, kv_full=kv_full,
                                 return_kv=False, top_k=top_k, cache_salt=[x.cache_salt for x in part],
                                 on_computed=on_computed, rows_for=[x.id for x in part if x.early], **export)
        except Exception as e:  # noqa: BLE001 - attributed below; a dead peer is reported by the peer watch
            err = e
            if not isinstance(e, RequestError):
                logging.warning("prefill of %s failed: %s", [x.id for x in part], traceback.format_exc(limit=3))
        if not any_process(err is not None):
            return out
        if len(idx) > 1:
            return [r for i in idx for r in attempt([i])]
        return ["prefill failed on another process (see its log)" if err is None else _failure_text(err)]

    per_step = 1 if engine.mesh is None else engine.parallel.in_flight
    outcomes: list = [None] * len(items)
    for _, idx in group_steps([len(x.tokens) for x in items], engine.bucket, per_step):
        for i, out in zip(idx, attempt(idx)):
            outcomes[i] = out
    return outcomes


def compute_loop(engine, broadcast, front, *, kv_store=None, kv_full: bool | None = None, top_k: int = 5) -> None:
    """Every process: process 0 (`front`, None elsewhere) takes the next batch from the scheduler and broadcasts it;
    all compute it; process 0 corrects the cost model online and writes the records. Ends when process 0 broadcasts
    None."""
    pending: dict = {}
    broadcast.warm()
    while True:
        payload = None
        if front is not None:
            batch = front.intake.next_batch()
            if isinstance(batch, WarmUp):
                payload = {"warm": [list(k) for k in batch.keys]}
            elif batch is not None:
                pending = {p.id: p for p in batch}
                payload = [BatchItem(p.id, p.request.tokens, None, p.request.cache_salt,
                                     front.wants_early(p.id)).to_wire() for p in batch]
        payload = broadcast(payload)
        if payload is None:
            break
        if isinstance(payload, dict):
            warm_up(engine, [tuple(k) for k in payload["warm"]], front)
            continue
        items = [BatchItem.from_wire(w, pending[w[0]].arrival_s if front is not None else None) for w in payload]
        ids = [x.id for x in items]
        t_batch, compiled_before = time.perf_counter(), set(engine.compile_ms)
        outcomes = prefill_isolated(engine, items, kv_store=kv_store, kv_full=kv_full, top_k=top_k,
                                    on_computed=None if front is None else front.early_answers(pending))
        if front is not None:
            # the engine's busy time for the cost model's online correction: wall time less first-time compilation
            busy_ms = (time.perf_counter() - t_batch) * 1e3 - sum(ms for key, ms in engine.compile_ms.items()
                                                                  if key not in compiled_before)
            front.observe([pending[i].work for i in ids], busy_ms)  # (n, cached) for expected prefix hits
            front.record_batch(ids, outcomes, pending)
