"""KV hand-off prefill → decode: NIXL (UCX, host memory) against files, and against a bare NIXL READ of the same bytes.

    .venv/bin/python benchmarks/handoff.py --sizes_mb=64,256,1024,2048 --repeats=5 \
        --e2e_sizes_mb=64,256,1024,2048 --itl_mb=1024 --out=benchmarks/measured/cpu/handoff.json

Synthetic KV in the gpt-oss-20b shape (24 layers, 8 KV heads, head_dim 64, bf16, every layer n tokens: 48 KiB per
token), n chosen per size. Each path runs in fresh process pairs (spawned, UCX on loopback: `UCX_NET_DEVICES=lo`):

- **bare**: two processes with nothing but NIXL: the target registers a filled buffer, the initiator registers a
  pre-touched one and times one READ of all bytes (after one untimed READ that sets up the connection). The
  machine's limit. Run before and after the slope_jax path; both runs count.
- **nixl**: `slope_jax.kv.nixl_transport`: the prefill process publishes the KV into its `KVPool` (copy into the
  registered arena + XXH3-128 per layer: `publish_s`); the decode process pulls it (`KVReader.pull` into a
  reused registered buffer: hold handshake, one READ per layer, each layer's digest checked, release:
  `pull_s`). After one untimed warm-up pull into a fresh buffer (reported as `cold_pull_s`: connection set-up,
  NIXL registration, first-touch page faults).
- **files**: the export format (`slope_jax.kv.format`: safetensors + file digests in the manifest, fsync, atomic
  publication; `write_s`) written by one process, then `format.load(verify=True)` (read + digest of every file:
  `read_s`) in another. The files sit in the local page cache (just written): the best case of a shared filesystem.

Reported per size (medians over the repeats): GB/s (10^9 bytes/s) of each step, `ratio` = nixl pull GB/s / bare
GB/s, and hand-off GB/s (publish + pull; write + read).

**End to end** (`--e2e_sizes_mb`, first; benchmarks/handoff_e2e.py and benchmarks/handoff_vllm.py): for each size
and transport (files, NIXL) the time from the prefill's first token (its KV in host memory) to vLLM's first decoded
token through the real connector and a real vLLM engine with its defaults (a gpt-oss-20b KV cut: the same 48 KiB of
bf16 KV per token), split into `export_s` (files written and published / `KVPool.publish`), `transfer_s` (the
connector's file read with its digest / NIXL pull with XXH3 per layer), `load_s` (rows cut, cast and written into
vLLM's cache) and `vllm_s` (the rest: scheduling, validation, the last prompt token's forward); the first hand-off
of each size is reported apart (`cold`). `handoff_gbs` = bytes / (export + transfer + load) against a bare NIXL READ
of the same bytes between two processes measured in the same run right after (`ratio_vs_bare`, issue 31's goal
≥ 0.7; `ratio_total_vs_bare` uses the whole first token → first token time). Then `--neighbours` requests decode
while an `--itl_mb` export loads: their inter-token gaps during the load vs before it (goal: median ≤ 1.5×).
Prints tables, writes JSON with provenance (`common.write_result`).
"""

from __future__ import annotations

import importlib.metadata
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # loopback only; inherited by the spawned processes

from absl import app, flags  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from common import start_load, write_result  # noqa: E402  (benchmarks/common.py)

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes_mb", ["64", "256", "1024", "2048"], "KV sizes in MiB (n tokens = size / 48 KiB).")
flags.DEFINE_integer("repeats", 5, "Timed transfers per size and path (medians reported).")
flags.DEFINE_list("paths", ["bare", "nixl", "files"], "Which paths to measure.")
flags.DEFINE_string("workdir", None, "Directory for the file exports (default: a temporary one under /tmp).")
flags.DEFINE_string("out", None, "Write the JSON here.")
flags.DEFINE_list("e2e_sizes_mb", ["64", "256", "1024", "2048"],
                  "End to end (prefill's first token → vLLM's first token): KV sizes in MiB; empty: skip.")
flags.DEFINE_list("e2e_transports", ["files", "nixl"], "End-to-end transports: files, nixl (each NIXL record "
                  "carries the manifest of the files run of the same request, so nixl needs files too).")
