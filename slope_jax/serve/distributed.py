"""Multi-process start-up that fails fast and clearly, and a watch that names a peer that dies.

Start-up (`initialize`): a TCP preflight, then `jax.distributed.initialize`. In the preflight, before JAX starts:
- process 0 listens on the coordinator address and waits for a HELLO from every other process, carrying its process
  count and its fingerprint (`slope_jax.serve.fingerprint`: layout, dtype, tiles, export flags, versions, checkpoint);
  if some never arrive within `init_timeout_s` it raises naming the missing ids; if the fingerprints differ it
  refuses the start, naming every differing field and which process has which value;
- every other process connects (retrying until the timeout: process 0 may start later), says HELLO and waits for
  process 0's GO, raising with the address and the rule if the coordinator is unreachable or refuses.
Process 0 then closes the listening socket and JAX binds the same port for its coordination service.

Running (`PeerWatch`): the preflight connections stay open. Each process tells its peers how it ends (BYE after a
clean finish, FAIL with its error line otherwise); a connection that closes without either means the peer was killed
or crashed. Process 0 relays what it learns to the others, so every process stops with one line naming the peer
(`process 1 died ...`) within a moment of the death, rather than hanging in a collective or aborting in JAX's runtime.
JAX's own heartbeat (`heartbeat_timeout_s`) stays the backstop for a host that vanishes without closing its sockets.
Agreement once the engine runs (the same prefill inputs on every process, one run nonce, barriers before a step's
first collective) is `slope_jax.serve.agreement`, which needs JAX; this module must not (it runs before JAX starts).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time

from slope_jax.serve import fingerprint as fp_lib

log = logging.getLogger(__name__)


class StartupError(RuntimeError):
    """A peer is missing or misconfigured at start-up; the message names the process and the address."""


def _parse(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise StartupError(f"--coordinator_address={address!r}: expected HOST:PORT")
    return host or "127.0.0.1", int(port)


def _recv_line(conn: socket.socket, deadline: float) -> str:
    data = b""
    while not data.endswith(b"\n"):
        conn.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = conn.recv(4096)
        if not chunk:
            raise ConnectionError("connection closed")
        data += chunk
    return data.decode().strip()


def _send(conn: socket.socket, text: str) -> None:
    try:
        conn.sendall((text.replace("\n", " ") + "\n").encode())
    except OSError:
        pass


def preflight(address: str, num_processes: int, process_id: int, timeout_s: float,
              fingerprint: dict | None = None) -> dict[int, socket.socket]:
    """Rendezvous of all processes over plain TCP on the coordinator address (see module docstring). Returns the open
    connections (process 0: one per peer; others: {0: connection to process 0}) for `PeerWatch`."""
    host, port = _parse(address)
    deadline = time.monotonic() + timeout_s
    fingerprint = fingerprint or {}
    if process_id == 0:
        return _coordinate(address, (host, port), num_processes, deadline, timeout_s, fingerprint)
    return _join(address, (host, port), num_processes, process_id, deadline, timeout_s, fingerprint)


def _refuse(peers: dict[int, socket.socket], message: str):
    """Process 0: tell every connected peer why the start is refused, then raise StartupError."""
    for conn in peers.values():
        _send(conn, f"ERR {message}")
    raise StartupError(message)


def _coordinate(address: str, where: tuple[str, int], num_processes: int, deadline: float, timeout_s: float,
                fingerprint: dict) -> dict[int, socket.socket]:
    """Process 0: accept every peer's HELLO, compare the fingerprints, answer GO (or ERR and raise)."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        srv.bind(where)
    except OSError as e:
        raise StartupError(f"process 0 cannot listen on {address}: {e} (is another run using the port?)") from e
    srv.listen(num_processes)
    peers: dict[int, socket.socket] = {}
    prints: dict[int, dict] = {0: fingerprint}
    ok = False
    try:
        while len(peers) < num_processes - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, num_processes)) - set(peers))
                _refuse(peers, f"process 0: process(es) {missing} did not connect to {address} within "
                        f"{timeout_s:.0f} s (--init_timeout); start every process with the same "
                        f"--coordinator_address and --num_processes={num_processes}")
            srv.settimeout(min(left, 1.0))
            try:
                conn, _ = srv.accept()
            except socket.timeout:
                continue
            words = _read_hello(conn, deadline)
            if words is not None:
                pid, prints_pid = _admit(conn, words, peers, num_processes)
                peers[pid], prints[pid] = conn, prints_pid
        problems = fp_lib.compare(prints)
        if problems:
            _refuse(peers, "processes disagree on what to run (every process must be started with the same "
                    "step-shaping flags, package versions and checkpoint): " + " | ".join(problems))
        for conn in peers.values():
            _send(conn, "GO")
        ok = True
    finally:
        if not ok:
            for conn in peers.values():
                conn.close()
        srv.close()
    return peers


