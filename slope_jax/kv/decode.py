"""A single-device reference decoder over an exported KV cache — to verify exports and connectors, not to serve.

`Decoder(cfg, params, kv, num_tokens, max_new_tokens)` holds the export's K/V (at their global positions) in
fixed-capacity per-layer buffers and `step(token)` runs one token through every layer at the next position: it
attends to the cached keys (with the layer's window) plus itself, appends its own K/V, and returns the next-token
logits. Fed the first token of a prefill and that prefill's KV, step 1 must equal a full forward over
prompt + first token; later steps equal a full forward over the whole sequence so far. One compiled program serves
every step of a request (the buffers have static shapes, rounded up to powers of two so requests of similar length
share it). `decode_step` is the one-step form.
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

_NO_KEY = -1  # position of an empty buffer slot (attention skips keys at negative positions)


class Decoder:
    """Multi-token decoding over an export; the caller picks each next token (greedy, sampling, forced).

    Args:
      cfg: the model configuration.
      params: single-device parameter pytree (`layers` stacked over the L layers, e.g. from `load_checkpoint`).
      kv: global layer id → an object with `k`, `v` `[t, K, H]` (post-RoPE) and `positions` `[t]` int32 — a
        `PrefillResult.kv` or `slope_jax.kv.load(path)`; sliding layers may hold only their last W tokens.
      num_tokens: the sequence length the cache stands for: the first `step` is at this position. Cached tokens at
        positions ≥ num_tokens are ignored (so a cache can be cut back, e.g. to replay the prompt's last token).
      max_new_tokens: how many `step` calls the buffers must hold.
    Raises:
      ValueError if a layer is missing, or a layer's kept positions do not end at num_tokens − 1 or are not
      consecutive.
    """

    def __init__(self, cfg: ModelConfig, params: dict, kv: dict, num_tokens: int, max_new_tokens: int):
        self.cfg, self.params = cfg, params
        self.position = int(num_tokens)
        self.steps_left = int(max_new_tokens)
        dtype = params["embed"].dtype
        k_bufs, v_bufs, p_bufs, fills = [], [], [], []
        for layer in range(cfg.num_hidden_layers):
            if layer not in kv:
                raise ValueError(f"KV cache has no layer {layer}")
            c = kv[layer]
            pos = np.asarray(c.positions, np.int32)
            keep = pos < num_tokens
            pos = pos[keep]
            if len(pos) and (int(pos[-1]) != num_tokens - 1 or np.any(np.diff(pos) != 1)):
                raise ValueError(f"layer {layer}: cached positions [{int(pos[0])}, {int(pos[-1]) + 1}) do not end at "
                                 f"{num_tokens - 1} as decoding position {num_tokens} needs")
            t = len(pos)
            cap = _capacity(t + max_new_tokens)
            kb = np.zeros((cap, cfg.num_key_value_heads, cfg.head_dim), np.float32)
            vb = np.zeros_like(kb)
            pb = np.full((cap,), _NO_KEY, np.int32)
            kb[:t], vb[:t], pb[:t] = np.asarray(c.k, np.float32)[keep], np.asarray(c.v, np.float32)[keep], pos
            k_bufs.append(jnp.asarray(kb, dtype)), v_bufs.append(jnp.asarray(vb, dtype)), p_bufs.append(jnp.asarray(pb))
            fills.append(t)
        self._caches = tuple(zip(k_bufs, v_bufs, p_bufs))
        self._fills = jnp.asarray(fills, jnp.int32)

    def step(self, token: int) -> np.ndarray:
        """Feed `token` at the next position; returns the float32 next-token logits `[V]`.
        Raises ValueError after `max_new_tokens` steps."""
        if self.steps_left <= 0:
            raise ValueError("Decoder: max_new_tokens steps already taken (the buffers are full)")
        logits, self._caches = _step(self.cfg, self.params, self._caches, self._fills, jnp.int32(token),
                                     jnp.int32(self.position))
        self._fills = self._fills + 1
        self.position += 1
        self.steps_left -= 1
        return np.asarray(logits)


def decode_step(cfg: ModelConfig, params: dict, kv: dict, token: int, position: int) -> np.ndarray:
    """Next-token logits (float32 `[V]`) after `token` at `position` (the prompt length for the first decoded
    token), over a cache that ends at `position − 1`. See `Decoder` for `kv` and the errors raised."""
    return Decoder(cfg, params, kv, position, 1).step(token)


def _capacity(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


@functools.partial(jax.jit, static_argnums=0)
def _step(cfg: ModelConfig, params: dict, caches, fills, token, position):
    dtype = params["embed"].dtype
    x = params["embed"][token[None]]
    pos = position[None]
    cos, sin = rope.cos_sin(cfg, pos, dtype)
    windows = model_lib.layer_windows(cfg)
    new_caches = []
    for layer, (k_cache, v_cache, k_pos) in enumerate(caches):
        p = {k: v[layer] for k, v in params["layers"].items()}

        def attend(q, k, v, sinks, k_cache=k_cache, v_cache=v_cache, k_pos=k_pos, window=int(windows[layer])):
            keys = jnp.concatenate([k_cache, k.astype(dtype)])
            values = jnp.concatenate([v_cache, v.astype(dtype)])
            return attn_lib.attention(q, keys, values, pos, jnp.concatenate([k_pos, pos]), sinks, window=window)

        x, k, v = model_lib.layer(x, p, cfg, cos=cos, sin=sin, valid=jnp.ones((1,), bool), attend=attend)
        at = fills[layer]
        new_caches.append((jax.lax.dynamic_update_slice(k_cache, k.astype(dtype), (at, 0, 0)),
                           jax.lax.dynamic_update_slice(v_cache, v.astype(dtype), (at, 0, 0)),
                           jax.lax.dynamic_update_slice(k_pos, pos, (at,))))
    return model_lib.unembed(x[0], params["final_norm"], params["unembed"], cfg), tuple(new_caches)
