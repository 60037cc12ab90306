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
exit status 1: no request was served (each failed or was rejected). Compiled length buckets are kept in the
persistent compilation cache (--compile_cache_dir, `slope_jax.compile_cache`).
"""


from __future__ import annotations

import os
import shutil
import sys
import threading
import time
import traceback

from absl import app, flags, logging

from slope_jax import xla_env  # no JAX
from slope_jax.parallel.config import ParallelConfig  # no JAX, no numpy: safe before exit_on_sigterm
from slope_jax.serve import launch_config  # defines the flags; no JAX, no numpy
from slope_jax.serve.launch_config import FlagError, LaunchConfig

FLAGS = flags.FLAGS

# Nothing at module level may import numpy or JAX: `distributed.exit_on_sigterm` must block SIGTERM before any
# library starts threads (see main()). The run's parts: `launch_config` (flags, LaunchConfig), `front` (process 0:
# intake, scheduler, records), `compute` (every process: broadcast, prefill steps); this module wires them.

_STEP_FLAGS = launch_config.STEP_FLAGS  # the flags of the start-up fingerprint (every process must agree)
_STATE: dict = {"watch": None, "multi": False}
_SUMMARY_ONCE = threading.Lock()  # `_summary_so_far`: held from the first call until the process exits


def _fingerprint(config: LaunchConfig) -> dict:
    """This process's start-up fingerprint (`serve.fingerprint`): the step-shaping options and the checkpoint."""
    from slope_jax.serve import fingerprint

    return fingerprint.make(config.fingerprint_options(), config.checkpoint)


def _serve(config: LaunchConfig) -> int:
    """One run: the layout, the engine, process 0's front, the broadcast/compute loop, the summary. Returns the exit
    status (1: every request failed)."""
    import jax

    from slope_jax.serve import compute, peer_rows
    from slope_jax.serve.engine import PrefillEngine
    from slope_jax.serve.front import Front

    t_start = time.perf_counter()
    cfg, max_tokens, hardware = _limits(config)
    parallel = _choose_layout(config, cfg, hardware, max_tokens)
    engine = PrefillEngine.from_checkpoint(config.checkpoint, parallel, config.dtype,
                                           progress=jax.process_index() == 0, options=config.step_options,
                                           reuse=config.reuse_options())
    warm_runs = []
    if config.precompile:
        engine.precompile(config.precompile_lengths)
        # every process (the steps are collective): warm-up runs whose times seed the cost model below
        warm_runs = compute.timed_runs(engine, config.precompile_lengths, compute.Broadcast(jax.process_count() > 1))
    kv_store = config.kv_store()  # the one owner of the --kv_dir policy: the intake, the HTTP endpoint, the engine
    if kv_store is not None:
        engine.use_store(kv_store)  # its reuse index (earlier runs' exports too) and retention serve the engine
    engine.peer_rows = peer_rows.start(config)  # several processes: how early P/D answers get the rows
    front = Front.open(engine, config, cfg, max_tokens, hardware, kv_store) if jax.process_index() == 0 else None
    if front is not None and warm_runs:
        front.predict_ms.seed(warm_runs)  # the first requests' predictions start from measured steps
    _STATE.update(front=front, config=config, t_start=t_start)  # the summary at SIGTERM (`_on_term`)
    try:
        compute.compute_loop(engine, compute.Broadcast(jax.process_count() > 1), front, kv_store=kv_store,
                             kv_full=config.kv_full, top_k=config.top_k)
    finally:
        if engine.peer_rows is not None:
            engine.peer_rows.close()
    return _finish(config, engine, front, t_start)