def _read_hello(conn: socket.socket, deadline: float) -> list[str] | None:
    """A new connection's "HELLO <pid> <num_processes> [fingerprint]" split in words, or None (closed) when it is
    not one: a stray connection is ignored."""
    try:
        words = _recv_line(conn, deadline).split(" ", 3)
    except (ConnectionError, socket.timeout, OSError, UnicodeDecodeError):
        conn.close()
        return None
    if len(words) < 3 or words[0] != "HELLO" or not (words[1].isdigit() and words[2].isdigit()):
        conn.close()
        return None
    return words


def _admit(conn: socket.socket, words: list[str], peers: dict[int, socket.socket],
           num_processes: int) -> tuple[int, dict]:
    """(pid, fingerprint) of a peer's HELLO; a wrong process count or an invalid/taken id refuses the start."""
    pid, n = int(words[1]), int(words[2])
    if n != num_processes:
        _send(conn, f"ERR process 0 expects --num_processes={num_processes}, this process has {n}")
        conn.close()
        _refuse(peers, f"process {pid} was started with --num_processes={n}, process 0 with {num_processes}")
    if not 0 < pid < num_processes or pid in peers:
        _send(conn, f"ERR process id {pid} is invalid or taken")
        conn.close()
        _refuse(peers, f"a peer claims --process_id={pid}: must be unique in 1..{num_processes - 1}")
    try:
        return pid, json.loads(words[3]) if len(words) > 3 else {}
    except ValueError:
        return pid, {}


