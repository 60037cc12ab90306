"""An export as a Hugging Face transformers KV cache: the decode half of prefill/decode disaggregation on
`GptOssForCausalLM` (torch + transformers, no JAX).

    cache = slope_jax.kv.to_transformers_cache("out/kv/doc-1", model)        # model: GptOssForCausalLM
    m = slope_jax.kv.read_manifest("out/kv/doc-1")
    out = model(torch.tensor([[m["first_token"]]]), cache=cache, use_cache=True)   # position m["num_tokens"]

The position contract. transformers' gpt-oss derives the position of the next token, the RoPE angle and the causal /
sliding masks from the cache alone (`position_ids = cache.get_seq_length() + arange(q)`; masks from
`get_mask_sizes`). A full layer's length is its number of stored keys; a sliding layer (`DynamicSlidingWindowLayer`)
stores at most its last W−1 keys and tracks the true sequence length in `cumulative_length`. Loading the kept tail
of a sliding layer with `update()` alone would make that layer — and, since layer 0 is sliding, the whole model —
believe the sequence is W tokens long, so the next token would get position W instead of n. This module sets every
sliding layer's length to n, so `cache.get_seq_length(layer) == n` for every layer and no `position_ids` are needed
(passing `position_ids=[[n]]` explicitly is equivalent).

Sliding-window semantics (docs/model.md §2.3): a query at position p sees keys at p−W+1 … p. transformers keeps the
last W−1 keys of a sliding layer (the new token is the W-th); the export keeps the last W, so a cache of the first
n−1 tokens (`num_tokens=n−1`, to replay the prompt's last token) can still be built from a default export.
"""

from __future__ import annotations

import os

import numpy as np

from slope_jax.kv import compat
from slope_jax.kv import format as kvfmt


def to_transformers_cache(path: str | os.PathLike, config, *, num_tokens: int | None = None, dtype=None,
                          device=None, check_fingerprint: bool = True):
    """Build the `transformers.DynamicCache` a `GptOssForCausalLM` continues decoding from.

    Works for the default export (sliding layers keep their last W tokens) and the `kv_full` one, written by any
    (pipeline, ring, ulysses) layout and any number of processes (`slope_jax.kv.load` reassembles the pieces).

    Args:
      path: the export directory `<kv_dir>/<request_id>`.
      config: the decode model: a transformers `GptOssForCausalLM` (its config, dtype and device are used), a
        `GptOssConfig`, a slope_jax `ModelConfig`, or a checkpoint directory.
      num_tokens: build the cache of the first `num_tokens` tokens only (default: all `manifest["num_tokens"]`),
        e.g. n−1 to let the decode engine recompute the first token from the prompt's last token. A default export
        supports any value ≥ n−1; a `kv_full` export any value (0: an empty cache).
      dtype: torch dtype of the cache tensors (default: the model's if `config` is a model, else the export's,
        `manifest["dtype"]`; bfloat16 exports are read through ml_dtypes and converted exactly).
      device: torch device (default: the model's, else CPU).
      check_fingerprint: also compare the config fingerprint (see `slope_jax.kv.compat.check_model`).
    Returns:
      A `transformers.DynamicCache` with one layer per model layer, tensors `[1, K, t, H]` (batch, kv_head, token,
      head_dim; t = tokens held), post-RoPE K. Full layers hold all `num_tokens` tokens; sliding layers the last
      min(num_tokens, W−1) with their length set to `num_tokens`. `cache.get_seq_length() == num_tokens`: feed the
      next token (the manifest's `first_token` after a full cache) without `position_ids`, or with
      `position_ids=[[num_tokens]]`.
    Raises:
      KVModelMismatch (a KVFormatError) naming the field and both values when the export's model differs from
      `config` (kv heads, head_dim, window, layer count or kinds, fingerprint); KVFormatError for an inconsistent or
      incomplete export or a `num_tokens` the export cannot serve; RuntimeError if the installed transformers does
      not build gpt-oss caches from `DynamicLayer` / `DynamicSlidingWindowLayer` as this module expects.
    """
    import torch
    import transformers

    path = kvfmt.resolve(os.fspath(path))  # one version of the export for the manifest check and the tensors
    model = config if isinstance(config, torch.nn.Module) else None
    cfg = compat.model_config(config)
    manifest = kvfmt.read_manifest(path)
    compat.check_model(manifest, cfg, path, check_fingerprint=check_fingerprint)
    n = int(manifest["num_tokens"])
    t = n if num_tokens is None else int(num_tokens)
    if not 0 <= t <= n:
        raise kvfmt.KVFormatError(f"{path}: num_tokens={t} is outside [0, {n}] (the export holds {n} tokens)")
    if model is not None:
        dtype = model.dtype if dtype is None else dtype
        device = model.device if device is None else device
    layers = kvfmt.load(path)

    hf_config = _hf_config(config, model, cfg, transformers)
    cache = transformers.DynamicCache(config=hf_config)
    if len(cache.layers) != cfg.num_hidden_layers:
        raise RuntimeError(f"transformers {transformers.__version__} built a cache of {len(cache.layers)} layers for "
                           f"a {cfg.num_hidden_layers}-layer model")
    if t == 0:
        return cache  # empty: the decode engine starts at position 0
    for i, cl in enumerate(cache.layers):
        _fill_layer(cl, i, layers[i], t, cfg, path=path, dtype=dtype, device=device)
    return cache


