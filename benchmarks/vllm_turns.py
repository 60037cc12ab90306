"""A persistent offline vLLM engine that times one prompt at a time, driven over a pipe; run by the vLLM venv's python
(benchmarks/peer_multiturn.py starts it through `VllmTurns`). Its prefix cache lives as long as the process, so the
turns of a conversation sent one by one hit it as a served conversation would.

    python benchmarks/vllm_turns.py '<spec json>'

spec: {"model": dir, "dtype": "bfloat16"|"float32", "max_model_len": int, "kv_cache_bytes": int,
       "prefix_caching": bool, "eager": bool}
stdin: one JSON command per line —
    {"op": "generate", "prompt": [ids]}  → {"seconds", "first_token", "num_cached_tokens", "num_tokens"}
    {"op": "reset"}                       → {"reset": bool}   (`llm.reset_prefix_cache()`)
    {"op": "quit"}
stdout: one JSON line per command (and {"ready": true, "init_s"} once the model is loaded); everything vLLM prints
goes to stderr (fd 1 is pointed at stderr before vLLM is imported, and its worker processes inherit that).
`seconds` is the wall time of `generate(prompt_token_ids, SamplingParams(max_tokens=1, temperature=0))` measured in
this process: scheduling, the prefill of the uncached tokens, sampling. Stdlib only at import time.
"""

import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_ATTN_SPLIT_KV", "0")  # vLLM-CPU's split-KV path mishandles gpt-oss sinks


def main(spec: dict) -> None:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's logs (and its engine-core process's) to stderr; the protocol keeps the real stdout
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    n = spec["max_model_len"]
    llm = LLM(model=spec["model"], dtype=spec["dtype"], enforce_eager=spec.get("eager", True), max_model_len=n,
              seed=0, skip_tokenizer_init=True, max_num_batched_tokens=max(n, 2048), max_num_seqs=1,
              kv_cache_memory_bytes=spec["kv_cache_bytes"], enable_prefix_caching=spec["prefix_caching"])
    out.write(json.dumps({"ready": True, "init_s": time.perf_counter() - t0}) + "\n")
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "reset":
            reply = {"reset": bool(llm.reset_prefix_cache())}
        else:
            t = time.perf_counter()
            o = llm.generate([{"prompt_token_ids": cmd["prompt"]}], sp, use_tqdm=False)[0]
            reply = {"seconds": time.perf_counter() - t, "first_token": int(o.outputs[0].token_ids[0]),
                     "num_cached_tokens": getattr(o, "num_cached_tokens", None), "num_tokens": len(cmd["prompt"])}
        out.write(json.dumps(reply) + "\n")



# ------------------------------------------------------------------------------------------------------------------
# the client side (imported by the benchmark's interpreter, not the vLLM venv's)
def vllm_env(extra: dict | None = None) -> dict:
    """The environment of a vLLM-CPU process that gets every core this process may use: its OpenMP compute threads
    bound to all of them (`VLLM_CPU_OMP_THREADS_BIND`), none reserved for the scheduler process
    (`VLLM_CPU_NUM_OF_RESERVED_CPU=0`; vLLM's default reserves one per rank, which on a 2-core host leaves one
    compute thread), split-KV attention off (as the tests run it); XLA/JAX variables dropped."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(VLLM_CPU_OMP_THREADS_BIND=",".join(str(c) for c in cores), VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               VLLM_CPU_ATTN_SPLIT_KV="0")
    env.update(extra or {})
    return env


class VllmTurns:
    """A running `vllm_turns.py` process: `generate(prompt)` → reply dict, `reset()`, `close()`. Its stderr (vLLM's
    logs) goes to `log_path`."""

    def __init__(self, python: str, spec: dict, log_path: str, repo: str, timeout_s: float = 1800):
        import subprocess

        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1,
                                     env=vllm_env({"PYTHONPATH": repo}))
        self.log_path, self.timeout_s = log_path, timeout_s
        self.init_s = self._read()["init_s"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=60)
            with open(self.log_path) as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"vLLM process exited (rc {self.proc.returncode}):\n{tail}")
        return json.loads(line)

    def _ask(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def generate(self, prompt) -> dict:
        return self._ask({"op": "generate", "prompt": [int(x) for x in prompt]})

    def reset(self) -> bool:
        return self._ask({"op": "reset"})["reset"]

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=120)
        except Exception:  # a dead or stuck process: end it (ours, by its handle)
            self.proc.kill()
            self.proc.wait()
        self.log.close()


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):  # a driver other scripts start: its usage
        sys.exit(__doc__)
    main(json.loads(sys.argv[1]))
