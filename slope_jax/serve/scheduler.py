"""SLO-aware request scheduling: earliest-deadline-first order, admission by predicted finish, bounded batch wait,
and the SLO metrics of a run (attainment, goodput, TTFT percentiles). Pure Python + numpy; no JAX.

Terms. A request's TTFT SLO `ttft_slo_ms` gives its deadline `arrival_s + ttft_slo_ms / 1000` (seconds on the
`time.perf_counter()` clock). `predict_ms(lengths)` is the cost model of one batch: the engine's compute time in ms
for prompts of these token counts (`slope_jax.plan.predict` per bucket, or a measured per-bucket fit). With
`bucket` (token count -> compiled length) and `per_step` (prompts per engine step) the scheduler knows the step
shapes `(bucket, prompts)` a batch runs, and with `compile_ms(shape)` (expected XLA compile ms of a shape, 0 once
compiled) it adds the compilation of every shape the plan has not compiled before, once: the first batch of a new
bucket pays it, later ones do not. Admission plans every member of a batch as finishing when the whole batch does
(conservative); at release each member's predicted TTFT is the end of its own step, since the engine runs a batch's
steps one after another and a request's first token is ready when its step ends.

Policy (docs/design.md §7, "the request loop uses the same model"):
  * Order: `order="edf"` serves the earliest deadline first; requests without an SLO come after all requests with
    one; ties (and requests without SLO) go first-come first-served. `order="fcfs"` serves in arrival order.
  * Batches (the same former plans the queue and releases the head batch, so a request is admitted by the finish
    of the batch it will actually be in). A batch holds requests of one bucket (the engine runs one bucket per
    step anyway, so mixing buckets only delays the first tokens of the shorter prompts). It starts with the first
    request in service order and takes the following ones of its bucket, up to `batch_size`; once a request of
    another bucket lies between, a later one of the bucket is taken only into a free slot of the batch's last step
    (it rides along without adding a step). A request is never added when that would make a member, or a request
    it overtakes, miss a deadline it could still meet: an urgent short request leaves first and alone.
  * Admission (`slo_policy="reject"`): the queue is planned as consecutive batches in that order, the first
    starting when the engine is free (`max(now, predicted end of the batch in flight)`). A new request is
    admitted only if, with it in the plan, its predicted finish (queue ahead + its batch's compute and compilation)
    and that of every request admitted before it meet their deadlines. Otherwise it is rejected at once, by the
    first `take_batch` call after its `add`, with a reason naming the predicted and the allowed TTFT in ms. An
    admitted request is dropped later only if work ahead ran longer than predicted so that it can no longer make
    its deadline (the reason says so); serving it would spend compute that on-time requests need.
    `slo_policy="serve_late"`: such a request is served instead, flagged `late=True`, and moved behind every
    request that can still meet its deadline (so one late request never makes others late).
    `slo_policy="none"`: no admission and no flags (the baseline: order + batching only).
  * Release: the head batch is released when it holds `batch_size` requests, when the stream is closed, when its
    oldest member has waited `batch_wait_ms`, or when waiting any longer would make a planned request miss its
    deadline (its slack is used up). A request is never held back waiting for a later one beyond
    `batch_wait_ms`. While a batch is in flight no batch is released; the call still admits/rejects.
  * `take_batch` marks the batch it returns as in flight with its predicted busy time; the loop calls
    `finished(now)` when the engine returns, so admission always counts the work ahead.

Example (a synchronous loop; `queue_lines` yields `Pending` items stamped by a reader thread):

    sched, wait_s = Scheduler(predict_ms, batch_size=8, batch_wait_ms=5, default_slo_ms=1000), None
    while True:
        for item in queue_lines(timeout=wait_s):          # block at most wait_s (None: until a line or EOF)
            sched.add(item)
        batch, rejected, wait_s = sched.take_batch(time.perf_counter(), closed=reader_done)
        for item, reason in rejected:
            emit({"id": item.id, "error": reason, "rejected": True, "ttft_slo_ms": item.slo_ms})
        if batch:  # write p.predicted_ttft_ms next to each measured TTFT
            results = engine.prefill([p.request for p in batch], arrival_times=[p.arrival_s for p in batch])
            sched.finished(time.perf_counter())           # engine free again
        elif reader_done and not sched.pending:
            break

In this synchronous loop a request that arrives during a batch is answered right after it. To reject it on arrival,
run `engine.prefill` in a worker thread and keep calling `take_batch` while it runs (it then only admits/rejects);
`benchmarks/slo_sim.py --replay` does exactly that. `OnlineCorrection(predict_ms)` scales the model by the measured
compute of finished batches (call `observe(lengths, measured_ms)`), so admission follows the machine's real speed.

Metrics: `slo_stats(records, wall_s)` over result records (dicts with `num_tokens`, `ttft_ms`, optional
`ttft_slo_ms`, and `error` for failed or rejected requests; a failed request that had an SLO must keep its
`ttft_slo_ms`, so it counts as a miss) gives `SLOStats`; `SLOStats.summary_line()` is one line
for the launcher's summary. Definitions as in DistServe (Zhong et al., OSDI 2024): SLO attainment = requests that
carry an SLO and were served within it / all requests that carry an SLO (rejected and failed ones count as missed);
goodput = prompt tokens per second of wall time of served requests that met their SLO (or had none).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from slope_jax.serve.steps import group_steps, step_shapes

ORDERS = ("edf", "fcfs")
SLO_POLICIES = ("reject", "serve_late", "none")
_EPS_S = 1e-9  # clock resolution for "due" comparisons, so a wait of ~0 s cannot spin


@dataclasses.dataclass(eq=False)  # identity: two requests are never "equal" (and `request` may hold arrays)
class Pending:
    """One queued request.

    request: the caller's payload (opaque here); id: request id (for records); num_tokens: prompt length (tokens);
    arrival_s: `time.perf_counter()` when it arrived; deadline_s: arrival_s + ttft_slo_ms / 1000, or None (no SLO;
    `Scheduler.add` fills it from `default_slo_ms`).
    Set by the scheduler: late (serve_late: predicted to miss its deadline, served behind on-time requests);
    dropped (rejected after admission because work ahead overran its prediction);
    predicted_ttft_ms / predicted_compute_ms / predicted_compile_ms (when released: the model's TTFT from arrival —
    until its own step of the batch ends —, its step's compute and the compiling inside it), to write next to the
    measured TTFT; predicted_share: the fraction of its batch's predicted time after which its step ends.
    """

    request: Any
    id: str
    num_tokens: int
    arrival_s: float
    deadline_s: float | None = None
    late: bool = False
    predicted_ttft_ms: float | None = None
    predicted_compute_ms: float | None = None
    predicted_compile_ms: float | None = None  # the part of predicted_compute_ms expected compiling step programs
    dropped: bool = False  # rejected after having been admitted (work ahead overran its prediction)
    seq: int = -1  # arrival order, set by `add` (FCFS tie-break)
    cached_tokens: int = 0  # prompt tokens expected from the prefix cache (prefix reuse): the step computes the rest
    cache_tokens: int = 0  # of those, what the cache holds now (the rest: shared with a request served before it)
    prefix_hashes: tuple = ()  # its usable prefix block hashes (`serve.reuse.usable_hashes`), () when not tracked
    predicted_share: float = 1.0  # its step ends after this fraction of its batch's predicted time (set at release)

    @property
    def work(self) -> int | tuple[int, int]:
        """What the cost model predicts from: the prompt length, or (length, cached tokens) for a prefix hit."""
        return self.num_tokens if not self.cached_tokens else (self.num_tokens, self.cached_tokens)

    @property
    def slo_ms(self) -> float | None:
        """The TTFT SLO in ms (deadline − arrival), or None."""
        return None if self.deadline_s is None else (self.deadline_s - self.arrival_s) * 1e3


class Scheduler:
    """Orders, admits and batches requests by their TTFT deadlines (see the module docstring for the policy).

    Args:
      predict_ms: `predict_ms(lengths: list[int]) -> float`, the predicted compute time in ms of one batch of
        prompts with these token counts. Called often: make it cheap (memoise per bucket).
      batch_size: most requests per batch (>= 1).
      batch_wait_ms: longest time the oldest request of a batch waits for the batch to fill (>= 0).
      order: "edf" (earliest deadline first) or "fcfs" (arrival order).
      slo_policy: "reject" (admission control), "serve_late" (serve and flag), or "none" (no admission).
      default_slo_ms: TTFT SLO for requests added without a deadline (None: they have none).
      bucket: token count -> compiled length (`PrefillEngine.bucket`); a batch holds one bucket. None: every length
        shares one bucket (batches then mix lengths; step shapes and compilation are not modelled).
      per_step: prompts per engine step (`parallel.in_flight` on a mesh, 1 on one device; >= 1).
      compile_ms: `compile_ms((bucket, prompts)) -> float`, the expected XLA compile time in ms of a step shape (0
        when compiled); needs `bucket`. None: compilation is not charged.
      hit_key: `hit_key(n, cached) -> (bucket, cached rows)`, the step of a prefix hit (`PrefillEngine.step_key`);
        a hit's compile shape is then `((bucket, cached rows), prompts)`. Requests carry their expected hit in
        `Pending.cached_tokens`; `predict_ms` then receives `(n, cached)` for them (`Pending.work`).
      prefix_block: the prefix cache's block size (tokens) where a prompt, once served, leaves its KV for later ones
        (0: not modelled). With one prompt per step, a request whose `prefix_hashes` share leading blocks with a
        request ahead of it in service order (among the first `SHARE_WINDOW`) is expected to take those blocks
        from it — the engine runs a batch's steps as separate prefills, so a later step finds an earlier one's
        prompt — and `cached_tokens` is the larger of that and `cache_tokens`.
    Raises:
      ValueError naming the argument and its allowed values.
    Thread safety: `add` may be called from a reader thread while the loop calls `take_batch`.
    """

    def __init__(self, predict_ms: Callable[[list[int]], float], *, batch_size: int, batch_wait_ms: float,
                 order: str = "edf", slo_policy: str = "reject", default_slo_ms: float | None = None,
                 bucket: Callable[[int], int] | None = None, per_step: int = 1,
                 compile_ms: Callable[[tuple[int, int]], float] | None = None,
                 hit_key: Callable[[int, int], tuple[int, int]] | None = None, prefix_block: int = 0):
        if order not in ORDERS:
            raise ValueError(f"order={order!r}: must be one of {ORDERS}")
        if slo_policy not in SLO_POLICIES:
            raise ValueError(f"slo_policy={slo_policy!r}: must be one of {SLO_POLICIES}")
        if int(batch_size) < 1:
            raise ValueError(f"batch_size={batch_size}: must be >= 1")
        if not batch_wait_ms >= 0 or math.isinf(batch_wait_ms):
            raise ValueError(f"batch_wait_ms={batch_wait_ms}: must be a finite number >= 0")
        if default_slo_ms is not None and not (0 < default_slo_ms < math.inf):
            raise ValueError(f"default_slo_ms={default_slo_ms}: must be a finite number > 0 (or None)")
        if int(per_step) < 1:
            raise ValueError(f"per_step={per_step}: must be >= 1")
        if compile_ms is not None and bucket is None:
            raise ValueError("compile_ms needs bucket: compiled step shapes are (bucket, prompts)")
        self.bucket, self.per_step, self.compile_ms = bucket, int(per_step), compile_ms
        self.hit_key, self.prefix_block = hit_key, max(0, int(prefix_block))
        self.predict_ms = predict_ms
        self.batch_size = int(batch_size)
        self.batch_wait_s = batch_wait_ms / 1e3
        self.order = order
        self.slo_policy = slo_policy
        self.default_slo_ms = default_slo_ms
        self._queue: list[Pending] = []  # admitted (or not yet checked) requests, unsorted
        self._new: list[Pending] = []  # added since the last take_batch: not yet admitted
        self._seq = 0
        self._busy_until: float | None = None  # predicted end of the batch in flight; None when idle
        self._warm: dict = {}  # step shapes admission refused a request for while uncompiled (`take_warm`)
        self._lock = threading.Lock()

    # ---- public API -------------------------------------------------------------------------------------------
    def add(self, item: Pending) -> None:
        """Queue a request. Its admission is decided by the next `take_batch` call."""
        with self._lock:
            if item.deadline_s is None and self.default_slo_ms is not None:
                item.deadline_s = item.arrival_s + self.default_slo_ms / 1e3
            item.seq = self._seq
            self._seq += 1
            self._new.append(item)

    def cancel(self, ids: set[str]) -> list[Pending]:
        """Remove the queued requests whose `id` is in `ids` (their client left) and return them; a request in the
        batch in flight is not queued and stays."""
        with self._lock:
            gone = [p for p in self._queue + self._new if p.id in ids]
            self._queue = [p for p in self._queue if p.id not in ids]
            self._new = [p for p in self._new if p.id not in ids]
            return gone

    @property
    def pending(self) -> int:
        """Requests queued (admitted or awaiting admission), not counting the batch in flight."""
        with self._lock:
            return len(self._queue) + len(self._new)

    @property
    def busy(self) -> bool:
        """True between `take_batch` returning a batch and `finished`."""
        return self._busy_until is not None

    def take_warm(self, now: float) -> list:
        """Step shapes to compile now, in the engine's idle time: the shape of each request admission rejected while
        that shape was not compiled yet (its compile time was part of why it could not make its deadline), still
        uncompiled, once nothing is queued or in flight. Without this a rejected request's shape never compiles (a
        rejected request runs nothing), so every later request of that length, in this run and the next (whose
        prediction reads the persistent cache's step index), is refused for the same compile. The engine counts as
        busy for their expected compile time until `finished`. Returns [] when there is nothing to warm or it is
        not idle."""
        with self._lock:
            if self._queue or self._new or self._busy_until is not None or not self._warm:
                return []
            expected = {s: float(self.compile_ms(s)) for s in self._warm}
            self._warm.clear()
            shapes = [s for s, ms in expected.items() if ms > 0]
            if shapes:
                self._busy_until = now + sum(expected[s] for s in shapes) / 1e3
            return shapes

    def refresh_expected(self, expected: Callable[[Pending], int], limit: int = 32) -> int:
        """Re-estimate what the prefix cache holds for the first `limit` admitted requests in service order
        (`Pending.cache_tokens`, and `cached_tokens` from it) with `expected(p)`: a batch that finished since they
        were admitted may have exported the prefix they share (an agent's turns, questions of one document queued
        behind the first), and predicting them cold overstates their compute and compile (another program) for
        admission and for their `predicted_ttft_ms`. Bounded to the head of the queue: it is what runs next, and
        each estimate hashes the prompt. Returns how many estimates changed."""
        with self._lock:
            head = self._sorted(self._queue)[:max(0, int(limit))]
        changed = 0
        for p in head:
            n = int(expected(p))
            if n != p.cache_tokens:
                p.cache_tokens, changed = n, changed + 1
            p.cached_tokens = n  # `take_batch` adds what a request ahead will leave (`_share_ahead`)
        return changed

    def finished(self, now: float) -> None:
        """The batch in flight has finished at `now` (perf_counter seconds): the engine is free."""
        with self._lock:
            self._busy_until = None

    def take_batch(self, now: float, closed: bool = False
                   ) -> tuple[list[Pending], list[tuple[Pending, str]], float | None]:
        """Admit new requests and release the next batch if it is due.

        Args:
          now: current `time.perf_counter()` seconds.
          closed: no more requests will arrive (release what is queued without waiting).
        Returns:
          batch: requests to run now, in service order (empty if none is due or a batch is in flight); it is marked
            in flight until `finished`. Each member has `predicted_ttft_ms` / `predicted_compute_ms` set.
          rejected: (request, reason) for every request rejected by this call; write their records at once.
          wait_s: seconds the loop may sleep before calling again if nothing arrives (None: nothing is waiting on
            time — sleep until the next arrival or `finished`).
        """
        with self._lock:
            self._share_ahead(self._sorted(self._queue + self._new))
            rejected = self._admit(now)
            if not self._queue or self._busy_until is not None:
                return [], rejected, None
            self._share_ahead(self._sorted(self._queue))  # admission may have rejected a request others shared
            start = now
            plan = self._plan(self._sorted(self._queue), start, head_only=self.slo_policy == "none")
            head, head_compute_ms = plan[0][0], plan[0][2]
            oldest = min(p.arrival_s for p in head)
            wait_until = oldest + self.batch_wait_s
            slack = _slack(plan)
            due = closed or len(head) >= self.batch_size or now >= wait_until - _EPS_S or slack <= _EPS_S
            if not due:
                return [], rejected, max(0.0, min(wait_until - now, slack))
            taken = {id(p) for p in head}
            self._queue = [p for p in self._queue if id(p) not in taken]
            for p, (done_ms, step_ms, compile_ms) in zip(head, self._member_times(head, head_compute_ms)):
                p.predicted_compute_ms, p.predicted_compile_ms = step_ms, compile_ms
                p.predicted_ttft_ms = (now + done_ms / 1e3 - p.arrival_s) * 1e3
                p.predicted_share = done_ms / head_compute_ms if head_compute_ms > 0 else 1.0
            self._busy_until = now + head_compute_ms / 1e3
            return head, rejected, None

    # ---- internals --------------------------------------------------------------------------------------------
    def _key(self, p: Pending):
        if self.order == "fcfs":
            return (p.arrival_s, p.seq)
        if p.deadline_s is None or p.late:
            return (1, 0.0, p.arrival_s, p.seq)
        return (0, p.deadline_s, p.arrival_s, p.seq)

    def _sorted(self, items: Iterable[Pending]) -> list[Pending]:
        return sorted(items, key=self._key)

    def _start(self, now: float) -> float:
        return now if self._busy_until is None else max(now, self._busy_until)

    def _group(self, n: int) -> int:
        return 0 if self.bucket is None else int(self.bucket(int(n)))

    def _step_key(self, work):
        """The compiled step a prompt runs in: its bucket, or for a prefix hit (work = (n, cached)) `hit_key(n,
        cached)`, the bucket of its new tokens and its cached-prefix rows (`PrefillEngine.step_key`)."""
        if isinstance(work, tuple):
            return self.hit_key(*work) if self.hit_key is not None else self._group(work[0])
        return self._group(work)

    def _shapes(self, batch: Sequence[Pending]) -> set:
        """The step shapes (bucket or step key, prompts) the engine runs for this batch (`steps.group_steps`)."""
        return step_shapes([p.work for p in batch], self._step_key, self.per_step)

    def _compile_part_ms(self, batch: Sequence[Pending], compiled: set) -> float:
        """Expected ms compiling the step shapes of `batch` not in `compiled`."""
        if self.compile_ms is None:
            return 0.0
        return sum(float(self.compile_ms(shape)) for shape in self._shapes(batch) - compiled)

    def _cost_ms(self, batch: Sequence[Pending], compiled: set) -> tuple[float, set]:
        """Predicted ms of a batch (compute + compiling its shapes not in `compiled`) and the shapes it compiles."""
        ms = float(self.predict_ms([p.work for p in batch]))
        if self.compile_ms is None:
            return ms, set()
        new = self._shapes(batch) - compiled
        return ms + sum(float(self.compile_ms(shape)) for shape in new), new

    def _share_ahead(self, ordered: Sequence[Pending]) -> None:
        """Expected prefix hits from requests served earlier in this order (`prefix_block`, class docstring): for
        each of the first `SHARE_WINDOW` requests, its leading blocks whose hashes a request ahead of it holds
        (hashes are chained: a block's hash held ahead means every block before it is shared too), or
        `cache_tokens` if more. Not with several prompts per step (prompts of one step do not reuse each other, and
        which step each lands in is not known here)."""
        if not self.prefix_block or self.per_step != 1:
            return
        ahead: set = set()
        for p in ordered[:SHARE_WINDOW]:
            shared = 0
            while shared < len(p.prefix_hashes) and p.prefix_hashes[shared] in ahead:
                shared += 1
            p.cached_tokens = max(p.cache_tokens, shared * self.prefix_block)
            ahead.update(p.prefix_hashes)

    def _member_times(self, batch: Sequence[Pending], total_ms: float) -> list[tuple[float, float, float]]:
        """Per member of a released batch, in order: (ms from the batch's start until its own step ends, its step's
        ms, the part of that compiling). The launcher runs a batch's steps one after another, grouped by the prompts'
        lengths as `compute.prefill_isolated` groups them (`steps.group_steps` over the cold buckets: a prefix hit
        is found when its step starts), and a request's first token is ready when its step ends, so a member of a
        later step waits for the steps before it. Each step costs `predict_ms` of its prompts plus compiling the
        programs it runs (a hit's own) where the batch first runs them; the steps are scaled to sum to `total_ms`
        (the batch's predicted time, as admission planned it)."""
        works = [p.work for p in batch]
        steps, compiled = [], set()
        for _, idx in group_steps([p.num_tokens for p in batch], self._group, self.per_step):
            shapes = step_shapes([works[i] for i in idx], self._step_key, self.per_step) - compiled
            compile_ms = sum(float(self.compile_ms(s)) for s in shapes) if self.compile_ms is not None else 0.0
            compiled |= shapes
            steps.append((idx, float(self.predict_ms([works[i] for i in idx])) + compile_ms, compile_ms))
        scale = total_ms / sum(ms for _, ms, _ in steps) if sum(ms for _, ms, _ in steps) > 0 else 1.0
        out: list = [None] * len(batch)
        done = 0.0
        for idx, ms, compile_ms in steps:
            done += ms * scale
            for i in idx:
                out[i] = (done, ms * scale, compile_ms * scale)
        return out

    def _keeps(self, p: Pending, finish_s: float) -> float:
        """The latest finish of p's batch that keeps p's deadline, if p would make it at `finish_s`; else inf."""
        if p.deadline_s is None or p.late or finish_s > p.deadline_s + _EPS_S:
            return math.inf
        return p.deadline_s

    def _form(self, ordered: Sequence[Pending], start: float, compiled: set):
        """The batch that leaves first from `ordered` at `start` (module docstring, "Batches"):
        (batch, compute_ms, shapes it compiles)."""
        head = ordered[0]
        key = self._group(head.num_tokens)
        batch = [head]
        ms, new = self._cost_ms(batch, compiled)
        guard = self._keeps(head, start + ms / 1e3)  # the batch must end by then
        overtaken = 0
        for p in ordered[1:]:
            if (len(batch) >= self.batch_size or (overtaken and len(batch) % self.per_step == 0)
                    or overtaken > self.batch_size):  # (a bound on the scan: a request rides past few others)
                break
            if self._group(p.num_tokens) != key:
                # p is overtaken by the rest of this batch: it starts only when the batch ends
                overtaken += 1
                alone_ms = self._cost_ms([p], compiled | new)[0]
                guard = min(guard, self._keeps(p, start + (ms + alone_ms) / 1e3) - alone_ms / 1e3)
                continue
            ms2, new2 = self._cost_ms(batch + [p], compiled)
            if start + ms2 / 1e3 > guard + _EPS_S:
                break  # it would make an earlier request miss: it leaves in a later batch
            batch.append(p)
            ms, new = ms2, new2
            guard = min(guard, self._keeps(p, start + ms / 1e3))
        return batch, ms, new

    def _plan(self, ordered: Sequence[Pending], start: float, head_only: bool = False):
        """The queue as consecutive batches in service order: [(batch, finish_s, compute_ms, compile_ms)], where
        compute_ms includes compile_ms, the expected compilation of step shapes no earlier batch compiles."""
        plan, t, rest, compiled = [], start, list(ordered), set()
        while rest:
            batch, ms, new = self._form(rest, t, compiled)
            t += ms / 1e3
            plan.append((batch, t, ms, self._compile_part_ms(batch, compiled)))
            compiled |= new
            if head_only:
                break
            if all(p is q for p, q in zip(batch, rest)):
                rest = rest[len(batch):]  # the usual case: the batch is the front of the queue
            else:
                taken = {id(p) for p in batch}
                rest = [p for p in rest if id(p) not in taken]
        return plan

    def _misses(self, plan) -> list[tuple[Pending, float]]:
        """(request, predicted finish) for each on-time-class request of the plan that would miss its deadline."""
        return [(p, fin) for batch, fin, *_ in plan for p in batch
                if p.deadline_s is not None and not p.late and fin > p.deadline_s + _EPS_S]

    def _admit(self, now: float) -> list[tuple[Pending, str]]:
        new, self._new = self._new, []
        if self.slo_policy == "none":
            self._queue.extend(new)
            return []
        rejected: list[tuple[Pending, str]] = []
        start = self._start(now)
        # 1. Requests admitted earlier that can no longer make it (work ahead ran over its prediction).
        while True:
            misses = self._misses(self._plan(self._sorted(self._queue), start))
            if not misses:
                break
            p, fin = misses[0]  # the earliest in service order; re-plan, since dropping it may save the others
            if self.slo_policy == "reject":
                plan = self._plan(self._sorted(self._queue), start)
                self._queue.remove(p)
                p.dropped = True
                rejected.append((p, _reason(p, fin, note="work ahead ran longer than predicted; ",
                                            parts=_parts(plan, p, start))))
            else:
                p.late = True
        # 2. New requests, in service order: admit each only if the plan with it keeps every deadline.
        for p in self._sorted(new):
            if p.deadline_s is None:
                self._queue.append(p)
                continue
            trial = self._plan(self._sorted(self._queue + [p]), start)
            misses = self._misses(trial)
            if not misses:
                self._queue.append(p)
                continue
            k = next(i for i, entry in enumerate(trial) if any(q is p for q in entry[0]))  # p's batch
            own = trial[k][1]
            if self.slo_policy == "serve_late":
                p.late = True
                self._queue.append(p)
                continue
            parts = _parts(trial, p, start)
            rejected.append((p, _reason(p, own, len(misses) if own <= p.deadline_s + _EPS_S else 0, parts=parts)))
            shape = (self._step_key(p.work), 1)
            if parts[1] > 0 and float(self.compile_ms(shape)) > 0:  # parts[1]: compiling; its own shape is new
                self._warm[shape] = None
        return rejected


SHARE_WINDOW = 32  # requests at the head of the queue whose shared prefixes with the ones ahead are modelled


def _slack(plan) -> float:
    """Seconds the plan can be delayed before an on-time request misses its deadline (inf if none has one)."""
    return min((p.deadline_s - fin for batch, fin, *_ in plan for p in batch
                if p.deadline_s is not None and not p.late), default=math.inf)


def _parts(plan, p: Pending, start: float) -> tuple[float, float, float]:
    """p's predicted TTFT in the plan, in ms, split into (waiting: from arrival until its batch starts, the work
    already running and the batches ahead; compiling: step programs not compiled yet, its batch's and those ahead;
    computing: its own batch)."""
    k = next(i for i, entry in enumerate(plan) if any(q is p for q in entry[0]))
    compile_ms = sum(entry[3] for entry in plan[:k + 1])
    ahead_ms = sum(entry[2] - entry[3] for entry in plan[:k])
    return (start - p.arrival_s) * 1e3 + ahead_ms, compile_ms, plan[k][2] - plan[k][3]


def _reason(p: Pending, finish_s: float, pushed: int = 0, note: str = "",
            parts: tuple[float, float, float] = (0.0, 0.0, 0.0)) -> str:
    """The rejection message: predicted vs allowed TTFT in ms and, in words, what the prediction is made of
    (`_parts`: waiting for work ahead, compiling, computing its batch)."""
    predicted = (finish_s - p.arrival_s) * 1e3
    slo = f"{p.slo_ms:.1f}" if p.slo_ms >= 0.1 else f"{p.slo_ms:.3g}"  # an SLO of 0.001 ms is not "0.0 ms"
    if pushed:
        head = (f"rejected: predicted TTFT {predicted:.1f} ms is within the allowed {slo} ms (ttft_slo_ms), "
                f"but admitting it would make {pushed} admitted request(s) miss their deadline")
    else:
        head = f"rejected: predicted TTFT {predicted:.1f} ms exceeds the allowed {slo} ms (ttft_slo_ms)"
    wait_ms, compile_ms, compute_ms = parts
    cached = f", {p.cached_tokens} of them expected from the prefix cache" if p.cached_tokens else ""
    compiling = (f"{compile_ms:.1f} ms compiling step shapes not compiled yet (--precompile warms them up "
                 "before traffic), ") if compile_ms > 0 else ""
    return (f"{head}; {note}{wait_ms:.1f} ms waiting for work already running or queued ahead, {compiling}"
            f"{compute_ms:.1f} ms computing its batch ({p.num_tokens} tokens{cached})")


def batch_predictor(step_ms: Callable[[int, int], float], bucket: Callable[[int], int], per_step: int = 1
                    ) -> Callable[[list[int]], float]:
    """A `predict_ms` for `Scheduler` that mirrors how `PrefillEngine.prefill` runs a batch (`steps.group_steps`):
    prompts grouped by bucket length, each group in steps of up to `per_step` prompts (the engine's
    `parallel.in_flight` on a mesh, 1 on one device), steps run one after another; the batch costs the sum of its
    steps.

    Args:
      step_ms: `step_ms(t, m)`, predicted ms of one step of m prompts padded to bucket length t (memoised here), e.g.
        from `slope_jax.plan.predict` or a measured table.
      bucket: token count -> bucket length (`PrefillEngine.bucket` or `layout.bucket_length`).
      per_step: most prompts per step (>= 1).
    """
    if per_step < 1:
        raise ValueError(f"per_step={per_step}: must be >= 1")
    step = functools.lru_cache(maxsize=None)(step_ms)

    def predict_ms(lengths: list[int]) -> float:
        return sum(step(t, len(idx)) for t, idx in group_steps(lengths, bucket, per_step))

    return predict_ms


class OnlineCorrection:
    """A cost model corrected online by measured compute: `predict_ms(lengths) = base(lengths) × factor`, where
    factor is an exponentially weighted mean (weight `alpha` per batch) of measured / predicted compute, clipped to
    [1/max_factor, max_factor]. Makes admission track the machine's actual speed (contention, a calibration off by
    a constant) without changing the model's shape across lengths.

        predict = OnlineCorrection(base_predict_ms)
        sched = Scheduler(predict, ...)
        ...  # after each batch:
        predict.observe([p.num_tokens for p in batch], measured_compute_ms)
    """

    def __init__(self, base: Callable[[list[int]], float], *, alpha: float = 0.2, max_factor: float = 10.0):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha={alpha}: must be in (0, 1]")
        if not max_factor >= 1:
            raise ValueError(f"max_factor={max_factor}: must be >= 1")
        self.base, self.alpha, self.max_factor = base, alpha, max_factor
        self.factor = 1.0

    def __call__(self, lengths: list[int]) -> float:
        return float(self.base(lengths)) * self.factor

    def seed(self, samples: list[tuple[list, float]]) -> float:
        """Set the factor from measured batches before any request — `[(lengths, measured_ms)]`, e.g. warm-up runs
        of the buckets traffic will use — as the geometric mean of measured / predicted (clipped as `observe`
        clips), in place of the uninformed 1.0 the first requests were otherwise predicted with. Samples without a
        positive prediction and time are skipped; none left: the factor stays. Returns the factor."""
        ratios = []
        for lengths, measured_ms in samples:
            base = float(self.base(lengths))
            if base > 0 and measured_ms > 0 and math.isfinite(measured_ms):
                ratios.append(measured_ms / base)
        if ratios:
            f = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
            self.factor = min(self.max_factor, max(1 / self.max_factor, f))
        return self.factor

    def observe(self, lengths: list[int], measured_ms: float) -> None:
        """Fold in one finished batch: its prompt lengths and its measured compute time in ms."""
        base = float(self.base(lengths))
        if not (base > 0 and measured_ms > 0 and math.isfinite(measured_ms)):
            return  # nothing to learn from (an empty or failed batch)
        f = (1 - self.alpha) * self.factor + self.alpha * measured_ms / base
        self.factor = min(self.max_factor, max(1 / self.max_factor, f))


# ---- metrics ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class SLOStats:
    """SLO metrics of one run (see the module docstring for the definitions).

    requests: records; served: without error; rejected: refused by admission (`rejected` true in the record);
    cancelled: withdrawn by their client before the prefill started (`cancelled` true; not in attainment); failed:
    other errors; with_slo: records carrying `ttft_slo_ms`; met: of those, served within it; late: served but
    past it; attainment: met / with_slo (None if no request has an SLO); goodput_tokens_per_s,
    goodput_requests_per_s: met (or served without SLO) per wall second; throughput_tokens_per_s: all served;
    ttft_p50/p90/p99_ms: percentiles of served TTFT (numpy linear interpolation; None if nothing was served).
    """

    requests: int
    served: int
    rejected: int
    failed: int
    with_slo: int
    met: int
    late: int
    attainment: float | None
    goodput_tokens_per_s: float
    goodput_requests_per_s: float
    throughput_tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    wall_s: float
    cancelled: int = 0

    def summary_line(self) -> str:
        att = "n/a (no request has ttft_slo_ms)" if self.attainment is None else (
            f"{100 * self.attainment:.1f}% ({self.met}/{self.with_slo})")
        pct = "n/a" if self.ttft_p50_ms is None else (
            f"{self.ttft_p50_ms:.1f}/{self.ttft_p90_ms:.1f}/{self.ttft_p99_ms:.1f} ms")
        return (f"SLO attainment {att}; goodput {self.goodput_tokens_per_s:.0f} tokens/s "
                f"({self.goodput_requests_per_s:.2f} req/s); TTFT p50/p90/p99 {pct}; served {self.served}, "
                f"late {self.late}, rejected {self.rejected}, "
                + (f"cancelled {self.cancelled}, " if self.cancelled else "")
                + f"failed {self.failed}; wall {self.wall_s:.1f} s")


def slo_met(record: dict) -> bool | None:
    """True/False whether a record met its TTFT SLO (an error counts as missed); None if it has no SLO."""
    slo = record.get("ttft_slo_ms")
    if slo is None:
        return None
    return "error" not in record and record.get("ttft_ms") is not None and record["ttft_ms"] <= slo


def slo_stats(records: Sequence[dict], wall_s: float) -> SLOStats:
    """SLO metrics from result records.

    Args:
      records: dicts with `num_tokens` (int), `ttft_ms` (float, served ones), optional `ttft_slo_ms`, `error` (str,
        failed or rejected) and `rejected` (bool).
      wall_s: wall time of the run in seconds (> 0), the goodput denominator.
    """
    if not wall_s > 0:
        raise ValueError(f"wall_s={wall_s}: must be > 0")
    served = [r for r in records if "error" not in r]
    rejected = sum(1 for r in records if "error" in r and r.get("rejected"))
    cancelled = sum(1 for r in records if "error" in r and r.get("cancelled"))
    with_slo = [r for r in records if r.get("ttft_slo_ms") is not None and not r.get("cancelled")]
    met = [r for r in with_slo if slo_met(r)]
    good = met + [r for r in served if r.get("ttft_slo_ms") is None]
    ttft = np.array([r["ttft_ms"] for r in served], np.float64)
    p50, p90, p99 = (float(x) for x in np.percentile(ttft, [50, 90, 99])) if ttft.size else (None, None, None)
    return SLOStats(
        requests=len(records), served=len(served), rejected=rejected, cancelled=cancelled,
        failed=len(records) - len(served) - rejected - cancelled,
        with_slo=len(with_slo), met=len(met), late=sum(1 for r in with_slo if "error" not in r and not slo_met(r)),
        attainment=len(met) / len(with_slo) if with_slo else None,
        goodput_tokens_per_s=sum(r["num_tokens"] for r in good) / wall_s,
        goodput_requests_per_s=len(good) / wall_s,
        throughput_tokens_per_s=sum(r["num_tokens"] for r in served) / wall_s,
        ttft_p50_ms=p50, ttft_p90_ms=p90, ttft_p99_ms=p99, wall_s=wall_s)
