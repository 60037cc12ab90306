"""slope_jax: SLO-driven long-context prefill engine for gpt-oss in JAX."""

from slope_jax.checkpoint import CheckpointError, load_checkpoint
from slope_jax.config import ConfigError, ModelConfig

__all__ = ["CheckpointError", "ConfigError", "ModelConfig", "load_checkpoint"]
__version__ = "0.1.0"
