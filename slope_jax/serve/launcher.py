r"""slope_jax launcher (`slope-jax` or `python -m slope_jax.launch`): run once per host (process). Process 0 reads
requests and writes results; every process computes its share of each prefill and writes the KV pieces it holds.

  # one process, the shipped checkpoint on 8 virtual CPU devices
  slope-jax --cpu_devices=8 --ring=2 --ulysses=4 --requests=reqs.jsonl --results=out/results.jsonl --kv_dir=out/kv

  # requests on stdin (no --requests): each batch leaves at most --batch_wait_ms after its first request arrives
  echo '{"id": "a", "text": "Hello"}' | slope-jax --cpu_devices=1

  # a prefill endpoint for prefill/decode serving: OpenAI-style POST /v1/completions on 127.0.0.1:8100, answered
  # with the first token and the kv_transfer_params a vLLM decode server reads (slope_jax.serve.http; launch/pd_vllm.sh)
  slope-jax --cpu_devices=8 --ring=2 --ulysses=4 --http_port=8100 --kv_dir=out/kv

  # two processes x 4 CPU devices on this machine (launch/local.sh does this)
  python -m slope_jax.launch --num_processes=2 --process_id=0 --coordinator_address=127.0.0.1:23456 \
      --cpu_devices=4 --ring=2 --ulysses=4 --requests=reqs.jsonl --results=out/results.jsonl --kv_dir=out/kv &
  python -m slope_jax.launch --num_processes=2 --process_id=1 --coordinator_address=127.0.0.1:23456 \
      --cpu_devices=4 --ring=2 --ulysses=4 --kv_dir=out/kv

Request lines are described in `slope_jax.serve.requests`. One result line (strict JSON) is written per request
line: an error record as soon as a bad line is read ({"id": id or null, "line": N, "error": ...}, plus
"duplicate_of" for a reused id), a result when its batch finishes (id, line, first token (and its text with a
tokenizer) and its logprob, top-k logits, num_tokens, bucket, TTFT = queue + compute, compile/export times in ms, KV
path, predicted_ttft_ms). Every record of a request with a TTFT SLO carries ttft_slo_ms and slo_met, and "late": true
when it was served after it; a request refused by admission gets an error record with "rejected": true. A flag or
layout mistake is one `slope_jax: error:` line and exit status 2; so is start-up with processes that disagree on
anything that shapes the compiled step (the differing field is named).
An existing --results file without --overwrite is refused (a run never replaces an earlier run's outputs silently);
exit status 1: every request failed. Compiled length buckets are kept in the persistent compilation cache
(--compile_cache_dir, `slope_jax.compile_cache`).
"""


from __future__ import annotations

import dataclasses
import json
import os
import queue
import shutil
import sys
import time
import traceback

from absl import app, flags, logging

from slope_jax import xla_env  # no JAX
from slope_jax.model.options import CHOICES as STEP_OPTION_CHOICES  # no JAX: safe before exit_on_sigterm
from slope_jax.model.options import FIELD_HELP as STEP_OPTION_HELP
from slope_jax.model.options import StepOptions
from slope_jax.parallel.config import ParallelConfig  # no JAX, no numpy: safe before exit_on_sigterm

FLAGS = flags.FLAGS
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

flags.DEFINE_string("checkpoint", os.path.join(_REPO, "checkpoints", "tiny-gpt-oss"),
                    "Checkpoint directory: HF layout (config.json + safetensors), an original/ directory, or a "
                    "directory converted by `python -m slope_jax.convert` (restored shard by shard).")
flags.DEFINE_enum("layout", "manual", ["manual", "auto"], "manual: the layout is --pipeline/--ring/--ulysses/--expert. "
                  "auto: the SLO planner (slope_jax.plan) picks it for --expected_lengths, --ttft_slo_ms and this "
                  "machine's devices (--hardware); the choice and its reason are logged at start-up.")
flags.DEFINE_list("expected_lengths", [], "--layout=auto: prompt lengths the layout must serve (default: the "
                  "--precompile lengths, else --max_tokens capped at 32768).")
flags.DEFINE_integer("pipeline", 1, "Pipeline stages (layers are split over them).")
flags.DEFINE_integer("ring", 1, "Ring-attention degree (zigzag sequence chunks).")
flags.DEFINE_integer("ulysses", 1, "Ulysses degree (all-to-all between sequence and head shards).")
flags.DEFINE_integer("expert", None, "Expert-parallel degree: ring*ulysses (each device of a stage holds "
                     "1/(ring*ulysses) of the experts) or 1 (every device holds all). Default: ring*ulysses when it "
                     "divides the expert count, else 1.")
