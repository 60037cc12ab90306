"""The SLO side of the launcher: which hardware profile predicts this machine, the layout for a length mix
(`--layout=auto`), and the batch-time model the scheduler admits requests by (docs/design.md §7: "request loop uses the
same model"). Thin glue over `slope_jax.plan` (cost model, layout search) and `slope_jax.serve.scheduler`.

The model that admits requests is the planner's predicted step time per (bucket, requests in flight), corrected
online by the measured compute of finished batches (`scheduler.OnlineCorrection`): the planner gives the shape
over lengths, the measurements the machine's actual speed (a calibration off by a constant, a loaded host). A CPU
profile is first carried over to this machine by a cached micro-measure (`this_machine`, `plan.machine`), so that the
first predictions, before any batch is measured, are this machine's.
"""

from __future__ import annotations

import functools
import logging
import os
import time

from slope_jax.model.config import ModelConfig
from slope_jax.parallel.config import ParallelConfig
from slope_jax.serve import scheduler as sched_lib

log = logging.getLogger(__name__)

# device_kind substrings -> hardware profile (configs/hardware/<name>.json); checked in order
_DEVICE_KINDS = (("h200", "h200"), ("h100", "h100"), ("a100", "a100"), ("mi300x", "mi300x"), ("mi250x", "mi250x"),
                 ("mi250", "mi250"), ("cpu", "cpu"))


def hardware_for(device_kind: str, platform: str) -> str:
    """The hardware profile name for a JAX device (`device.device_kind`, `device.platform`).

    Raises ValueError naming the device when no profile matches (pass `--hardware` then)."""
    kind = f"{platform} {device_kind}".lower()
    for key, name in _DEVICE_KINDS:
        if key in kind:
            return name
    raise ValueError(f"no hardware profile for device {device_kind!r} ({platform}): pass --hardware=NAME "
                     "(configs/hardware/*.json) so the cost model knows its FLOP/s and links")


def auto_layout(cfg: ModelConfig, hardware: str, num_devices: int, devices_per_host: int, lengths: list[int],
                ttft_slo_ms: float, percentile: float = 0.9, tiles=None) -> tuple[ParallelConfig, str]:
    """`--layout=auto`: the layout the planner picks for this length mix on these devices (`plan.choose_layout`:
    among layouts that fit memory and meet the SLO at the longest length, the one with the best goodput; else the
    fastest that fits; the profile carried over to this machine, `this_machine`), predicted with the step options the
    engine will run (`tiles`; None: the profile's `step_options`). Returns (ParallelConfig, reason). Raises
    LayoutError when no layout fits in memory."""
    from slope_jax.plan import choose_layout

    par, reason, _ = choose_layout(cfg, this_machine(hardware), num_devices, devices_per_host, lengths, ttft_slo_ms,
                                   percentile, **({} if tiles is None else {"tiles": tiles}))
    return par, reason


# Compile estimate for a profile without `compile_s`: an assumption (a large sharded step on an accelerator compiles in
# tens of seconds), replaced by the first compile measured on this process.
DEFAULT_COMPILE_S = 30.0
# A persistent-cache hit still traces and lowers the step: measured 2.5-3.1 s per step program where a miss took
# 29-45 s (tiny checkpoint, ring 2 x Ulysses 4, buckets 32 and 768, the 2-core host at load average 27).
CACHE_HIT_FRACTION = 0.1
# A prefix hit's step program (its new tokens attending to cached keys: a branch per kind of layer, the prefix
# attention's own tiles) compiles longer than a plain bucket's: 14.7 / 15.2 s vs 10.2 / 10.3 s (README command 1's
# two processes on the 2-core AMX Xeon, 2026-12-06), 14.8 s where a plain bucket's prior said 10 s. Applied to a hit
# shape's estimate while this process has measured only plain programs (or none), and inversely.
HIT_COMPILE_FACTOR = 1.45


# when this run started (this module is imported at start-up, before the engine compiles anything)
RUN_STARTED = time.time()


@functools.lru_cache(maxsize=8)
def this_machine(hardware: str):
    """The profile `hardware` (name or JSON path) carried over to this machine: a CPU profile with a
    `machine_reference` is rescaled by this machine's micro-measure (`plan.machine.adapt`: measured in ~2-5 s once
    per machine, then read from ~/.cache/slope_jax/machine), any other profile is returned as loaded."""
    from slope_jax.plan import hardware as hw_lib
    from slope_jax.plan import machine

    hw = hw_lib.load(hardware)
    adapted = machine.adapt(hw)
    if adapted is not hw:
        log.info("cost model: %s", adapted.sources.get("machine"))
    return adapted


def persistent_cache_warm(since: float | None = None) -> bool:
    """True when JAX's persistent compilation cache is on (`jax_compilation_cache_dir`) and holds entries written
    before `since` (default `RUN_STARTED`): an earlier run's, not the small programs this run compiled while starting
    up (which made a fresh cache look warm: README command 1's first run predicted 0.8 s for a 7.4 s compile). Taken as
    "this run's programs are cached" until the first compile measures otherwise (entries of other programs give an
    optimistic first estimate, corrected by that measurement). `BatchModel` asks per shape instead (the step index,
    `compile_cache.compiled_steps`); this machine-wide answer is kept for callers without an engine."""
    import jax

    path = jax.config.jax_compilation_cache_dir
    since = RUN_STARTED if since is None else since
    try:
        return bool(path) and any(e.stat().st_mtime < since for e in os.scandir(path))
    except OSError:
        return False


