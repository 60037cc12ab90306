"""Analytic counts for planning and benchmarks: FLOPs and collective bytes per device (no JAX needed)."""