flags.DEFINE_integer("microbatches", None, "Requests in flight through the pipeline per step (default: --pipeline).")
flags.DEFINE_integer("seq_chunks", 1, "Sequence chunks per request streamed through the pipeline stages "
                     "(sequence-pipelined prefill: stages then cut one request's TTFT; 1 = off). Prompts pad to a "
                     "multiple of 2*ring*ulysses*seq_chunks. Needs more than one device.", lower_bound=1)
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Weights and activations (norms, softmax, router "
                  "and accumulators are float32 either way).")
flags.DEFINE_string("requests", "-", "JSONL file of requests, or '-' for stdin (read by process 0 only; lines are "
                    "served as they arrive).")
flags.DEFINE_string("results", "-", "JSONL file for results, or '-' for stdout (written by process 0 only). An "
                    "existing non-empty file is never replaced silently: the run is refused at start-up unless "
                    "--overwrite.")
flags.DEFINE_string("kv_dir", None, "Export each request's KV cache to KV_DIR/<id>/ (safetensors + manifest.json). "
                    "Every process writes the pieces it holds; use a shared filesystem across hosts.")
flags.DEFINE_bool("kv_full", False, "Export every token of sliding-window layers (default: their last W tokens, "
                  "all a decoder needs).")
flags.DEFINE_bool("overwrite", False, "Replace an earlier run's outputs: the --results file and existing exports "
                  "KV_DIR/<id>/ (atomically: readers see the old or the new export, never a mix). Default: an "
                  "existing --results file refuses the run at start-up, and a request whose export exists gets an "
                  "error record.")
flags.DEFINE_string("logits_dir", None, "Also save each request's last-position logits as LOGITS_DIR/<id>.npy "
                    "(float32), for verification.")
flags.DEFINE_integer("top_k", 5, "Number of (token, logit) pairs per result.")
flags.DEFINE_integer("batch_size", 8, "Most requests per batch (a batch holds one length bucket; an urgent "
                     "request leaves in a smaller batch rather than wait behind others).")
flags.DEFINE_float("ttft_slo_ms", None, "Default TTFT SLO in ms for requests without their own \"ttft_slo_ms\" "
                   "(default: none). Deadline = arrival + SLO.")
flags.DEFINE_enum("slo_policy", "reject", ["reject", "serve_late", "none"], "A request predicted to miss its "
                  "deadline (queue ahead + its batch's predicted compute + compiling step shapes not compiled yet): "
                  "reject = an error record at once naming predicted vs allowed ms (\"rejected\": true); "
                  "serve_late = serve it behind on-time requests; none = no admission control. A request served "
                  "after its SLO has \"late\": true in its record.")
flags.DEFINE_enum("order", "edf", ["edf", "fcfs"], "Service order: earliest deadline first, or arrival order.")
flags.DEFINE_float("slo_percentile", 90.0, "--layout=auto: the TTFT percentile the SLO applies to (0-100).")
flags.DEFINE_string("hardware", None, "Hardware profile the cost model predicts with (configs/hardware/NAME.json: "
                    "mi250, mi250x, mi300x, a100, h100, h200, cpu). Default: from the device kind.")
flags.DEFINE_float("batch_wait_ms", 5.0, "Longest a batch waits for more requests after its first one arrived; a batch "
                   "never waits to fill up to --batch_size.")
flags.DEFINE_integer("max_tokens", None, "Longest accepted prompt (default and upper limit: the model's "
                     "max_position_embeddings).")
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
for _field in dataclasses.fields(StepOptions):  # one flag per step option, same name, default and help
    if _field.name in STEP_OPTION_CHOICES:
        flags.DEFINE_enum(_field.name, _field.default, list(STEP_OPTION_CHOICES[_field.name]),
                          STEP_OPTION_HELP[_field.name])
    elif isinstance(_field.default, float):
        flags.DEFINE_float(_field.name, _field.default, STEP_OPTION_HELP[_field.name])
    else:
        flags.DEFINE_integer(_field.name, _field.default, STEP_OPTION_HELP[_field.name])
flags.DEFINE_list("precompile", [], "Prompt lengths whose buckets are compiled before the first request is read "
                  "(e.g. 1024,4096,16384), so early requests do not wait for compilation. Compiled programs go to "
                  "the compilation cache: `--precompile=... --requests=/dev/null` fills it and exits.")
flags.DEFINE_string("compile_cache_dir", None, "Persistent XLA compilation cache directory: compiled length buckets "
                    "are kept there and loaded by later runs (the start-up log says cache hit or miss per bucket). "
                    "'off' disables it. Default: $SLOPE_JAX_COMPILE_CACHE, else $JAX_COMPILATION_CACHE_DIR, else "
                    "$XDG_CACHE_HOME/slope_jax/xla (~/.cache/slope_jax/xla). Every process writes its own entries "
                    "(a per-host or a shared directory).")
