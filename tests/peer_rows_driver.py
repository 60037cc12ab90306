"""One process of tests/test_peer_rows.py: `python tests/peer_rows_driver.py PID PORT` (two processes on 127.0.0.1,
one CPU device each). Prints one JSON line per case from process 0; process 1 prints its pool's state at the end."""

import json
import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
os.environ.setdefault("UCX_NET_DEVICES", "lo")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

pid, port = int(sys.argv[1]), sys.argv[2]
jax.distributed.initialize(f"127.0.0.1:{port}", 2, pid, initialization_timeout=120)

from slope_jax.serve import peer_rows  # noqa: E402

KINDS = ["sliding_attention", "full_attention"]
rows = peer_rows.PeerRows(1 << 20, timeout_s=2.0, lease_s=60.0)  # process 1's pool: 1 MiB
client = peer_rows._client()


def pieces(seed, tokens):
    rng = np.random.default_rng(seed)
    k, v = (rng.standard_normal((tokens, 3, 5)).astype(np.float32) for _ in range(2))
    return [(1, 0, 4, k[:4], v[:4]), (0, 4, tokens, k[4:], v[4:])]


def report(case, **fields):
    print(json.dumps({"case": case, **fields}), flush=True)


if pid == 1:
    rows.offer("ok", pieces(1, 11), KINDS)
    rows.offer("too-big", pieces(2, 20000), KINDS)  # 2 x 20000 x 3 x 5 x 4 bytes: more than the 1 MiB pool
    rows.offer("dropped", pieces(3, 9), KINDS)
    rows.offer("empty", [], KINDS)
    rows.offer("rec", pieces(4, 13), KINDS)  # handed on as a record (a composed answer's part), then dropped
    rows.offer("rec-too-big", pieces(5, 20000), KINDS)
    client.wait_at_barrier("collected", 60_000)  # "never" is never offered
    deadline = time.monotonic() + 10
    while rows.pool.stats()["entries"] and time.monotonic() < deadline:  # process 0's last release may be in flight
        time.sleep(0.05)
    report("pool", **rows.pool.stats())
else:
    got = rows.collect("ok")
    want = pieces(1, 11)
    report("ok", same=all(a[:3] == b[:3] and np.array_equal(a[3], b[3]) and np.array_equal(a[4], b[4])
                          for a, b in zip(got, want)) and len(got) == len(want))
    for case in ("too-big", "never"):
        try:
            rows.collect(case)
            report(case, error=None)
        except RuntimeError as e:
            report(case, error=str(e))
    rows.discard("dropped")
    report("empty", got=rows.collect("empty"))
    recs = rows.records("rec")
    report("records", count=len(recs), pieces=recs[0]["manifest"]["pieces"])
    rows.drop(recs)  # nobody pulls them: process 1's pool frees the entry
    try:
        rows.records("rec-too-big")
        report("records-too-big", error=None)
    except RuntimeError as e:
        report("records-too-big", error=str(e))
    deadline = time.monotonic() + 10  # process 1 posts its pool's occupancy every STATS_PERIOD_S
    while 1 not in rows.peer_pools() and time.monotonic() < deadline:
        time.sleep(0.1)
    report("peer-pools", pools={str(k): v for k, v in rows.peer_pools().items()})
    client.wait_at_barrier("collected", 60_000)
rows.close()
