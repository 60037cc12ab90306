"""slope_jax: SLO-driven long-context prefill engine for gpt-oss in JAX.

Public API: `load_checkpoint`, `PrefillEngine` (+ `PrefillResult`, `LayerKV`), `ParallelConfig`, `ModelConfig`.
Names are imported lazily, so `import slope_jax.kv` or `slope_jax.plan` does not import JAX.

Packages (imports only run downward): `model` (config, parameters, forward, attention, MoE, MXFP4, RoPE) →
`parallel` (layout, mesh, collectives, context parallelism, pipeline) → `checkpoints` (readers, writer) → `serve`
(engine API, requests, launcher); `kv` (export format) and `plan` (analytic counts) sit beside them.
"""

import importlib

_EXPORTS = {
    "CheckpointError": "slope_jax.checkpoints.hf", "load_checkpoint": "slope_jax.checkpoints.hf",
    "ConfigError": "slope_jax.model.config", "ModelConfig": "slope_jax.model.config",
    "LayerKV": "slope_jax.kv.format",
    "PrefillEngine": "slope_jax.serve.engine", "PrefillResult": "slope_jax.serve.engine",
    "RequestError": "slope_jax.serve.requests",
    "LayoutError": "slope_jax.parallel.config", "ParallelConfig": "slope_jax.parallel.config",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'slope_jax' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