flags.DEFINE_integer("http_port", None, "Serve prefill requests over HTTP on this port instead of reading "
                     "--requests (process 0; needs --kv_dir): an OpenAI-style POST /v1/completions (prompt as text "
                     "or token ids, max_tokens 1) answered with the first token, TTFT fields and the "
                     "kv_transfer_params a vLLM decode server's SlopeJaxConnector reads; GET /health, /v1/models. "
                     "Same request rules, SLO scheduler and result records as --requests; runs until SIGTERM. "
                     "See slope_jax.serve.http. 0 = any free port.")
flags.DEFINE_string("http_host", "127.0.0.1", "--http_port: the address to listen on (0.0.0.0: every interface).")
flags.DEFINE_string("http_model_name", None, "--http_port: the model name clients give in \"model\" (default: the "
                    "--checkpoint directory's name).")
flags.DEFINE_bool("summary", True, "Print a one-screen summary at the end (process 0, to stderr).")


# Nothing at module level may import numpy or JAX: `distributed.exit_on_sigterm` must block SIGTERM before any
# library starts threads (see main()).

# Flags that shape the compiled step or what it reads: every process must agree on them (start-up fingerprint).
# The layout flags (one per ParallelConfig field) and the step options (StepOptions fields) are in by construction;
# a new flag of another kind must be added here.
_LAYOUT_FLAGS = tuple(f.name for f in dataclasses.fields(ParallelConfig))
_STEP_FLAGS = (("layout", "expected_lengths", "ttft_slo_ms", "slo_percentile", "hardware", "dtype", "kv_full",
                "overwrite", "cpu_devices", "platform") + _LAYOUT_FLAGS + StepOptions.field_names())
_STATE: dict = {"watch": None}


class FlagError(ValueError):
    """A flag value is invalid; the message names the flag and the rule."""


def _configure_platform():
    """Environment that must be set before JAX starts its backends."""
    xla_env.configure(FLAGS.cpu_devices, FLAGS.platform)


def _check_flags() -> None:
    """Flag mistakes found before anything starts (FlagError names the flag and the rule)."""
    try:
        _step_options()
    except ValueError as e:  # StepOptions names the field and the rule; the flag has the same name
        raise FlagError(f"--{e}") from None
    positive = {"batch_size": FLAGS.batch_size, "top_k": FLAGS.top_k, "num_processes": FLAGS.num_processes,
                "init_timeout": FLAGS.init_timeout, "heartbeat_timeout": FLAGS.heartbeat_timeout}
    for name, value in positive.items():
        if not value > 0:
            raise FlagError(f"--{name}={value}: must be > 0")
    for name in ("max_tokens", "cpu_devices", "device_memory_gib"):
        value = getattr(FLAGS, name)
        if value is not None and not value > 0:
            raise FlagError(f"--{name}={value}: must be > 0")
    if FLAGS.ttft_slo_ms is not None and not 0 < FLAGS.ttft_slo_ms < float("inf"):
        raise FlagError(f"--ttft_slo_ms={FLAGS.ttft_slo_ms}: must be a finite number > 0")
    if not 0 < FLAGS.slo_percentile <= 100:
        raise FlagError(f"--slo_percentile={FLAGS.slo_percentile}: must be in (0, 100]")
    for x in FLAGS.expected_lengths:
        if not x.strip().isdigit() or int(x) < 1:
            raise FlagError(f"--expected_lengths: {x!r} is not a positive prompt length")
    if FLAGS.layout == "auto" and FLAGS.ttft_slo_ms is None:
        raise FlagError("--layout=auto needs --ttft_slo_ms: the planner picks the layout that meets it")
    if not FLAGS.batch_wait_ms >= 0:
        raise FlagError(f"--batch_wait_ms={FLAGS.batch_wait_ms}: must be >= 0")
    if not 0 <= FLAGS.process_id < FLAGS.num_processes:
        raise FlagError(f"--process_id={FLAGS.process_id}: must be in 0..{FLAGS.num_processes - 1} "
                        f"(--num_processes={FLAGS.num_processes})")
    for x in FLAGS.precompile:
        if not x.strip().isdigit() or int(x) < 1:
            raise FlagError(f"--precompile: {x!r} is not a positive prompt length")
    if not os.path.isdir(FLAGS.checkpoint):
        raise FlagError(f"--checkpoint={FLAGS.checkpoint}: no such directory")
    if FLAGS.http_port is not None:
        if not 0 <= FLAGS.http_port <= 65535:
            raise FlagError(f"--http_port={FLAGS.http_port}: must be in 0..65535")
        if FLAGS["requests"].present:
            raise FlagError("--http_port and --requests are exclusive: requests come over HTTP")
        if FLAGS.kv_dir is None:
            raise FlagError("--http_port needs --kv_dir: the decode server reads each request's export")
    if FLAGS.process_id == 0 and FLAGS.requests != "-" and not os.path.exists(FLAGS.requests):
        raise FlagError(f"--requests={FLAGS.requests}: no such file")


