"""The gpt-oss model: config, parameter declarations and forward pass, attention, MoE, MXFP4, RoPE.

Modules are imported explicitly (`from slope_jax.model import gpt_oss`); `config` needs no JAX.
"""