def compile_prior_ms(hardware: str, loadavg: float | None = None, cpus: int | None = None,
                     cache_warm: bool = False) -> float:
    """The compile time in ms the scheduler expects for a step shape before this process has compiled any: the
    profile's `compile_s` (else `DEFAULT_COMPILE_S`); on a profile whose devices share the host's cores
    (`shared_compute`, the CPU) times the host's oversubscription max(1, loadavg / cpus) — XLA compiles on one
    core, and a host running loadavg runnable threads on `cpus` cores gives it about cpus/loadavg of one
    (conservative: measured 16-25 s at load 3-7, 29-45 s at load 27); times `CACHE_HIT_FRACTION` when the
    persistent compilation cache is warm (`cache_warm`, see `persistent_cache_warm`).
    loadavg: 1-minute load average, default `os.getloadavg()`; cpus: default `os.cpu_count()`."""
    from slope_jax.plan import hardware as hw_lib

    hw = hw_lib.load(hardware)
    ms = 1e3 * (DEFAULT_COMPILE_S if hw.compile_s is None else hw.compile_s)
    if hw.shared_compute:
        load = os.getloadavg()[0] if loadavg is None else loadavg
        ms *= max(1.0, load / max(1, cpus or os.cpu_count() or 1))
    return ms * (CACHE_HIT_FRACTION if cache_warm else 1.0)


def _items(d: dict) -> list:
    """`list(d.items())`, retried while the engine's thread adds a compiled step (a dict changed in iteration)."""
    for _ in range(100):
        try:
            return list(d.items())
        except RuntimeError:
            continue
    return list(d.copy().items())


def program_identity(engine) -> str | None:
    """A digest of what shapes `engine`'s step programs besides the step key: model config, layout, dtype, step
    options, parameter shapes and dtypes, devices, processes, jax/jaxlib versions and XLA flags — the persistent
    cache's step index (`compile_cache.record_steps`) is keyed by it. None for an object without these (a stand-in
    engine in tests)."""
    import hashlib

    import jax
    import jaxlib

    try:
        params = jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), engine.params)
        devices = [(d.platform, d.device_kind) for d in jax.devices()]
        parts = (repr(engine.cfg), repr(engine.parallel), str(engine.dtype), repr(engine.options), repr(params),
                 repr(devices), jax.process_count(), jax.__version__, jaxlib.__version__, os.environ.get("XLA_FLAGS"))
    except AttributeError:
        return None
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