def _step_options() -> StepOptions:
    """The step options given by the flags (unresolved: the engine resolves "auto" for its devices)."""
    return StepOptions(**{name: FLAGS[name].value for name in StepOptions.field_names()})


def _fingerprint() -> dict:
    from slope_jax.serve import fingerprint

    options = {name: FLAGS[name].value for name in _STEP_FLAGS}
    options["kv_export"] = FLAGS.kv_dir is not None
    return fingerprint.make(options, FLAGS.checkpoint)


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


def _any_process(flag: bool) -> bool:
    """True on every process if `flag` is True on any (one small all-gather; identity for one process)."""
    import jax

    if jax.process_count() == 1:
        return flag
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.asarray(multihost_utils.process_allgather(np.array([int(flag)], np.int32))).any())


class _Intake:
    """Process 0's side of the loop: lines from the reader thread → parsed requests (as `scheduler.Pending`) in the
    scheduler, bad lines and rejected requests → error records at once."""

    def __init__(self, reader, scheduler, parse_line, emit):
        from slope_jax.serve.scheduler import Pending  # numpy: not before main() has set up SIGTERM handling

        self.reader, self.scheduler, self.parse_line, self.emit = reader, scheduler, parse_line, emit
        self.pending_type = Pending
        self.closed = False

    def _accept(self, item) -> None:
        if item is None:
            self.closed = True
            return
        for req in self.parse_line(*item):
            deadline = None if req.ttft_slo_ms is None else req.arrival + req.ttft_slo_ms / 1e3
            self.scheduler.add(self.pending_type(req, req.id, int(req.tokens.size), req.arrival, deadline))

    def next_batch(self):
        """The next batch to run (a list of Request), or None when the input is closed and everything is served."""
        while True:
            batch, rejected, wait_s = self.scheduler.take_batch(time.perf_counter(), self.closed)
            for item, reason in rejected:
                req = item.request
                self.emit(_request_error(req, f"line {req.line} ({req.id}): {reason}", rejected=True,
                                         num_tokens=item.num_tokens))
            if batch:
                return batch
            if self.closed:
                return None
            try:
                self._accept(self.reader.get(wait_s))
                while not self.closed:  # take whatever else has already arrived
                    self._accept(self.reader.get(0))
            except queue.Empty:
                pass


def _prefill_isolated(engine, prompts, ids, arrivals, **kwargs) -> list:
    """Run prompts so that a failure is attributed to the request that causes it: prompts go in engine steps of one
    length bucket (as the engine would group them); a step that fails (on any process) is retried one request at a
    time, and only a request that fails alone gets an error. Returns PrefillResult or an error string per prompt."""
    from slope_jax.serve.requests import RequestError

    def attempt(idx):
        err = None
        try:
            out = engine.prefill([prompts[i] for i in idx], ids=[ids[i] for i in idx],
                                 arrival_times=None if arrivals is None else [arrivals[i] for i in idx], **kwargs)
        except Exception as e:  # noqa: BLE001 - attributed below; a dead peer is reported by the peer watch
            err = e
            if not isinstance(e, RequestError):
                logging.warning("prefill of %s failed: %s", [ids[i] for i in idx], traceback.format_exc(limit=3))
        if not _any_process(err is not None):
            return out
        if len(idx) > 1:
            return [r for i in idx for r in attempt([i])]
        if err is None:
            return ["prefill failed on another process (see its log)"]
        return [f"prefill failed: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"]

    per_step = 1 if engine.mesh is None else engine.parallel.in_flight
    order = sorted(range(len(prompts)), key=lambda i: (engine.bucket(len(prompts[i])), i))
    outcomes: list = [None] * len(prompts)
    start = 0
    while start < len(order):
        t = engine.bucket(len(prompts[order[start]]))
        chunk = [order[start]]
        while (len(chunk) < per_step and start + len(chunk) < len(order)
               and engine.bucket(len(prompts[order[start + len(chunk)]])) == t):
            chunk.append(order[start + len(chunk)])
        for i, out in zip(chunk, attempt(chunk)):
            outcomes[i] = out
        start += len(chunk)
    return outcomes


def _refuse_existing_results(path: str, overwrite: bool) -> None:
    """FlagError if `path` holds an earlier run's results (a non-empty file) and not `overwrite`."""
    if overwrite or not os.path.exists(path):
        return
    if os.path.isdir(path):
        raise FlagError(f"--results={path}: is a directory; give a file path")
    if os.path.getsize(path) > 0:
        raise FlagError(f"--results={path} already holds an earlier run's results: pass --overwrite to replace it "
                        "(and the KV exports of the same ids), or give another --results file")


