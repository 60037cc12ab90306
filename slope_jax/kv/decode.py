"""A single-device reference decode step over an exported KV cache — to verify exports, not to serve.

`decode_step(cfg, params, kv, token, position)` runs one token through every layer, attending to the cached keys
(at their global positions, with the layer's window) plus itself, and returns the next-token logits. Fed the first
token of a prefill and that prefill's KV, it must equal a full forward over prompt + first token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from slope_jax.model import attention as attn_lib
from slope_jax.model import gpt_oss as model_lib
from slope_jax.model import rope
from slope_jax.model.config import ModelConfig


def decode_step(cfg: ModelConfig, params: dict, kv: dict, token: int, position: int) -> np.ndarray:
    """Next-token logits after `token` at `position`.

    Args:
      params: single-device parameter pytree (`layers` stacked over the L layers, e.g. from `load_checkpoint`).
      kv: global layer id → an object with `k`, `v` `[t, K, H]` (post-RoPE) and `positions` `[t]` — a
        `PrefillResult.kv` or `slope_jax.kv.load(path)`; sliding layers may hold only their last W tokens.
      token: the token id to feed; position: its global position (the prompt length for the first decoded token).
    Returns:
      float32 logits `[V]`.
    Raises:
      ValueError if a layer is missing or the cache does not end at `position − 1`.
    """
    caches = []
    for layer in range(cfg.num_hidden_layers):
        if layer not in kv:
            raise ValueError(f"KV cache has no layer {layer}")
        c = kv[layer]
        if len(c.positions) and int(c.positions[-1]) != position - 1:
            raise ValueError(f"layer {layer}: cache ends at position {int(c.positions[-1])}, decoding "
                             f"position {position} needs it to end at {position - 1}")
        caches.append((np.asarray(c.k), np.asarray(c.v), np.asarray(c.positions, np.int32)))
    return np.asarray(_decode(cfg, params, tuple(caches), jnp.int32(token), jnp.int32(position)))


@functools.partial(jax.jit, static_argnums=0)
def _decode(cfg: ModelConfig, params: dict, caches, token, position):
    dtype = params["embed"].dtype
    x = params["embed"][token[None]]
    pos = position[None]
    cos, sin = rope.cos_sin(cfg, pos, dtype)
    windows = model_lib.layer_windows(cfg)
    for layer, (k_cache, v_cache, k_pos) in enumerate(caches):
        p = {k: v[layer] for k, v in params["layers"].items()}
        k_all_pos = jnp.concatenate([k_pos, pos])

        def attend(q, k, v, sinks, k_cache=k_cache, v_cache=v_cache, k_pos=k_all_pos, window=int(windows[layer])):
            keys = jnp.concatenate([k_cache.astype(dtype), k])
            values = jnp.concatenate([v_cache.astype(dtype), v])
            return attn_lib.attention(q, keys, values, pos, k_pos, sinks, window=window)

        x, _, _ = model_lib.layer(x, p, cfg, cos=cos, sin=sin, valid=jnp.ones((1,), bool), attend=attend)
    return model_lib.unembed(x[0], params["final_norm"], params["unembed"], cfg)
