r"""slope_jax launcher: run once per host (process). Process 0 reads requests and writes results; every process
computes its share of each prefill and writes the KV pieces it holds.

  # one process, the shipped checkpoint on 8 virtual CPU devices
  python -m slope_jax.launch --cpu_devices=8 --ring=2 --ulysses=4 --requests=reqs.jsonl --results=out.jsonl \
      --kv_dir=kv

  # two processes x 4 CPU devices on this machine (launch/local.sh does this)
  python -m slope_jax.launch --num_processes=2 --process_id=0 --coordinator_address=127.0.0.1:23456 \
      --cpu_devices=4 --ring=2 --ulysses=4 --requests=reqs.jsonl --results=out.jsonl --kv_dir=kv &
  python -m slope_jax.launch --num_processes=2 --process_id=1 --coordinator_address=127.0.0.1:23456 \
      --cpu_devices=4 --ring=2 --ulysses=4 --kv_dir=kv

Request lines are described in `slope_jax.requests`. One result line is written per request: an error record as
soon as a bad line is read, a result when its batch finishes (id, first token and its logprob, top-k logits,
num_tokens, TTFT = queue + compute, compile/export times in ms, KV path).
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags, logging

FLAGS = flags.FLAGS
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

flags.DEFINE_string("checkpoint", os.path.join(_REPO, "checkpoints", "tiny-gpt-oss"),
                    "Checkpoint directory (HF layout with config.json and safetensors, or an original/ directory).")
flags.DEFINE_integer("pipeline", 1, "Pipeline stages (layers are split over them).")
flags.DEFINE_integer("ring", 1, "Ring-attention degree (zigzag sequence chunks).")
flags.DEFINE_integer("ulysses", 1, "Ulysses degree (all-to-all between sequence and head shards).")
flags.DEFINE_integer("microbatches", None, "Requests in flight through the pipeline per step (default: --pipeline).")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Weights and activations (norms, softmax, router "
                  "and accumulators are float32 either way).")
flags.DEFINE_string("requests", "-", "JSONL file of requests, or '-' for stdin (read by process 0 only).")
flags.DEFINE_string("results", "-", "JSONL file for results, or '-' for stdout (written by process 0 only).")
flags.DEFINE_string("kv_dir", None, "Export each request's KV cache to KV_DIR/<id>/ (safetensors + manifest.json). "
                    "Every process writes the pieces it holds; use a shared filesystem across hosts.")
flags.DEFINE_bool("kv_full", False, "Export every token of sliding-window layers (default: their last W tokens, "
                  "all a decoder needs).")
flags.DEFINE_string("logits_dir", None, "Also save each request's last-position logits as LOGITS_DIR/<id>.npy "
                    "(float32), for verification.")
flags.DEFINE_integer("top_k", 5, "Number of (token, logit) pairs per result.")
flags.DEFINE_integer("batch_size", 8, "Requests per engine call (grouped by length bucket inside).")
flags.DEFINE_integer("max_tokens", None, "Longest accepted prompt (default: the model's max_position_embeddings).")
flags.DEFINE_float("device_memory_gib", None, "Per-device memory budget for admitting a request: its length bucket's "
                   "compiled step (weights, KV, activations, from XLA's memory analysis) must fit. Default: what the "
                   "device reports (no check on CPU).")
flags.DEFINE_string("coordinator_address", "127.0.0.1:23456", "HOST:PORT of process 0 (multi-process runs).")
flags.DEFINE_integer("num_processes", 1, "Number of processes (hosts) in the run.")
flags.DEFINE_integer("process_id", 0, "This process's id, 0..num_processes-1; process 0 is the coordinator.")
flags.DEFINE_float("init_timeout", 120.0, "Seconds to wait for every process to join before failing.")
flags.DEFINE_float("heartbeat_timeout", 30.0, "Seconds without a peer's heartbeat before the run is aborted.")
flags.DEFINE_integer("cpu_devices", None, "Split the CPU into this many virtual devices (testing without "
                     "accelerators; sets XLA_FLAGS=--xla_force_host_platform_device_count).")
flags.DEFINE_string("platform", None, "Force a JAX platform (cpu, cuda, rocm); default: JAX's choice.")
flags.DEFINE_integer("q_tile", 256, "Attention query tile (tokens).")
flags.DEFINE_integer("kv_tile", 256, "Attention key/value tile (tokens).")
flags.DEFINE_integer("moe_tile", 128, "Rows per expert matmul tile.")
flags.DEFINE_enum("attention_impl", "auto", ["auto", "pallas", "xla"], "Local attention core: auto = the fused Pallas "
                  "kernel on GPUs (Triton) and the pure-JAX blockwise reference elsewhere; pallas on CPU runs in "
                  "interpret mode (slow, for testing).")
flags.DEFINE_enum("moe_impl", "auto", ["auto", "ragged", "loop"], "MoE grouped expert compute: loop = per-expert "
                  "tile loop, ragged = jax.lax.ragged_dot; auto = loop (XLA runs ragged_dot as dense work over all "
                  "experts on CPU and, measured, on H200).")
flags.DEFINE_list("precompile", [], "Prompt lengths whose buckets are compiled before the first request is read "
                  "(e.g. 1024,4096,16384), so early requests do not wait for compilation.")
flags.DEFINE_bool("summary", True, "Print a one-screen summary at the end (process 0, to stderr).")


def _configure_platform():
    """Environment that must be set before JAX starts its backends."""
    if FLAGS.cpu_devices:
        xla = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
        os.environ["XLA_FLAGS"] = " ".join(xla + [f"--xla_force_host_platform_device_count={FLAGS.cpu_devices}"])
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if FLAGS.platform:
        os.environ["JAX_PLATFORMS"] = FLAGS.platform


class _Broadcast:
    """Process 0 → all processes: one JSON value per call (a batch, or None to stop)."""

    def __init__(self, multi: bool):
        self.multi = multi

    def __call__(self, value):
        if not self.multi:
            return value
        import jax
        import numpy as np
        from jax.experimental import multihost_utils

        data = json.dumps(value).encode() if jax.process_index() == 0 else b""
        n = int(multihost_utils.broadcast_one_to_all(np.array([len(data)], np.int64))[0])
        size = 1 << max(6, (n - 1).bit_length())  # a few padded sizes: few compiled broadcasts
        buf = np.zeros(size, np.uint8)
        buf[:len(data)] = np.frombuffer(data, np.uint8)
        out = np.asarray(multihost_utils.broadcast_one_to_all(buf))
        return json.loads(out[:n].tobytes().decode())


def _read_batch(lines, state, limit, *, vocab, max_tokens, tokenizer, emit_error, fits=None):
    """Up to `limit` valid requests from the line iterator; bad lines go to `emit_error`. None at end of input.
    `fits(n)` raises RequestError when an n-token prompt does not fit the memory plan."""
    from slope_jax.serve import requests
    from slope_jax.serve.requests import RequestError

    batch = []
    while len(batch) < limit:
        line = next(lines, None)
        if line is None:
            return batch or None
        state["lineno"] += 1
        if not line.strip():
            continue
        try:
            req = requests.parse(line, state["lineno"], vocab_size=vocab, max_tokens=max_tokens,
                                 tokenizer=tokenizer, seen_ids=state["ids"])
            if fits is not None:
                try:
                    fits(req.tokens.size)
                except RequestError as e:
                    raise RequestError(f"line {req.line} ({req.id}): {e}") from e
            batch.append(req)
        except RequestError as e:
            rid = None
            try:
                obj = json.loads(line)
                rid = obj.get("id") if isinstance(obj, dict) and isinstance(obj.get("id"), str) else None
            except json.JSONDecodeError:
                pass
            emit_error({"id": rid, "line": state["lineno"], "error": str(e)})
    return batch


def _summary(records, wall_s):
    ok = [r for r in records if "error" not in r]
    lines = [f"{'id':<24} {'tokens':>7} {'first':>7} {'TTFT ms':>9} {'queue':>8} {'(compile)':>9} {'compute':>8} "
             f"{'export':>8}  status"]
    for r in records[:40]:
        if "error" in r:
            lines.append(f"{str(r.get('id')):<24} {'':>7} {'':>7} {'':>9} {'':>8} {'':>9} {'':>8} {'':>8}  "
                         f"error: {r['error'][:60]}")
        else:
            slo = "" if r.get("slo_met") is None else ("  SLO met" if r["slo_met"] else "  SLO missed")
            lines.append(f"{r['id']:<24} {r['num_tokens']:>7} {r['first_token']:>7} {r['ttft_ms']:>9.1f} "
                         f"{r['queue_ms']:>8.1f} {r['compile_ms']:>9.1f} {r['compute_ms']:>8.1f} "
                         f"{r['export_ms']:>8.1f}  ok{slo}")
    if len(records) > 40:
        lines.append(f"... {len(records) - 40} more")
    toks = sum(r["num_tokens"] for r in ok)
    with_slo = [r for r in ok if r.get("slo_met") is not None]
    lines.append(f"{len(ok)} ok, {len(records) - len(ok)} failed; {toks} prompt tokens in {wall_s:.1f} s "
                 f"({toks / max(wall_s, 1e-9):.0f} tokens/s including compilation)"
                 + (f"; SLO attainment {sum(r['slo_met'] for r in with_slo)}/{len(with_slo)}" if with_slo else ""))
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    _configure_platform()
    from slope_jax.serve import distributed

    try:
        distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                               init_timeout_s=FLAGS.init_timeout, heartbeat_timeout_s=FLAGS.heartbeat_timeout)
    except distributed.StartupError as e:
        _fail(f"start-up failed: {e}")
    try:
        _serve()
    except Exception as e:  # noqa: BLE001 - turn a peer's death into one clear line, then exit non-zero
        if FLAGS.num_processes > 1:
            _fail(f"process {FLAGS.process_id}: the run stopped ({type(e).__name__}: {str(e).splitlines()[0][:300]}). "
                  "In a multi-process run this usually means another process died; see its log.", hard=True)
        raise


def _fail(message: str, hard: bool = False):
    """Print one clear line and exit with status 2. `hard` skips exit handlers: after a peer died, JAX's shutdown
    barrier would otherwise wait for it and then abort."""
    print(f"slope_jax: error: {message}", file=sys.stderr, flush=True)
    if hard:
        sys.stdout.flush()
        os._exit(2)
    sys.exit(2)


def _serve():
    import jax
    import numpy as np

    from slope_jax.parallel.config import ParallelConfig
    from slope_jax.serve.engine import PrefillEngine
    from slope_jax.serve.requests import RequestError

    t_start = time.perf_counter()
    me = jax.process_index()
    parallel = ParallelConfig(pipeline=FLAGS.pipeline, ring=FLAGS.ring, ulysses=FLAGS.ulysses,
                              microbatches=FLAGS.microbatches)
    engine = PrefillEngine.from_checkpoint(FLAGS.checkpoint, parallel, FLAGS.dtype, progress=me == 0,
                                           q_tile=FLAGS.q_tile, kv_tile=FLAGS.kv_tile, moe_tile=FLAGS.moe_tile,
                                           attention_impl=FLAGS.attention_impl, moe_impl=FLAGS.moe_impl)
    cfg = engine.cfg
    if FLAGS.precompile:
        engine.precompile([int(x) for x in FLAGS.precompile])
    max_tokens = FLAGS.max_tokens or cfg.max_position_embeddings
    broadcast = _Broadcast(jax.process_count() > 1)
    records: list[dict] = []
    out = None
    if me == 0:
        tokenizer = None
        tok_path = os.path.join(FLAGS.checkpoint, "tokenizer.json")
        if os.path.exists(tok_path):
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(tok_path)
        src = sys.stdin if FLAGS.requests == "-" else open(FLAGS.requests)
        lines = iter(src)
        if FLAGS.results != "-":
            os.makedirs(os.path.dirname(os.path.abspath(FLAGS.results)), exist_ok=True)
        out = sys.stdout if FLAGS.results == "-" else open(FLAGS.results, "w")
        state = {"lineno": 0, "ids": set()}

        def emit(rec):
            records.append(rec)
            out.write(json.dumps(rec) + "\n")
            out.flush()

        if FLAGS.logits_dir:
            os.makedirs(FLAGS.logits_dir, exist_ok=True)
        budget = None if FLAGS.device_memory_gib is None else int(FLAGS.device_memory_gib * 2**30)

        def fits(n):
            engine.check_fits(n, budget)
    while True:
        payload = None
        if me == 0:
            batch = _read_batch(lines, state, FLAGS.batch_size, vocab=cfg.vocab_size, max_tokens=max_tokens,
                                tokenizer=tokenizer, emit_error=emit, fits=fits)
            if batch is not None:
                payload = [[r.id, r.tokens.tolist()] for r in batch]
        payload = broadcast(payload)
        if payload is None:
            break
        prompts = [np.asarray(p[1], np.int32) for p in payload]
        ids = [p[0] for p in payload]
        arrivals = [r.arrival for r in batch] if me == 0 else None
        try:
            results = engine.prefill(prompts, FLAGS.kv_dir, ids=ids, kv_full=FLAGS.kv_full, return_kv=False,
                                     top_k=FLAGS.top_k, arrival_times=arrivals)
        except RequestError as e:  # deterministic on every process: record it and go on
            if me == 0:
                for r in batch:
                    emit({"id": r.id, "line": r.line, "error": str(e)})
            continue
        if me == 0:
            for r, res in zip(batch, results):
                rec = {"id": r.id, "first_token": res.first_token, "logprob": round(res.logprob, 6),
                       "top_k": [[t, round(v, 6)] for t, v in res.top_k], "num_tokens": res.num_tokens,
                       "bucket": engine.bucket(res.num_tokens), "ttft_ms": round(res.ttft_ms, 3),
                       "queue_ms": round(res.queue_ms, 3), "compile_ms": round(res.compile_ms, 3),
                       "compute_ms": round(res.compute_ms, 3),
                       "export_ms": round(res.export_ms, 3), "kv_path": res.kv_path}
                if r.ttft_slo_ms is not None:
                    rec["ttft_slo_ms"] = r.ttft_slo_ms
                    rec["slo_met"] = res.ttft_ms <= r.ttft_slo_ms
                if FLAGS.logits_dir:
                    np.save(os.path.join(FLAGS.logits_dir, f"{r.id}.npy"), res.logits)
                emit(rec)
    if me == 0:
        if out is not sys.stdout:
            out.close()
        if FLAGS.summary:
            print(_summary(records, time.perf_counter() - t_start), file=sys.stderr)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("slope_jax launcher done")
    logging.info("process %d done", me)


def run():
    """Console-script entry point (`slope-jax`)."""
    # absl's --help lists the flags of the module named by argv[0]; for a console script that is the wrapper, so
    # register this module's flags under that name too.
    for flag in FLAGS.flags_by_module_dict().get(__name__, []):
        FLAGS.register_key_flag_for_module(sys.argv[0], flag)
    app.run(main)


if __name__ == "__main__":
    run()
