"""The SLO side of the launcher: which hardware profile predicts this machine, the layout for a length mix
(`--layout=auto`), and the batch-time model the scheduler admits requests by (design §7: "the request loop uses the
same model"). Thin glue over `slope_jax.plan` (cost model, layout search) and `slope_jax.serve.scheduler`.

The model that admits requests is the planner's predicted step time per (bucket, requests in flight), corrected
online by the measured compute of finished batches (`scheduler.OnlineCorrection`): the planner gives the shape
over lengths, the measurements the machine's actual speed (a calibration off by a constant, a loaded host).
"""

from __future__ import annotations

import logging

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
                ttft_slo_ms: float, percentile: float = 0.9) -> tuple[ParallelConfig, str]:
    """`--layout=auto`: the layout the planner picks for this length mix on these devices (`plan.choose_layout`:
    among layouts that fit memory and meet the SLO at the longest length, the one with the best goodput; else the
    fastest that fits). Returns (ParallelConfig, reason). Raises LayoutError when no layout fits in memory."""
    from slope_jax.plan import choose_layout

    par, reason, _ = choose_layout(cfg, hardware, num_devices, devices_per_host, lengths, ttft_slo_ms, percentile)
    return par, reason


class BatchModel:
    """`predict_ms(lengths)` of one batch on `engine` for the scheduler: the planner's predicted step time per
    (bucket, prompts per step), grouped as `PrefillEngine.prefill` runs a batch (by bucket, `parallel.in_flight`
    prompts per step), scaled online by measured compute (`observe`), plus the expected XLA compile time for every
    step shape the engine has not compiled yet (the mean of its measured compile times; nothing before the first):
    the first request of a new bucket pays its compilation, so admission must count it.
    """

    def __init__(self, engine, step_ms):
        self.engine = engine
        self.per_step = 1 if engine.mesh is None else engine.parallel.in_flight
        self.model = sched_lib.OnlineCorrection(sched_lib.batch_predictor(step_ms, engine.bucket, self.per_step))

    def _step_shapes(self, lengths) -> set[tuple[int, int]]:
        groups: dict[int, int] = {}
        for n in lengths:
            t = self.engine.bucket(int(n))
            groups[t] = groups.get(t, 0) + 1
        shapes = set()
        for t, c in groups.items():
            full, rest = divmod(c, self.per_step)
            shapes.update([(t, self.per_step)] * bool(full) + [(t, rest)] * bool(rest))
        return shapes

    def __call__(self, lengths: list[int]) -> float:
        ms = self.model(lengths)
        seen = self.engine.compile_ms
        if seen:
            new = self._step_shapes(lengths) - set(seen)
            ms += len(new) * sum(seen.values()) / len(seen)
        return ms

    def observe(self, lengths: list[int], measured_ms: float) -> None:
        """Fold in one finished batch's measured compute (ms, compilation excluded)."""
        self.model.observe(lengths, measured_ms)


def batch_model(engine, hardware: str, dtype: str, devices_per_host: int) -> BatchModel:
    """The scheduler's batch-time model for `engine` (see `BatchModel`), from `slope_jax.plan.predict` on
    `hardware` (a profile name) for the engine's layout and dtype."""
    from slope_jax.plan import predict

    parallel = engine.parallel
    layout = parallel.replace(expert=parallel.expert_degree(engine.cfg))

    def step_ms(bucket: int, m: int) -> float:
        return float(predict(engine.cfg, layout, bucket, hardware, batch=m, bucket=bucket, dtype=dtype,
                             devices_per_host=devices_per_host).ttft_ms)

    return BatchModel(engine, step_ms)
