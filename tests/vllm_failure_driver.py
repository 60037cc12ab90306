"""Runs one in-process vLLM engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: scheduler, worker and this driver share one
process) with the slope_jax connector, stepping it by hand; run by the vLLM venv's python
(tests/test_vllm_failures.py). Needs only vLLM and slope_jax (on PYTHONPATH).

    python tests/vllm_failure_driver.py spec.json out.json

spec: {"model": dir, "hybrid": bool, "prefix_caching": bool, "policy": "fail" | "recompute", "extra_config": {...},
       "block_size", "max_model_len", "kv_cache_bytes", "num_gpu_blocks" (optional), "max_num_seqs",
       "phases": [{"wait_for": path or null, "policy": "fail" | "recompute" (optional), "requests": [request, ...]}]}
Each phase empties vLLM's prefix cache first (so no request hits another phase's blocks); "policy" switches vLLM's
kv_load_failure_policy from that phase on (the scheduler's `recompute_kv_load_failures`, which vLLM sets from the
config at start-up, and the connector's copy), so one engine serves both policies.
request: {"id", "prompt": [ids], "params": {...} or null, "cache_salt", "max_tokens" (16), "ignore_eos" (true),
          "stop_token_ids", "stop_at_first_token_of": id (stop at the first token that request produced),
          "after": {"id": other request, "tokens": k} (added once that one has k tokens; default: at the phase's
          start), "abort_after_steps": k (aborted k engine steps after it was added),
          "tamper": "delete" | "flip" | "truncate" (done to the export's kv-p0.safetensors right after the scheduler
          validated it and allocated its blocks: `update_state_after_alloc`) | "reclaim" (the whole export removed
          then, as the prefill's /v1/kv/release does),
          "nixl": {"lease_s", "delay_s", "file": bool, "flip": bool, "pre_export": bool} (the export at params' path
          is published in the driver's NIXL pool with that lease just before the request is added, after a sleep of
          delay_s — a decode queue longer than the lease —; params then carry the hand-off record, and the path only
          with "file"; "flip": one byte of the pool entry flipped after publication; "pre_export": the record's
          manifest lists no files, as one published before its export is written)}
Greedy, float32. out: {"results": {id: {"tokens", "logprobs", "finish_reason", "num_cached_tokens",
"kv_transfer_params", "added", "token_times"}}, "free_blocks": {"start", "end"}, "preemptions": {id: count},
"pool": the NIXL pool's stats at the end (`KVPool.stats`) or null, "switch_interval_s": the interpreter's GIL switch
interval once every load has ended, "staging_bytes": the worker connector's NIXL staging buffer at the end (0: none)}
(times: time.perf_counter seconds; free blocks of every KV cache group's pool, idle, before the first and after the last
phase).
"""

import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_ATTN_SPLIT_KV", "0")  # vLLM-CPU's split-KV decode mishandles gpt-oss sinks
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the tamper hook and the block counts need the engine in-process


def _tamper(path: str, action: str) -> None:
    f = os.path.join(path, "kv-p0.safetensors")
    if action == "reclaim":
        from slope_jax.kv import format as kvfmt

        kvfmt.remove_tree(path)
    elif action == "delete":
        os.remove(f)
    elif action == "flip":  # one byte in the middle of the tensor data: same size, other digest
        with open(f, "r+b") as fh:
            fh.seek(os.path.getsize(f) // 2)
            b = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([b[0] ^ 0x55]))
    elif action == "truncate":
        os.truncate(f, os.path.getsize(f) - 4096)
    else:
        raise ValueError(action)


def _hook_tampering(tamper: dict) -> None:
    """Tamper with a request's export right after the scheduler validated it and allocated its blocks."""
    from slope_jax.kv.vllm_connector import SlopeJaxConnector

    orig = SlopeJaxConnector.update_state_after_alloc

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        orig(self, request, blocks, num_external_tokens)
        # vLLM appends "-<random>" to the caller's request id
        rid = next((r for r in tamper if request.request_id.startswith(r + "-")), None)
        action = tamper.pop(rid, None)
        if action and num_external_tokens > 0:
            d = self._decisions[request.request_id]
            _tamper(d.source or d.export.path, action)  # the export itself, not the connector's pin of it
            print(f"driver: tampered ({action}) with the export of {request.request_id} after validation",
                  flush=True)

    SlopeJaxConnector.update_state_after_alloc = update_state_after_alloc