def _limits(config: LaunchConfig):
    """(model config, longest accepted prompt, hardware profile name), checked before any weight is read; process 0
    also refuses an existing --results file here (before the weights are loaded)."""
    import jax

    from slope_jax.checkpoints.orbax_store import model_config
    from slope_jax.plan.hardware import HardwareError
    from slope_jax.plan.hardware import load as load_hardware
    from slope_jax.serve import slo
    from slope_jax.serve.front import refuse_existing_results

    device = _first_device(config)
    cfg = model_config(config.checkpoint)  # no weights read: check the limits before loading them
    if config.max_tokens is not None and config.max_tokens > cfg.max_position_embeddings:
        raise FlagError(f"--max_tokens={config.max_tokens} exceeds the model's max_position_embeddings="
                        f"{cfg.max_position_embeddings} ({config.checkpoint})")
    max_tokens = config.max_tokens or cfg.max_position_embeddings
    too_long = [n for n in config.precompile_lengths if n > max_tokens]
    if too_long:
        raise FlagError(f"--precompile={','.join(map(str, too_long))}: longer than the longest accepted prompt, "
                        f"{max_tokens} tokens (--max_tokens, else the model's max_position_embeddings)")
    if jax.process_index() == 0 and config.results != "-":
        refuse_existing_results(config.results, config.overwrite)  # before the weights are loaded
    for name in ("results", "logits_dir") if jax.process_index() == 0 else ():
        path = getattr(config, name)
        where = path if name == "logits_dir" else os.path.dirname(os.path.abspath(path))
        if path and path != "-":
            try:
                os.makedirs(where, exist_ok=True)
            except OSError as e:
                raise FlagError(f"--{name}={path}: cannot create {where}: {e.strerror or e}") from e
    try:
        hardware = config.hardware or slo.hardware_for(device.device_kind, device.platform)
        load_hardware(hardware)  # an unknown profile is a flag error before the weights are read
    except (ValueError, HardwareError) as e:
        raise FlagError(str(e)) from e
    return cfg, max_tokens, hardware


def _first_device(config: LaunchConfig):
    """This process's first JAX device; FlagError naming --platform when JAX cannot start that backend."""
    import jax

    try:
        return jax.devices()[0]
    except (RuntimeError, AssertionError) as e:  # jax 0.10 asserts when a named platform's plugin is missing
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise FlagError(f"--platform={config.platform or '(JAX default)'}: JAX could not start that backend (is its "
                        f"plugin installed and its device visible?): {detail}") from e


def _choose_layout(config: LaunchConfig, cfg, hardware: str, max_tokens: int) -> ParallelConfig:
    """The layout: the flags' (--layout=manual) or the SLO planner's (--layout=auto, logged with its reason),
    validated for this model and device count (LayoutError names the rule)."""
    import jax

    from slope_jax.serve import slo

    if config.layout == "auto":
        lengths = (config.expected_length_values or config.precompile_lengths) or [min(max_tokens, 32768)]
        parallel, reason = slo.auto_layout(cfg, hardware, jax.device_count(), jax.local_device_count(), lengths,
                                           config.ttft_slo_ms, config.slo_percentile / 100, config.step_options)
        if config.seq_chunks_given:  # an explicit --seq_chunks overrides the planner's choice
            parallel = parallel.replace(seq_chunks=config.seq_chunks)
        parallel = parallel.replace(microbatches=config.microbatches)
        logging.info("--layout=auto on %d %s device(s), lengths %s, TTFT SLO %g ms: pipeline=%d ring=%d ulysses=%d "
                     "expert=%s seq_chunks=%d (%s)", jax.device_count(), hardware, lengths, config.ttft_slo_ms,
                     parallel.pipeline, parallel.ring, parallel.ulysses, parallel.expert, parallel.seq_chunks, reason)
    else:  # one flag per ParallelConfig field, same name
        parallel = config.manual_layout()
    parallel.validate(cfg, jax.device_count() if parallel.num_devices > 1 else None)
    return parallel


def _finish(config: LaunchConfig, engine, front, t_start: float) -> int:
    """Close the results, print the summary (process 0), wait for every process; 1 when every request failed."""
    import jax

    from slope_jax.serve import summary

    if front is not None:
        if front.out is not sys.stdout:
            front.out.close()
        _STATE["front"] = None  # the summary below is the run's: a SIGTERM from here on prints none
        if config.summary:
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
        rejected = sum(bool(r.get("rejected")) for r in records)
        why = f"{rejected} rejected by SLO admission, {len(records) - rejected} failed" if rejected else "all failed"
        print(f"slope_jax: no request was served ({len(records)} error record(s): {why}); exit status 1",
              file=sys.stderr, flush=True)
        return 1
    return 0


def _on_term(sig: str) -> None:
    """SIGTERM/SIGINT (`distributed.exit_on_sigterm`'s thread, the process then exits): tell the peers, and print
    the summary so far."""
    if _STATE["watch"] is not None:
        _STATE["watch"].close(f"terminated by {sig}")
    _summary_so_far(sig)


def _on_peer_lost(message: str) -> None:
    """The peer watch's exit (a peer died or failed, e.g. `local.sh` stopping every process): the summary so far,
    then the one error line and status 2."""
    from slope_jax.serve import distributed

    _summary_so_far("a peer's loss")
    distributed.exit_with(message)


