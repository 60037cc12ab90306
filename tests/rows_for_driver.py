"""One process of tests/test_peer_rows.py's engine test: `python tests/rows_for_driver.py PID PORT KV_DIR MODE`
(two processes on 127.0.0.1, one CPU device each, ring 2). `PrefillEngine.prefill(rows_for=...)` with MODE "gather"
(no `peer_rows`: the step's K/V all-gathered) or "nixl" (`serve.peer_rows.PeerRows`); process 0 keeps the rows its
`on_computed` got and, after the exports, prints per request whether they equal the written export bitwise."""

import json
import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
os.environ.setdefault("UCX_NET_DEVICES", "lo")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # noqa: E402
import numpy as np  # noqa: E402

pid, port, kv_dir, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
jax.distributed.initialize(f"127.0.0.1:{port}", 2, pid, initialization_timeout=120)

from slope_jax import kv as kvfmt  # noqa: E402
from slope_jax.kv import prefix as prefix_lib  # noqa: E402
from slope_jax.parallel.config import ParallelConfig  # noqa: E402
from slope_jax.serve import peer_rows  # noqa: E402
from slope_jax.serve.engine import PrefillEngine  # noqa: E402

eng = PrefillEngine.from_checkpoint(os.path.join(REPO, "checkpoints", "tiny-gpt-oss"), ParallelConfig(ring=2),
                                    dtype="float32", progress=False, q_tile=32, kv_tile=32, moe_tile=32,
                                    reuse=prefix_lib.ReuseOptions(block_size=16))
if mode == "nixl":
    eng.peer_rows = peer_rows.PeerRows(1 << 24, timeout_s=60)
rng = np.random.default_rng(7)
base = rng.integers(0, 1000, 75)
got = {}


def on_computed(ids, results, exports):
    for rid, export in zip(ids, exports):
        if rid != "skipped":  # asked for, never collected: its offers are dropped
            got[rid] = {i: (x.k.copy(), x.v.copy(), x.positions.copy(), x.kind) for i, x in export.rows().items()}


batches = [(["cold", "skipped"], [base, rng.integers(0, 1000, 40)]),
           (["hit"], [np.concatenate([base, rng.integers(0, 1000, 21)])])]  # reuses the cold prompt's 64 tokens
for ids, prompts in batches:
    out = eng.prefill(prompts, kv_dir=kv_dir, ids=ids, kv_full=False, rows_for=ids,
                      on_computed=on_computed if pid == 0 else None)
    if pid == 0:
        for rid, res in zip(ids, out):
            if rid in got:
                want = kvfmt.load(res.kv_path, verify=True)
                same = sorted(want) == sorted(got[rid]) and all(
                    got[rid][i][0].tobytes() == w.k.tobytes() and got[rid][i][1].tobytes() == w.v.tobytes()
                    and np.array_equal(got[rid][i][2], w.positions) and got[rid][i][3] == w.kind
                    for i, w in want.items())
                print(json.dumps({"id": rid, "same": same, "cached": res.cached_tokens}), flush=True)
if eng.peer_rows is not None:
    if pid == 1:
        deadline = time.monotonic() + 10
        while eng.peer_rows.pool.stats()["entries"] and time.monotonic() < deadline:  # a release may be in flight
            time.sleep(0.05)
        print(json.dumps({"pool": eng.peer_rows.pool.stats()}), flush=True)
    eng.peer_rows.close()
