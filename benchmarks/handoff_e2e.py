"""benchmarks/handoff.py's end-to-end part: from the prefill's first token (its KV in host memory) to vLLM's first
decoded token, through the real connector, over files or NIXL.

The model is a gpt-oss-20b KV cut (`make_cut`): gpt-oss-20b's attention and KV dimensions exactly (24 layers
alternating sliding/full, window 128, 64 query heads, 8 KV heads, head_dim 64: 48 KiB of bf16 KV per token) with the
rest cut so that vLLM-CPU serves it on 2 cores (hidden 1024, 4 dense experts of 256, the 1,000-token vocabulary of
checkpoints/tiny-gpt-oss-hd64; random weights). The KV handed off is synthetic (`handoff.synthetic_kv`, every layer
all n tokens, the `full` policy): its values are not the model's, its bytes, manifest and checks are the real ones,
and vLLM loads it and decodes from it as from a real export.

Per hand-off (`Decoder.handoff`): `export_s` (files: the export written — safetensors, file digests, manifest, fsync,
atomic publication — as `kv.exporter` writes it; NIXL: `KVPool.publish`, the copy into the registered arena with
an XXH3-128 per layer), then the request goes to vLLM (benchmarks/handoff_vllm.py, one in-process engine with
vLLM's defaults: prefix caching on, its own block size, hybrid manager); `transfer_s` (the connector's read of the
files with their digests, or its NIXL pull with the per-layer digests, until the last byte is verified), `load_s`
(the rest of the load: writing the rows into vLLM's cache; a NIXL pull writes each layer while the next one is
read, so this is only the tail of its writes; `write_ops_s`: all of the cache-update ops' seconds), `vllm_s` (the
rest of vLLM's time to its first token: scheduling, validation, waiting for a step, the last prompt token's
forward), `total_s` (the prefill's first token → vLLM's first token, one monotonic clock).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "checkpoints", "tiny-gpt-oss-hd64")
CUT = {"hidden_size": 1024, "intermediate_size": 256, "num_local_experts": 4, "num_experts_per_tok": 4,
       "experts_per_token": 4, "vocab_size": 1000, "eos_token_id": 993, "pad_token_id": 992}


def make_cut(directory: str) -> str:
    """Write the gpt-oss-20b KV cut (module doc) to `directory` (kept if it already holds one). Returns it."""
    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    from slope_jax.checkpoints import writer
    from slope_jax.model.config import ModelConfig

    with open(os.path.join(REPO, "configs", "gpt-oss-20b.json")) as f:
        hf = {**json.load(f), **CUT}
    tmp = directory + ".config.json"
    os.makedirs(os.path.dirname(os.path.abspath(directory)), exist_ok=True)
    with open(tmp, "w") as f:
        json.dump(hf, f)
    cfg = dataclasses.replace(ModelConfig.from_json(tmp), expert_format="mxfp4")
    os.remove(tmp)
    writer.write_hf(directory + ".tmp", cfg, writer.random_params(cfg, 0), experts="dense")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(TINY, name), os.path.join(directory + ".tmp", name))
    os.rename(directory + ".tmp", directory)
    return directory


def export_files(kv: dict, tokens, cfg, kv_dir: str, rid: str, weights: str) -> str:
    """Write `kv` (every layer all n tokens) as a published `full` export `<kv_dir>/<rid>`, as the exporter does."""
    from slope_jax.kv import format as kvfmt

    n = len(tokens)
    staging = kvfmt.staging_dir(kv_dir, rid, kvfmt.new_run_nonce(), 0)
    name, recs = kvfmt.write_shard_file(staging, 0, [(i, 0, n, x.k, x.v) for i, x in kv.items()], token_ids=tokens)
    kvfmt.write_manifest(staging, request_id=rid, token_ids=tokens, cfg=cfg, dtype="bfloat16", full=True,
                         segments=recs, files=[name], weights_digest=weights)
    return kvfmt.publish(kv_dir, rid, staging, overwrite=False)


class Decoder:
    """benchmarks/handoff_vllm.py in the vLLM venv, driven over a pipe."""

    def __init__(self, vllm_python: str, model: str, max_tokens_kv: int, kv_cache_bytes: int, weights: str,
                 log_path: str, switch_interval_s: float | None = None, staging_mib: int = 0):
        spec = {"model": model, "dtype": "bfloat16", "max_model_len": max_tokens_kv + 64,
                "kv_cache_bytes": kv_cache_bytes,
                "extra_config": {"weights_digest": weights, "nixl_staging_mib": staging_mib},
                "switch_interval_s": switch_interval_s}
        self.staging_mib = staging_mib
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
        env.update(PYTHONPATH=REPO, PYTHONUNBUFFERED="1", UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"))
        self.log = open(log_path, "w")
        t0 = time.monotonic()
        self.proc = subprocess.Popen([vllm_python, os.path.join(REPO, "benchmarks", "handoff_vllm.py"),
                                      json.dumps(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env, cwd=REPO)
        self._answer(ready=True)
        self.init_s = time.monotonic() - t0

    def _answer(self, ready: bool = False):
        for line in self.proc.stdout:
            line = line.strip()
            if ready and line == "ready":
                return None
            if not ready and line.startswith("{"):
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    pass
            self.log.write(line + "\n")
        raise RuntimeError(f"the vLLM driver ended (exit {self.proc.wait()}); see {self.log.name}")

    def request(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps({"op": "request", **cmd}) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        self.log.close()


def split(t_first: float, export_s: float, ans: dict) -> dict:
    """One hand-off's parts (module doc) from the prefill's clock and vLLM's answer."""
    c = ans["connector"]
    transfer = c.get("read_s", 0.0)
    load = c.get("load_s", 0.0) - transfer
    vllm = ans["first_token_at"] - ans["added"]
    params = ans.get("kv_transfer_params") or {}
    return {"export_s": export_s, "send_s": ans["added"] - t_first - export_s, "transfer_s": transfer,
            "load_s": load, "vllm_s": vllm - transfer - load, "total_s": ans["first_token_at"] - t_first,
            "write_ops_s": c.get("write_s", 0.0),
            "num_cached_tokens": ans["num_cached_tokens"], "how": c.get("how"),
            "status": params.get("slope_jax_status"), "transport": params.get("slope_jax_transport")}


def gaps(ans: dict) -> tuple[list, list]:
    """Inter-token gaps (s) of the neighbours: before the export request arrived, and from its arrival to its first
    token (its load and its first step)."""
    before, during = [], []
    for times in ans["neighbours"].values():
        for a, b in zip(times, times[1:]):
            if b <= ans["added"]:
                before.append(b - a)
            elif a < ans["first_token_at"]:
                during.append(b - a)
    return before, during


def itl(before: list, during: list) -> dict:
    """Medians, 90th percentiles and maxima of the gaps without (`before`) and `during` a load, and their ratios
    (pass the gaps of several runs pooled: one run's `during` window holds only ~25 gaps)."""
    q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] if xs else None  # noqa: E731
    out = {"without": {"median_s": statistics.median(before), "p90_s": q(before, 0.9), "max_s": max(before),
                       "gaps": len(before)},
           "during": {"median_s": statistics.median(during), "p90_s": q(during, 0.9), "max_s": max(during),
                      "gaps": len(during)} if during else None}
    if during:
        out["ratio_median"] = out["during"]["median_s"] / out["without"]["median_s"]
        out["ratio_max"] = out["during"]["max_s"] / out["without"]["median_s"]
    return out
