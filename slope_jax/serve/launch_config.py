"""The launcher's options: every absl flag of `slope-jax` / `python -m slope_jax.launch` (defined here, at import),
and `LaunchConfig`, the frozen record of their values that the launcher builds once at its entry point
(`LaunchConfig.from_flags(FLAGS)`, which also validates them: `FlagError` names the flag and its limit) and passes
down. Nothing below the entry point reads absl flags. No JAX, no numpy (safe before `distributed.exit_on_sigterm`).

The start-up fingerprint (`fingerprint_options`) holds every option that shapes the compiled step or what it reads
(`STEP_FLAGS`); every process of a run must agree on it.
"""

from __future__ import annotations

import dataclasses
import os

from absl import flags

from slope_jax.model.options import CHOICES as STEP_OPTION_CHOICES  # no JAX: safe before exit_on_sigterm
from slope_jax.model.options import FIELD_HELP as STEP_OPTION_HELP
from slope_jax.model.options import StepOptions
from slope_jax.parallel.config import ParallelConfig  # no JAX, no numpy

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_CHECKPOINT = os.path.join(_REPO, "checkpoints", "tiny-gpt-oss")

flags.DEFINE_string("checkpoint", DEFAULT_CHECKPOINT,
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
flags.DEFINE_bool("kv_full", None, "Export every token of sliding-window layers (--kv_full) or only the rows a "
                  "decoder needs (--nokv_full: the last W tokens and back to the vLLM KV-block boundary at or before "
                  "them, docs/kv-format.md). Default: every token while --prefix_reuse is on (a later prompt can then "
                  "reuse an export from any block boundary), else those rows. A prompt whose prefix came from a "
                  "--nokv_full export keeps sliding rows from that export's first one only.")
flags.DEFINE_bool("prefix_reuse", True, "Prefix reuse: a prompt whose leading blocks were prefilled before (same "
                  "weights, dtype, KV layout and cache_salt) computes only its new tokens, attending to the cached "
                  "KV, which comes from host memory or from the --kv_dir exports (also those of earlier runs). "
                  "--noprefix_reuse computes every prompt cold.")
flags.DEFINE_integer("prefix_block", 128, "Prefix reuse: tokens per hashed block; a hit reuses whole blocks, at "
                     "most n-1 tokens of an n-token prompt.", lower_bound=1)
flags.DEFINE_float("prefix_host_gib", 2.0, "Prefix reuse: GiB of host memory for the KV of recent prompts (least "
                   "recently used out first; 0 = only the --kv_dir exports; single-process runs).", lower_bound=0)
flags.DEFINE_float("kv_dir_max_gib", None, "Retention: keep at most this many GiB of exports in --kv_dir, removing "
                   "the least recently used first (never one a request is using, nor one published in the last "
                   "60 s: a decode engine handed it has that long to read it). Default: no limit.")
flags.DEFINE_float("kv_dir_max_age_h", None, "Retention: remove exports of --kv_dir not used for this many hours. "
                   "Default: no limit.")
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
flags.DEFINE_float("slo_percentile", 90.0, "--layout=auto: the TTFT percentile the SLO applies to, in [1, 100).")
flags.DEFINE_string("hardware", None, "Hardware profile the cost model predicts with (configs/hardware/NAME.json: "
                    "mi250, mi250x, mi300x, a100, h100, h200, cpu). Default: from the device kind.")
flags.DEFINE_float("batch_wait_ms", 5.0, "Longest a batch waits for more requests after its first one arrived; a batch "
                   "never waits to fill up to --batch_size.")
flags.DEFINE_integer("max_tokens", None, "Longest accepted prompt (default and upper limit: the model's "
                     "max_position_embeddings).")
flags.DEFINE_float("device_memory_gib", None, "Per-device memory budget for admitting a request: its length bucket's "
                   "step (weights, KV, activations, as the planner's memory model slope_jax.plan predicts them) must "
                   "fit. Default: what the device reports (no check on CPU).")
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
                  "(e.g. 1024,4096,16384), so early requests do not wait for compilation; each bucket then runs on a "
                  "dummy prompt, shortest first, for up to 30 s in all (twice when the first run takes under 1 s: "
                  "its first execution's one-time cost is paid before traffic) and the runs' times seed the "
                  "scheduler's cost model, so the first requests' TTFT predictions and admission follow this "
                  "machine's measured speed. Compiled programs go to "
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
flags.DEFINE_float("kv_pool_gib", None, "--http_port: GiB of registered host memory (process 0) in which each P/D "
                   "request's KV is also published for the decode side to pull over NIXL (0: off, the export files "
                   "alone serve); under several processes every process holds a pool of this size for its own "
                   "pieces and the answer's record names every pool (vLLM pulls each piece from the process that "
                   "computed it). Default: $SLOPE_JAX_KV_POOL_GIB, else 1.")
flags.DEFINE_float("kv_lease_s", None, "--http_port: seconds an unread NIXL pool entry lives after its publication or "
                   "its last hold (a reader that reports it received frees it at once). Default: "
                   "$SLOPE_JAX_KV_LEASE_S, else 60.")
flags.DEFINE_bool("summary", True, "Print a one-screen summary at the end (process 0, to stderr).")



# Flags that shape the compiled step or what it reads: every process must agree on them (start-up fingerprint).
# The layout flags (one per ParallelConfig field) and the step options (StepOptions fields) are in by construction;
# a new flag of another kind must be added here.
LAYOUT_FLAGS = tuple(f.name for f in dataclasses.fields(ParallelConfig))
STEP_FLAGS = (("layout", "expected_lengths", "ttft_slo_ms", "slo_percentile", "hardware", "dtype", "kv_full",
               "overwrite", "cpu_devices", "platform", "prefix_reuse", "prefix_block") + LAYOUT_FLAGS
              + StepOptions.field_names())


class FlagError(ValueError):
    """A flag value is invalid; the message names the flag and the rule."""


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Every launcher option, one field per flag (same name; the flags' help says what each means), plus
    `step_options` (the `StepOptions` fields' flags, unresolved: the engine resolves "auto" for its devices) and
    whether `--seq_chunks` / `--requests` were given explicitly. List flags are tuples of the strings given.
    Build it with `from_flags` (validated) or directly (tests; call `validate()` for the same checks)."""

    checkpoint: str = DEFAULT_CHECKPOINT
    layout: str = "manual"
    expected_lengths: tuple[str, ...] = ()
    pipeline: int = 1
    ring: int = 1
    ulysses: int = 1
    expert: int | None = None
    microbatches: int | None = None
    seq_chunks: int = 1
    dtype: str = "bfloat16"
    requests: str = "-"
    results: str = "-"
    kv_dir: str | None = None
    kv_full: bool | None = None
    overwrite: bool = False
    prefix_reuse: bool = True
    prefix_block: int = 128
    prefix_host_gib: float = 2.0
    kv_dir_max_gib: float | None = None
    kv_dir_max_age_h: float | None = None
    logits_dir: str | None = None
    top_k: int = 5
    batch_size: int = 8
    ttft_slo_ms: float | None = None
    slo_policy: str = "reject"
    order: str = "edf"
    slo_percentile: float = 90.0
    hardware: str | None = None
    batch_wait_ms: float = 5.0
    max_tokens: int | None = None
    device_memory_gib: float | None = None
    coordinator_address: str = "127.0.0.1:23456"
    num_processes: int = 1
    process_id: int = 0
    init_timeout: float = 120.0
    heartbeat_timeout: float = 30.0
    cpu_devices: int | None = None
    platform: str | None = None
    step_options: StepOptions = StepOptions()
    precompile: tuple[str, ...] = ()
    compile_cache_dir: str | None = None
    http_port: int | None = None
    http_host: str = "127.0.0.1"
    http_model_name: str | None = None
    kv_pool_gib: float | None = None
    kv_lease_s: float | None = None
    summary: bool = True
    seq_chunks_given: bool = False  # --seq_chunks on the command line: overrides the planner's (--layout=auto)
    requests_given: bool = False  # --requests on the command line (exclusive with --http_port)

    @classmethod
    def from_flags(cls, fv: flags.FlagValues) -> LaunchConfig:
        """The configuration the parsed flags `fv` give, validated (FlagError names the flag and the rule)."""
        names = [f.name for f in dataclasses.fields(cls)
                 if f.name not in ("step_options", "seq_chunks_given", "requests_given")]
        values = {name: fv[name].value for name in names}
        for name in ("expected_lengths", "precompile"):
            values[name] = tuple(values[name])
        try:
            step_options = StepOptions(**{name: fv[name].value for name in StepOptions.field_names()})
        except ValueError as e:  # StepOptions names the field and the rule; the flag has the same name
            raise FlagError(f"--{e}") from None
        config = cls(**values, step_options=step_options, seq_chunks_given=fv["seq_chunks"].present,
                     requests_given=fv["requests"].present)
        config.validate()
        return config

    def validate(self) -> None:
        """Mistakes found before anything starts (FlagError names the flag and its limit)."""
        self._check_numbers()
        self._check_lengths()
        self._check_paths()

    def _check_numbers(self) -> None:
        positive = {"batch_size": self.batch_size, "top_k": self.top_k, "num_processes": self.num_processes,
                    "init_timeout": self.init_timeout, "heartbeat_timeout": self.heartbeat_timeout}
        for name, value in positive.items():
            if not value > 0:
                raise FlagError(f"--{name}={value}: must be > 0")
        for name in ("max_tokens", "cpu_devices", "device_memory_gib", "prefix_block", "kv_dir_max_gib",
                     "kv_dir_max_age_h"):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):
                raise FlagError(f"--{name}={value}: must be a finite number > 0")
        if self.ttft_slo_ms is not None and not 0 < self.ttft_slo_ms < float("inf"):
            raise FlagError(f"--ttft_slo_ms={self.ttft_slo_ms}: must be a finite number > 0")
        if not 0 <= self.prefix_host_gib < float("inf"):
            raise FlagError(f"--prefix_host_gib={self.prefix_host_gib}: must be a finite number >= 0")
        if self.kv_pool_gib is not None and not 0 <= self.kv_pool_gib < float("inf"):
            raise FlagError(f"--kv_pool_gib={self.kv_pool_gib}: must be a finite number >= 0 (0: no NIXL pool)")
        if self.kv_lease_s is not None and not 0 < self.kv_lease_s < float("inf"):
            raise FlagError(f"--kv_lease_s={self.kv_lease_s}: must be a finite number of seconds > 0")
        if not 1 <= self.slo_percentile < 100:  # NaN fails too; the planner's --percentile rule
            raise FlagError(f"--slo_percentile={self.slo_percentile}: must be a percent in [1, 100), e.g. 90 for p90 "
                            "(p100 admits no queueing at all)")

    def _check_lengths(self) -> None:
        for x in self.expected_lengths:
            if not x.strip().isdigit() or int(x) < 1:
                raise FlagError(f"--expected_lengths: {x!r} is not a positive prompt length")
        if self.layout == "auto" and self.ttft_slo_ms is None:
            raise FlagError("--layout=auto needs --ttft_slo_ms: the planner picks the layout that meets it")
        if not self.batch_wait_ms >= 0:
            raise FlagError(f"--batch_wait_ms={self.batch_wait_ms}: must be >= 0")
        if not 0 <= self.process_id < self.num_processes:
            raise FlagError(f"--process_id={self.process_id}: must be in 0..{self.num_processes - 1} "
                            f"(--num_processes={self.num_processes})")
        for x in self.precompile:
            if not x.strip().isdigit() or int(x) < 1:
                raise FlagError(f"--precompile: {x!r} is not a positive prompt length")

    def _check_paths(self) -> None:
        if not os.path.isdir(self.checkpoint):
            raise FlagError(f"--checkpoint={self.checkpoint}: no such directory")
        if self.http_port is not None:
            if not 0 <= self.http_port <= 65535:
                raise FlagError(f"--http_port={self.http_port}: must be in 0..65535")
            if self.requests_given:
                raise FlagError("--http_port and --requests are exclusive: requests come over HTTP")
            if self.kv_dir is None:
                raise FlagError("--http_port needs --kv_dir: the decode server reads each request's export")
        self._check_kv_dir()
        if self.process_id == 0 and self.requests != "-" and not os.path.exists(self.requests):
            raise FlagError(f"--requests={self.requests}: no such file")

    def _check_kv_dir(self) -> None:
        if self.kv_dir is None:
            for name in ("kv_dir_max_gib", "kv_dir_max_age_h"):
                if getattr(self, name) is not None:
                    raise FlagError(f"--{name} needs --kv_dir: it bounds the exports written there")
            return
        if not self.kv_dir.strip():
            raise FlagError("--kv_dir='': must name a directory (created if missing); leave the flag out to write "
                            "no KV exports")
        if os.path.exists(self.kv_dir) and not os.path.isdir(self.kv_dir):
            raise FlagError(f"--kv_dir={self.kv_dir}: exists and is not a directory")

    @property
    def precompile_lengths(self) -> list[int]:
        """--precompile as prompt lengths."""
        return [int(x) for x in self.precompile]

    @property
    def expected_length_values(self) -> list[int]:
        """--expected_lengths as prompt lengths."""
        return [int(x) for x in self.expected_lengths]

    @property
    def memory_budget_bytes(self) -> int | None:
        """--device_memory_gib in bytes, or None (then the device's own report, if any, is the budget)."""
        return None if self.device_memory_gib is None else int(self.device_memory_gib * 2**30)

    def manual_layout(self) -> ParallelConfig:
        """The layout the layout flags give (one flag per ParallelConfig field; LayoutError names the rule)."""
        return ParallelConfig(**{name: getattr(self, name) for name in LAYOUT_FLAGS})

    def kv_store(self):
        """The one owner of the --kv_dir policy (`kv.store.KVStore`: --overwrite, retention by --kv_dir_max_gib and
        --kv_dir_max_age_h, never of an export younger than 60 s or --kv_lease_s), or None without --kv_dir."""
        if self.kv_dir is None:
            return None
        from slope_jax.kv.store import KVStore

        from slope_jax.kv.store import MIN_AGE_S

        return KVStore(self.kv_dir, overwrite=self.overwrite,
                       max_bytes=None if self.kv_dir_max_gib is None else int(self.kv_dir_max_gib * 2**30),
                       max_age_s=None if self.kv_dir_max_age_h is None else self.kv_dir_max_age_h * 3600.0,
                       min_age_s=max(MIN_AGE_S, self.kv_lease_s or 0.0))  # a decode side has its lease to read

    def reuse_options(self):
        """The engine's prefix-reuse options (`kv.prefix.ReuseOptions`) from --prefix_reuse, --prefix_block and
        --prefix_host_gib."""
        from slope_jax.kv.prefix import ReuseOptions

        return ReuseOptions(enabled=self.prefix_reuse, block_size=self.prefix_block,
                            host_bytes=int(self.prefix_host_gib * 2**30))

    def fingerprint_options(self) -> dict:
        """The step-shaping options of the start-up fingerprint: flag name -> value for `STEP_FLAGS`, plus
        `kv_export` (whether --kv_dir is given). The same names and values as the flags themselves."""
        options = {}
        for name in STEP_FLAGS:
            value = (getattr(self.step_options, name) if name in StepOptions.field_names()
                     else getattr(self, name))
            options[name] = list(value) if isinstance(value, tuple) else value
        options["kv_export"] = self.kv_dir is not None
        return options
