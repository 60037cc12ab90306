"""Memory admission on process 0's intake path, from the planner's memory model (no compilation, no JAX here).

A request is admitted iff the predicted bytes per device of its step — `slope_jax.plan.predict(...)`'s
`memory_bytes_per_device` (parameters, inputs, XLA's temporaries, the KV export; `plan/memory.py`) for its length
bucket and the engine's prompts per step — fit the budget (`--device_memory_gib`, else what the device reports; no
budget, no check). Predictions are memoised per bucket, so the intake does arithmetic, never a compile.
`PrefillEngine.check_fits` (XLA's memory analysis of the compiled step) stays for API users.
"""

from __future__ import annotations

import functools
from typing import Callable


class MemoryAdmission:
    """Admits prompt lengths by predicted memory per device.

    Args:
      predict_bytes: `predict_bytes(bucket, prompts_per_step) -> bytes per device` (memoised here).
      bucket: token count -> the step's padded length (`PrefillEngine.bucket`).
      per_step: prompts per step (the step shape the engine compiles for a full step).
      budget_bytes: bytes per device a step may use, or None (no check).
      budget_source: what the budget is, for messages (e.g. "--device_memory_gib").
    """

    def __init__(self, predict_bytes: Callable[[int, int], float], bucket: Callable[[int], int], per_step: int,
                 budget_bytes: int | None, budget_source: str = "--device_memory_gib"):
        self.predict_bytes = functools.lru_cache(maxsize=None)(predict_bytes)
        self.bucket, self.per_step = bucket, int(per_step)
        self.budget_bytes, self.budget_source = budget_bytes, budget_source

    def refusal(self, n: int) -> str | None:
        """None when an n-token prompt fits the budget; else the reason (tokens, predicted GiB, budget GiB)."""
        if self.budget_bytes is None:
            return None
        t = self.bucket(int(n))
        need = float(self.predict_bytes(t, self.per_step))
        if need <= self.budget_bytes:
            return None
        return (f"{n} tokens (bucket {t}) need a predicted {need / 2**30:.3f} GiB per device (the planner's memory "
                f"model, {self.per_step} prompt(s) per step), over the budget of {self.budget_bytes / 2**30:.3f} GiB "
                f"({self.budget_source}): use more context-parallel devices, more pipeline stages, or a shorter "
                "prompt")


def for_engine(engine, hardware: str, dtype: str, devices_per_host: int, budget_bytes: int | None
               ) -> MemoryAdmission:
    """The admission of `engine`'s requests: `plan.predict` on the engine's model, layout (its EP degree), resolved
    step options (tiles) and `dtype`, for `hardware` (a profile name). `budget_bytes` None: what the device reports
    (`engine.device_memory_limit()`, None on CPU: no check)."""
    from slope_jax.plan import predict

    source = "--device_memory_gib"
    if budget_bytes is None:
        budget_bytes, source = engine.device_memory_limit(), "the device's reported memory"
    layout = engine.parallel.replace(expert=engine.parallel.expert_degree(engine.cfg))
    per_step = 1 if engine.mesh is None else engine.parallel.in_flight

    def predict_bytes(bucket: int, m: int) -> float:
        return predict(engine.cfg, layout, bucket, hardware, batch=m, bucket=bucket, dtype=dtype,
                       devices_per_host=devices_per_host, tiles=engine.options).memory_bytes_per_device

    return MemoryAdmission(predict_bytes, engine.bucket, per_step, budget_bytes, source)