def _join(address: str, where: tuple[str, int], num_processes: int, process_id: int, deadline: float,
          timeout_s: float, fingerprint: dict) -> dict[int, socket.socket]:
    """A peer: connect to process 0 (retrying until the deadline), send HELLO, wait for GO."""
    while True:
        try:
            conn = socket.create_connection(where, timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise StartupError(f"process {process_id}: coordinator {address} (process 0) is not reachable after "
                                   f"{timeout_s:.0f} s (--init_timeout); is process 0 running on that address?") from e
            time.sleep(0.2)
    try:
        _send(conn, f"HELLO {process_id} {num_processes} {json.dumps(fingerprint, sort_keys=True)}")
        reply = _recv_line(conn, deadline)
    except (ConnectionError, socket.timeout, OSError) as e:
        conn.close()
        raise StartupError(f"process {process_id}: process 0 at {address} did not confirm that all "
                           f"{num_processes} processes arrived within {timeout_s:.0f} s ({e}); "
                           "a peer is missing") from e
    if reply != "GO":
        conn.close()
        raise StartupError(f"process {process_id}: process 0 refused the start: {reply.removeprefix('ERR ')}")
    return {0: conn}


class PeerWatch:
    """Watches the preflight connections (see module docstring). `on_peer_lost(message)` is called once, from a
    watcher thread, when a peer dies or fails; the default prints `slope_jax: error: <message>` and exits with
    status 2 at once (a collective with a dead peer can only hang or abort)."""

    def __init__(self, process_id: int, conns: dict[int, socket.socket], on_peer_lost=None):
        self.process_id = process_id
        self.conns = conns
        self.lost: str | None = None
        self._lock = threading.Lock()
        self._closing = False
        self._finished: set[int] = set()
        self._lost_event = threading.Event()
        self._ended: set[int] = set()  # peers whose connection has closed
        self._ended_cv = threading.Condition()
        self._on_lost = on_peer_lost or exit_with
        for pid, conn in conns.items():
            conn.settimeout(None)
            threading.Thread(target=self._watch, args=(pid, conn), name=f"slope_jax-peer-watch-{pid}",
                             daemon=True).start()

    def _watch(self, pid: int, conn: socket.socket) -> None:
        buf = b""
        while True:
            try:
                chunk = conn.recv(4096)
            except OSError as e:
                chunk, why = b"", f"{e}"
            else:
                why = "connection closed"
            if not chunk:
                with self._ended_cv:
                    self._ended.add(pid)
                    self._ended_cv.notify_all()
                with self._lock:
                    if pid in self._finished:  # it said goodbye first: a clean end
                        return
                self._report(f"process {self.process_id}: process {pid} died (its connection to process "
                             f"{self.process_id} closed without a goodbye: {why}; killed or crashed, see its log); "
                             "stopping this process")
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                word, _, rest = line.decode(errors="replace").partition(" ")
                if word == "BYE":
                    with self._lock:
                        self._finished.add(pid)
                    if self.process_id == 0:
                        continue
                    return
                if word == "FAIL":
                    self._report(f"process {self.process_id}: process {pid} stopped with an error: {rest}; "
                                 "stopping this process")
                    return
                if word == "LOST":  # relayed by process 0 about a third process
                    self._report(f"process {self.process_id}: {rest}")
                    return

    def _report(self, message: str) -> None:
        with self._lock:
            if self._closing or self.lost is not None:
                return
            self.lost = message
        if self.process_id == 0:  # tell the others which process it was
            for conn in self.conns.values():
                _send(conn, f"LOST {message.split(': ', 1)[1]}")
        self._lost_event.set()
        self._on_lost(message)

    def wait_for_loss(self, timeout_s: float) -> str | None:
        """The peer-loss message if a peer died or failed within `timeout_s` (e.g. after a collective raised)."""
        self._lost_event.wait(timeout_s)
        return self.lost

    def close(self, failure: str | None = None) -> None:
        """This process ends: tell the peers how (BYE, or FAIL with the error line) and stop reporting."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        for conn in self.conns.values():
            _send(conn, "BYE" if failure is None else f"FAIL {failure}")
        for conn in self.conns.values():
            try:
                conn.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        if self.process_id == 0 and failure is not None:
            # process 0 hosts JAX's coordination service: let the peers act on FAIL and exit first (at most 2 s), or
            # their JAX runtime sees the service vanish and aborts with its own "another task died" message
            with self._ended_cv:
                self._ended_cv.wait_for(lambda: len(self._ended) >= len(self.conns), timeout=2.0)


def exit_with(message: str) -> None:
    """Print `slope_jax: error: <message>` (one line, never interleaved with another error) and exit with status 2
    at once (no exit handlers: JAX's shutdown barrier would wait for peers that are gone)."""
    from slope_jax import cli

    cli.EXITING.acquire()  # the main thread may be reporting its own error: one line, never two
    print(f"slope_jax: error: {message}", file=sys.stderr, flush=True)
    cli.flush_stdout()  # also what the Gloo line filter still holds
    os._exit(2)


def exit_on_sigterm(on_term=None) -> None:
    """Make SIGTERM and SIGINT (Ctrl-C) end the process promptly, even while the main thread waits in a collective or
    on input: the signals are blocked in this thread (and so in every thread started later, JAX's included) and a
    daemon thread `sigwait`s for them, calls `on_term(name)` (e.g. to tell the peers; name "SIGTERM" or "SIGINT") and
    exits with status 128 + the
    signal's number (143, 130). Call it first thing in the main thread, before JAX starts (JAX's preemption notifier
    would otherwise swallow SIGTERM; a KeyboardInterrupt raised inside a runtime callback was swallowed, or aborted
    the process in XLA's C++ threads)."""
    signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)

    def wait():
        got = signal.sigwait(signals)
        name = signal.Signals(got).name
        print(f"slope_jax: error: terminated by {name}", file=sys.stderr, flush=True)
        if on_term is not None:
            try:
                on_term(name)
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
        os._exit(128 + got)

    threading.Thread(target=wait, name="slope_jax-sigterm", daemon=True).start()


def initialize(address: str, num_processes: int, process_id: int, *, init_timeout_s: float = 120,
               heartbeat_timeout_s: float = 30, fingerprint: dict | None = None) -> dict[int, socket.socket]:
    """Preflight (with the fingerprint check), then `jax.distributed.initialize` with explicit timeouts. Returns the
    preflight connections for `PeerWatch` ({} for one process, where it is a no-op). Raises StartupError."""
    if num_processes <= 1:
        return {}
    if not 0 <= process_id < num_processes:
        raise StartupError(f"--process_id={process_id}: must be in 0..{num_processes - 1}")
    t0 = time.monotonic()
    conns = preflight(address, num_processes, process_id, init_timeout_s, fingerprint)
    import jax

    left = max(10, int(init_timeout_s - (time.monotonic() - t0)))
    jax.distributed.initialize(address, num_processes, process_id, initialization_timeout=left,
                               heartbeat_timeout_seconds=int(heartbeat_timeout_s))
    log.info("process %d/%d joined %s in %.1f s: %d local / %d global devices", process_id, num_processes, address,
             time.monotonic() - t0, jax.local_device_count(), jax.device_count())
    return conns