def _open_results(path: str, overwrite: bool):
    """Open the results file for writing: created exclusively unless `overwrite` (an empty leftover file is reused),
    so a concurrent run that created it meanwhile is refused instead of interleaved."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    _refuse_existing_results(path, overwrite)
    if overwrite or os.path.exists(path):  # only an empty file is left here without overwrite
        return open(path, "w")
    try:
        return open(path, "x")
    except FileExistsError as e:
        raise FlagError(f"--results={path} was created by another run meanwhile: pass --overwrite or give another "
                        "--results file") from e


def _compile_line(engine) -> str:
    """One summary line: how long getting the step programs took and how many came from the compilation cache."""
    from slope_jax import compile_cache

    n, hits = len(engine.compile_ms), sum(src == "cache" for src in engine.compile_source.values())
    where = compile_cache.directory()
    return (f"compile: {n} step program(s) in {sum(engine.compile_ms.values()) / 1e3:.1f} s, {hits} loaded from the "
            f"compilation cache" + (f" ({where})" if where else " (cache off)"))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from slope_jax.serve import distributed

    distributed.exit_on_sigterm(lambda: _STATE["watch"] and _STATE["watch"].close("terminated by SIGTERM"))
    try:
        _check_flags()
    except FlagError as e:
        _fail(str(e))
    _configure_platform()
    logging.info("XLA_FLAGS=%s", os.environ.get("XLA_FLAGS", ""))
    from slope_jax import cli, compile_cache

    cli.quiet(gloo=FLAGS.num_processes > 1)  # Gloo's connection lines: multi-process CPU collectives only

    try:
        compile_cache.enable(FLAGS.compile_cache_dir)
    except OSError as e:
        _fail(f"--compile_cache_dir: cannot use the compilation cache directory: {e}")
    try:
        conns = distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                                       init_timeout_s=FLAGS.init_timeout, heartbeat_timeout_s=FLAGS.heartbeat_timeout,
                                       fingerprint=_fingerprint() if FLAGS.num_processes > 1 else None)
    except distributed.StartupError as e:
        _fail(f"start-up failed: {e}")
    if conns:
        _STATE["watch"] = distributed.PeerWatch(FLAGS.process_id, conns)
    from slope_jax.checkpoints.hf import CheckpointError
    from slope_jax.model.config import ConfigError
    from slope_jax.parallel.config import LayoutError

    status = 0
    try:
        status = _serve()
    except (FlagError, LayoutError, ConfigError, CheckpointError) as e:
        _fail(str(e))
    except Exception as e:  # noqa: BLE001 - one clear line; a peer's death is named by the peer watch
        watch = _STATE["watch"]
        if watch is None:
            raise
        lost = watch.wait_for_loss(3.0)  # a collective that failed because a peer died: the watch names the peer
        if lost is None:
            logging.error("%s", traceback.format_exc())
            _fail(f"process {FLAGS.process_id}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
    if _STATE["watch"] is not None:
        _STATE["watch"].close()
    if status:
        sys.exit(status)


def _fail(message: str):
    """Print one clear line and exit with status 2. In a multi-process run the peers are told first, and exit
    handlers are skipped: JAX's shutdown barrier would otherwise wait for processes that are stopping too."""
    from slope_jax import cli

    cli.EXITING.acquire()  # the peer watch may be reporting a peer's error: one line, never two
    watch = _STATE["watch"]
    if watch is not None:
        watch.close(failure=message)
    print(f"slope_jax: error: {message}", file=sys.stderr, flush=True)
    if FLAGS.num_processes > 1:
        cli.flush_stdout()  # also what the Gloo line filter still holds
        os._exit(2)
    sys.exit(2)


def _slo_ms(req) -> float | None:
    """A request's TTFT SLO in ms: its own `ttft_slo_ms`, else `--ttft_slo_ms`, else None."""
    return req.ttft_slo_ms if req.ttft_slo_ms is not None else FLAGS.ttft_slo_ms


def _request_error(req, message: str, **extra) -> dict:
    """The error record of a parsed request (failed or rejected). A request with a TTFT SLO keeps it in its record
    with `"slo_met": false`: SLO attainment counts it as a miss."""
    rec = {"id": req.id, "line": req.line, "error": message, **extra}
    slo_ms = _slo_ms(req)
    if slo_ms is not None:
        rec.update(ttft_slo_ms=round(slo_ms, 3), slo_met=False)
    return rec