flags.register_validator("e2e_transports", lambda v: set(v) <= {"files", "nixl"} and ("nixl" not in v or "files" in v),
                         "--e2e_transports: a subset of files,nixl; nixl needs files (its records carry the manifest "
                         "of the files run of the same request)")
flags.DEFINE_integer("e2e_repeats", 3, "End-to-end hand-offs per size and transport: the first is reported as "
                     "`cold` (the connector's first read or pull of that size: buffers, registration, page faults), "
                     "medians over the others.")
flags.DEFINE_integer("itl_mb", 1024, "KV size (MiB) loaded while other requests decode (0: skip).")
flags.DEFINE_integer("neighbours", 4, "Requests decoding while the itl_mb export loads.")
flags.DEFINE_integer("itl_repeats", 5, "Loads of the itl_mb export per transport; their gaps are pooled (one load's "
                     "window holds only ~25 gaps of the neighbours).")
flags.DEFINE_integer("staging_mib", -1, "The connector's nixl_staging_mib: -1 = the largest size measured + 64 MiB "
                     "(sized at vLLM's start-up, as the docs advise), 0 = grown by the pulls.")
flags.DEFINE_float("vllm_switch_interval_ms", None, "Diagnostic: the vLLM process's GIL switch interval (ms; "
                   "Python's default 5): how much the connector's background read or pull waits for the GIL while "
                   "vLLM's step loop runs.")
flags.DEFINE_string("vllm_python", os.environ.get("SLOPE_VLLM_PYTHON", os.path.join(REPO, ".venv-vllm", "bin",
                                                                                       "python")),
                    "python of the vLLM venv (end to end).")

LAYERS, KV_HEADS, HEAD_DIM, ITEM = 24, 8, 64, 2  # gpt-oss-20b, bf16
BYTES_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * ITEM  # 49152


def synthetic_kv(n: int) -> dict:
    """24 layers of bf16 K/V [n, 8, 64] with a cheap per-layer bit pattern (transfer speed does not depend on it)."""
    import ml_dtypes
    import numpy as np

    from slope_jax.kv.format import LayerKV

    count = n * KV_HEADS * HEAD_DIM
    base = (np.arange(count, dtype=np.uint32) * np.uint32(2654435761)) >> np.uint32(16)
    out = {}
    for layer in range(LAYERS):
        k = (base ^ np.uint32(layer)).astype(np.uint16).view(ml_dtypes.bfloat16).reshape(n, KV_HEADS, HEAD_DIM)
        v = (base ^ np.uint32(layer + 1000)).astype(np.uint16).view(ml_dtypes.bfloat16).reshape(n, KV_HEADS, HEAD_DIM)
        out[layer] = LayerKV(k, v, np.arange(n, dtype=np.int32),
                             "sliding_attention" if layer % 2 == 0 else "full_attention")
    return out


# --- bare NIXL -----------------------------------------------------------------------------------------------------

def _agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))  # as nixl_transport


