"""Request arrival for the launcher (pure Python, no JAX).

`LineReader` reads request lines on a thread and stamps each with `time.perf_counter()` the moment it arrives, so
queue times are honest when requests trickle in over stdin or a pipe. The batching decision (bounded wait, order,
admission) is `slope_jax.serve.scheduler.Scheduler`.

A request source is anything with `get(timeout_s)` (as below) and `deliver(record)` (called with every result or
error record the launcher emits): `LineReader` for --requests, `slope_jax.serve.http.HttpIntake` for --http_port.
"""

from __future__ import annotations

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

    def deliver(self, record: dict) -> None:
        """Records go to the results file only: nobody waits on a line."""