def _result_record(req, res, engine, tokenizer, item=None) -> dict:
    """A served request's record; `"late": true` exactly when it carries an SLO and its TTFT exceeded it."""
    import numpy as np

    if not np.all(np.isfinite(res.logits)):
        return _request_error(req, "the step produced non-finite logits (NaN/Inf); no result")
    rec = {"id": req.id, "line": req.line, "first_token": res.first_token}
    if tokenizer is not None:
        rec["first_token_text"] = tokenizer.decode([res.first_token], skip_special_tokens=False)
    rec.update({"logprob": round(res.logprob, 6), "top_k": [[t, round(v, 6)] for t, v in res.top_k],
                "num_tokens": res.num_tokens, "bucket": engine.bucket(res.num_tokens),
                "ttft_ms": round(res.ttft_ms, 3), "queue_ms": round(res.queue_ms, 3),
                "compile_ms": round(res.compile_ms, 3), "compute_ms": round(res.compute_ms, 3),
                "export_ms": round(res.export_ms, 3), "kv_path": res.kv_path})
    if item is not None and item.predicted_ttft_ms is not None:  # the cost model's TTFT beside the measured one
        rec["predicted_ttft_ms"] = round(item.predicted_ttft_ms, 3)
    slo_ms = _slo_ms(req)
    if slo_ms is not None:
        rec["ttft_slo_ms"] = round(slo_ms, 3)
        rec["slo_met"] = res.ttft_ms <= slo_ms
        if not rec["slo_met"]:
            rec["late"] = True
    return rec


def _serve() -> int:
    """One run: the layout, the engine, process 0's intake, the broadcast/compute loop, the summary. Returns the exit
    status (1: every request failed)."""
    import jax

    from slope_jax.serve.engine import PrefillEngine

    t_start = time.perf_counter()
    cfg, max_tokens, hardware = _limits()
    parallel = _choose_layout(cfg, hardware, max_tokens)
    engine = PrefillEngine.from_checkpoint(FLAGS.checkpoint, parallel, FLAGS.dtype,
                                           progress=jax.process_index() == 0, options=_step_options())
    if FLAGS.precompile:
        engine.precompile([int(x) for x in FLAGS.precompile])
    front = _Front.open(engine, cfg, max_tokens, hardware) if jax.process_index() == 0 else None
    _compute_loop(engine, _Broadcast(jax.process_count() > 1), front)
    return _finish(engine, front, t_start)


def _limits():
    """(model config, longest accepted prompt, hardware profile name), checked before any weight is read; process 0
    also refuses an existing --results file here (before the weights are loaded)."""
    import jax

    from slope_jax.checkpoints.orbax_store import model_config
    from slope_jax.serve import slo

    cfg = model_config(FLAGS.checkpoint)  # no weights read: check the limits before loading them
    if FLAGS.max_tokens is not None and FLAGS.max_tokens > cfg.max_position_embeddings:
        raise FlagError(f"--max_tokens={FLAGS.max_tokens} exceeds the model's max_position_embeddings="
                        f"{cfg.max_position_embeddings} ({FLAGS.checkpoint})")
    max_tokens = FLAGS.max_tokens or cfg.max_position_embeddings
    if jax.process_index() == 0 and FLAGS.results != "-":
        _refuse_existing_results(FLAGS.results, FLAGS.overwrite)  # before the weights are loaded
    device = jax.devices()[0]
    try:
        hardware = FLAGS.hardware or slo.hardware_for(device.device_kind, device.platform)
    except ValueError as e:
        raise FlagError(str(e)) from e
    return cfg, max_tokens, hardware


def _choose_layout(cfg, hardware: str, max_tokens: int) -> ParallelConfig:
    """The layout: the flags' (--layout=manual) or the SLO planner's (--layout=auto, logged with its reason),
    validated for this model and device count (LayoutError names the rule)."""
    import jax

    from slope_jax.serve import slo

    if FLAGS.layout == "auto":
        lengths = [int(x) for x in (FLAGS.expected_lengths or FLAGS.precompile)] or [min(max_tokens, 32768)]
        parallel, reason = slo.auto_layout(cfg, hardware, jax.device_count(), jax.local_device_count(), lengths,
                                           FLAGS.ttft_slo_ms, FLAGS.slo_percentile / 100)
        if FLAGS["seq_chunks"].present:  # an explicit --seq_chunks overrides the planner's choice
            parallel = parallel.replace(seq_chunks=FLAGS.seq_chunks)
        parallel = parallel.replace(microbatches=FLAGS.microbatches)
        logging.info("--layout=auto on %d %s device(s), lengths %s, TTFT SLO %g ms: pipeline=%d ring=%d ulysses=%d "
                     "expert=%s seq_chunks=%d (%s)", jax.device_count(), hardware, lengths, FLAGS.ttft_slo_ms,
                     parallel.pipeline, parallel.ring, parallel.ulysses, parallel.expert, parallel.seq_chunks, reason)
    else:  # one flag per ParallelConfig field, same name
        parallel = ParallelConfig(**{name: FLAGS[name].value for name in _LAYOUT_FLAGS})
    parallel.validate(cfg, jax.device_count() if parallel.num_devices > 1 else None)
    return parallel