def _bare_target(conn, nbytes: int) -> None:
    import numpy as np

    agent = _agent(f"bare-target-{os.getpid()}")
    buf = np.empty(nbytes, np.uint8)
    buf.fill(7)
    agent.register_memory(np.array([[buf.ctypes.data, nbytes, 0]], np.uint64), "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    while not conn.poll(0.001):  # until the initiator is done; progresses the UCX worker (connection set-up) as
        agent.get_new_notifs()  # the pool's notification thread does, every millisecond


def _bare_initiator(conn, nbytes: int, repeats: int) -> None:
    import numpy as np

    agent = _agent(f"bare-initiator-{os.getpid()}")
    md, addr = conn.recv()
    remote = agent.add_remote_agent(md)
    remote = remote.decode() if isinstance(remote, bytes) else remote
    dst = np.empty(nbytes, np.uint8)
    dst.fill(0)  # pre-touched, as the reader's reused buffer
    agent.register_memory(np.array([[dst.ctypes.data, nbytes, 0]], np.uint64), "DRAM")
    local = agent.get_xfer_descs(np.array([[dst.ctypes.data, nbytes, 0]], np.uint64), "DRAM")
    far = agent.get_xfer_descs(np.array([[addr, nbytes, 0]], np.uint64), "DRAM")
    times = []
    for r in range(repeats + 1):  # the first READ sets up the connection: not timed
        dst[:: 1 << 16] = 0
        t0 = time.perf_counter()
        h = agent.initialize_xfer("READ", local, far, remote)
        state = agent.transfer(h)
        while state == "PROC":
            state = agent.check_xfer_state(h)
        dt = time.perf_counter() - t0
        h.release()
        if state != "DONE" or not (dst[:: 1 << 16] == 7).all():
            raise RuntimeError(f"bare READ ended {state}, or the bytes did not arrive")
        if r:
            times.append(dt)
    conn.send(times)


def measure_bare(nbytes: int, repeats: int) -> list[float]:
    """Seconds of each timed READ of `nbytes` between two bare NIXL processes."""
    ctx = mp.get_context("spawn")
    t_conn, t_child = ctx.Pipe()
    i_conn, i_child = ctx.Pipe()
    target = ctx.Process(target=_bare_target, args=(t_child, nbytes))
    initiator = ctx.Process(target=_bare_initiator, args=(i_child, nbytes, repeats))
    target.start(), initiator.start()
    i_conn.send(t_conn.recv())  # the target's metadata and address, out of band
    times = i_conn.recv()
    t_conn.send("done")
    target.join(60), initiator.join(60)
    if target.exitcode or initiator.exitcode:
        raise RuntimeError(f"bare NIXL processes exited {target.exitcode}, {initiator.exitcode}")
    return times


# --- slope_jax NIXL ------------------------------------------------------------------------------------------------

def _prefill(conn, n: int, repeats: int) -> None:
    from slope_jax.kv import nixl_transport as nt

    kv = synthetic_kv(n)
    nbytes = sum(x.k.nbytes + x.v.nbytes + x.positions.nbytes for x in kv.values())
    pool = nt.KVPool(nbytes + (1 << 20), lease_s=600)
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        params = pool.publish(f"req-{r}", kv, {"request_id": f"req-{r}", "num_tokens": n})
        conn.send((params, time.perf_counter() - t0))
        conn.recv()  # pulled
        deadline = time.monotonic() + 30
        while pool.stats()["entries"] and time.monotonic() < deadline:  # the release frees it
            time.sleep(0.001)
    conn.send(pool.stats())
    pool.close()


def _reader(conn, repeats: int) -> None:
    import numpy as np

    from slope_jax.kv import nixl_transport as nt

    reader = nt.KVReader(timeout_s=300)
    out, rows = None, []
    for r in range(repeats + 1):
        params, publish_s = conn.recv()
        rec = params[nt.PARAMS_KEY]
        if r and out is None:
            out = np.empty(rec["nbytes"], np.uint8)
            out.fill(0)
        t0 = time.perf_counter()
        kv = reader.pull(params, out=out)  # r == 0: a fresh buffer (cold)
        pull_s = time.perf_counter() - t0
        assert len(kv) == LAYERS and kv[LAYERS - 1].k.shape[0] == rec["manifest"]["num_tokens"]
        rows.append({"publish_s": publish_s, "pull_s": pull_s, "bytes": rec["nbytes"]})
        del kv
        conn.send("pulled")
    conn.send(rows)
    reader.close()


def measure_nixl(n: int, repeats: int) -> dict:
    ctx = mp.get_context("spawn")
    p_conn, p_child = ctx.Pipe()
    r_conn, r_child = ctx.Pipe()
    prefill = ctx.Process(target=_prefill, args=(p_child, n, repeats))
    reader = ctx.Process(target=_reader, args=(r_child, repeats))
    prefill.start(), reader.start()
    for _ in range(repeats + 1):
        r_conn.send(p_conn.recv())
        p_conn.send(r_conn.recv())
    rows, pool_stats = r_conn.recv(), p_conn.recv()
    prefill.join(60), reader.join(60)
    return {"cold": rows[0], "warm": rows[1:], "pool_after": {k: pool_stats[k] for k in ("entries", "used_bytes")}}


# --- files ---------------------------------------------------------------------------------------------------------

def _writer(conn, n: int, repeats: int, workdir: str) -> None:
    import numpy as np

    from slope_jax.kv import format as kvfmt
    from slope_jax.model.config import ModelConfig

    cfg = ModelConfig.from_json(os.path.join(REPO, "configs", "gpt-oss-20b.json"))
    kv = synthetic_kv(n)
    tokens = np.arange(n, dtype=np.int32)
    for r in range(repeats):
        kv_dir = os.path.join(workdir, f"kv-{n}-{r}")
        os.makedirs(kv_dir)
        t0 = time.perf_counter()
        staging = kvfmt.staging_dir(kv_dir, "req", kvfmt.new_run_nonce(), 0)
        name, recs = kvfmt.write_shard_file(staging, 0, [(layer, 0, n, x.k, x.v) for layer, x in kv.items()])
        kvfmt.write_manifest(staging, request_id="req", token_ids=tokens, cfg=cfg, dtype="bfloat16", full=True,
                             segments=recs, files=[name])
        path = kvfmt.publish(kv_dir, "req", staging, overwrite=False)
        write_s = time.perf_counter() - t0
        conn.send((path, write_s, os.path.getsize(os.path.join(path, name))))
        conn.recv()  # read
        shutil.rmtree(kv_dir)
    conn.send(None)


def _file_reader(conn) -> None:
    from slope_jax.kv import format as kvfmt

    while True:
        msg = conn.recv()
        if msg is None:
            return
        path = msg
        t0 = time.perf_counter()
        kv = kvfmt.load(path, verify=True)
        read_s = time.perf_counter() - t0
        assert len(kv) == LAYERS
        del kv
        conn.send(read_s)


def measure_files(n: int, repeats: int, workdir: str) -> list[dict]:
    ctx = mp.get_context("spawn")
    w_conn, w_child = ctx.Pipe()
    r_conn, r_child = ctx.Pipe()
    writer = ctx.Process(target=_writer, args=(w_child, n, repeats, workdir))
    reader = ctx.Process(target=_file_reader, args=(r_child,))
    writer.start(), reader.start()
    rows = []
    while (msg := w_conn.recv()) is not None:
        path, write_s, file_bytes = msg
        r_conn.send(path)
        rows.append({"write_s": write_s, "read_s": r_conn.recv(), "file_bytes": file_bytes})
        w_conn.send("read")
    r_conn.send(None)
    writer.join(60), reader.join(60)
    return rows


# --- end to end: the prefill's first token → vLLM's first token (benchmarks/handoff_e2e.py) -----------------------

def _tokens_of(mb: int) -> int:
    return round(mb * 2**20 / BYTES_PER_TOKEN)


def _handoff(dec, transport: str, kv: dict, tokens, ctx: dict, rid: str, **cmd) -> dict:
    """One hand-off of `kv` (prompt `tokens`) over `transport` ("files": a published export; "nixl": a `KVPool`
    entry carrying the manifest of the files run of the same request id, `ctx["manifests"]`, so the files run goes
    first); returns its parts (`handoff_e2e.split`) and, with neighbours in `cmd`, their inter-token gaps
    (`handoff_e2e.itl`). `ctx`: cfg, weights, kv_dir, pool, manifests."""
    import handoff_e2e as e2e
    from slope_jax.kv import format as kvfmt

    t_first = time.monotonic()  # the prefill's first token: its KV is in host memory
    if transport == "files":
        path = e2e.export_files(kv, tokens, ctx["cfg"], ctx["kv_dir"], rid, ctx["weights"])
        params = {"slope_jax_kv_path": path}
    else:
        from slope_jax.kv import nixl_transport as nt

        manifest = getattr(nt, "handoff_manifest", dict)(ctx["manifests"][rid])
        params = ctx["pool"].publish(rid, kv, manifest)
    export_s = time.monotonic() - t_first
    ans = dec.request(id=f"{rid}/{transport}", prompt=[int(t) for t in tokens], params=params, **cmd)
    out = e2e.split(t_first, export_s, ans)
    if cmd.get("neighbours"):
        out["gaps"] = dict(zip(("without", "during"), e2e.gaps(ans)))
        out["itl"] = e2e.itl(out["gaps"]["without"], out["gaps"]["during"])
    if transport == "files":
        ctx["manifests"][rid] = kvfmt.read_manifest(path)
        for name in os.listdir(ctx["kv_dir"]):
            p = os.path.join(ctx["kv_dir"], name)
            os.remove(p) if os.path.islink(p) else shutil.rmtree(p, ignore_errors=True)
    else:
        ctx["pool"].discard(params["slope_jax_nixl"]["entry"])
    return out


def run_e2e(workdir: str) -> dict:
    """Every end-to-end size × transport (`--e2e_repeats` each) and the inter-token latency run at `--itl_mb`."""
    import numpy as np

    import handoff_e2e as e2e
    from slope_jax.checkpoints.digest import weights_digest
    from slope_jax.model.config import ModelConfig

    model = e2e.make_cut(os.path.join(workdir, "gpt-oss-20b-kvcut"))
    cfg, weights = ModelConfig.from_json(os.path.join(model, "config.json")), weights_digest(model)
    sizes = [int(x) for x in FLAGS.e2e_sizes_mb]
    biggest = _tokens_of(max(sizes + [FLAGS.itl_mb]))
    dec = e2e.Decoder(FLAGS.vllm_python, model, biggest, biggest * BYTES_PER_TOKEN + (256 << 20), weights,
                      os.path.join(workdir, "vllm.log"),
                      None if FLAGS.vllm_switch_interval_ms is None else FLAGS.vllm_switch_interval_ms / 1e3,
                      staging_mib=max(sizes + [FLAGS.itl_mb]) + 64 if FLAGS.staging_mib < 0 else FLAGS.staging_mib)
    pool = None
    if "nixl" in FLAGS.e2e_transports:
        from slope_jax.kv import nixl_transport as nt

        pool = nt.KVPool(biggest * (BYTES_PER_TOKEN + 8) + (64 << 20), lease_s=600)
    ctx = {"cfg": cfg, "weights": weights, "kv_dir": os.path.join(workdir, "kv"), "pool": pool, "manifests": {}}
    os.makedirs(ctx["kv_dir"], exist_ok=True)
    rows = []
    try:
        for mb in sizes:
            n = _tokens_of(mb)
            kv, tokens = synthetic_kv(n), np.random.default_rng(n).integers(0, 900, n).astype(np.int32)
            row = {"mib": mb, "tokens": n, "bytes": n * BYTES_PER_TOKEN}
            runs = {t: [] for t in FLAGS.e2e_transports}
            for r in range(FLAGS.e2e_repeats):
                tokens[0] = r  # the prompt of repeat r (vLLM's prefix cache is emptied before each request)
                for transport in sorted(FLAGS.e2e_transports):  # files first: NIXL carries its manifest
                    runs[transport].append(_handoff(dec, transport, kv, tokens, ctx, f"e2e-{mb}-{r}"))
                    print(f"  {mb} MiB {transport}: {runs[transport][-1]}", flush=True)
            for transport in FLAGS.e2e_transports:
                row[transport] = _median_parts(runs[transport], row["bytes"])
            if "bare" in FLAGS.paths:
                bare = measure_bare(row["bytes"], FLAGS.repeats)
                row["bare"] = {"read_s": bare, "gbs": row["bytes"] / _med(bare) / 1e9}
                for transport in FLAGS.e2e_transports:
                    t = row[transport]
                    t["ratio_vs_bare"] = t["handoff_gbs"] / row["bare"]["gbs"]
                    t["ratio_total_vs_bare"] = t["total_gbs"] / row["bare"]["gbs"]
            rows.append(row)
            del kv
        itl_row = _itl_run(dec, ctx) if FLAGS.itl_mb else None
    finally:
        dec.close()
        if pool is not None:
            pool.close()
    return {"model": "gpt-oss-20b KV cut (handoff_e2e.make_cut)", "vllm_init_s": dec.init_s, "rows": rows,
            "itl": itl_row, "vllm_switch_interval_ms": FLAGS.vllm_switch_interval_ms,
            "nixl_staging_mib": dec.staging_mib}


def _median_parts(runs: list[dict], nbytes: int) -> dict:
    """Medians of the parts over the runs after the first (`cold`); `handoff_gbs`: bytes / (export + transfer +
    load), the hand-off's own throughput; `total_gbs`: bytes / the whole first token → first token time (vLLM's
    scheduling and the last prompt token's forward included)."""
    keys = ("export_s", "send_s", "transfer_s", "load_s", "vllm_s", "total_s")
    warm = runs[1:] or runs
    out = {k: _med([r[k] for r in warm]) for k in keys}
    out["handoff_gbs"] = nbytes / _med([r["export_s"] + r["transfer_s"] + r["load_s"] for r in warm]) / 1e9
    out["total_gbs"] = nbytes / out["total_s"] / 1e9
    out["cold"], out["runs"] = runs[0], warm
    return out


def _itl_run(dec, ctx: dict) -> dict:
    """`--neighbours` requests decode; an `--itl_mb` export arrives and loads (`--itl_repeats` times per transport):
    their inter-token gaps during its load vs before it, pooled over the repeats, per transport."""
    import numpy as np

    import handoff_e2e as e2e

    n = _tokens_of(FLAGS.itl_mb)
    kv, tokens = synthetic_kv(n), np.random.default_rng(7).integers(0, 900, n).astype(np.int32)
    out = {"mib": FLAGS.itl_mb, "tokens": n, "neighbours": FLAGS.neighbours, "repeats": FLAGS.itl_repeats}
    runs = {t: [] for t in FLAGS.e2e_transports}
    for r in range(FLAGS.itl_repeats):
        tokens[0] = r  # a new prompt per repeat
        for transport in sorted(FLAGS.e2e_transports):  # files first: NIXL carries its manifest
            got = _handoff(dec, transport, kv, tokens, ctx, f"itl-{r}", neighbours=FLAGS.neighbours,
                           neighbour_len=64, warm_tokens=24)
            print(f"  ITL {FLAGS.itl_mb} MiB {transport} run {r}: {got['itl']}", flush=True)
            runs[transport].append(got)
    for transport, got in runs.items():
        pooled = e2e.itl([g for x in got for g in x["gaps"]["without"]],
                         [g for x in got for g in x["gaps"]["during"]])
        out[transport] = {"itl": pooled, "load_s": _med([x["transfer_s"] + x["load_s"] for x in got]),
                          "runs": got, "run_ratios": [x["itl"].get("ratio_median") for x in got]}
    return out


E2E_COLUMNS = ("export_s", "transfer_s", "load_s", "vllm_s", "total_s")


def _e2e_table(e2e: dict) -> str:
    lines = ["| KV | transport | export s | transfer s | load s | vLLM s | first token → first token s | "
             "hand-off GB/s (export+transfer+load) | bare NIXL GB/s | hand-off / bare | total / bare | cold total s |",
             "|---" * 12 + "|"]
    for r in e2e["rows"]:
        for t in FLAGS.e2e_transports:
            p = r[t]
            f = lambda key: "–" if key not in p else f"{p[key]:.2f}"  # noqa: E731
            cells = [f"{r['mib']} MiB", t] + [f"{p[k]:.3f}" for k in E2E_COLUMNS] + [
                f"{p['handoff_gbs']:.2f}", "–" if "bare" not in r else f"{r['bare']['gbs']:.2f}",
                f("ratio_vs_bare"), f("ratio_total_vs_bare"), f"{p['cold']['total_s']:.2f}"]
            lines.append("| " + " | ".join(cells) + " |")
    it = e2e.get("itl")
    for t in FLAGS.e2e_transports if it else ():
        x = it[t]["itl"]
        lines.append(f"\nITL of {it['neighbours']} decoding requests while a {it['mib']} MiB export loads over {t}: "
                     f"median {x['during']['median_s'] * 1e3:.0f} ms vs {x['without']['median_s'] * 1e3:.0f} ms "
                     f"without ({x['ratio_median']:.2f}x), max {x['during']['max_s'] * 1e3:.0f} ms "
                     f"({x['ratio_max']:.2f}x); load {it[t]['load_s']:.2f} s (median); gaps of {it['repeats']} runs "
                     f"pooled, per run {', '.join(f'{r:.2f}' for r in it[t]['run_ratios'] if r)}x")
    return "\n".join(lines)


# --- the run -------------------------------------------------------------------------------------------------------

def _med(xs):
    return statistics.median(xs)


def summarize(nbytes: int, bare: list[float], nixl: dict | None, files: list[dict] | None) -> dict:
    gbs = lambda s: nbytes / s / 1e9  # noqa: E731
    row = {"bytes": nbytes}
    if bare:
        row["bare"] = {"read_s": bare, "gbs": gbs(_med(bare))}
    if nixl:
        pub, pull = [w["publish_s"] for w in nixl["warm"]], [w["pull_s"] for w in nixl["warm"]]
        row["nixl"] = {"publish_s": pub, "pull_s": pull, "publish_gbs": gbs(_med(pub)), "pull_gbs": gbs(_med(pull)),
                       "handoff_gbs": gbs(_med([a + b for a, b in zip(pub, pull)])),
                       "cold_pull_s": nixl["cold"]["pull_s"],
                       "entry_bytes": nixl["warm"][0]["bytes"], "pool_after": nixl["pool_after"]}
        if bare:
            row["ratio_pull_vs_bare"] = row["nixl"]["pull_gbs"] / row["bare"]["gbs"]
            row["ratio_handoff_vs_bare"] = row["nixl"]["handoff_gbs"] / row["bare"]["gbs"]
    if files:
        w, r = [f["write_s"] for f in files], [f["read_s"] for f in files]
        row["files"] = {"write_s": w, "read_s": r, "write_gbs": gbs(_med(w)), "read_gbs": gbs(_med(r)),
                        "handoff_gbs": gbs(_med([a + b for a, b in zip(w, r)])), "file_bytes": files[0]["file_bytes"]}
    return row


def _get(row: dict, *keys):
    for k in keys:
        if not isinstance(row, dict) or k not in row:
            return None
        row = row[k]
    return row


COLUMNS = (("bare READ GB/s", ("bare", "gbs")), ("nixl pull GB/s", ("nixl", "pull_gbs")),
           ("pull / bare", ("ratio_pull_vs_bare",)), ("nixl publish GB/s", ("nixl", "publish_gbs")),
           ("nixl publish+pull GB/s", ("nixl", "handoff_gbs")), ("files write GB/s", ("files", "write_gbs")),
           ("files read GB/s", ("files", "read_gbs")), ("files write+read GB/s", ("files", "handoff_gbs")))


def _table(rows: list[dict]) -> str:
    lines = ["| KV | " + " | ".join(c for c, _ in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for r in rows:
        cells = [f"{r['bytes'] / 2**20:.0f} MiB"] + [
            "–" if _get(r, *k) is None else f"{_get(r, *k):.2f}" for _, k in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv):
    del argv
    load = start_load()
    workdir = FLAGS.workdir or tempfile.mkdtemp(prefix="handoff-")
    e2e = run_e2e(workdir) if FLAGS.e2e_sizes_mb else None
    if e2e:
        print(_e2e_table(e2e), flush=True)
    rows = []
    for mb in (int(x) for x in FLAGS.sizes_mb):
        n = round(mb * 2**20 / BYTES_PER_TOKEN)
        nbytes = n * BYTES_PER_TOKEN  # K and V of every layer (positions add 96 bytes per token on the NIXL path)
        print(f"{mb} MiB: {n} tokens, {nbytes} bytes", flush=True)
        bare = nixl = files = None
        if "bare" in FLAGS.paths:
            bare = measure_bare(nbytes, FLAGS.repeats)
        if "nixl" in FLAGS.paths:
            nixl = measure_nixl(n, FLAGS.repeats)
        if "bare" in FLAGS.paths:
            bare = bare + measure_bare(nbytes, FLAGS.repeats)  # after as well: the machine's load drifts
        if "files" in FLAGS.paths:
            files = measure_files(n, FLAGS.repeats, workdir)
        rows.append(dict(summarize(nbytes, bare, nixl, files), tokens=n))
        print(_table(rows[-1:]), flush=True)
    if not FLAGS.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    print(_table(rows))
    if e2e:
        print(_e2e_table(e2e))
    if FLAGS.out:
        shape = {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16"}
        packages = {p: importlib.metadata.version(p) for p in ("nixl", "nixl-cu12", "xxhash")}
        write_result(FLAGS.out, {"benchmark": "handoff", "model_shape": shape, "repeats": FLAGS.repeats,
                                 "ucx_net_devices": os.environ.get("UCX_NET_DEVICES"), "packages": packages,
                                 "rows": rows, "end_to_end": e2e}, load_start=load)


if __name__ == "__main__":
    app.run(main)
