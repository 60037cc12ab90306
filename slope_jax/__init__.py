"""slope_jax: SLO-driven long-context prefill engine for gpt-oss in JAX.

Public API: `load_checkpoint`, `PrefillEngine` (+ `PrefillResult`, `LayerKV`), `ParallelConfig`, `ModelConfig`.
"""

from slope_jax.checkpoint import CheckpointError, load_checkpoint
from slope_jax.config import ConfigError, ModelConfig
from slope_jax.engine import LayerKV, PrefillEngine, PrefillResult, RequestError
from slope_jax.parallel import LayoutError, ParallelConfig

__all__ = ["CheckpointError", "ConfigError", "LayerKV", "LayoutError", "ModelConfig", "ParallelConfig",
           "PrefillEngine", "PrefillResult", "RequestError", "load_checkpoint"]
__version__ = "0.1.0"