class _Front:
    """Process 0's side of a run: the request source (stdin/file `LineReader` or the HTTP intake), parsing, the
    scheduler and its cost model, and the result records (`emit`). Other processes only compute."""

    def __init__(self, engine, cfg, max_tokens: int, tokenizer, out):
        self.engine, self.cfg, self.max_tokens, self.tokenizer, self.out = engine, cfg, max_tokens, tokenizer, out
        self.budget = None if FLAGS.device_memory_gib is None else int(FLAGS.device_memory_gib * 2**30)
        self.records: list[dict] = []
        self.seen: set[str] = set()
        self.lineno = 0
        self.source = self.intake = self.scheduler = self.predict_ms = None

    @classmethod
    def open(cls, engine, cfg, max_tokens: int, hardware: str) -> _Front:
        """Load the tokenizer, open the requests and the results, build the scheduler, start the source."""
        import jax

        from slope_jax.serve import slo
        from slope_jax.serve.scheduler import Scheduler

        tok_path = os.path.join(FLAGS.checkpoint, "tokenizer.json")
        tokenizer = None
        if os.path.exists(tok_path):
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(tok_path)
        src = _request_stream()
        out = sys.stdout if FLAGS.results == "-" else _open_results(FLAGS.results, FLAGS.overwrite)
        if FLAGS.logits_dir:
            os.makedirs(FLAGS.logits_dir, exist_ok=True)
        front = cls(engine, cfg, max_tokens, tokenizer, out)
        front.predict_ms = slo.batch_model(engine, hardware, FLAGS.dtype, jax.local_device_count())
        front.scheduler = Scheduler(front.predict_ms, batch_size=FLAGS.batch_size, batch_wait_ms=FLAGS.batch_wait_ms,
                                    order=FLAGS.order, slo_policy=FLAGS.slo_policy,
                                    default_slo_ms=FLAGS.ttft_slo_ms, bucket=engine.bucket,
                                    per_step=front.predict_ms.per_step, compile_ms=front.predict_ms.compile_ms)
        front.source = _start_source(src, cfg, max_tokens, tok_path if tokenizer is not None else None)
        front.intake = _Intake(front.source, front.scheduler, front.parse_line, front.emit)
        return front

    def emit(self, rec: dict) -> None:
        """Write one result record (strict JSON, flushed) and hand it to the source (an HTTP request waits for it)."""
        try:
            text = json.dumps(rec, allow_nan=False)
        except ValueError:  # a non-finite number: never written as NaN/Infinity
            rec = {"id": rec.get("id"), "line": rec.get("line"), "error": "result had non-finite numbers",
                   **({"ttft_slo_ms": rec["ttft_slo_ms"], "slo_met": False} if "ttft_slo_ms" in rec else {})}
            text = json.dumps(rec)
        self.records.append(rec)
        self.out.write(text + "\n")
        self.out.flush()
        self.source.deliver(rec)

    def parse_line(self, raw, arrival) -> list:
        """One request line → [Request], or [] after emitting its error record (bad line, existing export, too
        big for the device memory budget)."""
        from slope_jax import kv as kvfmt
        from slope_jax.serve import requests

        self.lineno += 1
        if isinstance(raw, OSError):
            self.emit({"id": None, "line": self.lineno, "error": f"reading the requests failed: {raw}"})
            return []
        if not raw.strip():
            return []
        try:
            req = requests.parse(raw, self.lineno, vocab_size=self.cfg.vocab_size, max_tokens=self.max_tokens,
                                 tokenizer=self.tokenizer, seen_ids=self.seen, arrival=arrival)
        except requests.LineError as e:
            self.emit(requests.error_record(e))
            return []
        if FLAGS.kv_dir is not None:  # an existing export is this request's error, found before any compute
            try:
                kvfmt.check_target(FLAGS.kv_dir, req.id, FLAGS.overwrite)
            except kvfmt.ExportExistsError as e:
                self.emit(_request_error(req, f"line {req.line} ({req.id}): {e}"))
                return []
        try:
            self.engine.check_fits(req.tokens.size, self.budget)
        except Exception as e:  # noqa: BLE001 - RequestError, or a failure compiling its bucket: its own error
            self.emit(_request_error(req, f"line {req.line} ({req.id}): {e}"))
            return []
        return [req]

    def observe(self, lengths: list[int], busy_ms: float) -> None:
        """Online correction: the cost model learns the batch's measured busy time; the scheduler frees the engine."""
        self.predict_ms.observe(lengths, busy_ms)
        self.scheduler.finished(time.perf_counter())

    def record_batch(self, ids: list[str], outcomes: list, pending: dict) -> None:
        """One record per request of a finished batch (and its logits file with --logits_dir)."""
        import numpy as np

        for rid, res in zip(ids, outcomes):
            item = pending[rid]
            req = item.request
            if isinstance(res, str):
                self.emit(_request_error(req, res))
                continue
            if FLAGS.logits_dir:
                np.save(os.path.join(FLAGS.logits_dir, f"{rid}.npy"), res.logits)
            self.emit(_result_record(req, res, self.engine, self.tokenizer, item))


