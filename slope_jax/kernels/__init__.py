"""Fused accelerator kernels (Pallas). Pure compute on padded arrays: masking rules, padding and tile ranges are
decided by the callers in `slope_jax.model`, which stay the reference implementation."""