def _engine(spec: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(kv_connector="SlopeJaxConnector", kv_connector_module_path="slope_jax.kv.vllm_connector",
                           kv_role="kv_consumer", kv_connector_extra_config=spec.get("extra_config", {}),
                           kv_load_failure_policy=spec.get("policy", "fail"))
    cache = {"kv_cache_memory_bytes": spec.get("kv_cache_bytes", 1 << 28)}
    if spec.get("num_gpu_blocks"):  # fewer blocks than the memory holds (to make vLLM preempt)
        cache["num_gpu_blocks_override"] = spec["num_gpu_blocks"]
    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, max_model_len=spec.get("max_model_len", 2048),
              seed=0, block_size=spec.get("block_size", 128), kv_transfer_config=ktc,
              enable_prefix_caching=spec["prefix_caching"], disable_hybrid_kv_cache_manager=not spec["hybrid"],
              max_num_seqs=spec.get("max_num_seqs", 256), **cache)
    return llm.llm_engine


def _scheduler(engine):
    return engine.engine_core.engine_core.scheduler


def _free_blocks(engine) -> int:
    return _scheduler(engine).kv_cache_manager.block_pool.get_num_free_blocks()


_POOL = []


def _publish(r: dict) -> dict:
    """The request's kv_transfer_params with its export published in the driver's NIXL pool (module doc)."""
    from slope_jax.kv import nixl_transport as nt
    from slope_jax.kv import vllm_plan as plan

    if not _POOL:
        _POOL.append(nt.KVPool(256 << 20, name="driver-pool"))
        _POOL.append(nt.KVPool(256 << 20, name="driver-pool-2"))  # the second process's pool of a composed record
    pool, spec, path = _POOL[0], r["nixl"], r["params"][plan.PATH_KEY]
    if spec.get("composed"):  # as a 2-process prefill answers: each layer's rows split over two pools
        return _composed(r["id"], path)
    if spec.get("pre_export"):  # as the endpoint answers before the export is written: its manifest has no files
        from slope_jax.kv import format as kvfmt

        manifest = {**nt.handoff_manifest(kvfmt.read_manifest(path)), "files": [], "checksums": {}}
        params = pool.publish(r["id"], kvfmt.load(path), manifest, lease_s=spec.get("lease_s"))
    else:
        params = pool.publish_export(path, lease_s=spec.get("lease_s"))
    if spec.get("flip"):
        rec = params[nt.PARAMS_KEY]
        pool._arena[rec["address"] - pool._base + rec["layers"][-1]["offset"] + 1] ^= 0xFF
    time.sleep(spec.get("delay_s", 0.0))
    return {**params, **({plan.PATH_KEY: path} if spec.get("file") else {})}


def _composed(rid: str, path: str) -> dict:
    """A composed record of the export at `path`: each layer's rows [a, b) split at a + 2/5 of them (off vLLM's block
    boundaries), the first piece in one pool, the second in the other (`nixl_transport.compose`)."""
    from slope_jax.kv import format as kvfmt
    from slope_jax.kv import nixl_transport as nt

    kv, halves = kvfmt.load(path), ([], [])
    for layer, lkv in kv.items():
        a, b = int(lkv.positions[0]), int(lkv.positions[-1]) + 1
        cut = a + 2 * (b - a) // 5
        for half, (lo, hi) in zip(halves, ((a, cut), (cut, b))):
            half.append((layer, lo, hi, lkv.k[lo - a: hi - a], lkv.v[lo - a: hi - a]))
    kinds = {layer: lkv.kind for layer, lkv in kv.items()}
    parts = [pool.publish_pieces(rid, half, kinds) for pool, half in zip(_POOL, halves)]
    return nt.compose(rid, parts, nt.handoff_manifest(kvfmt.read_manifest(path)))


def _params(r: dict, results: dict):
    from vllm import SamplingParams

    if r.get("stop_at_first_token_of"):
        r = {**r, "stop_token_ids": results[r["stop_at_first_token_of"]]["tokens"][:1]}
    return SamplingParams(max_tokens=r.get("max_tokens", 16), temperature=0.0, ignore_eos=r.get("ignore_eos", True),
                          logprobs=0, stop_token_ids=r.get("stop_token_ids"),
                          extra_args={"kv_transfer_params": r["params"]} if r.get("params") else None)


