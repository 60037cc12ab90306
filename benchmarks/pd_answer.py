"""How long the P/D prefill endpoint takes, after a prompt's first token, to answer: over NIXL (answered from the host
tier before the export is written, `serve.http.HttpIntake.deliver_early`) vs over files (answered once the export is
on disk, which the decode side then reads).

    python benchmarks/pd_answer.py                                # 64 / 128 / 256 MiB of KV, 2 prompts each
    python benchmarks/pd_answer.py --mib=64 --repeats=1 --out=/tmp/pd_answer.json        # smoke, ~1 minute
    python benchmarks/pd_answer.py --processes=2 --out=benchmarks/measured/cpu/pd_answer_2proc.json

One launcher process (`slope_jax.launch --http_port`, ONE CPU device, bf16, every other flag its default: prefix
reuse on, 128-token blocks, whole-prompt exports), or `--processes` of them with ring attention over their devices
(as `launch/pd_vllm.sh` starts it: each process then keeps its pieces in its own NIXL pool and the answer's record
names every pool, `nixl_transport.compose`), on the
gpt-oss-20b KV cut of benchmarks/handoff_e2e.py
(gpt-oss-20b's 24 layers, 8 KV heads of 64: 48 KiB of KV per token; the rest cut small). Per size, `--repeats`
pairs of requests, each a fresh random prompt (no prefix hit) of the size's token count, sent one at a time with
`kv_transfer_params={"do_remote_decode": true}` and then with `"slope_jax_transport": "files"` as well. Per request:
the client's wall time from sending to the answer, the endpoint's `ttft_ms` (arrival → first token) and
`after_first_token_ms` = wall − ttft (what the answer waited for after the first token: the publish into the pool,
or the export's write, plus HTTP), and whether the answer came with `export_pending`; then `/v1/kv/release` frees
its pool entry, as the P/D proxy does once vLLM decoded. Each size's buckets are
compiled by an untimed request first. Prints a table; writes JSON via common.write_result (default
benchmarks/measured/cpu/pd_answer.json).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
KV_BYTES_PER_TOKEN = 24 * 2 * 8 * 64 * 2  # layers x (K, V) x KV heads x head_dim x bf16


def _post(url: str, body: dict) -> tuple[dict, float]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=1800) as r:
        out = json.loads(r.read())
    return out, time.perf_counter() - t0


def _ask(url: str, rid: str, prompt: list[int], transport: str) -> dict:
    ktp = {"do_remote_decode": True, **({"slope_jax_transport": "files"} if transport == "files" else {})}
    body, wall = _post(url + "/v1/completions", {"prompt": prompt, "request_id": rid, "kv_transfer_params": ktp})
    if "error" in body:
        raise RuntimeError(f"{rid}: {body['error']}")
    ttft = body["ttft_ms"]
    _post(url + "/v1/kv/release", {"request_id": rid})  # as the P/D proxy does once decoded: the pool entry freed
    return {"id": rid, "transport": transport, "wall_ms": wall * 1e3, "ttft_ms": ttft,
            "after_first_token_ms": wall * 1e3 - ttft, "export_pending": bool(body.get("export_pending")),
            "publish_ms": body.get("publish_ms"), "publish_from": body.get("publish_from"),
            "nixl": "slope_jax_nixl" in body["kv_transfer_params"]}


def _start(ckpt: str, port: int, work: str, processes: int) -> list[subprocess.Popen]:
    """The endpoint: `processes` launcher processes of one CPU device each (ring attention over them when 2+)."""
    from common import free_port

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.setdefault("UCX_NET_DEVICES", "lo")
    coord, procs = free_port(), []
    for i in reversed(range(processes)):
        multi = [f"--num_processes={processes}", f"--process_id={i}", f"--coordinator_address=127.0.0.1:{coord}",
                 f"--ring={processes}"] if processes > 1 else []
        cmd = [sys.executable, "-m", "slope_jax.launch", "--cpu_devices=1", f"--checkpoint={ckpt}", *multi,
               "--dtype=bfloat16", f"--http_port={port}", f"--kv_dir={os.path.join(work, 'kv')}", "--overwrite",
               f"--results={os.path.join(work, 'results.jsonl')}", "--kv_pool_gib=1", "--batch_wait_ms=0"]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(os.path.join(work, f"launcher{i}.log"), "w"),
                                      stderr=subprocess.STDOUT))
    deadline = time.time() + 600
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return procs
        except OSError:
            if any(p.poll() is not None for p in procs) or time.time() > deadline:
                raise RuntimeError("the endpoint did not start; see " + os.path.join(work, "launcher0.log")) from None
            time.sleep(1)


def main(argv):
    del argv
    import numpy as np
    from absl import flags
    from common import free_port, start_load, write_result
    from handoff_e2e import make_cut

    F = flags.FLAGS
    load0 = start_load()
    ckpt = make_cut(F.checkpoint_dir)
    os.makedirs(F.work_dir, exist_ok=True)
    port = free_port()
    procs = _start(ckpt, port, F.work_dir, F.processes)
    url = f"http://127.0.0.1:{port}"
    rng = np.random.default_rng(F.seed)
    rows = []
    print("| KV MiB | tokens | transport | after first token, ms (median) | TTFT ms (median) | export_pending |")
    print("|---|---|---|---|---|---|")
    try:
        for mib in F.mib:
            n = int(mib) * 2**20 // KV_BYTES_PER_TOKEN
            prompt = lambda: rng.integers(0, 990, n).tolist()  # noqa: E731 - below the tiny vocabulary's specials
            _ask(url, f"warm-{mib}", prompt(), "nixl")  # compile this length's bucket
            runs = {"nixl": [], "files": []}
            for r in range(F.repeats):
                for transport in ("nixl", "files"):
                    runs[transport].append(_ask(url, f"{transport}-{mib}-{r}", prompt(), transport))
            row = {"mib": int(mib), "tokens": n, "kv_bytes": n * KV_BYTES_PER_TOKEN, "runs": runs}
            for transport, xs in runs.items():
                row[transport] = {"after_first_token_ms": statistics.median(x["after_first_token_ms"] for x in xs),
                                  "ttft_ms": statistics.median(x["ttft_ms"] for x in xs),
                                  "export_pending": all(x["export_pending"] for x in xs)}
                each = ", ".join(f"{x['after_first_token_ms']:.0f}" for x in xs)
                print(f"| {mib} | {n} | {transport} | {row[transport]['after_first_token_ms']:.0f} ({each}) | "
                      f"{row[transport]['ttft_ms']:.0f} | {row[transport]['export_pending']} |", flush=True)
            row["ratio_nixl_vs_files"] = (row["nixl"]["after_first_token_ms"] / row["files"]["after_first_token_ms"])
            rows.append(row)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=120)
    records = [json.loads(x) for x in open(os.path.join(F.work_dir, "results.jsonl"))]
    export_ms = {r["id"]: r.get("export_ms") for r in records}
    for row in rows:
        for xs in row["runs"].values():
            for x in xs:
                x["export_ms"] = export_ms.get(x["id"])  # the export's write, from the results file
    payload = {"what": "P/D endpoint: client wall time minus the endpoint's TTFT (what the answer waited for after "
                       "the first token), NIXL (answered before the export) vs files (after it)",
               "checkpoint": "gpt-oss-20b KV cut (handoff_e2e.make_cut)", "dtype": "bfloat16",
               "processes": F.processes, "devices": F.processes,
               "repeats": F.repeats, "rows": rows}
    write_result(F.out, payload, load_start=load0)
    print(f"\nwrote {F.out}")


def _define_flags():
    from absl import flags

    flags.DEFINE_list("mib", ["64", "128", "256"], "KV sizes (MiB) of the prompts (48 KiB per token).")
    flags.DEFINE_integer("repeats", 2, "Timed requests per size and transport.")
    flags.DEFINE_integer("processes", 1, "Launcher processes of one CPU device each (2+: ring attention over them, "
                         "the step's K/V gathered to process 0 for a NIXL answer).")
    flags.DEFINE_integer("seed", 0, "Random prompts.")
    flags.DEFINE_string("checkpoint_dir", "/tmp/slope_jax_20b_kv_cut", "The gpt-oss-20b KV cut (written if absent).")
    flags.DEFINE_string("work_dir", "/tmp/slope_jax_pd_answer", "The endpoint's kv_dir, results and log.")
    flags.DEFINE_string("out", "benchmarks/measured/cpu/pd_answer.json", "JSON output path.")


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.path.insert(0, REPO)
    from absl import app

    _define_flags()
    app.run(main)