def _fill_layer(cl, i: int, kv, t: int, cfg, *, path: str, dtype, device) -> None:
    """Load layer `i` of an export (`kv`: positions `[n]` int, k and v `[n, K, H]`) into transformers cache layer
    `cl` as the cache of the first `t` tokens: all of them on a full layer, the last W−1 on a sliding one (whose
    length is then set to `t`).

    Raises KVFormatError when the export does not hold the tokens needed, RuntimeError when `cl` is not the layer
    class / window this module expects or reports another length after loading (a transformers version change)."""
    import transformers
    from transformers.cache_utils import DynamicSlidingWindowLayer

    w = cfg.sliding_window
    sliding = cfg.is_sliding(i)
    rows = _held_rows(kv, i, t, w if sliding else None, path)
    k, v = (_torch(a[rows], dtype, device) for a in (kv.k, kv.v))
    if sliding != isinstance(cl, DynamicSlidingWindowLayer) or (sliding and cl.sliding_window != w):
        raise RuntimeError(f"transformers {transformers.__version__}: cache layer {i} is {type(cl).__name__} "
                           f"(window {getattr(cl, 'sliding_window', None)}), expected "
                           f"{'DynamicSlidingWindowLayer' if sliding else 'DynamicLayer'} for a {kv.kind} layer")
    cl.update(k, v)
    if sliding:
        cl.cumulative_length = t  # the true sequence length (the layer holds only its last W−1 tokens)
    if cl.get_seq_length() != t or cl.keys.shape[-2] != min(t, w - 1 if sliding else t):
        raise RuntimeError(f"transformers {transformers.__version__}: cache layer {i} reports length "
                           f"{cl.get_seq_length()} holding {cl.keys.shape[-2]} tokens after loading {t} tokens; "
                           "its sliding-window bookkeeping differs from what this module was written for")


def _held_rows(kv, i: int, t: int, window: int | None, path: str) -> slice:
    """The rows of export layer `kv` (sorted `positions`) that transformers holds for a sequence of `t` tokens: all
    of `[0, t)`, or on a sliding layer (`window` W, None on a full one) only the last W−1. Raises KVFormatError naming
    the layer and the range when the export does not hold them."""
    sliding = window is not None
    need = max(0, t - (window - 1)) if sliding else 0
    pos = np.asarray(kv.positions)
    if len(pos) == 0 or pos[0] > need or pos[-1] < t - 1:
        have = f"[{int(pos[0])}, {int(pos[-1]) + 1})" if len(pos) else "no tokens"
        raise kvfmt.KVFormatError(
            f"{path}: layer {i} ({kv.kind}) holds {have}; a cache of {t} tokens needs [{need}, {t})"
            + (" (export with kv_full to keep earlier tokens of sliding layers)" if sliding else ""))
    return slice(int(np.searchsorted(pos, need)), int(np.searchsorted(pos, t)))


def _hf_config(config, model, cfg, transformers):
    """A transformers config with the right layer kinds and window, for `DynamicCache(config=...)`."""
    if model is not None:
        return model.config
    if isinstance(config, transformers.PretrainedConfig):
        return config
    return transformers.GptOssConfig(**cfg.to_hf_dict())


def _torch(a: np.ndarray, dtype, device):
    """`[t, K, H]` numpy (float32 or ml_dtypes.bfloat16) → torch `[1, K, t, H]` in `dtype` on `device`."""
    import ml_dtypes
    import torch

    a = np.array(a)  # a writable, contiguous copy (safetensors hands out read-only views)
    if a.dtype == ml_dtypes.bfloat16:
        x = torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    else:
        x = torch.from_numpy(a)
    x = x.permute(1, 0, 2).unsqueeze(0).contiguous()
    return x.to(device=device if device is not None else "cpu", dtype=dtype if dtype is not None else x.dtype)


def lowest_index_ties(model) -> int:
    """Make every gpt-oss router of a transformers `model` break exact top-k ties as slope_jax does: among experts
    with equal router logits the lower expert index wins (`moe.route`, `jax.lax.top_k`). transformers' router
    (`GptOssTopKRouter`) uses `torch.topk`, whose order among equal values is unspecified (measured, torch 2.13 CPU:
    logits of 32 experts equal to 0 pick experts [22, 21, 20, 23], slope_jax [0, 1, 2, 3]); a token with a tie
    would route to other experts in decode than in prefill. The replacement is a stable descending sort, equal to
    `torch.topk` wherever there is no tie. Patches the model's router instances in place (not the class); returns
    how many."""
    import types

    n = 0
    for module in model.modules():
        if type(module).__name__ == "GptOssTopKRouter":
            module.forward = types.MethodType(_router_forward_lowest_index_ties, module)
            n += 1
    return n


def _router_forward_lowest_index_ties(self, hidden_states):
    """`GptOssTopKRouter.forward` with the top-k taken from a stable descending sort (ties: lower index first)."""
    import torch
    import torch.nn.functional as F

    router_logits = F.linear(hidden_states, self.weight, self.bias)  # [T, E]
    order = torch.sort(router_logits, dim=-1, descending=True, stable=True)
    top, ids = order.values[..., :self.top_k], order.indices[..., :self.top_k]
    scores = torch.nn.functional.softmax(top, dim=1, dtype=top.dtype)
    return router_logits, scores, ids