def _run_phase(engine, phase: dict, results: dict, preemptions: dict) -> None:
    """Add the phase's requests (each when its `after` condition holds), step until all finished, record outputs."""
    todo = list(phase["requests"])
    steps_since: dict[str, int] = {}
    live: set[str] = set()
    while todo or live:
        for r in list(todo):
            after = r.get("after")
            if after and len(results.get(after["id"], {}).get("tokens", ())) < after["tokens"]:
                continue
            todo.remove(r)
            prompt = {"prompt_token_ids": r["prompt"], **({"cache_salt": r["cache_salt"]} if r.get("cache_salt")
                                                          else {})}
            if r.get("nixl") is not None:
                r = {**r, "params": _publish(r)}
            results[r["id"]] = {"tokens": [], "logprobs": [], "token_times": [], "added": time.perf_counter(),
                                "finish_reason": None}
            engine.add_request(r["id"], prompt, _params(r, results))
            steps_since[r["id"]], live = 0, live | {r["id"]}
        for r in phase["requests"]:
            k = r.get("abort_after_steps")
            if r["id"] in live and k is not None and steps_since.get(r["id"]) == k:
                engine.abort_request([r["id"]])
                results[r["id"]]["finish_reason"] = "aborted"
                live.discard(r["id"])
        for req_id, req in _scheduler(engine).requests.items():  # vLLM's id: the caller's + "-<random>"
            if req.num_preemptions:
                preemptions[req_id.rsplit("-", 1)[0]] = req.num_preemptions
        outs = engine.step() if engine.has_unfinished_requests() else []
        now = time.perf_counter()
        for rid in steps_since:
            steps_since[rid] += 1
        for o in outs:
            _record(results[o.request_id], o, now)
            if o.finished:
                live.discard(o.request_id)


def _record(res: dict, o, now: float) -> None:
    c = o.outputs[0] if o.outputs else None
    new = list(c.token_ids) if c is not None else []
    res["token_times"] += [now] * (len(new) - len(res["tokens"]))
    res["tokens"] = new
    if c is not None and c.logprobs:
        res["logprobs"] = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]
    res["num_cached_tokens"] = o.num_cached_tokens
    res["kv_transfer_params"] = o.kv_transfer_params
    if o.finished:
        res["finish_reason"] = c.finish_reason if c is not None else "error"


def _settle(engine, timeout: float = 60.0) -> None:
    """Step the engine until the scheduler holds no request, finished ones included (an aborted request's blocks
    wait for the connector to report its load finished)."""
    core = engine.engine_core.engine_core
    end = time.perf_counter() + timeout
    while core.scheduler.has_requests():
        assert time.perf_counter() < end, "requests still held by the scheduler"
        core.step_fn()
        time.sleep(0.01)


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    tamper = {r["id"]: r["tamper"] for p in spec["phases"] for r in p["requests"] if r.get("tamper")}
    _hook_tampering(tamper)
    engine = _engine(spec)
    out = {"results": {}, "preemptions": {}, "free_blocks": {"start": _free_blocks(engine)}}
    for phase in spec["phases"]:
        wait = phase.get("wait_for")
        while wait and not os.path.exists(wait):
            time.sleep(0.2)
        if spec["prefix_caching"]:
            assert engine.reset_prefix_cache()
        if phase.get("policy"):
            sched = _scheduler(engine)
            sched.recompute_kv_load_failures = sched.connector._recompute = phase["policy"] == "recompute"
        _run_phase(engine, phase, out["results"], out["preemptions"])
        _settle(engine)
    out["free_blocks"]["end"] = _free_blocks(engine)
    out["switch_interval_s"] = sys.getswitchinterval()  # the connector's 0.2 ms during loads, restored after
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    staging = getattr(get_kv_transfer_group(), "_staging", None)
    out["staging_bytes"] = 0 if staging is None else int(staging.nbytes)
    time.sleep(0.5)  # the connector's "done" notifications reach the pool
    out["pool"] = _POOL[0].stats() if _POOL else None
    out["pool2"] = _POOL[1].stats() if _POOL else None
    for pool in _POOL:
        pool.close()  # its notification thread stopped before the interpreter tears the agent down
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
