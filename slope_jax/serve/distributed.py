"""Multi-process start-up that fails fast and clearly: a TCP preflight, then `jax.distributed.initialize`.

Without the preflight, a missing peer makes JAX abort after its initialization timeout with a bare
DEADLINE_EXCEEDED. Here, before JAX starts:
- process 0 listens on the coordinator address and waits for a HELLO from every other process (checking that they
  agree on the process count); if some never arrive within `init_timeout_s`, it raises naming the missing ids;
- every other process connects (retrying until the timeout: process 0 may start later), says HELLO and waits for
  process 0's GO, raising with the address and the rule if the coordinator is unreachable or never confirms.
Process 0 then closes the socket and JAX binds the same port for its coordination service. Once running, JAX's
heartbeat (`heartbeat_timeout_s`) makes the surviving processes abort with a message naming the dead task.
"""

from __future__ import annotations

import logging
import socket
import time

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
        chunk = conn.recv(256)
        if not chunk:
            raise ConnectionError("connection closed")
        data += chunk
    return data.decode().strip()


def preflight(address: str, num_processes: int, process_id: int, timeout_s: float) -> None:
    """Rendezvous of all processes over plain TCP on the coordinator address (see module docstring)."""
    host, port = _parse(address)
    deadline = time.monotonic() + timeout_s
    if process_id == 0:
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            srv.bind((host, port))
        except OSError as e:
            raise StartupError(f"process 0 cannot listen on {address}: {e} (is another run using the port?)") from e
        srv.listen(num_processes)
        peers: dict[int, socket.socket] = {}
        try:
            while len(peers) < num_processes - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(1, num_processes)) - set(peers))
                    raise StartupError(f"process 0: process(es) {missing} did not connect to {address} within "
                                       f"{timeout_s:.0f} s (--init_timeout); start every process with the same "
                                       f"--coordinator_address and --num_processes={num_processes}")
                srv.settimeout(min(left, 1.0))
                try:
                    conn, _ = srv.accept()
                except socket.timeout:
                    continue
                try:
                    words = _recv_line(conn, deadline).split()
                except (ConnectionError, socket.timeout, OSError):
                    conn.close()
                    continue
                if len(words) != 3 or words[0] != "HELLO":
                    conn.close()
                    continue
                pid, n = int(words[1]), int(words[2])
                if n != num_processes:
                    conn.sendall(f"ERR process 0 expects --num_processes={num_processes}\n".encode())
                    conn.close()
                    raise StartupError(f"process {pid} was started with --num_processes={n}, process 0 with "
                                       f"{num_processes}")
                if not 0 < pid < num_processes or pid in peers:
                    conn.sendall(f"ERR process id {pid} is invalid or taken\n".encode())
                    conn.close()
                    raise StartupError(f"a peer claims --process_id={pid}: must be unique in 1..{num_processes - 1}")
                peers[pid] = conn
            for conn in peers.values():
                conn.sendall(b"GO\n")
        finally:
            for conn in peers.values():
                conn.close()
            srv.close()
        return
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise StartupError(f"process {process_id}: coordinator {address} (process 0) is not reachable after "
                                   f"{timeout_s:.0f} s (--init_timeout); is process 0 running on that address?") from e
            time.sleep(0.2)
    try:
        conn.sendall(f"HELLO {process_id} {num_processes}\n".encode())
        reply = _recv_line(conn, deadline)
    except (ConnectionError, socket.timeout, OSError) as e:
        raise StartupError(f"process {process_id}: process 0 at {address} did not confirm that all "
                           f"{num_processes} processes arrived within {timeout_s:.0f} s ({e}); "
                           "a peer is missing") from e
    finally:
        conn.close()
    if reply != "GO":
        raise StartupError(f"process {process_id}: process 0 refused the start: {reply}")


def initialize(address: str, num_processes: int, process_id: int, *, init_timeout_s: float = 120,
               heartbeat_timeout_s: float = 30) -> None:
    """Preflight, then `jax.distributed.initialize` with explicit timeouts. A no-op for one process."""
    if num_processes <= 1:
        return
    if not 0 <= process_id < num_processes:
        raise StartupError(f"--process_id={process_id}: must be in 0..{num_processes - 1}")
    t0 = time.monotonic()
    preflight(address, num_processes, process_id, init_timeout_s)
    import jax

    left = max(10, int(init_timeout_s - (time.monotonic() - t0)))
    jax.distributed.initialize(address, num_processes, process_id, initialization_timeout=left,
                               heartbeat_timeout_seconds=int(heartbeat_timeout_s))
    log.info("process %d/%d joined %s in %.1f s: %d local / %d global devices", process_id, num_processes, address,
             time.monotonic() - t0, jax.local_device_count(), jax.device_count())