def _request_stream():
    """The byte stream of request lines (stdin or --requests), or None with --http_port."""
    if FLAGS.http_port is not None:
        return None
    if FLAGS.requests == "-":
        logging.info("reading requests from stdin, one JSON object per line (end of input ends the run)")
        return sys.stdin.buffer
    return open(FLAGS.requests, "rb")


def _start_source(src, cfg, max_tokens: int, tokenizer_path: str | None):
    """The request source: a `LineReader` thread over `src`, or (src None) the started HTTP intake."""
    if src is not None:
        from slope_jax.serve.batching import LineReader

        return LineReader(src)
    from slope_jax.serve.http import HttpIntake

    name = FLAGS.http_model_name or os.path.basename(os.path.normpath(FLAGS.checkpoint))
    source = HttpIntake(FLAGS.http_host, FLAGS.http_port, vocab_size=cfg.vocab_size, max_tokens=max_tokens,
                        model_name=name, tokenizer_path=tokenizer_path, top_k=FLAGS.top_k, kv_dir=FLAGS.kv_dir,
                        overwrite=FLAGS.overwrite)
    try:
        source.start()
    except OSError as e:
        raise FlagError(f"--http_host={FLAGS.http_host} --http_port={FLAGS.http_port}: cannot listen ({e})")
    return source


def _compute_loop(engine, broadcast, front: _Front | None) -> None:
    """Every process: process 0 (`front`) takes the next batch from the scheduler and broadcasts it; all compute it;
    process 0 corrects the cost model online and writes the records. Ends when process 0 broadcasts None."""
    import numpy as np

    pending: dict = {}
    while True:
        payload = None
        if front is not None:
            batch = front.intake.next_batch()
            if batch is not None:
                pending = {item.id: item for item in batch}
                payload = [[item.id, item.request.tokens.tolist()] for item in batch]
        payload = broadcast(payload)
        if payload is None:
            break
        ids = [p[0] for p in payload]
        prompts = [np.asarray(p[1], np.int32) for p in payload]
        arrivals = [pending[i].arrival_s for i in ids] if front is not None else None
        t_batch, compiled_before = time.perf_counter(), set(engine.compile_ms)
        outcomes = _prefill_isolated(engine, prompts, ids, arrivals, kv_dir=FLAGS.kv_dir, kv_full=FLAGS.kv_full,
                                     return_kv=False, top_k=FLAGS.top_k, overwrite=FLAGS.overwrite)
        if front is not None:
            # the engine's busy time for the cost model's online correction: wall time less first-time compilation
            busy_ms = (time.perf_counter() - t_batch) * 1e3 - sum(ms for key, ms in engine.compile_ms.items()
                                                                  if key not in compiled_before)
            front.observe([len(p) for p in prompts], busy_ms)
            front.record_batch(ids, outcomes, pending)


def _finish(engine, front: _Front | None, t_start: float) -> int:
    """Close the results, print the summary (process 0), wait for every process; 1 when every request failed."""
    import jax

    from slope_jax.serve import summary

    if front is not None:
        if front.out is not sys.stdout:
            front.out.close()
        if FLAGS.summary:
            wall_s = time.perf_counter() - t_start
            print(summary.format_summary(front.records, wall_s, shutil.get_terminal_size((120, 24)).columns) + "\n"
                  + _compile_line(engine), file=sys.stderr)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("slope_jax launcher done")
    me = jax.process_index()
    logging.info("process %d done", me)
    records = front.records if front is not None else []
    if me == 0 and records and all("error" in r for r in records):
        print(f"slope_jax: every request failed ({len(records)} error record(s)); exit status 1", file=sys.stderr,
              flush=True)
        return 1
    return 0


def run():
    """Console-script entry point (`slope-jax`); `python -m slope_jax.launch` calls it too."""
    # absl's --help prints __main__'s docstring and the key flags of the module named by argv[0]: give both entry
    # points this module's usage text and flags.
    sys.modules["__main__"].__doc__ = __doc__
    for flag in FLAGS.flags_by_module_dict().get(__name__, []):
        FLAGS.register_key_flag_for_module(sys.argv[0], flag)
    from slope_jax import cli

    cli.run(main)  # absl's app.run, --help exiting 0, backend noise filtered


if __name__ == "__main__":
    run()