class BatchModel:
    """The scheduler's cost model for `engine`. `model(lengths)`: predicted compute ms of one batch — the planner's
    step time per (bucket, prompts per step), grouped as `PrefillEngine.prefill` runs a batch (by bucket,
    `parallel.in_flight` prompts per step), scaled online by measured compute (`observe`). `compile_ms(shape)`:
    expected XLA compile ms of a step shape (bucket, prompts), which the scheduler adds once for each shape its
    plan has not compiled yet (`Scheduler(..., compile_ms=model.compile_ms)`).

    The compile estimate reads the engine and the persistent cache's step index (`compile_cache.compiled_steps`,
    per shape): 0 for a shape in `engine.compile_ms` (compiled in this process); for a shape the index lists (an
    earlier run compiled it into the persistent cache: a load, which still traces and lowers) the latest cache load
    measured in this process, else `compile_prior_ms` × `CACHE_HIT_FRACTION`; for any other shape (never compiled
    here: a full compile, however many other entries the cache holds) the latest full compile measured in this
    process, else `compile_prior_ms` (`compile_prior_ms()` with a cold cache). A prefix hit's program is estimated
    from the latest of its kind, else × `HIT_COMPILE_FACTOR` of a plain one's (and the prior likewise). Compile time
    barely depends on the shape: layers are scanned and attention/MoE tiles looped (16–25 s for buckets 32–1536 on
    the CPU). The shapes this process compiles are added to the index (`observe`, `compile_ms`).
    """

    def __init__(self, engine, step_ms, compile_prior_ms: float, hit_ms=None):
        from slope_jax import compile_cache

        self.engine = engine
        self.per_step = 1 if engine.mesh is None else engine.parallel.in_flight
        cold = sched_lib.batch_predictor(step_ms, engine.bucket, self.per_step)
        hit = functools.lru_cache(maxsize=4096)(hit_ms) if hit_ms is not None else None

        def base(works: list) -> float:
            # a prefix hit (n, cached) runs its own step: its new tokens and their attention over the cached keys
            hits = [w for w in works if isinstance(w, tuple)]
            ms = cold([w for w in works if not isinstance(w, tuple)]) if len(hits) < len(works) else 0.0
            return ms + sum(hit(*w) if hit is not None else cold([w[0]]) for w in hits)

        self.model = sched_lib.OnlineCorrection(base)
        self.compile_prior_ms = float(compile_prior_ms)
        self.identity = program_identity(engine) if compile_cache.directory() else None
        self.cached = compile_cache.compiled_steps(self.identity) if self.identity else set()
        self._recorded: set = set()
        self.record_compiled()

    def __call__(self, lengths: list) -> float:
        return self.model(lengths)

    def record_compiled(self) -> None:
        """Add the shapes this process compiled since the last call to the persistent cache's step index (also
        called after idle-time warm compiles, which no later prediction may follow in this run)."""
        from slope_jax import compile_cache

        new = [k for k, _ in _items(self.engine.compile_ms) if k not in self._recorded]
        if not new:
            return
        self._recorded.update(new)
        if self.identity:
            compile_cache.record_steps(self.identity, new)
            self.cached.update(compile_cache.step_key(k) for k in new)

    def _latest(self, loads: bool, hit: bool) -> float | None:
        """The latest compile measured in this process that was a cache load (`loads`) or a full compile (a step
        without a recorded source counts as a full compile), of a prefix-hit program (`hit`) or a plain one: the
        latest of that kind, else the latest of the other kind scaled by `HIT_COMPILE_FACTOR`."""
        source = dict(_items(getattr(self.engine, "compile_source", {})))
        other = None
        for key, ms in reversed(_items(self.engine.compile_ms)):
            if (source.get(key) == "cache") != loads:
                continue
            if (len(key) == 3) == hit:
                return ms
            if other is None:
                other = ms * HIT_COMPILE_FACTOR if hit else ms / HIT_COMPILE_FACTOR
        return other

    def compile_ms(self, shape: tuple) -> float:
        """Expected ms to compile the step of `shape` = (bucket length, prompts per step), or for a prefix hit
        ((bucket, cached rows), prompts per step); 0 when compiled (class docstring)."""
        from slope_jax import compile_cache

        key = engine_key(shape)
        self.record_compiled()
        if key in self.engine.compile_ms:
            return 0.0
        hit = len(key) == 3
        prior = self.compile_prior_ms * (HIT_COMPILE_FACTOR if hit else 1.0)
        if compile_cache.step_key(key) in self.cached:
            ms = self._latest(loads=True, hit=hit)
            return prior * CACHE_HIT_FRACTION if ms is None else ms
        ms = self._latest(loads=False, hit=hit)
        return prior if ms is None else ms

    def seed(self, runs: list[tuple[int, int, float]]) -> None:
        """Start the online correction from measured warm-up steps `[(prompt length, prompts, ms)]`
        (`compute.timed_runs`) instead of the uncorrected model (`OnlineCorrection.seed`); logs the result."""
        before = [self.model.base([n] * m) for n, m, _ in runs]
        factor = self.model.seed([([n] * m, ms) for n, m, ms in runs])
        logging.info("cost model seeded by %d warm-up step(s): measured %s ms vs predicted %s ms -> predictions x%.2f",
                     len(runs), ", ".join(f"{ms:.0f}" for *_, ms in runs), ", ".join(f"{b:.0f}" for b in before),
                     factor)

    def observe(self, lengths: list[int], measured_ms: float) -> None:
        """Fold in one finished batch's measured compute (ms, compilation excluded)."""
        self.record_compiled()
        self.model.observe(lengths, measured_ms)


def engine_key(shape: tuple) -> tuple:
    """A scheduler step shape — (bucket, prompts) or ((bucket, cached rows), prompts) — as the engine's compiled-step
    key (`PrefillEngine.compiled`'s (t, m) or (t, m, prefix_rows); `compile_ms` is keyed by it)."""
    key, m = shape
    if isinstance(key, tuple):
        return (int(key[0]), int(m), int(key[1])) if key[1] else (int(key[0]), int(m))
    return (int(key), int(m))


def batch_model(engine, hardware: str, dtype: str, devices_per_host: int) -> BatchModel:
    """The scheduler's batch-time model for `engine` (see `BatchModel`), from `slope_jax.plan.predict` on
    `hardware` (a profile name) carried over to this machine (`this_machine`) for the engine's layout, dtype and step
    options (not the profile's `step_options`: the engine runs its own), with
    `compile_prior_ms` as the estimate of a full compile before the first one is measured."""
    from slope_jax.plan import predict

    name, hardware = hardware, this_machine(hardware)
    parallel = engine.parallel
    layout = parallel.replace(expert=parallel.expert_degree(engine.cfg))

    def step_ms(bucket: int, m: int) -> float:
        return float(predict(engine.cfg, layout, bucket, hardware, batch=m, bucket=bucket, dtype=dtype,
                             devices_per_host=devices_per_host, tiles=engine.options).ttft_ms)

    def hit_ms(n: int, cached: int) -> float:
        bucket, _ = engine.step_key(n, cached)
        return float(predict(engine.cfg, layout, n - cached, hardware, bucket=bucket, dtype=dtype, cached=cached,
                             devices_per_host=devices_per_host, tiles=engine.options).ttft_ms)

    return BatchModel(engine, step_ms, compile_prior_ms(name), hit_ms)
