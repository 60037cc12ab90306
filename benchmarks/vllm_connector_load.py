"""vLLM decode from a slope_jax export: the connector's load time per request vs vLLM's own prefill of that prompt.

    SLOPE_VLLM_PYTHON=.venv-vllm/bin/python python benchmarks/vllm_connector_load.py \
        --lengths=128,512,1000,2000 --rounds=3 --out=benchmarks/measured/cpu/vllm_connector_load.json

slope_jax (1,1,1, float32) exports each prompt of the shipped head_dim-64 checkpoint; one vLLM engine (CPU,
float32, enforce_eager, hybrid KV manager, prefix caching off) then serves each request alone, `max_tokens=1`,
--rounds times: once plain (vLLM prefills all n tokens) and once with the export (the connector validates the export
— manifest, model, prompt hash, every file's SHA-256 — in the scheduler, then reads it and writes n−1 tokens of every
layer through the attention backend's cache-update op; vLLM computes the last token). Reported per length (medians):
`plain_s` (vLLM's time to the first token, prefill), `connector_s` (the same with the export), `load_ms` (the
worker's read + write, from the connector's log line), `validate_ms` (scheduler-side checks, timed here by calling
`vllm_plan.validate` in this process). Prints a table and writes JSON. The machine load (`os.getloadavg`) is
recorded: on a shared machine the absolute numbers move, the ratio less.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from common import start_load, write_result  # noqa: E402  (benchmarks/common.py)

FLAGS = flags.FLAGS
flags.DEFINE_list("lengths", ["128", "512", "1000", "2000"], "Prompt lengths (tokens).")
flags.DEFINE_integer("rounds", 3, "Requests per length and path (medians reported).")
flags.DEFINE_string("out", None, "Write the JSON here.")
flags.DEFINE_string("vllm_python", os.environ.get("SLOPE_VLLM_PYTHON", os.path.join(REPO, ".venv-vllm", "bin",
                                                                                       "python")),
                    "python of the vLLM venv.")


def main(argv):
    del argv
    import numpy as np

    from slope_jax.kv import vllm_plan
    from slope_jax.model.config import ModelConfig
    from slope_jax.serve.engine import PrefillEngine

    ckpt = os.path.join(REPO, "checkpoints", "tiny-gpt-oss-hd64")
    cfg = ModelConfig.from_json(os.path.join(ckpt, "config.json"))
    lengths = [int(x) for x in FLAGS.lengths]
    prompts = {n: np.random.default_rng(n).integers(0, cfg.vocab_size - 16, n).astype(np.int32) for n in lengths}
    work = tempfile.mkdtemp(prefix="vllm_connector_load-")
    eng = PrefillEngine.from_checkpoint(ckpt, dtype="float32", progress=False)
    eng.prefill([prompts[n] for n in lengths], os.path.join(work, "kv"), ids=[f"len-{n}" for n in lengths])
    weights = vllm_plan.weights_digest(ckpt)  # what the connector digests of the model vLLM serves
    validate_ms = {}
    for n in lengths:
        t = []
        for _ in range(FLAGS.rounds):
            t0 = time.perf_counter()
            vllm_plan.validate(os.path.join(work, "kv", f"len-{n}"), prompts[n], cfg, "float32", None,
                               weights=weights)
            t.append((time.perf_counter() - t0) * 1e3)
        validate_ms[n] = statistics.median(t)
    phases = []
    for r in range(FLAGS.rounds):
        for n in lengths:
            p = prompts[n].tolist()
            p[0] = (p[0] + r) % (cfg.vocab_size - 16)  # each round a new prompt: nothing cached between rounds
            for path in ("plain", "connector"):
                params = None
                if path == "connector":
                    sub = os.path.join(work, "kv", f"len-{n}-r{r}")
                    if not os.path.exists(sub):
                        eng.prefill([np.asarray(p, np.int32)], os.path.join(work, "kv"), ids=[f"len-{n}-r{r}"])
                    params = {vllm_plan.PATH_KEY: sub}
                phases.append({"requests": [{"id": f"{path}/{n}/{r}", "prompt": p, "params": params}]})
    spec = {"model": ckpt, "hybrid": True, "prefix_caching": False, "max_tokens": 1, "phases": phases,
            "max_model_len": max(lengths) + 16}
    with open(os.path.join(work, "spec.json"), "w") as f:
        json.dump(spec, f)
    load_before = start_load()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(PYTHONPATH=REPO, VLLM_CPU_ATTN_SPLIT_KV="0")
    proc = subprocess.run([FLAGS.vllm_python, os.path.join(REPO, "benchmarks", "vllm_driver.py"),
                           os.path.join(work, "spec.json"), os.path.join(work, "out.json")], env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
    with open(os.path.join(work, "out.json")) as f:
        out = json.load(f)
    log = proc.stdout + proc.stderr
    loads = [float(x) for x in re.findall(r"injected tokens \[\d+, \d+\) \(\d+\) from \S+ in ([0-9.]+) ms", log)]
    ids = [ph["requests"][0]["id"] for ph in phases]
    secs = dict(zip(ids, out["phase_seconds"]))
    rows = []
    connector_ids = [i for i in ids if i.startswith("connector/")]
    load_by_id = dict(zip(connector_ids, loads))  # one request per phase: log lines come in phase order
    for n in lengths:
        plain = statistics.median(secs[f"plain/{n}/{r}"] for r in range(FLAGS.rounds))
        conn = statistics.median(secs[f"connector/{n}/{r}"] for r in range(FLAGS.rounds))
        load = statistics.median(load_by_id[f"connector/{n}/{r}"] for r in range(FLAGS.rounds))
        for r in range(FLAGS.rounds):
            assert out["results"][f"connector/{n}/{r}"]["num_cached_tokens"] == n - 1
            assert out["results"][f"connector/{n}/{r}"]["tokens"] == out["results"][f"plain/{n}/{r}"]["tokens"]
        rows.append({"tokens": n, "plain_s": plain, "connector_s": conn, "load_ms": load,
                     "validate_ms": validate_ms[n], "load_over_plain": load / 1e3 / plain})
    result = {"rows": rows, "rounds": FLAGS.rounds, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
              "cpus": os.cpu_count(), "model": "checkpoints/tiny-gpt-oss-hd64 (float32)",
              "vllm_init_s": out["init_seconds"]}
    print(f"{'tokens':>7} {'vLLM prefill s':>15} {'with export s':>14} {'load ms':>8} {'validate ms':>12} "
          f"{'load/prefill':>13}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['plain_s']:>15.3f} {r['connector_s']:>14.3f} {r['load_ms']:>8.1f} "
              f"{r['validate_ms']:>12.1f} {r['load_over_plain']:>13.3f}")
    print(f"load average before/after: {load_before} / {result['loadavg_after']} on {os.cpu_count()} CPUs")
    if FLAGS.out:
        write_result(FLAGS.out, result, load_start=load_before)


if __name__ == "__main__":
    app.run(main)