def _summary_so_far(why: str) -> None:
    """Process 0, a run ending early (SIGTERM, Ctrl-C, a peer lost): print the summary of the records written so far
    (an HTTP endpoint runs until it is stopped: its operator reads what it served here, as after a --requests run).
    Once: a second caller (the signal and the peer watch race when every process is signalled) waits for the first's
    exit."""
    _SUMMARY_ONCE.acquire()
    front, config = _STATE.get("front"), _STATE.get("config")
    if front is None or not config.summary:
        return
    from slope_jax.serve import summary

    wall_s = max(time.perf_counter() - _STATE["t_start"], 1e-9)
    print(summary.format_summary(list(front.records), wall_s, shutil.get_terminal_size((120, 24)).columns)
          + f"\n(summary at {why}: requests still queued or computing have no record)", file=sys.stderr, flush=True)


def _compile_line(engine) -> str:
    """One summary line: how long getting the step programs took and how many came from the compilation cache."""
    from slope_jax import compile_cache

    n, hits = len(engine.compile_ms), sum(src == "cache" for src in engine.compile_source.values())
    where = compile_cache.directory()
    return (f"compile: {n} step program(s) in {sum(engine.compile_ms.values()) / 1e3:.1f} s, {hits} loaded from the "
            f"compilation cache" + (f" ({where})" if where else " (cache off)"))


def main(argv):
    """absl entry point: the flags become one `LaunchConfig` here (the only place this module reads them), then
    start-up (platform, compilation cache, processes joining) and the run."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from slope_jax.serve import distributed

    distributed.exit_on_sigterm(_on_term)
    _STATE["multi"] = FLAGS.num_processes > 1
    try:
        config = LaunchConfig.from_flags(FLAGS)
    except FlagError as e:
        _fail(str(e))
    _start(config)
    _run(config)


def _start(config: LaunchConfig) -> None:
    """Platform, compilation cache, and (several processes) the start-up handshake and the peer watch."""
    from slope_jax.serve import distributed

    xla_env.configure(config.cpu_devices, config.platform)  # before JAX starts its backends
    logging.info("XLA_FLAGS=%s", os.environ.get("XLA_FLAGS", ""))
    from slope_jax import cli, compile_cache

    cli.quiet(gloo=config.num_processes > 1)  # Gloo's connection lines: multi-process CPU collectives only
    try:
        compile_cache.enable(config.compile_cache_dir)
    except OSError as e:
        _fail(f"--compile_cache_dir: cannot use the compilation cache directory: {e}")
    try:
        conns = distributed.initialize(config.coordinator_address, config.num_processes, config.process_id,
                                       init_timeout_s=config.init_timeout,
                                       heartbeat_timeout_s=config.heartbeat_timeout,
                                       fingerprint=_fingerprint(config) if config.num_processes > 1 else None)
    except distributed.StartupError as e:
        _fail(f"start-up failed: {e}")
    if conns:
        _STATE["watch"] = distributed.PeerWatch(config.process_id, conns, on_peer_lost=_on_peer_lost)


def _run(config: LaunchConfig) -> None:
    """The run, its errors as one line (exit 2), and its exit status."""
    from slope_jax.checkpoints.hf import CheckpointError
    from slope_jax.model.config import ConfigError
    from slope_jax.parallel.config import LayoutError
    from slope_jax.plan.hardware import HardwareError

    status = 0
    try:
        status = _serve(config)
    except (FlagError, LayoutError, ConfigError, CheckpointError, HardwareError) as e:
        _fail(str(e))
    except Exception as e:  # noqa: BLE001 - one clear line; a peer's death is named by the peer watch
        watch = _STATE["watch"]
        if watch is None:
            raise
        lost = watch.wait_for_loss(3.0)  # a collective that failed because a peer died: the watch names the peer
        if lost is None:
            logging.error("%s", traceback.format_exc())
            _fail(f"process {config.process_id}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
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
    if _STATE["multi"]:
        cli.flush_stdout()  # also what the Gloo line filter still holds
        os._exit(2)
    sys.exit(2)


def run():
    """Console-script entry point (`slope-jax`); `python -m slope_jax.launch` calls it too."""
    # absl's --help prints __main__'s docstring and the key flags of the module named by argv[0]: give both entry
    # points this module's usage text and the launcher's flags (defined in `launch_config`).
    sys.modules["__main__"].__doc__ = __doc__
    for flag in FLAGS.flags_by_module_dict().get(launch_config.__name__, []):
        FLAGS.register_key_flag_for_module(sys.argv[0], flag)
    from slope_jax import cli

    cli.run(main)  # absl's app.run, --help exiting 0, backend noise filtered


if __name__ == "__main__":
    run()
