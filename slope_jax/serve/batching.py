"""Request arrival and the batching decision of the launcher (pure Python, no JAX).

`LineReader` reads request lines on a thread and stamps each with `time.perf_counter()` the moment it arrives, so
queue times are honest when requests trickle in over stdin or a pipe. `Batcher` is the whole batching policy: a
batch leaves as soon as `batch_size` requests wait, the input is closed, or its first request has waited `wait_s`
seconds; it never waits for the batch to fill. Its interface (`add`, `take_batch(now, closed) -> (batch, rejected,
wait_s)`) is the scheduler's, so an SLO-aware scheduler can replace it without touching the loop.
"""

from __future__ import annotations

import collections
import queue
import threading
import time


class LineReader:
    """Reads a binary stream line by line on a daemon thread. `get(timeout_s)` returns `(raw_bytes, arrival)` for the
    next line, `None` at end of input, or raises `queue.Empty` when nothing arrived within `timeout_s` (None: block).
    A read error ends the input after a `(OSError, arrival)` item."""

    def __init__(self, stream):
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, args=(stream,), name="slope_jax-request-reader",
                                         daemon=True)
        self._thread.start()

    def _run(self, stream):
        try:
            for raw in stream:
                self._queue.put((raw, time.perf_counter()))
        except OSError as e:
            self._queue.put((e, time.perf_counter()))
        finally:
            self._queue.put(None)

    def get(self, timeout_s: float | None):
        return self._queue.get(timeout=timeout_s) if timeout_s is None or timeout_s > 0 else self._queue.get_nowait()


class Batcher:
    """Bounded-wait batching. Items need an `arrival` attribute (perf_counter seconds).

    take_batch(now, closed) returns (batch, rejected, wait_s): the items to run now (oldest first, at most
    `batch_size`), items refused (always [] here), and, when the batch is empty, how long to wait before asking again
    (None: until the next arrival)."""

    def __init__(self, batch_size: int, wait_s: float):
        self.batch_size, self.wait_s = batch_size, wait_s
        self.pending: collections.deque = collections.deque()

    def add(self, item) -> None:
        self.pending.append(item)

    def take_batch(self, now: float, closed: bool):
        if not self.pending:
            return [], [], None
        due = self.pending[0].arrival + self.wait_s
        if len(self.pending) >= self.batch_size or closed or now >= due:
            return [self.pending.popleft() for _ in range(min(self.batch_size, len(self.pending)))], [], 0.0
        return [], [], due - now
