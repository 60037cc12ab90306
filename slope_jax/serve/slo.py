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


def batch_model(engine, hardware: str, dtype: str, devices_per_host: int) -> sched_lib.OnlineCorrection:
    """`predict_ms(lengths)` of one batch on `engine` (grouped by bucket, `engine.parallel.in_flight` prompts per
    step, as `PrefillEngine.prefill` runs it), from the planner's predicted step time, corrected online: call
    `.observe(lengths, measured_ms)` after each batch."""
    from slope_jax.plan import predict

    parallel = engine.parallel
    per_step = 1 if engine.mesh is None else parallel.in_flight
    layout = ParallelConfig(pipeline=parallel.pipeline, ring=parallel.ring, ulysses=parallel.ulysses,
                            microbatches=parallel.microbatches, expert=parallel.expert_degree(engine.cfg))

    def step_ms(bucket: int, m: int) -> float:
        return float(predict(engine.cfg, layout, bucket, hardware, batch=m, bucket=bucket, dtype=dtype,
                             devices_per_host=devices_per_host).ttft_ms)

    return sched_lib.OnlineCorrection(sched_lib.batch_predictor(step_ms, engine.bucket, per_step))
